"""AppTest smoke tests of every page, on the bundled sample run (no browser)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")  # the pages (main.py: the server, st.App)
TIMEOUT = 60


@pytest.fixture
def at(app_env):
    a = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    a.run()
    assert not a.exception, a.exception
    return a


def _goto(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"views/{page}.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_opens_on_sample_run(at):
    assert at.title[0].value == "Traceprop"  # the landing page
    _goto(at, "runs")
    assert at.title[0].value.endswith("Runs")
    assert at.session_state["runs_active"] == str(REPO / "sample_runs" / "facts")
    assert at.selectbox(key="runs_pick").value == str(REPO / "sample_runs" / "facts")
    df = at.dataframe[0].value
    row = df[df["run"] == "facts"].iloc[0]
    assert row["kind"] == "sample" and row["status"] == "completed"
    assert row["records"] > 0 and row["tracked layers"] > 0


def test_influencers_eval_example(at):
    _goto(at, "influencers")
    at.button(key="infl_go").click().run()
    assert not at.exception
    assert not at.error, [e.value for e in at.error]
    props, opps = at.dataframe[0].value, at.dataframe[1].value
    assert len(props) == 10 and len(opps) == 10
    assert (props["score"] > 0).all() and (opps["score"] < 0).all()
    assert props["location"].str.match(r"^\w+\.jsonl:\d+$").all()
    assert any("proponent" in i.value for i in at.info)


def test_influencers_typed_prompt(at):
    _goto(at, "influencers")
    at.radio(key="infl_mode").set_value("typed").run()
    at.text_area(key="infl_prompt").input("Q: Which colour does the planet Ethmor have?\nA:")
    at.text_input(key="infl_completion").input(" violet")
    at.slider(key="infl_topk").set_value(5)
    at.selectbox(key="infl_pre").set_value("identity")
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error
    assert len(at.dataframe[0].value) == 5
    assert len(at.expander) >= 5
    _open_first_example(at)
    codes = [c.value for c in at.code]
    assert any("⟦" in c for c in codes)  # tokens with the trained-on ones marked
    assert any('"sha256"' in c for c in codes)  # lineage
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert {t["name"] for t in fig["data"]} == {"positive", "negative", "total"}


def _open_first_example(at):
    """Open the first example's expander (its details are drawn only while it is open)."""
    from services import exports
    from views.example_details import expander_key

    rows = exports.shown_rows(at.session_state["infl_result"]["result"])
    at.session_state[expander_key(next(rows.iter_rows(named=True)))] = True
    at.run()
    assert not at.exception


def test_influencers_empty_prompt_is_an_error(at):
    _goto(at, "influencers")
    at.radio(key="infl_mode").set_value("typed").run()
    at.button(key="infl_go").click().run()
    assert not at.exception
    assert at.error and "empty" in at.error[0].value
    assert not at.dataframe


def test_launch_form_validation(at, app_env):
    _goto(at, "launch")
    at.radio(key="launch_data_kind").set_value("path")
    at.text_input(key="launch_data_path").input("../../etc")
    at.number_input(key="launch_lr").set_value(0.0)
    at.button[0].click().run()  # the form's submit button
    assert not at.exception
    msgs = " ".join(e.value for e in at.error)
    assert "outside the allowed data root" in msgs
    at.radio(key="launch_data_kind").set_value("upload")
    at.button[0].click().run()
    assert "upload at least one data file" in " ".join(e.value for e in at.error)
    assert not [p for p in app_env["runs"].iterdir() if p.name.startswith("run-")]


def test_launch_refuses_malformed_data_before_starting_a_job(at, app_env):
    """Issue 29 defect 8: the data is read on the form; the error names the file and line."""
    (app_env["data"] / "set").mkdir()
    (app_env["data"] / "set" / "a.jsonl").write_text('{"text": "ok"}\n{"prompt": 3}\n')
    _goto(at, "launch")
    at.radio(key="launch_data_kind").set_value("path")
    at.text_input(key="launch_data_path").input("set")
    at.button[0].click().run()
    assert not at.exception
    msgs = " ".join(e.value for e in at.error)
    assert "training data: a.jsonl:2: field 'prompt'" in msgs, msgs
    assert not at.success  # no "Started …"
    runs = app_env["runs"]
    assert not runs.exists() or not [p for p in runs.iterdir() if (p / "launch.json").exists()]


def _decode(arr):
    if isinstance(arr, dict) and "bdata" in arr:
        return np.frombuffer(base64.b64decode(arr["bdata"]), dtype=np.dtype(arr["dtype"]))
    return np.asarray(arr)


