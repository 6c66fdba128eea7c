"""The run directory is the training process's alone: a lock, no writes through links, no
half-written model, clear failures (diverged loss, full disk, bad input) instead of tracebacks."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
from helpers import facts_data, fast_settings

from traceprop_engine import ConfigError, RunError, Store, StoreError
from traceprop_engine.cli.main import main
from traceprop_engine.run import read_manifest, read_progress
from traceprop_engine.settings import TrainSettings
from traceprop_engine.store.writer import StoreWriter
from traceprop_engine.training import run_dir as run_dir_mod
from traceprop_engine.training.command import train_argv
from traceprop_engine.training.loop import train
from traceprop_engine.training.run_dir import LOCK_FILE
from traceprop_engine.verify import verify_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def made(data, tmp_path_factory):
    return train(fast_settings(data, tmp_path_factory.mktemp("made") / "run"))


def _snapshot(d):
    return {
        str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _cli_train(data, out, *extra):
    flags = {
        "data": data / "train",
        "eval_data": data / "eval",
        "out": out,
        "batch_size": 8,
        "max_length": 48,
        "tiny_layers": 1,
        "tiny_width": 32,
        "tiny_vocab": 300,
        "threads": 1,
        "k_in": 4,
        "k_out": 4,
    }
    return train_argv(flags) + list(extra)


# -- 7: one training process per run directory ---------------------------------------------------
def test_a_held_lock_stops_a_second_train_before_it_writes(data, made):
    before = _snapshot(made)
    fd = os.open(made / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunError, match="in use by another 'traceprop train'"):
            train(fast_settings(data, made), overwrite=True)
    finally:
        os.close(fd)
    assert _snapshot(made) == before


@pytest.mark.slow
def test_two_train_processes_into_one_out(data, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    # Output goes to a file, not an unread pipe: a full pipe would block the first process in
    # write() so that it could never reach the step boundary where SIGTERM stops it.
    log = open(tmp_path / "first.log", "wb")  # noqa: SIM115 - closed in finally
    first = subprocess.Popen(
        _cli_train(data, out, "--epochs", "400"), env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while len(read_progress(out)) < 2:
            assert first.poll() is None and time.monotonic() < deadline, "first train did not start"
            time.sleep(0.1)
        run_id = read_manifest(out)["run_id"]
        second = subprocess.run(
            _cli_train(data, out, "--epochs", "1", "--overwrite"),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1, second.stderr
        assert "in use by another 'traceprop train'" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.wait(timeout=60)
        finally:
            first.kill()
            log.close()
    m = read_manifest(out)
    assert m["run_id"] == run_id and m["status"] == "cancelled"
    steps = [x["step"] for x in read_progress(out)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaving


# -- 8: symlinks and directories that look like runs ----------------------------------------------
def test_overwrite_refuses_a_symlinked_model_and_writes_nothing_through_it(data, made, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(made, run)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"precious")
    shutil.rmtree(run / "model")
    (run / "model").symlink_to(outside, target_is_directory=True)
    with pytest.raises(RunError, match="symbolic link"):
        train(fast_settings(data, run), overwrite=True)
    assert (outside / "model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in outside.iterdir()) == ["model.safetensors"]
    assert (run / "model").is_symlink() and (run / "store.h5").exists()


def test_a_folder_that_looks_like_a_run_needs_overwrite(data, made, tmp_path):
    run = tmp_path / "remains"
    shutil.copytree(made, run)
    (run / "run.json").unlink()
    before = _snapshot(run)
    with pytest.raises(RunError, match=r"what is left of one: .*store\.h5.*model"):
        train(fast_settings(data, run))
    assert _snapshot(run) == before
    train(fast_settings(data, run), overwrite=True)
    assert read_manifest(run)["status"] == "completed"


# -- 6: degenerate runs ----------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1.0])
def test_a_non_finite_or_negative_lr_is_rejected(tmp_path, lr):
    with pytest.raises(ConfigError, match="lr a finite number"):
        TrainSettings(data="d", out=str(tmp_path), lr=lr)


def test_a_diverging_run_stops_and_is_marked_failed(data, tmp_path):
    with pytest.raises(RunError, match=r"the training loss became (nan|inf) at step \d+"):
        train(fast_settings(data, tmp_path / "div", lr=1e6, epochs=3))
    m = read_manifest(tmp_path / "div")
    assert m["status"] == "failed" and "loss became" in m["error"]
    assert "fingerprint" not in m["model"] and not (tmp_path / "div" / "model").exists()
    with Store(tmp_path / "div" / "store.h5") as s:  # readable and partial
        assert s.status == "failed" and s.is_partial and s.n_records > 0


def test_truncated_classification_inputs_are_counted_in_the_notes(tmp_path, caplog):
    d = tmp_path / "cls"
    d.mkdir()
    rows = [{"text": " ".join(f"word{j}" for j in range(100)), "label": "a"}] * 3 + [
        {"text": "short text", "label": "b"}
    ] * 3
    (d / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(
        TrainSettings(
            data=str(d),
            out=str(tmp_path / "run"),
            model="minilm",
            task="classification",
            max_length=16,
            epochs=1,
            eval_fraction=0.0,
            track=None,
            threads=1,
        )
    )
    notes = read_manifest(tmp_path / "run")["notes"]
    assert notes == ["3 of 6 examples were longer than --max-length 16 tokens and were truncated"]
    assert any("were truncated" in r.message for r in caplog.records)


# -- 10: the final save is all or nothing ----------------------------------------------------------
def test_an_interrupt_during_the_final_save_leaves_no_model(data, tmp_path, monkeypatch):
    real = run_dir_mod.save_model

    def save_then_second_ctrl_c(loaded, out, **kw):
        real(loaded, out, **kw)  # the files are written, the rename has not happened yet
        raise KeyboardInterrupt

    monkeypatch.setattr(run_dir_mod, "save_model", save_then_second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train(fast_settings(data, tmp_path / "r"))
    run = tmp_path / "r"
    assert not (run / "model").exists() and not (run / ".model.tmp").exists()
    assert read_manifest(run)["status"] == "cancelled"
    assert not verify_run(run)["ok"]


def test_the_model_is_renamed_into_place(made):
    assert (made / "model" / "model.safetensors").is_file()
    assert not (made / ".model.tmp").exists()
    assert verify_run(made)["model"]["status"] == "ok"


# -- 11: a full disk -------------------------------------------------------------------------------
def test_a_full_disk_fails_the_run_with_a_message(data, tmp_path, monkeypatch, capsys):
    def no_space(self, arrays, meta):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StoreWriter, "append", no_space)
    out = tmp_path / "full"
    argv = _cli_train(data, out, "--epochs", "1", "--buffer-records", "8")[3:]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the disk is full" in err and "Traceback" not in err
    m = read_manifest(out)
    assert m["status"] == "failed" and m["error"].startswith("disk full")
    with Store(out / "store.h5") as s:
        assert s.status == "failed" and s.n_records == 0


# -- round 2, "silently wrong" item 6: a disk that really fills (no mock) ---------------------------
_LIMITED_TRAIN = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from traceprop_engine.cli.main import main
raise SystemExit(main(sys.argv[2:]))
"""


