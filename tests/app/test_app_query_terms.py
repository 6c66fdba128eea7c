"""The Influencers page's query-time terms (AppTest, no browser): a classification run's class
prior and a causal-LM run's LM-bias term are each on by default, shown in the caption and as each
hit's last share, and their toggle turns them off; the second opinion ranks with the same term."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import fast_settings, free_text_data, train_classifier_run
from streamlit.testing.v1 import AppTest

from traceprop_engine.attribution import open_run
from traceprop_engine.attribution.score.ranking import LM_BIAS_LAYER
from traceprop_engine.index_settings import DEFAULT_CLASS_PRIOR, DEFAULT_LM_BIAS
from traceprop_engine.settings import IndexSettings, TrackSettings
from traceprop_engine.training.loop import train

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train_classifier_run(tmp_path_factory.mktemp("cls"), ("alpha", "beta", "gamma"))


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    free_text_data(root / "data")
    track = TrackSettings(k_in=4, k_out=8, free_text_rank=4)
    return Path(train(fast_settings(root / "data", root / "run", track=track)))


def _influencers(trained: Path, run: Path) -> AppTest:
    """The Influencers page on a copy of ``trained`` at ``run`` (the app's runs root)."""
    shutil.copytree(trained, run)
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["runs_active"] = str(run)
    at.run()
    at.switch_page("views/influencers.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _ask(at: AppTest) -> dict:
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    return at.session_state["infl_result"]["result"]


def test_the_class_prior_shows_and_toggles_off(trained, app_env):
    run = app_env["runs"] / "classifier"
    at = _influencers(trained, run)
    assert at.toggle(key="infl_prior").value is True
    # the switch's help states this run's own prior (a full fine-tune: the default, not adapters')
    assert f"{DEFAULT_CLASS_PRIOR:g} for an example of the queried label" in (
        at.toggle(key="infl_prior").help
    )
    res = _ask(at)
    assert res.query["class_prior"] == DEFAULT_CLASS_PRIOR
    assert any(f"class prior {DEFAULT_CLASS_PRIOR:g}" in c.value for c in at.caption)
    shares = [json.loads(x) for x in res.rows["layer_scores"]]
    assert all(list(x)[-1] == "class prior" for x in shares)
    # the run's notes are shown once, above the query, not again with the result
    notes = [w.value for w in at.warning]
    assert sum("class prior by default" in n for n in notes) == 1
    # the second opinion ranks with the same prior: its marks are identity's top k with it
    at.selectbox(key="infl_second").set_value("identity").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("agree on" in c.value for c in at.caption)
    other = open_run(run).query(
        eval_example=at.selectbox(key="infl_eval").value,
        top_k=int(res.query["top_k"]),
        settings=IndexSettings(preconditioner="identity"),  # auto: the default prior
    )
    theirs = other.rows.filter(other.rows["kind"] == "proponent")
    top = set(theirs["source"] + ":" + theirs["row"].cast(str))
    props = at.dataframe[0].value
    assert props["both"].tolist() == [loc in top for loc in props["location"]]
    # off: the records alone
    at.toggle(key="infl_prior").set_value(False).run()
    res = _ask(at)
    assert res.query["class_prior"] == 0.0
    assert not any("class prior 0" in c.value for c in at.caption)
    assert all("class prior" not in json.loads(x) for x in res.rows["layer_scores"])


def test_the_lm_bias_term_shows_and_toggles_off(text_run, app_env):
    at = _influencers(text_run, app_env["runs"] / "text")
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