def test_overhead_from_real_timings(at):
    """The page plots the active run's own step timings (its store) and each run's median step
    time (its manifest); with no bench results (an empty bench folder here) it says how to make
    them and draws no bench chart."""
    from traceprop_engine.store.reader import Store

    _goto(at, "overhead")
    # chart ids end with the chart's key
    charts = {
        c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec) for c in at.get("plotly_chart")
    }
    assert set(charts) == {"overhead_steps", "overhead_runs"}
    with Store(REPO / "sample_runs" / "facts" / "store.h5") as s:
        want = np.asarray(s.timings()["step_ms"], dtype=float)
    steps = charts["overhead_steps"]["data"][0]
    np.testing.assert_allclose(_decode(steps["y"]), want, rtol=1e-6)
    np.testing.assert_array_equal(_decode(steps["x"]), np.arange(1, len(want) + 1))
    caption = (
        f"{len(want)} steps from the store; median {np.median(want):.2f} ms "
        "(the Runs page's 'median step ms')"
    )
    assert caption in [c.value for c in at.caption]
    # one median step time per run, the same on both pages: that of the plotted series
    runs = charts["overhead_runs"]["data"][0]
    assert list(runs["x"]) == ["facts"]
    assert float(_decode(runs["y"])[0]) == pytest.approx(round(float(np.median(want)), 2))
    assert any("traceprop bench overhead" in i.value for i in at.info)


def test_audit_verify_ok_and_trail(at):
    _goto(at, "audit")
    at.button(key="audit_verify").click().run()
    assert not at.exception
    assert at.success and "match" in at.success[0].value
    at.button(key="audit_query").click().run()
    assert not at.exception and not at.error
    assert any("influencers" in m.value for m in at.markdown)


def test_overhead_reads_bench_json(app_env):
    bench = app_env["runs"] / "bench"
    bench.mkdir(parents=True)
    (bench / "overhead.json").write_text(
        json.dumps(
            {
                "overhead_pct": 4.2,
                "logging_pct": 3.0,
                "covariance_pct": 1.2,
                "cpu_overhead_pct": 5.0,
                "plain_step_ms": 10.0,
                "tracked_step_ms": 10.42,
                "bytes_per_example": 2304.0,
                "repeats": 5,
                "pair_overheads_pct": [4.0, 4.4],
                # the sample's tracking configuration (the default)
                "config": {"k_in": 126, "k_out": 126, "sketch": "factored", "scope": "all"},
            }
        )
    )
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    _goto(at, "runs")
    # a benchmark of another model is not the run's overhead: the Runs table shows none
    assert "overhead %" not in at.dataframe[0].value.columns
    _goto(at, "overhead")
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    steps = next(s for s in specs if {t.get("name") for t in s["data"]} == {"plain", "tracked"})
    assert [float(_decode(t["y"])[0]) for t in steps["data"]] == [10.0, 10.42]
    assert not any("bench overhead" in i.value for i in at.info)


def test_audit_reports_a_changed_data_file(tmp_path, monkeypatch):
    import shutil

    samples = tmp_path / "samples"
    shutil.copytree(REPO / "sample_runs" / "facts", samples / "facts")
    shutil.copytree(REPO / "sample_runs" / "facts-data", samples / "facts-data")
    m = json.loads((samples / "facts" / "run.json").read_text())
    m["data"]["root"] = str(samples / "facts-data" / "train")
    m["data"]["eval_root"] = str(samples / "facts-data" / "eval")
    (samples / "facts" / "run.json").write_text(json.dumps(m))
    with open(samples / "facts-data" / "train" / "planets.jsonl", "a") as f:
        f.write('{"prompt": "Q: tampered?\\nA:", "completion": " yes"}\n')
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(samples))
    monkeypatch.setenv("TRACEPROP_RUNS_ROOT", str(tmp_path / "runs"))
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    _goto(at, "audit")
    at.button(key="audit_verify").click().run()
    assert not at.exception and not at.success
    assert [e.value.replace("\\", "") for e in at.error] == [
        f"changed: {samples / 'facts-data' / 'train' / 'planets.jsonl'}"
    ]


def test_every_page_says_so_when_there_are_no_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(tmp_path / "none"))
    monkeypatch.setenv("TRACEPROP_RUNS_ROOT", str(tmp_path / "runs"))
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception and any("sample run is not here" in i.value for i in at.info)
    _goto(at, "runs")
    assert "No runs found" in at.warning[0].value
    for page in ("influencers", "overhead", "audit", "launch"):
        _goto(at, page)
    _goto(at, "influencers")
    assert any("No run to query" in w.value for w in at.warning)