def _assert_failed_for_lack_of_space(out, rc: int, err: str, capsys) -> None:
    """rc 1 with the message, run.json failed, no temporary files, and a store (if one was
    begun) that reads back as failed, which info and verify report without a traceback."""
    assert rc == 1, err
    assert "the disk is full" in err and "Traceback" not in err, err
    m = read_manifest(out)
    assert m["status"] == "failed" and m["error"].startswith("disk full"), m.get("error")
    left = {"run.json.tmp", "store.h5.tmp", ".model.tmp", ".checkpoint.tmp"}
    assert not left & {p.name for p in out.iterdir()}
    if (out / "store.h5").exists():
        with Store(out / "store.h5") as s:
            assert s.status == "failed"
            assert len(s.records()["step"]) == s.n_records
    capsys.readouterr()
    assert main(["info", str(out)]) in (0, 1) and main(["verify", str(out)]) == 3
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("fraction", [0.0, 0.7])
def test_a_file_size_limit_fails_the_run_with_a_message_and_a_readable_store(
    data, made, tmp_path, fraction, capsys
):
    """RLIMIT_FSIZE (`ulimit -f`) makes the writes past it fail as a full disk would (EFBIG):
    at the store's creation (0.0) or while records are appended (0.7)."""
    from traceprop_engine.store.space import RESERVE_BYTES

    limit = RESERVE_BYTES + int(fraction * (made / "store.h5").stat().st_size)
    out = tmp_path / "limited"
    argv = _cli_train(data, out, "--epochs", "2", "--buffer-records", "8")[3:]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = [sys.executable, "-c", _LIMITED_TRAIN, str(limit), *map(str, argv)]
    p = subprocess.run(code, env=env, capture_output=True, text=True, timeout=600)
    _assert_failed_for_lack_of_space(out, p.returncode, p.stderr, capsys)


