"""``traceprop train --resume`` of a DDP run (2 ranks, gloo, CPU): a run whose torchrun group was
SIGKILLed after a checkpoint, resumed under torchrun with the same number of processes, ends
equal to an uninterrupted DDP run shard by shard (records, sketches, covariance, norms, content
digest) and in its model; what cannot be resumed is refused with a message."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import facts_data, torchrun, torchrun_failure
from test_resume import assert_same_model, assert_same_store

from traceprop_engine import Store
from traceprop_engine.errors import RunError
from traceprop_engine.run import RunManifest, read_manifest, read_progress
from traceprop_engine.training import checkpoint
from traceprop_engine.training.command import train_argv
from traceprop_engine.training.loop import resume
from traceprop_engine.training.resume import check_shards

pytestmark = pytest.mark.slow  # torchrun jobs of 2 ranks, killed and resumed

WORLD = 2
# exact: the same operations in the same order on each rank (a 2-rank gloo all-reduce adds two
# numbers, whatever DDP's bucket layout; a buffer of one step, so the deferred projection's
# GEMMs have the same rows in both runs, see test_resume.TOL), so the resumed shards equal the
# uninterrupted ones
TOL = 0.0
EVERY = 5
STEPS = 6 * 7  # 6 epochs of 7 global batches (8 examples: 4 per rank)
SHARDS = [f"store.rank{r}.h5" for r in range(WORLD)]


def _launcher() -> list[str]:
    return torchrun(WORLD)


def _flags(data, out) -> dict:
    return {
        "data": data / "train",
        "eval_data": data / "eval",
        "out": out,
        "epochs": 6,
        "batch_size": 4,  # per rank
        "tiny_layers": 1,
        "tiny_width": 32,
        "tiny_vocab": 300,
        "max_length": 48,
        "threads": 1,
        "k_in": 4,
        "k_out": 4,
        "buffer_records": 4,  # one step per flush
        "checkpoint_every": EVERY,
        "device": "cpu",
    }


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc): torchrun starts its workers in new sessions,
    so a kill of its process group leaves them running."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        here = todo.pop()
        kids = [c for c, pp in parent.items() if pp == here]
        out += kids
        todo += kids
    return out


def _kill_job_after(argv, out, step: int) -> None:
    """Start a torchrun job and SIGKILL it, workers and launcher, once progress.jsonl reaches
    ``step`` (a preempted node)."""
    p = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=ENV
    )
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        lines = read_progress(out, last=1)
        if lines and lines[-1]["step"] >= step:
            break
        time.sleep(0.01)
    assert p.poll() is None, "the run ended before it could be killed"
    workers = _children(p.pid)
    assert len(workers) >= WORLD, workers
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _resume_argv(run) -> list[str]:
    return [*_launcher(), "-m", "traceprop_engine", "train", "--resume", str(run)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_ddp")
    data = facts_data(root / "data")
    ref, killed = root / "ref", root / "killed"
    r = subprocess.run(
        train_argv(_flags(data, ref), launcher=_launcher()),
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert r.returncode == 0, torchrun_failure(r.stderr)
    # checkpoints after steps 5, 10, 15, 20: killed at 18 or a little later
    _kill_job_after(train_argv(_flags(data, killed), launcher=_launcher()), killed, 18)
    shutil.copytree(killed, root / "killed_copy")  # for the refusals, before it is resumed
    return root, ref, killed


def test_a_killed_ddp_run_resumes_to_the_uninterrupted_result(runs):
    root, ref, killed = runs
    assert read_manifest(ref)["status"] == "completed"
    assert not (ref / checkpoint.CHECKPOINT_DIR).exists()
    ckpt = checkpoint.load(killed)
    assert ckpt is not None and ckpt.step >= 15 and ckpt.world_size == WORLD
    counts = [int(r["n_records"]) for r in ckpt.meta["ranks"]]
    assert counts == [ckpt.step * 4] * WORLD
    for r in range(WORLD):
        assert (ckpt.folder / checkpoint.rank_state_file(r)).is_file()
    kill_step = read_progress(killed, last=1)[0]["step"]

    # launched without torchrun: refused, nothing touched
    before = (killed / "run.json").read_text()
    with pytest.raises(RunError, match=r"trained by 2 processes .*torchrun --nproc-per-node 2"):
        resume(killed)
    assert (killed / "run.json").read_text() == before

    r = subprocess.run(_resume_argv(killed), capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, torchrun_failure(r.stderr)
    assert "completed" in r.stdout

    m = read_manifest(killed)
    assert m["status"] == "completed" and m["resumed"][0]["from_step"] == ckpt.step
    assert m["resumed"][0]["previous_status"] == "killed"
    assert m["resumed"][0]["n_records_kept"] == sum(counts)
    assert [x["step"] for x in read_progress(killed)] == list(range(1, STEPS + 1)), kill_step
    assert not (killed / checkpoint.CHECKPOINT_DIR).exists()
    assert m["store"]["n_records_per_shard"] == read_manifest(ref)["store"]["n_records_per_shard"]

    for shard in SHARDS:
        with Store(ref / shard) as a, Store(killed / shard) as b:
            assert b.status == "completed" and a.n_records == b.n_records == STEPS * 4
            assert_same_store(a, b, TOL)
    assert_same_model(ref, killed)
    assert read_manifest(ref)["metrics"] == m["metrics"]


def test_sigterm_to_torchrun_checkpoints_every_rank_and_resume_finishes(runs, tmp_path):
    """SIGTERM to the launcher (as a scheduler sends it): torchrun passes it on, every rank stops
    at the same step and writes the stop checkpoint; the resumed run equals the uninterrupted one
    (whose checkpoints every 5 steps change nothing)."""
    root, ref, _ = runs
    out = tmp_path / "c"
    p = subprocess.Popen(
        train_argv({**_flags(root / "data", out), "checkpoint_every": 1000}, launcher=_launcher()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=ENV,
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(read_progress(out)) < 3:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGTERM)
    p.wait(timeout=120)
    m = read_manifest(out)
    assert m["status"] == "cancelled", m.get("error")
    stopped = m["timings"]["n_steps"]
    ckpt = checkpoint.load(out)
    assert (
        ckpt.step == stopped and [r["n_records"] for r in ckpt.meta["ranks"]] == [stopped * 4] * 2
    )
    r = subprocess.run(_resume_argv(out), capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, torchrun_failure(r.stderr)
    m = read_manifest(out)
    assert m["status"] == "completed" and m["resumed"][0]["from_step"] == stopped
    for shard in SHARDS:
        with Store(ref / shard) as a, Store(out / shard) as b:
            assert b.n_records == a.n_records == STEPS * 4
            for i in range(len(a.layers)):
                np.testing.assert_allclose(b.sketches(i), a.sketches(i), rtol=0, atol=TOL)
            assert b.attrs()["content_sha256"] == a.attrs()["content_sha256"]


@pytest.fixture(scope="module")
def killed_copy(runs):
    """A copy of the killed run taken before it was resumed (for the refusals)."""
    return runs[0] / "killed_copy"


def test_resume_refuses_a_missing_or_short_shard(runs, killed_copy, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(killed_copy, run)
    m, ckpt = RunManifest.load(run, as_written=True), checkpoint.load(run)
    check_shards(run, m, ckpt)  # whole: fine
    need = int(ckpt.meta["ranks"][1]["n_records"])
    with h5py.File(run / SHARDS[1], "r+", locking=False) as f:  # a shard that lost records
        f.attrs["n_records"] = need - 1
    with pytest.raises(
        RunError,
        match=rf"holds {need - 1} complete records, the checkpoint counts {need} for rank 1",
    ):
        check_shards(run, m, ckpt)

    # end to end under torchrun: a missing shard stops every rank with the message, run.json
    # unchanged
    (run / SHARDS[1]).unlink()
    before = (run / "run.json").read_text()
    r = subprocess.run(_resume_argv(run), capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode != 0
    assert "the store shard store.rank1.h5 of rank 1 is missing" in r.stderr, r.stderr[-3000:]
    assert (run / "run.json").read_text() == before


def test_resume_checks_the_world_size_and_refuses_fsdp(killed_copy, tmp_path, monkeypatch):
    m = read_manifest(killed_copy)
    assert m["distributed"]["world_size"] == WORLD
    # a launch with 3 processes: refused before any process group is joined
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunError, match=r"trained by 2 processes .*this launch has 3\)"):
        resume(killed_copy)
    # a single-process run launched under torchrun
    one = tmp_path / "one"
    one.mkdir()
    (one / "run.json").write_text(json.dumps({k: v for k, v in m.items() if k != "distributed"}))
    with pytest.raises(RunError, match="trained by one process, this launch has 3"):
        resume(one)
    # an FSDP run (sharded states: no checkpoint) is refused whatever the launch
    fsdp = tmp_path / "fsdp"
    fsdp.mkdir()
    m["distributed"]["parallel"] = "fsdp"
    (fsdp / "run.json").write_text(json.dumps(m))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunError, match="resuming FSDP runs is not supported yet"):
        resume(fsdp)
