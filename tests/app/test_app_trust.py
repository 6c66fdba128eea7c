"""Issue 10, items 15 and 7 (the app half): the Launch page and the job slot say what they do."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import services
from streamlit.testing.v1 import AppTest

from traceprop_engine import constants as C

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")  # the pages (main.py: the server, st.App)
TIMEOUT = 60


@pytest.fixture
def cfg(app_env):
    return services.AppConfig.from_env()


def _spec(data: Path, eval_data: Path | None = None, *extra: str) -> services.LaunchSpec:
    return services.LaunchSpec(
        data=data, eval_data=eval_data, max_length=32, tiny_layers=1, tiny_width=32, extra=extra
    )


def _stop(run_dir: Path) -> None:
    services.cancel_job(run_dir)
    services.wait_job(run_dir, timeout_s=60)


# -- item 7, the app half: one job slot, taken under an exclusive lock ------------------------
@pytest.mark.slow
def test_two_sessions_pressing_start_together_train_once(cfg):
    data, eval_data = services.sample_dataset(cfg, "facts")
    spec = _spec(data, eval_data, "--max-steps", "4")
    barrier = threading.Barrier(3)
    started, refused = [], []

    def press(name: str) -> None:
        barrier.wait()
        try:
            started.append(services.start_job(cfg, spec, name))
        except services.JobError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=press, args=(n,)) for n in ("tab-a", "tab-b", "tab-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert len(started) == 1, [s.run_dir.name for s in started]
        assert len(refused) == 2 and all("already" in m for m in refused), refused
        # the refused presses wrote nothing: one run directory, one launch record
        dirs = [p for p in cfg.runs_root.iterdir() if p.name.startswith("tab-")]
        assert dirs == [started[0].run_dir]
    finally:
        for s in started:
            _stop(s.run_dir)


# -- item 15.6: the Runs page shows the run's own figures, one median step time -----------------
def test_runs_and_overhead_show_one_median_step_and_no_borrowed_overhead(app_env):
    import numpy as np

    from traceprop_engine.store.reader import Store

    bench = app_env["runs"] / "bench"
    bench.mkdir(parents=True)
    (bench / "other-model.json").write_text(
        json.dumps(
            {
                "overhead_pct": 4.41,
                "plain_step_ms": 10.0,
                "tracked_step_ms": 10.44,
                "config": {"k_in": 126, "k_out": 126, "sketch": "factored"},
            }
        )
    )
    with Store(REPO / "sample_runs" / "facts" / "store.h5") as s:
        want = round(float(np.median(s.timings()["step_ms"])), 2)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/runs.py")
    at.run()
    df = at.dataframe[0].value
    assert "overhead %" not in df.columns
    assert df[df["run"] == "facts"]["median step ms"].iloc[0] == pytest.approx(want)
    at.switch_page("views/overhead.py")
    at.run()
    assert any(f"median {want:.2f} ms" in c.value for c in at.caption)


# -- item 15.2: cancelling a job while it is "starting" ---------------------------------------
@pytest.mark.slow
def test_cancel_while_starting_is_cancelled_and_the_run_can_be_seen_and_deleted(cfg, app_env):
    data, eval_data = services.sample_dataset(cfg, "facts")
    job = services.start_job(cfg, _spec(data, eval_data), "early")
    assert job.status == "starting"  # the process is still importing torch: no run.json yet
    assert services.cancel_job(job.run_dir)
    done = services.wait_job(job.run_dir, timeout_s=60)
    assert not (job.run_dir / C.MANIFEST_FILE).exists()
    assert done.status == C.STATUS_CANCELLED, (done.status, done.error)
    assert "cancelled before training started" in done.error
    t = services.runs_table(cfg)
    assert t.filter(t["run"] == "early")["status"].to_list() == ["cancelled"]
    # the Launch page says cancelled (a warning), not "Training failed (see the log)"
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.session_state["launch_run"] = str(job.run_dir)
    at.run()
    at.switch_page("views/launch.py")
    at.run()
    assert not at.exception
    assert not [e.value for e in at.error if "failed" in e.value]
    assert any("cancelled" in w.value for w in at.warning)
    # the Runs page lists it and deletes it
    at.switch_page("views/runs.py")
    at.run()
    df = at.dataframe[0].value
    assert df[df["run"] == "early"]["status"].iloc[0] == "cancelled"
    at.selectbox(key="runs_delete_pick").set_value(str(job.run_dir)).run()
    at.checkbox(key=f"runs_delete_confirm_{job.run_dir}").check().run()
    at.button(key="runs_delete_button").click().run()
    assert not at.exception
    assert not job.run_dir.exists()


# -- item 15.5: run names with '/' -------------------------------------------------------------
@pytest.mark.parametrize("name", ["a/b", "../x", "x y", ".hidden", "é"])
def test_run_names_that_are_not_plain_folder_names_are_refused(cfg, tmp_path, name):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    with pytest.raises(services.JobError, match="use letters, digits"):
        services.start_job(cfg, _spec(data), name)
    assert not [p for p in cfg.runs_root.iterdir() if p.is_dir()]


def test_launch_page_refuses_a_run_name_with_a_slash(app_env):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/launch.py")
    at.run()
    at.text_input(key="launch_name").input("team/exp1")
    at.button[0].click().run()
    assert not at.exception
    msgs = " ".join(e.value for e in at.error)
    assert "team/exp1" in msgs and "no '/'" in msgs
    assert not [p for p in app_env["runs"].iterdir() if (p / "launch.json").exists()]


# -- item 15.1: uploads are never ignored --------------------------------------------------------
def test_uploads_win_over_a_bundled_set_and_conflict_with_a_path():
    from traceprop_engine.errors import ConfigError

    kind, note = services.launch.choose_data("facts", ["a.jsonl", "b.csv"])
    assert kind == "upload"
    assert "2 uploaded file(s) (a.jsonl, b.csv)" in note and "not on the bundled" in note
    assert services.launch.choose_data("facts", []) == (
        "facts",
        "Training on the bundled generated facts set",
    )
    assert services.launch.choose_data("path", [], "d/x.jsonl")[1].endswith("'d/x.jsonl'")
    with pytest.raises(ConfigError, match="choose 'Upload files'"):
        services.launch.choose_data("path", ["a.jsonl"], "d/x.jsonl")


# -- item 4: the Audit page never vouches for a run that did not complete ----------------------
def test_audit_page_does_not_vouch_for_a_failed_run(app_env):
    """A copy of the sample run marked failed (a crash): Verify on the Audit page shows errors
    ("cannot vouch"), no green "match" message (the page once said "All 0 data files and the
    model match" for such a run)."""
    import shutil

    run = app_env["runs"] / "crashed"
    shutil.copytree(REPO / "sample_runs" / "facts", run, ignore=shutil.ignore_patterns("index"))
    shutil.copytree(REPO / "sample_runs" / "facts-data", app_env["runs"] / "facts-data")
    m = json.loads((run / "run.json").read_text())
    m["status"] = "failed"
    (run / "run.json").write_text(json.dumps(m))
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.session_state["runs_active"] = str(run)
    at.run()
    at.switch_page("views/audit.py")
    at.run()
    at.button(key="audit_verify").click().run()
    assert not at.success, [s.value for s in at.success]
    assert any("vouch" in e.value for e in at.error), [e.value for e in at.error]
