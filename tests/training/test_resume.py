"""``traceprop train --resume``: a run SIGKILLed after a checkpoint and resumed ends equal to
one that was never interrupted (records, sketches, covariance, model), and runs that cannot be
resumed are refused with a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import facts_data, fast_settings
from safetensors.torch import load_file

from traceprop_engine import Store
from traceprop_engine.errors import RunError
from traceprop_engine.run import read_manifest, read_progress
from traceprop_engine.training import checkpoint
from traceprop_engine.training.command import train_argv
from traceprop_engine.training.loop import resume, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("data"))


# what the resumed run must match the uninterrupted one to: exactly (same operations in the same
# order on the same CPU thread), so the tolerance is zero. That holds because the buffer is one
# step: the deferred projection (capture/project.py) then multiplies one step's rows at a time
# in both runs; with a larger buffer a resumed run would batch other rows together, a GEMM of
# another M, which some BLAS (MKL on Intel Xeon) rounds differently
TOL = 0.0
EVERY = 5  # --checkpoint-every


def _flags(data, out) -> dict:
    return {
        "data": data / "train",
        "eval_data": data / "eval",
        "out": out,
        "epochs": 12,  # 7 steps an epoch: 84 steps, a few seconds
        "tiny_layers": 1,
        "tiny_width": 32,
        "tiny_vocab": 300,
        "max_length": 48,
        "threads": 1,
        "k_in": 4,
        "k_out": 4,
        "buffer_records": 8,  # one step: step k's records are flushed when step k + 1 starts
        "checkpoint_every": EVERY,
        "device": "cpu",
    }


def _run_cli(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)


def _kill_after(argv, out, step: int) -> None:
    """Start ``argv`` and SIGKILL it once progress.jsonl reaches ``step``."""
    p = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        lines = read_progress(out, last=1)
        if lines and lines[-1]["step"] >= step:
            break
        time.sleep(0.01)
    assert p.poll() is None, "the run ended before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def _records(store: Store) -> dict:
    recs = store.records()
    return {name: recs[name] for name in ("example_index", "step", "epoch", "lr", "loss")}


def assert_same_store(a: Store, b: Store, tol: float = TOL) -> None:
    """Records, sketches, covariance, norms and content digest of ``b`` equal ``a``'s."""
    ra, rb = _records(a), _records(b)
    for name in ra:
        np.testing.assert_allclose(rb[name], ra[name], rtol=0, atol=tol, err_msg=name)
    for i in range(len(a.layers)):
        np.testing.assert_allclose(b.sketches(i), a.sketches(i), rtol=0, atol=tol)
        ca, cb = a.covariance(i), b.covariance(i)
        assert ca is not None and cb is not None
        np.testing.assert_allclose(cb.A, ca.A, rtol=0, atol=tol)
        np.testing.assert_allclose(cb.S, ca.S, rtol=0, atol=tol)
        assert cb.n_tokens == ca.n_tokens
        assert b.sq_norm_sum(i) == a.sq_norm_sum(i)
    assert b.attrs()["content_sha256"] == a.attrs()["content_sha256"]


