"""AppTest of the Curate page: the Influencers query's top proponents → a cleaned copy under the
runs root → a background retrain (a real one, on a copy of the bundled sample run) → the
side-by-side proof on the page."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")
TIMEOUT = 90
PROMPT = "Q: Which colour does the planet Ethmor have?\nA:"


@pytest.fixture
def sample_copy(tmp_path, monkeypatch, app_env):
    root = tmp_path / "samples"
    root.mkdir()
    for name in ("facts", "facts-data"):
        shutil.copytree(REPO / "sample_runs" / name, root / name)
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(root))
    return root / "facts"


def _table(at: AppTest, column: str):
    for d in at.dataframe:
        if column in d.value.columns:
            return d.value
    raise AssertionError(f"no table with a {column!r} column")


def _curate_page_with_query(at: AppTest) -> AppTest:
    at.switch_page("views/influencers.py")
    at.run()
    at.radio(key="infl_mode").set_value("typed").run()
    at.text_area(key="infl_prompt").input(PROMPT)
    at.text_input(key="infl_completion").input(" violet")
    at.slider(key="infl_topk").set_value(5)
    at.button(key="infl_go").click().run()
    props = _table(at, "score")
    at.switch_page("views/curate.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    at.button(key="cur_add").click().run()
    return at, props


def test_the_influencers_query_previews_its_top_proponents(sample_copy, app_env):
    """The query → preview half of the flow (the retrain and its proof: the real-browser
    test_browser_curate.py, which runs the same flow to the end)."""
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at, props = _curate_page_with_query(at)
    at.number_input(key="cur_k").set_value(3).run()
    preview = _table(at, "why")
    assert len(preview) == 3
    assert sorted(preview["location"]) == sorted(props["location"].head(3))
    assert all(w.startswith("proponent #") for w in preview["why"])
    assert not at.button(key="cur_go").disabled
    assert not (app_env["runs"] / "curated").exists()  # nothing written before the click


def test_a_bad_hand_picked_row_says_why(sample_copy):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/curate.py")
    at.run()
    at.text_input(key="cur_ids").input("planets.jsonl:9999").run()
    assert not at.exception
    assert any("no training example" in i.value for i in at.info)
    assert at.button(key="cur_go").disabled
    at.text_input(key="cur_ids").input("planets.jsonl:2, 5").run()
    assert len(_table(at, "why")) == 2
    # and the top 3 of a ranking: the union, each row with every reason that picked it
    at.number_input(key="cur_k").set_value(3).run()
    at.selectbox(key="cur_by").set_value("loss").run()
    picked = _table(at, "why")
    by_loss = [w for w in picked["why"] if "loss #" in w]
    assert len(by_loss) == 3 and 3 <= len(picked) <= 5
    assert not at.button(key="cur_go").disabled


def test_without_runs_the_page_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(tmp_path / "none"))
    monkeypatch.setenv("TRACEPROP_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.setenv("TRACEPROP_DATA_ROOT", str(tmp_path / "data"))
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/curate.py")
    at.run()
    assert not at.exception
    assert any("No run to curate" in w.value for w in at.warning)
