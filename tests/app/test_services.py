"""Unit tests of the app/services package: path safety, uploads, exports, and real training jobs."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import services

from traceprop_engine import constants as C

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_runs" / "facts"


@pytest.fixture
def cfg(app_env):
    return services.AppConfig.from_env()


# -- configuration and listing ------------------------------------------------------------------
def test_config_from_env_creates_runs_root(cfg, app_env):
    assert cfg.runs_root == app_env["runs"].resolve() and cfg.runs_root.is_dir()
    assert cfg.sample_runs == (REPO / "sample_runs").resolve()


def test_runs_table_lists_the_sample(cfg):
    t = services.runs_table(cfg)
    row = t.filter(t["run"] == "facts").row(0, named=True)
    assert row["kind"] == "sample" and row["status"] == "completed"
    m = json.loads((SAMPLE / "run.json").read_text())
    assert row["records"] == m["store"]["n_records"]
    assert row["examples"] == m["data"]["n_train"]
    assert row["tracked layers"] == len(m["tracking"]["layers"])
    assert row["k"] == "126x126"  # the default tracking configuration


def test_active_run_defaults_to_sample_and_survives_deletion(cfg):
    state: dict = {}
    assert services.ensure_active_run(cfg, state) == SAMPLE.resolve()
    state["runs_active"] = "/nonexistent/run"
    assert services.ensure_active_run(cfg, state) == SAMPLE.resolve()


def test_sample_run_cannot_be_deleted(cfg):
    with pytest.raises(services.PathError, match="sample"):
        services.delete_run(cfg, SAMPLE)
    assert (SAMPLE / "run.json").exists()


# -- path safety ------------------------------------------------------------------------------
def test_safe_path_accepts_paths_under_root(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("{}\n")
    assert services.safe_path(tmp_path, "d/a.jsonl") == (tmp_path / "d" / "a.jsonl").resolve()
    assert services.safe_path(tmp_path, str(tmp_path / "d")) == (tmp_path / "d").resolve()


@pytest.mark.parametrize("typed", ["..", "../x", "d/../../etc/passwd", "/etc/passwd", "~/x", ""])
def test_safe_path_refuses_escapes(tmp_path, typed):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    with pytest.raises(services.PathError):
        services.safe_path(root, typed, must_exist=False)


def test_safe_path_refuses_symlink_out_of_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(services.PathError, match="outside"):
        services.safe_path(root, "link")
    with pytest.raises(services.PathError, match="outside"):
        services.safe_path(root, "link/file.jsonl", must_exist=False)


def test_safe_path_missing(tmp_path):
    with pytest.raises(services.PathError, match="does not exist"):
        services.safe_path(tmp_path, "nope.jsonl")


# -- uploads ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("train.jsonl", "train.jsonl"),
        ("../../etc/passwd.csv", "passwd.csv"),
        ("..\\..\\x.txt", "x.txt"),
        (".hidden.jsonl", "hidden.jsonl"),
        ("my data (1).csv", "my_data_1_.csv"),
        ("..", "file"),
        ("a..b.csv", "a.b.csv"),
    ],
)
def test_sanitize_name(name, want):
    got = services.sanitize_name(name)
    assert got == want
    assert "/" not in got and not got.startswith(".")


def test_save_uploads_stays_under_uploads(cfg):
    out = services.save_uploads(
        cfg, [("../../evil.jsonl", b'{"text": "a"}\n'), ("ok.csv", b"text\nb\n")]
    )
    assert out.parent == cfg.runs_root / services.UPLOADS_DIR
    assert sorted(p.name for p in out.iterdir()) == ["evil.jsonl", "ok.csv"]
    assert (out / "evil.jsonl").read_bytes() == b'{"text": "a"}\n'


@pytest.mark.parametrize(
    ("files", "match"),
    [([], "at least one"), ([("x.exe", b"1")], "unsupported"), ([("x.jsonl", b"")], "empty")],
)
def test_save_uploads_refuses_bad_files(cfg, files, match):
    with pytest.raises(services.PathError, match=match):
        services.save_uploads(cfg, files)
    assert not (cfg.runs_root / services.UPLOADS_DIR).exists() or not any(
        (cfg.runs_root / services.UPLOADS_DIR).iterdir()
    )


# -- exports ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample_result():
    from traceprop_engine.attribution.query import open_run

    run = open_run(SAMPLE)
    res = run.query(eval_example=int(run.eval_examples()["example_id"][0]), top_k=4)
    yield run, res
    run.close()


def test_export_csv_rows_carry_lineage(sample_result):
    _, res = sample_result
    rows = list(csv.DictReader(io.StringIO(services.export_bytes(res, "csv").decode())))
    assert len(rows) == res.rows.height == 8
    for r, want in zip(rows, res.rows.iter_rows(named=True), strict=True):
        assert r["source"] == want["source"] and int(r["row"]) == want["row"]
        assert r["location"] == f"{want['source']}:{want['row']}"
        assert float(r["score"]) == pytest.approx(want["score"], rel=1e-6)
        assert r["sha256"] == want["sha256"]


def test_export_json_matches_csv(sample_result):
    _, res = sample_result
    doc = json.loads(services.export_bytes(res, "json"))
    assert doc["query"]["eval_example"] == res.query["eval_example"]  # the query rides along
    js = doc["rows"]
    assert [r["example_id"] for r in js] == res.rows["example_id"].to_list()
    assert {
        "rank",
        "kind",
        "score",
        "source",
        "row",
        "sha256",
        "text",
        "layer_scores",
        "location",
    } <= set(js[0])


def test_audit_bytes(sample_result):
    run, res = sample_result
    js, csv_bytes, trail = services.audit_bytes(SAMPLE, res)
    assert json.loads(js)["run_id"] == run.run_id
    rows = list(csv.DictReader(io.StringIO(csv_bytes.decode())))
    assert len(rows) == len(trail["influencers"]) == res.rows.height
    assert all(r["run_id"] == run.run_id for r in rows)


def test_layer_scores_table_sums_to_score(sample_result):
    _, res = sample_result
    r = res.rows.row(0, named=True)
    t = services.layer_scores_table(r["layer_scores"])
    assert t.height > 0
    assert t["score"].sum() == pytest.approx(r["score"], rel=1e-3, abs=1e-5)


# -- jobs (a real tiny training process) --------------------------------------------------------
def _spec(
    data: Path, eval_data: Path, epochs: int = 1, extra: tuple[str, ...] = ()
) -> services.LaunchSpec:
    return services.LaunchSpec(
        data=data,
        eval_data=eval_data,
        epochs=epochs,
        max_length=32,
        tiny_layers=1,
        tiny_width=32,
        extra=extra,
    )


def test_launch_spec_errors(tmp_path):
    spec = services.LaunchSpec(
        data=tmp_path / "missing", epochs=0, lr=-1.0, model="minilm", task="causal-lm", scope="("
    )
    errs = " ".join(spec.errors())
    for part in (
        "does not exist",
        "epochs=0",  # the bounds are TrainSettings' (settings.py), reported in its words
        "lr=-1.0",
        "minilm",
        "valid regular expression",  # TrackSettings' scope check
    ):
        assert part in errs


def test_launch_spec_bounds_are_the_settings_bounds(tmp_path):
    from traceprop_engine.errors import ConfigError
    from traceprop_engine.settings import TrackSettings, TrainSettings

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    assert services.LaunchSpec(data=data).errors() == []
    for bad in ({"tiny_width": 30}, {"max_length": 1}, {"k_in": 0}, {"rank": -1}):
        (msg,) = services.LaunchSpec(data=data, **bad).errors()
        settings = TrackSettings if set(bad) & {"k_in", "rank"} else TrainSettings
        args = bad if settings is TrackSettings else {"data": "d", "out": "o", **bad}
        with pytest.raises(ConfigError) as e:
            settings(**args)
        assert msg == str(e.value)


@pytest.mark.slow
def test_job_runs_to_completion_and_second_launch_is_refused(cfg):
    data, eval_data = services.sample_dataset(cfg, "facts")
    job = services.start_job(cfg, _spec(data, eval_data, extra=("--max-steps", "6")), "first")
    assert job.running and job.run_dir == cfg.runs_root / "first"
    with pytest.raises(services.JobError, match="already running"):
        services.start_job(cfg, _spec(data, eval_data), "second")
    assert services.active_job(cfg).run_dir == job.run_dir
    done = services.wait_job(job.run_dir, timeout_s=120)
    assert done.status == C.STATUS_COMPLETED, done.log_tail
    assert done.step == done.total > 0
    assert services.active_job(cfg) is None
    t = services.runs_table(cfg)
    assert t.filter(t["run"] == "first")["status"].to_list() == ["completed"]
    assert (job.run_dir / C.LOG_FILE).stat().st_size > 0
    services.delete_run(cfg, job.run_dir)
    assert not job.run_dir.exists()


@pytest.mark.slow
def test_job_cancel(cfg):
    data, eval_data = services.sample_dataset(cfg, "facts")
    job = services.start_job(cfg, _spec(data, eval_data, epochs=50), "slow")
    deadline = time.monotonic() + 60
    while services.job_state(job.run_dir).step < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert services.job_state(job.run_dir).status == C.STATUS_RUNNING
    with pytest.raises(services.JobError, match="cancel it first"):
        services.delete_run(cfg, job.run_dir)
    assert services.cancel_job(job.run_dir)
    done = services.wait_job(job.run_dir, timeout_s=60)
    assert done.status == C.STATUS_CANCELLED
    assert done.step < done.total
    deadline = time.monotonic() + 30  # the process saves what it has, then exits
    while services.process_alive(done.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not services.process_alive(done.pid)
    assert not services.cancel_job(job.run_dir)


@pytest.mark.slow
def test_job_that_fails_reports_its_log(cfg, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    job = services.start_job(
        cfg, services.LaunchSpec(data=bad, max_length=32, tiny_layers=1, tiny_width=32), "bad"
    )
    done = services.wait_job(job.run_dir, timeout_s=60)
    assert done.status == C.STATUS_FAILED
    assert done.log_tail  # the user sees why
    assert done.error


def test_process_alive_ignores_zombies():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    assert not services.process_alive(p.pid)
    assert not services.process_alive(None)
    assert services.process_alive(os.getpid())
    _ = signal  # imported for readers: cancel sends SIGTERM to the process group


def test_md_escape_neutralises_markup():
    s = services.md_escape("[click](javascript:alert(1)) **bold** <b>x</b> my_file.jsonl `code`")
    for raw in ("[", "]", "*", "<", ">", "`", "_"):
        assert s.count(raw) == s.count("\\" + raw)
    assert (
        s.replace("\\", "") == "[click](javascript:alert(1)) **bold** <b>x</b> my_file.jsonl `code`"
    )


def test_measured_configurations_and_the_launch_assessment(tmp_path):
    import polars as pl

    table = services.measured_configurations()
    assert table.height >= 4 and table["on the front"].any()
    default = table.filter(pl.col("configuration").str.ends_with("(default)"))
    assert default.height == 1 and default["bytes / example"][0] <= 4400
    assert "mean LDS" in services.assess_configuration(services.LaunchSpec(data=tmp_path))
    odd = services.LaunchSpec(data=tmp_path, k_in=5, k_out=7)
    assert "not measured" in services.assess_configuration(odd)


def test_one_line_shows_text_not_a_python_repr():
    assert services.one_line("Q: Which colour?\nA: violet") == "Q: Which colour? ⏎ A: violet"
    assert services.one_line("x" * 200, limit=10) == "x" * 9 + "…"
    assert "\\n" not in services.one_line("a\nb") and "'" not in services.one_line("a\nb")