def assert_same_model(ref, other) -> None:
    """The saved model of run ``other`` is bit-identical to run ``ref``'s."""
    ma = load_file(ref / "model" / "model.safetensors")
    mb = load_file(other / "model" / "model.safetensors")
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_result(data, tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    r = _run_cli(train_argv(_flags(data, ref)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (ref / checkpoint.CHECKPOINT_DIR).exists()  # a completed run keeps none

    # checkpoints after steps 5, 10, 15, 20: killed at 18 or a little later, the
    # store holds the records of step 16 (usually: the writer thread may lag), past the
    # checkpoint of step 15; they are dropped on resume (test_reopen_truncates_to_the_checkpoint
    # checks the truncation on its own)
    _kill_after(train_argv(_flags(data, killed)), killed, 18)
    assert read_manifest(killed)["status"] == "failed"  # its process is gone
    ckpt = checkpoint.load(killed)
    assert ckpt is not None and ckpt.step >= 15
    with Store(killed / "store.h5") as s:
        assert s.n_records >= ckpt.n_records == ckpt.step * 8
    kill_step = read_progress(killed, last=1)[0]["step"]

    r = _run_cli([sys.executable, "-m", "traceprop_engine", "train", "--resume", str(killed)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "completed" in r.stdout

    m = read_manifest(killed)
    assert m["status"] == "completed" and m["resumed"][0]["from_step"] == ckpt.step
    assert m["resumed"][0]["previous_status"] == "killed"
    assert m["run_id"] == json.loads((killed / "run.json").read_text())["run_id"]
    steps = [line["step"] for line in read_progress(killed)]
    assert steps == list(range(1, 85)), (
        f"progress must continue the numbering (killed at {kill_step})"
    )
    assert not (killed / checkpoint.CHECKPOINT_DIR).exists()

    with Store(ref / "store.h5") as a, Store(killed / "store.h5") as b:
        assert b.status == "completed" and a.n_records == b.n_records == 84 * 8
        assert_same_store(a, b)
    assert_same_model(ref, killed)
    assert read_manifest(ref)["metrics"] == m["metrics"]
    assert read_manifest(ref)["model"]["fingerprint"] == m["model"]["fingerprint"]


def test_resume_refuses_what_it_cannot_continue(data, tmp_path):
    done = train(fast_settings(data, tmp_path / "done", checkpoint_every=2))
    with pytest.raises(RunError, match="completed run: there is nothing to resume"):
        resume(done)
    with pytest.raises(RunError, match="not a Traceprop run"):
        resume(tmp_path)
    with pytest.raises(RunError, match="not a Traceprop run"):
        resume(tmp_path / "nowhere")

    # a cancelled run without checkpoints (checkpoint_every 0): nothing to resume from
    nock = tmp_path / "nock"
    m = read_manifest(train(fast_settings(data, nock, checkpoint_every=0)))
    m["status"] = "cancelled"
    (nock / "run.json").write_text(json.dumps(m))
    with pytest.raises(RunError, match="has no checkpoint to resume from"):
        resume(nock)

    # a DDP run needs as many processes as it was trained by (tests/training/test_resume_ddp.py)
    m["distributed"] = {"world_size": 2, "backend": "gloo"}
    (nock / "run.json").write_text(json.dumps(m))
    with pytest.raises(RunError, match=r"trained by 2 processes .*this launch has 1\)"):
        resume(nock)


@pytest.mark.slow
def test_resume_cli_rejects_other_flags_and_a_run_in_use(data, tmp_path):
    r = _run_cli(
        [sys.executable, "-m", "traceprop_engine", "train", "--resume", str(tmp_path), "--lr", "1"]
    )
    assert r.returncode == 2 and "drop --lr" in r.stderr
    r = _run_cli([sys.executable, "-m", "traceprop_engine", "train"])
    assert r.returncode == 2 and "required: --data, --out" in r.stderr

    # a run whose lock is held (being trained) is refused, nothing touched
    from traceprop_engine.training.run_dir import lock_run_dir

    run = tmp_path / "busy"
    train(fast_settings(data, run, checkpoint_every=2, max_steps=3))
    fd = lock_run_dir(run)
    try:
        with pytest.raises(RunError, match="in use by another"):
            resume(run)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_finishes(data, tmp_path):
    """A cancelled run is resumed from the step it stopped at (its stop checkpoint)."""
    out = tmp_path / "c"
    p = subprocess.Popen(
        train_argv({**_flags(data, out), "checkpoint_every": 1000}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(read_progress(out)) < 3:
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=60)
    m = read_manifest(out)
    assert m["status"] == "cancelled"
    stopped = m["timings"]["n_steps"]
    assert checkpoint.load(out).step == stopped
    resume(out)
    m = read_manifest(out)
    assert m["status"] == "completed" and m["resumed"][0]["from_step"] == stopped
    with Store(out / "store.h5") as s:
        assert s.n_records == 84 * 8
        assert sorted(set(s.records()["step"].tolist())) == list(range(84))


def test_resume_refuses_changed_data_and_a_run_of_another_host(data, tmp_path):
    import shutil

    from traceprop_engine.training.loop import StopFlag

    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    out = tmp_path / "run"
    stop = StopFlag()

    def at_step(line):  # a caller's stop request after step 3: cancelled, with a checkpoint
        if line["step"] == 3:
            stop.requested, stop.reason = True, "test"

    train(fast_settings(copy, out, checkpoint_every=100), on_progress=at_step, stop=stop)
    assert read_manifest(out)["status"] == "cancelled" and checkpoint.load(out).step == 3

    m = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**m, "status": "running", "host": "elsewhere"}))
    with pytest.raises(RunError, match="being trained on elsewhere"):
        resume(out)
    (out / "run.json").write_text(json.dumps(m))

    first = sorted((copy / "train").iterdir())[0]
    original = first.read_bytes()
    first.write_bytes(original + b"\n")
    with pytest.raises(RunError, match="the data changed since this run began"):
        resume(out)
    assert read_manifest(out)["status"] == "failed"  # the refused resume says so
    first.write_bytes(original)
    resume(out)  # the same data again: it finishes
    m = read_manifest(out)
    assert m["status"] == "completed" and [r["from_step"] for r in m["resumed"]] == [3, 3]
    with Store(out / "store.h5") as s:
        assert s.n_records == m["store"]["n_records"] == 7 * 8
        assert s.verify_content()["status"] == "ok"


def test_reopen_truncates_to_the_checkpoint(data, tmp_path):
    """The store of a resumed run keeps exactly the checkpoint's records and appends after them."""
    from traceprop_engine.errors import StoreError
    from traceprop_engine.store.writer import StoreWriter

    run = train(fast_settings(data, tmp_path / "r"))
    with Store(run / "store.h5") as s:
        full, sk = s.records(), [s.sketches(i) for i in range(len(s.layers))]
    norms = [float(i + 1) for i in range(len(sk))]
    w = StoreWriter.reopen(run / "store.h5", 24, norms)
    w.close("cancelled")
    with Store(run / "store.h5") as s:
        assert s.n_records == 24 and s.status == "cancelled"
        for name, col in s.records().items():
            np.testing.assert_array_equal(col, full[name][:24], err_msg=name)
        for i in range(len(sk)):
            np.testing.assert_array_equal(s.sketches(i), sk[i][:24])
            assert s.sq_norm_sum(i) == norms[i]
            assert s._f[f"layers/{i:03d}/U"].shape[0] == 24  # the datasets are cut, not masked
        assert s.verify_content()["status"] == "ok"  # the digest is written again on close
    with pytest.raises(StoreError, match="holds 24 complete records, the checkpoint counts 25"):
        StoreWriter.reopen(run / "store.h5", 25, norms)


def test_a_run_recorded_before_share_k_resumes_with_its_own_k(tmp_path):
    """run.json from before ``share_k`` and ``projection`` existed: resumed unshared and
    Gaussian, as its store was made (the new defaults would give its layers other projections
    than its records)."""
    from traceprop_engine.settings import TrackSettings
    from traceprop_engine.training.resume import settings_from_config

    track = TrackSettings(k_in=48, k_out=48).to_dict()
    del track["share_k"], track["projection"]
    got = settings_from_config({"data": "d", "out": "o", "track": track}, tmp_path)
    assert got.track == TrackSettings(k_in=48, k_out=48, share_k=False, projection="gaussian")
    assert got.track.layer_k(32, 96) == (32, 48)
