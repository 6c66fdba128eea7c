"""Bundled runs are read-only for every page (issue 27 item 6, issue 29 defect 3): every page's
operations on a read-only copy of the bundled sample run leave every file under it as it was;
what they compute for it goes beside the user's runs."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest
from services import config
from services import counterfactual as cf
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")
TIMEOUT = 120
PROMPT = "Q: Which colour does the planet Ethmor have?\nA:"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, mode, size, mtime and content digest."""
    out = {}
    for p in sorted(root.rglob("*")):
        st_ = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = (stat.S_IFMT(st_.st_mode), st_.st_mode, st_.st_size,
                                         st_.st_mtime_ns, digest)  # fmt: skip
    return out


def _read_only(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def bundled(tmp_path, monkeypatch, app_env):
    """A read-only copy of the bundled sample runs (as root, which ignores the mode, the
    snapshot still catches every write)."""
    root = tmp_path / "bundled"
    root.mkdir()
    for name in ("facts", "facts-data"):
        shutil.copytree(REPO / "sample_runs" / name, root / name)
    shutil.rmtree(root / "facts" / cf.cf.CF_DIR, ignore_errors=True)
    _read_only(root)
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(root))
    yield root
    for p in [root, *root.rglob("*")]:  # let tmp_path's clean-up remove it
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def _visit(at: AppTest, page: str) -> AppTest:
    at.switch_page(page)
    at.run()
    assert not at.exception, (page, [e.message for e in at.exception])
    return at


def test_every_page_leaves_a_bundled_run_unchanged(bundled, app_env):
    before = snapshot(bundled)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception
    for page in ("views/runs.py", "views/overhead.py", "views/quality.py", "views/launch.py"):
        _visit(at, page)
    # a query with every preconditioner the page offers, the per-token view, the check's plan
    _visit(at, "views/influencers.py")
    at.radio(key="infl_mode").set_value("typed").run()
    at.text_area(key="infl_prompt").input(PROMPT)
    at.text_input(key="infl_completion").input(" violet")
    for pre in at.selectbox(key="infl_pre").options:
        at.selectbox(key="infl_pre").set_value(pre)
        at.button(key="infl_go").click().run()
        assert not at.exception, (pre, [e.message for e in at.exception])
        assert not [e.value for e in at.error], (pre, [e.value for e in at.error])
    # every ranking under every preconditioner
    _visit(at, "views/rankings.py")
    for by in at.selectbox(key="rank_by").options:
        for pre in at.selectbox(key="rank_pre").options:
            at.selectbox(key="rank_by").set_value(by)
            at.selectbox(key="rank_pre").set_value(pre).run()
            assert not at.exception, (by, pre, [e.message for e in at.exception])
    # the run against itself on the Compare page; verify and the audit trail
    _visit(at, "views/compare.py")
    at.button(key="cmp_go").click().run()
    assert not at.exception, [e.message for e in at.exception]
    _visit(at, "views/audit.py")
    at.button(key="audit_verify").click().run()
    assert not at.exception, [e.message for e in at.exception]
    assert snapshot(bundled) == before


def test_the_check_of_a_bundled_run_goes_beside_the_users_runs(bundled, app_env):
    run = bundled / "facts"
    out = cf.results_dir(run)
    assert out is not None and config.is_under(out, app_env["runs"].resolve())
    assert cf.results_dir(run) == out  # one folder per run, found again on a revisit
    spec = cf.spec_for({"prompt": PROMPT, "completion": " violet"}, 5, 1, "identity")
    cmd = cf.command(run, spec)
    assert cmd[cmd.index("--out") + 1] == str(out)
    # a user run the app can write keeps its checks in its own folder
    user = app_env["runs"] / "mine"
    user.mkdir(parents=True)
    assert cf.results_dir(user) is None
    if os.geteuid() != 0:  # a read-only user run is routed like a bundled one
        user.chmod(0o555)
        try:
            assert cf.results_dir(user) is not None
        finally:
            user.chmod(0o755)
