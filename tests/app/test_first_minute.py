"""The first minute (issue 13, items 5, 7, 8): the landing page's sample question, the model's own
answer beside the influencers, the Runs page's story of a run, the lazy engine and the warm-up.
Values are checked against the engine's own functions."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from traceprop_engine.attribution.model_side.answer import model_answer
from traceprop_engine.attribution.query import open_run
from traceprop_engine.evaluate.pareto import describe
from traceprop_engine.run import RunManifest, read_progress
from traceprop_engine.store.sizes import steady_state_bytes

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"
if str(APP) not in sys.path:
    sys.path.insert(0, str(APP))
from services.text import md_escape  # noqa: E402

MAIN = str(APP / "navigation.py")  # the pages (main.py: the server, st.App)
SAMPLE = REPO / "sample_runs" / "facts"
GT = json.loads((REPO / "sample_runs" / "facts-data" / "ground_truth.json").read_text())
TIMEOUT = 90


@pytest.fixture(scope="module")
def engine_run():
    r = open_run(SAMPLE)
    yield r
    r.close()


def _metrics(at) -> dict:
    return {m.label: m.value for m in at.metric}


def test_home_asks_the_sample_question_in_one_click(app_env, engine_run):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    assert at.title[0].value == "Traceprop"
    md = " ".join(m.value for m in at.markdown)
    for word in ("identity", "kfac", "ekfac", "proponent", "opponent", "score > 0"):
        assert word in md, word
    at.button(key="home_ask").click().run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.title[0].value == "Influencers"
    q = GT["eval"][0]
    assert at.text_area(key="infl_prompt").value == q["prompt"]
    assert at.text_input(key="infl_completion").value == q["completion"]
    # answered without a further click; the numbers are the engine's
    ref = model_answer(engine_run, q["prompt"], q["completion"])
    m = _metrics(at)
    assert float(m["Model's loss on the queried output"]) == pytest.approx(ref.loss, abs=1e-4)
    assert m["Queried output"] == ref.queried.strip() == "violet"
    assert m["Model's own greedy answer"] == ref.greedy.strip()
    assert not any("does not produce" in w.value for w in at.warning)
    assert len(at.dataframe[0].value) == 10  # the proponents


def test_warning_when_the_model_does_not_produce_the_queried_output(app_env, engine_run):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/influencers.py")
    at.run()
    at.radio(key="infl_mode").set_value("typed").run()
    at.text_area(key="infl_prompt").input(GT["eval"][0]["prompt"])
    at.text_input(key="infl_completion").input(" green")
    at.button(key="infl_go").click().run()
    assert not at.exception
    ref = model_answer(engine_run, GT["eval"][0]["prompt"], " green")
    assert not ref.matches
    m = _metrics(at)
    assert float(m["Model's loss on the queried output"]) == pytest.approx(ref.loss, abs=1e-4)
    assert m["Model's own greedy answer"] == ref.greedy.strip() == "violet"
    warn = [w.value for w in at.warning if "does not produce" in w.value]
    assert len(warn) == 1 and "green" in warn[0] and "violet" in warn[0]


def test_runs_page_tells_the_runs_story_and_relaunches_it(app_env, engine_run, caplog):
    engine_run.examples()  # the store is open elsewhere in the process, as in the app
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/runs.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    prog = read_progress(SAMPLE)
    m = _metrics(at)
    assert int(m["Training steps"]) == len(prog) == 240
    assert m["Final training loss"] == f"{prog[-1]['loss']:.3f}"
    bpe = steady_state_bytes(SAMPLE / "store.h5")["bytes_per_example"]
    assert m["Bytes per example"] == f"{bpe:,.0f}"
    man = RunManifest.load(SAMPLE)
    line = describe(man.tracking.settings)
    assert "LDS" in line and any(c.value == md_escape(line) for c in at.caption)
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert fig["data"][0]["type"] == "scatter" and fig["layout"]["yaxis"]["title"]["text"] == (
        "training loss"
    )
    at.button(key="runs_relaunch").click().run()
    assert not at.exception
    assert at.title[0].value.startswith("Launch")
    assert at.number_input(key="launch_epochs").value == man.config["epochs"]
    assert at.number_input(key="launch_lr").value == pytest.approx(man.config["lr"])
    assert at.number_input(key="launch_k_in").value == man.tracking.settings["k_in"]
    assert at.number_input(key="launch_rank").value == man.tracking.settings["rank"]
    assert at.number_input(key="launch_tiny_width").value == man.config["tiny_width"]
    assert at.radio(key="launch_data_kind").value == "facts"
    assert at.text_input(key="launch_name").value == "facts-again"
    assert any("Prefilled from the run" in i.value for i in at.info)
    # issue 29 defect 7: the form's widgets took a default and the prefilled state at once
    assert not [r for r in caplog.records if "Session State API" in r.getMessage()]


def test_relaunch_of_a_run_on_the_data_root(app_env, tmp_path):
    from services import config, run_story

    cfg = config.AppConfig.from_env()
    run = app_env["runs"] / "mine"
    run.mkdir(parents=True)
    raw = json.loads((SAMPLE / "run.json").read_text())
    raw["config"]["data"] = str(app_env["data"] / "set" / "train")
    raw["config"]["eval_data"] = str(app_env["data"] / "set" / "eval.jsonl")
    raw["config"]["model"] = "/elsewhere/model"
    (run / "run.json").write_text(json.dumps(raw))
    values, notes = run_story.relaunch_state(cfg, run)
    assert values["launch_data_kind"] == "path"
    assert values["launch_data_path"] == "set/train"
    assert values["launch_eval_path"] == "set/eval.jsonl"
    assert "launch_model" not in values and any("/elsewhere/model" in n for n in notes)


@pytest.mark.slow
def test_app_start_and_runs_page_import_no_torch():
    """Item 8: the first page and the Runs page need no torch, transformers or faiss."""
    code = (
        f"import sys; sys.path[:0] = [{str(APP)!r}, {str(REPO)!r}]\n"
        "import services, plotly.graph_objects\n"
        "from services import run_story, landing, warmup, answers\n"
        "import traceprop_engine, traceprop_engine.evaluate.pareto, traceprop_engine.store.sizes\n"
        "print(sorted(m for m in ('torch', 'transformers', 'faiss') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    # the lazy names still resolve
    code2 = "import traceprop_engine as t; from traceprop_engine.evaluate import LdsSettings; print(t.Tracker.__name__, t.Store.__name__, LdsSettings.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code2], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.split() == ["Tracker", "Store", "LdsSettings"]


def test_warm_up_loads_the_model_once(app_env, monkeypatch):
    from services import queries, warmup

    assert not warmup.start(SAMPLE)  # TRACEPROP_NO_WARMUP=1 in the tests
    warmup.warm(SAMPLE)
    run, _ = queries.open_cached(SAMPLE)
    assert run.encoder._loaded is not None  # the model a first query needs is loaded
    monkeypatch.delenv("TRACEPROP_NO_WARMUP")
    monkeypatch.setenv("TRACEPROP_QUERY_WORKER", "0")  # the worker: test_warm_up_with_the_worker
    monkeypatch.setattr(warmup, "_started", set())
    calls = []
    monkeypatch.setattr(warmup, "warm", lambda d, worker: calls.append(worker))
    assert warmup.start(SAMPLE) and not warmup.start(SAMPLE)  # once per run and process
    assert not warmup.start(None)
    assert calls == [False]  # no worker: the warm-up loads the model in this process


CROSS_PROCESS_RTOL = 1e-6
"""Scores computed in another process (the worker, a subprocess's server half) against this
one: the same code, but numpy's BLAS may run with another thread count in each process, and a
GEMM split differently rounds differently (issue 27 item 1)."""


def _assert_frames_close(a, b) -> None:
    import polars as pl

    assert a.columns == b.columns and a.height == b.height
    for c in a.columns:
        if a[c].dtype.is_float():
            np.testing.assert_allclose(
                a[c].to_numpy(), b[c].to_numpy(), rtol=CROSS_PROCESS_RTOL, atol=1e-9, err_msg=c
            )
        else:
            assert a[c].equals(b[c]) or a.select(pl.col(c)).equals(b.select(pl.col(c))), c


@pytest.mark.slow
def test_warm_up_with_the_worker_leaves_torch_out_of_the_server(app_env, tmp_path):
    """Item 8: with the query worker (the default), the server process answers the sample
    question, the model's answer, an influencer's tokens and per-token view without importing
    torch, and gives what the in-process path gives."""
    import shutil

    run = tmp_path / "facts"
    shutil.copytree(SAMPLE, run)  # its index is built here, not in the repository
    code = f"""
import sys, pickle
sys.path[:0] = [{str(APP)!r}, {str(REPO)!r}]
from services import answers, counterfactual, model_worker, queries, warmup
assert warmup.start_worker()  # what the server's start does (main.py): the sample's model
w = model_worker._worker
assert w is not None and w.alive
assert warmup.start({str(run)!r})  # a session on another run: the same worker warms it too
assert model_worker._worker is w
# the warm-up's end, however long it takes on a loaded machine (subprocess.run's timeout bounds
# it): stopping the worker under a warm-up still asking it made that request fall back to
# torch in this process, which then crashed the exit (issue 27 item 4)
assert warmup.join()
ex = queries.cached_examples({str(run)!r}, queries.manifest_mtime({str(run)!r}), "eval")
eid = int(ex["example_id"][0])
res, by_source, table, _ = queries.run_query_and_scores({str(run)!r}, eval_example=eid)
ans = answers.model_answer({str(run)!r}, eval_example=eid)
top = int(res.proponents["example_id"][0])
text = queries.example_tokens_text({str(run)!r}, top)
pieces, tc = counterfactual.token_view({str(run)!r}, res, top)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
model_worker.stop()
assert not w.alive
sys.stdout.flush()
with open({str(tmp_path / "out.pkl")!r}, "wb") as f:
    pickle.dump((eid, res.rows, table, ans, text, pieces, tc.contributions), f)
"""
    env = {**os.environ, "TRACEPROP_QUERY_WORKER": "1"}
    env.pop("TRACEPROP_NO_WARMUP", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    with open(tmp_path / "out.pkl", "rb") as f:
        eid, rows, table, ans, text, pieces, contributions = pickle.load(f)

    # the same answers in one process (the path the app takes without a worker)
    from services import answers, counterfactual, queries

    res, _, table_here, _ = queries.run_query_and_scores(run, eval_example=eid)
    _assert_frames_close(rows, res.rows)
    _assert_frames_close(table, table_here)
    ans_here = answers.model_answer(run, eval_example=eid)
    assert dataclasses.replace(ans, loss=0.0) == dataclasses.replace(ans_here, loss=0.0)
    assert ans.loss == pytest.approx(ans_here.loss, rel=CROSS_PROCESS_RTOL)
    top = int(res.proponents["example_id"][0])
    assert text == queries.example_tokens_text(run, top)
    pieces_here, tc = counterfactual.token_view(run, res, top)
    assert pieces == pieces_here
    np.testing.assert_allclose(contributions, tc.contributions, rtol=1e-9, atol=1e-12)


def test_data_root_exists_by_default(tmp_path, monkeypatch):
    from services import config

    monkeypatch.setenv("TRACEPROP_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.setenv("TRACEPROP_DATA_ROOT", str(tmp_path / "fresh" / "data"))
    assert config.AppConfig.from_env().data_root.is_dir()


@pytest.mark.parametrize("has_st_app", [True, False])
def test_main_run_as_a_script_draws_the_pages(app_env, monkeypatch, has_st_app):
    """main.py run as the pages' script (AppTest from main.py, as ../shared/TESTING-UI.md does,
    or `streamlit run` on a Streamlit without st.App) draws the landing page itself."""
    import streamlit

    if not has_st_app:
        monkeypatch.delattr(streamlit, "App")
    at = AppTest.from_file(str(APP / "main.py"), default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Traceprop"