_FULL_SAVES = """
import resource, signal, sys, torch
from safetensors.torch import save_file
from pathlib import Path
from traceprop_engine.training.checkpoint import _save_state
from traceprop_engine.training.run_dir import disk_full
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
for save in (lambda: save_file({"w": torch.zeros(8192)}, sys.argv[1] + "/m.safetensors"),
             lambda: _save_state({"w": torch.zeros(8192)}, Path(sys.argv[1]) / "s.pt")):
    try:
        save()
    except Exception as e:
        print(type(e).__name__, disk_full(e, None) is not None)
"""


def test_the_model_and_checkpoint_writers_failures_for_lack_of_space_are_recognised(tmp_path):
    """safetensors (the model) says it in a SafetensorError; torch.save (a checkpoint) raises a
    RuntimeError without a reason, which the checkpoint writer turns into the OSError."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-c", _FULL_SAVES, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "SafetensorError True"
    assert p.stdout.split("\n")[1] == "OSError True"


def test_a_full_tmpfs_fails_the_run_with_a_message_and_a_readable_store(
    data, made, tmp_path, capsys
):
    """A real full file system: a tmpfs (mounting one needs root, as in CI)."""
    from traceprop_engine.store.space import RESERVE_BYTES

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = RESERVE_BYTES + (made / "store.h5").stat().st_size // 2
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / "run"
        rc = main(_cli_train(data, out, "--epochs", "2", "--buffer-records", "8")[3:])
        _assert_failed_for_lack_of_space(out, rc, capsys.readouterr().err, capsys)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# -- 13: clear errors instead of tracebacks --------------------------------------------------------
def _nul_data(tmp_path):
    d = tmp_path / "nul"
    d.mkdir()
    (d / "a.jsonl").write_text(
        '{"prompt": "Q", "completion": " A"}\n{"prompt": "Q\\u0000", "completion": " B"}\n'
    )
    return d


def _bad_store(tmp_path, made, edit):
    run = tmp_path / "bad"
    shutil.copytree(made, run)
    with h5py.File(run / "store.h5", "r+") as f:
        edit(f)
    return run


@pytest.mark.parametrize(
    "case, expect",
    [
        ("nul-in-row", r"a\.jsonl:2: field 'prompt' contains a NUL character"),
        ("out-is-a-file", "is a file, not a directory"),
        ("out-read-only", "cannot create the run directory"),
        ("cuda-without-cuda", "usable CUDA device"),
        ("prompt-not-utf8", "not valid UTF-8"),
        ("store-without-records-loss", "missing dataset 'records/loss'"),
        ("store-without-examples-text", "missing dataset 'examples/text'"),
        ("store-without-P_in", "missing dataset 'layers/000/P_in'"),
        ("schema-version-not-int", "schema_version attribute that is not an integer"),
        ("run-json-a-list", "holds a JSON list, not a run manifest"),
    ],
)
def test_bad_input_gets_a_message_not_a_traceback(case, expect, data, made, tmp_path, capsys):
    base = _cli_train(data, tmp_path / "run", "--epochs", "1")[3:]
    if case == "nul-in-row":
        argv = base + ["--data", str(_nul_data(tmp_path)), "--eval-fraction", "0"]
        argv.remove("--eval-data")
        argv.remove(str(data / "eval"))
    elif case == "out-is-a-file":
        (tmp_path / "f").write_text("x")
        argv = base + ["--out", str(tmp_path / "f")]
    elif case == "out-read-only":
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        # root ignores permission bits: /proc refuses everyone
        target = "/proc/1/traceprop-run" if os.geteuid() == 0 else str(ro / "run")
        argv = base + ["--out", target]
    elif case == "cuda-without-cuda":
        argv = base + ["--device", "cuda:99" if torch.cuda.is_available() else "cuda"]
    elif case == "prompt-not-utf8":
        argv = ["query", str(made), "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")]
    elif case.startswith("store-") or case == "schema-version-not-int":
        edits = {
            "store-without-records-loss": lambda f: f.__delitem__("records/loss"),
            "store-without-examples-text": lambda f: f.__delitem__("examples/text"),
            "store-without-P_in": lambda f: f.__delitem__("layers/000/P_in"),
            "schema-version-not-int": lambda f: f.attrs.__setitem__("schema_version", "two"),
        }
        run = _bad_store(tmp_path, made, edits[case])
        if case == "store-without-P_in":  # needed (and checked) where the query is sketched
            with Store(run / "store.h5") as st, pytest.raises(StoreError, match=expect):
                st.projection(0, "in")
            argv = ["query", str(run), "--prompt", "Q: x\nA:", "--completion", " y"]
        else:
            with pytest.raises(StoreError, match=expect):
                Store(run / "store.h5")
            argv = ["info", str(run)]
    elif case == "run-json-a-list":
        run = tmp_path / "listrun"
        shutil.copytree(made, run)
        (run / "run.json").write_text("[]")
        argv = ["info", str(run)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert expect.replace("\\", "") in err.replace("\\", "") or __import__("re").search(expect, err)
    assert "Traceback" not in err


def test_runs_lists_an_unreadable_run_and_goes_on(made, tmp_path, capsys):
    root = tmp_path / "runs"
    root.mkdir()
    for name, text in (("a-good", None), ("b-list", "[]"), ("c-garbage", "{not json")):
        shutil.copytree(made, root / name)
        if text is not None:
            (root / name / "run.json").write_text(text)
    assert main(["runs", str(root)]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert set(lines) == {"a-good", "b-list", "c-garbage"}
    assert "completed" in lines["a-good"]
    assert "unreadable" in lines["b-list"] and "unreadable" in lines["c-garbage"]


def test_a_run_trained_at_lr_0_says_every_score_is_zero(data, tmp_path):
    """--lr 0: the model learns nothing and every lr-weighted score is 0. The query says so
    (run note + result note) instead of listing the same rows as proponents and opponents."""
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.attribution.score.ranking import ALL_ZERO_NOTE, ZERO_LR_NOTE

    train(fast_settings(data, tmp_path / "lr0", lr=0.0, epochs=1))
    run = open_run(tmp_path / "lr0")
    res = run.query("Where does Ada live?", " Paris", top_k=5, opponents=True)
    assert res.rows.height == 0
    assert ZERO_LR_NOTE in res.notes and ALL_ZERO_NOTE in res.notes
    # a run that learned keeps its rows and says neither
    train(fast_settings(data, tmp_path / "lr1", epochs=1))
    other = open_run(tmp_path / "lr1").query("Where does Ada live?", " Paris", top_k=5)
    assert other.rows.height > 0
    assert ZERO_LR_NOTE not in other.notes and ALL_ZERO_NOTE not in other.notes
