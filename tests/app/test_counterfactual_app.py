"""AppTest of the Influencers page's per-token view and counterfactual check (real retrains on a
copy of the bundled sample run)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from services import counterfactual as cf
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")  # the pages (main.py: the server, st.App)
TIMEOUT = 90
PROMPT = "Q: Which colour does the planet Ethmor have?\nA:"


@pytest.fixture
def sample_copy(tmp_path, monkeypatch, app_env):
    """The sample run and its data copied, so the check writes beside the copy, not the repo."""
    root = tmp_path / "samples"
    root.mkdir()
    for name in ("facts", "facts-data"):
        shutil.copytree(REPO / "sample_runs" / name, root / name)
    shutil.rmtree(root / "facts" / "counterfactual", ignore_errors=True)
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(root))
    return root / "facts"


def _table(at: AppTest, column: str):
    """The first dataframe with ``column`` (AppTest does not expose a dataframe's key)."""
    for d in at.dataframe:
        if column in d.value.columns:
            return d.value
    raise AssertionError(f"no table with a {column!r} column")


def _query(at: AppTest, completion: str = " violet") -> AppTest:
    at.switch_page("views/influencers.py")
    at.run()
    at.radio(key="infl_mode").set_value("typed").run()
    at.text_area(key="infl_prompt").input(PROMPT)
    at.text_input(key="infl_completion").input(completion)
    at.slider(key="infl_topk").set_value(5)
    at.button(key="infl_go").click().run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_per_token_view_escapes_and_sums(sample_copy):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    _query(at)
    html = [m.value for m in at.markdown if "tp-tok" in m.value]
    assert len(html) == 1 and "<span" in html[0]
    # the caption states the sum; the table lists the tokens with the largest contributions
    cap = [c.value for c in at.caption if c.value.startswith("Sum over tokens")]
    assert cap, [c.value for c in at.caption]
    table = _table(at, "contribution")
    assert len(table) >= 1 and table["contribution"].abs().max() > 0
    # another influencer: the view follows the selection
    ids = at.selectbox(key="tok_pick").options
    at.selectbox(key="tok_pick").set_value(at.selectbox(key="tok_pick").options[-1]).run()
    assert not at.exception and len(ids) == 10


def test_too_big_run_is_refused(sample_copy, monkeypatch):
    monkeypatch.setattr(cf.cf, "MAX_ESTIMATED_S", 1.0)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    _query(at)
    warn = [w.value for w in at.warning if "Counterfactual check unavailable" in w.value]
    assert warn and "too big" in warn[0]


def test_highlighted_html_escapes_every_piece():
    out = cf.highlighted_html(
        ["<script>alert(1)</script>", " a&b", "\n"], [0.5, -1.0, 0.0], [1, 1, 0]
    )
    assert "<script>" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    assert "a&amp;b" in out
    assert "rgba(231,111,81,0.88)" in out  # the largest |contribution|, negative: full red
    assert 'title="no loss on this token"' in out


@pytest.mark.slow
def test_cancel_stops_the_background_check(sample_copy):
    spec = cf.spec_for({"prompt": PROMPT, "completion": " a planet"}, 5, 3, "identity")
    s = cf.start(sample_copy, spec)
    assert s["status"] == "running"
    with pytest.raises(cf.CounterfactualError, match="running already"):
        cf.start(sample_copy, spec)
    deadline = time.monotonic() + 300
    while cf.state(sample_copy, spec)["done"] < 1 and time.monotonic() < deadline:
        time.sleep(0.3)  # wait until it is retraining
    assert cf.cancel(sample_copy, spec)
    s = cf.wait(sample_copy, spec, timeout_s=120)
    assert s["status"] == "cancelled", s
    assert cf.result(sample_copy, spec) is None
    assert not (sample_copy / "counterfactual" / f"{spec.key()}.work").exists()
