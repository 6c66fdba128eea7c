"""Issue 27 item 6 across the app: a walk through every page on a bundled sample run, doing
what each page does with a run (the sample question, a query with a second opinion, every
ranking, a comparison, verify and an audit trail), writes nothing into the bundled run."""

from __future__ import annotations

import shutil
from pathlib import Path

from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


def _go(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"views/{page}.py")
    at.run()
    assert not at.exception, (page, [e.message for e in at.exception])
    return at


def _click(at: AppTest, key: str) -> None:
    at.button(key=key).click().run()
    assert not at.exception, (key, [e.message for e in at.exception])
    assert not at.error, (key, [e.value for e in at.error])


def test_every_page_leaves_a_bundled_run_as_it_was(app_env, tmp_path, monkeypatch):
    bundled = tmp_path / "sample_runs"
    shutil.copytree(REPO / "sample_runs", bundled, ignore=shutil.ignore_patterns(".*.lock"))
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(bundled))
    monkeypatch.setenv("TRACEPROP_CACHE_DIR", str(tmp_path / "cache"))
    before = _snapshot(bundled)

    at = AppTest.from_file(MAIN, default_timeout=120)
    at.run()
    assert not at.exception
    assert at.session_state["runs_active"] == str(bundled / "facts")
    _click(at, "home_ask")  # the landing page's sample question
    _go(at, "runs")
    _go(at, "influencers")
    _click(at, "infl_go")
    at.selectbox(key="infl_second").set_value("ekfac").run()
    assert not at.exception and not at.error
    assert len(at.dataframe[0].value) == 10 and "both" in at.dataframe[0].value.columns
    for page in ("curate", "overhead", "quality", "launch"):
        _go(at, page)
    _go(at, "rankings")
    for by in ("self-influence", "gradient-norm", "loss"):
        at.selectbox(key="rank_by").set_value(by).run()
        assert not at.exception and not at.error, (by, [e.value for e in at.error])
    _go(at, "compare")
    _click(at, "cmp_go")
    _go(at, "audit")
    _click(at, "audit_verify")
    assert at.checkbox(key="audit_use_last").value  # the trail of the Influencers query...
    at.checkbox(key="audit_use_last").uncheck().run()
    _click(at, "audit_query")  # ... and of an eval example asked here
    assert any(
        b.label.startswith("Download") or "trail" in b.label for b in at.get("download_button")
    )

    after = _snapshot(bundled)
    assert after == before, {
        "added": sorted(set(after) - set(before)),
        "removed": sorted(set(before) - set(after)),
        "changed": sorted(k for k in set(after) & set(before) if after[k] != before[k]),
    }
