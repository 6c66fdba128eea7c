"""The Influencers page on a free-text causal-LM run (AppTest, no browser): its LM-bias term is on
by default, shown in the caption and as each hit's last share, and the toggle turns it off; the
second opinion ranks with the same term."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import fast_settings, free_text_data
from streamlit.testing.v1 import AppTest

from traceprop_engine.attribution.score.ranking import LM_BIAS_LAYER
from traceprop_engine.index_settings import DEFAULT_LM_BIAS
from traceprop_engine.settings import TrackSettings
from traceprop_engine.training.loop import train

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    free_text_data(root / "data")
    track = TrackSettings(k_in=4, k_out=8, free_text_rank=4)
    return Path(train(fast_settings(root / "data", root / "run", track=track)))


def _ask(at: AppTest):
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    return at.session_state["infl_result"]["result"]


def test_the_lm_bias_term_shows_and_toggles_off(trained, app_env):
    run = app_env["runs"] / "text"
    shutil.copytree(trained, run)
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["runs_active"] = str(run)
    at.run()
    at.switch_page("views/influencers.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.toggle(key="infl_lm_bias").value is True
    assert f"Add {DEFAULT_LM_BIAS:g} x the cosine" in at.toggle(key="infl_lm_bias").help
    res = _ask(at)
    assert res.query["lm_bias"] == DEFAULT_LM_BIAS
    assert any(f"LM bias {DEFAULT_LM_BIAS:g}" in c.value for c in at.caption)
    assert all(list(json.loads(x))[-1] == LM_BIAS_LAYER for x in res.rows["layer_scores"])
    notes = [w.value for w in at.warning]
    assert sum("LM-bias term to its scores by default" in n for n in notes) == 1
    # the second opinion ranks with the same term
    at.selectbox(key="infl_second").set_value("identity").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("agree on" in c.value for c in at.caption)
    # off: the records alone
    at.toggle(key="infl_lm_bias").set_value(False).run()
    res = _ask(at)
    assert res.query["lm_bias"] == 0.0
    assert not any("LM bias" in c.value for c in at.caption)
    assert all(LM_BIAS_LAYER not in json.loads(x) for x in res.rows["layer_scores"])