def test_quality_page_without_results_says_how_to_make_them(at):
    _goto(at, "quality")
    assert any("traceprop eval lds" in i.value for i in at.info)


def test_quality_page_shows_the_measured_lds(app_env, monkeypatch):
    # the repository's committed LDS results (benchmarks/results/lds-*)
    monkeypatch.setenv("TRACEPROP_BENCH_DIRS", str(REPO / "benchmarks" / "results"))
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    _goto(at, "quality")
    assert at.selectbox(key="quality_eval").value.startswith("lds-")
    table = at.dataframe[0].value
    assert {"method", "k", "lds", "ci_low", "ci_high"} <= set(table.columns)
    assert ((table["lds"] > -1) & (table["lds"] < 1)).all()
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert fig["data"]


def test_runs_page_explains_its_two_byte_counts(at):
    """Defect 5 of issue 29: the Runs page showed this run's bytes per example next to the
    benchmark model's figure for the same configuration, with no word on the difference."""
    _goto(at, "runs")
    notes = [c.value for c in at.caption if c.value.startswith("Two byte counts")]
    assert len(notes) == 1, [c.value for c in at.caption]
    assert "tracked layers" in notes[0] and "benchmark model" in notes[0]


def test_influencers_second_opinion_marks_where_two_estimators_agree(at, app_env):
    """Issue 29 goal 4 (triangulation): the same query asked of identity marks, in the default
    (K-FAC) answer's tables, exactly the examples identity also ranks in its top k (checked
    against the engine asked directly)."""
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.settings import IndexSettings

    _goto(at, "influencers")
    at.button(key="infl_go").click().run()
    assert at.selectbox(key="infl_second").value == "off"
    assert "both" not in at.dataframe[0].value.columns
    at.selectbox(key="infl_second").set_value("identity").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    props, opps = at.dataframe[0].value, at.dataframe[1].value
    run = open_run(REPO / "sample_runs" / "facts")
    ev = at.selectbox(key="infl_eval").value
    other = run.query(eval_example=ev, top_k=10, settings=IndexSettings(preconditioner="identity"))
    for kind, shown in (("proponent", props), ("opponent", opps)):
        theirs = other.rows.filter(other.rows["kind"] == kind)
        locs = theirs["source"] + ":" + theirs["row"].cast(str)
        top = dict(zip(locs, theirs["rank"], strict=True))
        assert shown["both"].tolist() == [loc in top for loc in shown["location"]]
        for loc, rank, both in zip(
            shown["location"], shown["second_rank"], shown["both"], strict=True
        ):
            assert (rank == top[loc]) if both else rank != rank  # NaN when not in its top k
    assert 0 < props["both"].sum() < len(props)  # a real check: some agree, some do not
    assert any("agree on" in c.value for c in at.caption)


def test_a_job_started_on_the_launch_page_shows_in_its_sidebar(at, app_env):
    """Issue 29 defect 7: the sidebar was drawn before the form started the job, so the Launch
    page's own sidebar did not show it; the page now reruns once the job has started."""
    import time

    from services import jobs

    _goto(at, "launch")
    for key, value in (
        ("launch_maxlen", 32),
        ("launch_tiny_layers", 1),
        ("launch_tiny_width", 32),
        ("launch_epochs", 1),
    ):
        at.number_input(key=key).set_value(value)
    at.text_input(key="launch_name").input("sidebar-run")
    at.button[0].click().run()
    run_dir = app_env["runs"] / "sidebar-run"
    try:
        assert not at.exception and not at.error, [e.value for e in at.error]
        assert at.success[0].value.startswith("Started sidebar-run")
        shown = [i.value for i in at.sidebar.info]
        assert any(v.startswith("Training sidebar-run: step") for v in shown), shown
    finally:
        jobs.cancel_job(run_dir)
        deadline = time.monotonic() + 120
        while jobs.job_state(run_dir).running and time.monotonic() < deadline:
            time.sleep(0.2)


def test_launch_help_texts_are_the_settings_own(at):
    """Issue 28 item 3: the Launch form shows each setting's one help text (its field's)."""
    from traceprop_engine.settings import TrackSettings, TrainSettings, field_help

    _goto(at, "launch")
    assert at.number_input(key="launch_k_in").help == field_help(TrackSettings, "k_in")
    assert at.number_input(key="launch_rank").help == field_help(TrackSettings, "rank")
    assert at.number_input(key="launch_lr").help == field_help(TrainSettings, "lr")
    assert at.checkbox(key="launch_cov").help == field_help(TrackSettings, "covariance")
