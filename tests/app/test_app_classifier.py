"""The Influencers page on a classification run (AppTest, no browser): its class prior is on by
default, shown in the caption and as each hit's last share, and the toggle turns it off; the
second opinion ranks with the same prior."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import train_classifier_run
from streamlit.testing.v1 import AppTest

from traceprop_engine.attribution import open_run
from traceprop_engine.index_settings import DEFAULT_CLASS_PRIOR
from traceprop_engine.settings import IndexSettings

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train_classifier_run(tmp_path_factory.mktemp("cls"), ("alpha", "beta", "gamma"))


def _ask(at: AppTest) -> dict:
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    return at.session_state["infl_result"]["result"]


def test_the_class_prior_shows_and_toggles_off(trained, app_env):
    run = app_env["runs"] / "classifier"
    shutil.copytree(trained, run)
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["runs_active"] = str(run)
    at.run()
    at.switch_page("views/influencers.py").run()
    assert not at.exception, [e.message for e in at.exception]
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
