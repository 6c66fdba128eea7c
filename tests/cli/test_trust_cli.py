"""Trust, round 2 (issue 27): what a CLI user meets on hostile input gets a message, never a
raw traceback, and the words say what is true. Each test is named in docs/trust.md's section
"Round 2: errors and words"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import h5py
import pytest
from helpers import facts_data, fast_settings

from traceprop_engine.cli.main import main
from traceprop_engine.run import read_progress
from traceprop_engine.training.loop import train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def made(data, tmp_path_factory):
    return train(fast_settings(data, tmp_path_factory.mktemp("made") / "run"))


def _cli(*args, **kw) -> subprocess.CompletedProcess:
    """``python -m traceprop_engine ARGS`` (bytes or str arguments), with this tree's code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "traceprop_engine", *args],
        capture_output=True,
        env=env,
        timeout=300,
        **kw,
    )


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _train_flags(data, out) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--eval-fraction",
        "0",
        "--epochs",
        "1",
        "--tiny-layers",
        "1",
        "--tiny-width",
        "32",
        "--tiny-vocab",
        "300",
        "--threads",
        "1",
        "--k-in",
        "4",
        "--k-out",
        "4",
        "--max-length",
        "48",
    ]


def _undecodable(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes


# -- arguments that are not UTF-8: one check in main, for every command ----------------------------
@pytest.mark.parametrize(
    "case, flag",
    [
        ("audit-prompt", "--prompt"),
        ("counterfactual-completion", "--completion"),
        ("query-label", "--label"),
        ("info-run-path", "RUN"),
        ("train-out", "--out"),
        ("eval-lds-data", "--data"),
    ],
    ids=[
        "audit-prompt",
        "counterfactual-completion",
        "query-label",
        "info-run-path",
        "train-out",
        "eval-lds-data",
    ],
)
def test_arguments_that_are_not_utf8_are_refused_by_every_command(
    case, flag, made, tmp_path, capsys
):
    bad = _undecodable(b"caf\xe9")
    run = str(made)
    argv = {
        "audit-prompt": ["audit", run, "--prompt", bad, "--out", str(tmp_path / "t.json")],
        "counterfactual-completion": ["counterfactual", run, "--prompt", "Q", "--completion", bad],
        "query-label": ["query", run, "--prompt", "Q", "--completion", " A", "--label", bad],
        "info-run-path": ["info", str(tmp_path / bad)],
        "train-out": ["train", "--data", run, "--out", str(tmp_path / bad)],
        "eval-lds-data": ["eval", "lds", "--data", bad, "--out", str(tmp_path / "e")],
    }[case]
    assert main(argv) == 1
    err = _err(capsys)
    assert f"{flag} holds bytes that are not valid UTF-8" in err and r"caf\xe9" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_real_argv_bytes_get_the_message_in_a_subprocess(made, tmp_path):
    """The same through the interpreter's own argv decoding (the issue's $'caf\\xe9')."""
    p = _cli("audit", str(made), "--prompt", b"caf\xe9", "--out", str(tmp_path / "t.json"))
    assert p.returncode == 1
    assert b"--prompt holds bytes that are not valid UTF-8" in p.stderr
    assert b"Traceback" not in p.stderr


# -- | head -1: the reader goes away ----------------------------------------------------------------
@pytest.mark.parametrize("command", ["info", "runs", "rank"])
def test_a_closed_output_pipe_ends_quietly(command, made):
    arg = str(made.parent) if command == "runs" else str(made)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen(
        [sys.executable, "-m", "traceprop_engine", command, arg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    p.stdout.close()  # closed before the command writes: its first write meets EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141  # 128 + SIGPIPE, as `yes | head -1` reports
    assert "Traceback" not in err and "BrokenPipeError" not in err


# -- settings refused before anything is written ---------------------------------------------------
@pytest.mark.parametrize("seed", ["-1", str(2**64 + 1)])
def test_a_seed_out_of_range_is_refused_before_the_run_folder(seed, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_train_flags(data / "train", out), "--seed", seed]) == 1
    assert f"seed must be an integer from 0 to 4294967295, got {seed}" in _err(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "command, extra, expect",
    [
        ("lds", ["--out", "FILE"], "is a file, not a directory"),
        ("detect", ["--out", "FILE"], "is a file, not a directory"),
        ("lds", ["--out", "E", "--damping", "nan"], "damping=nan (a finite number >= 0"),
        ("lds", ["--out", "E", "--damping", "-1"], "damping=-1.0"),
        (
            "lds",
            ["--out", "E", "--max-new-subsets", "-1"],
            "max_new_subsets must be an integer >= 0",
        ),
        ("lds", ["--out", "E", "--config", "bad"], "write NAME:KEY=VALUE"),
    ],
    ids=[
        "lds-out-a-file",
        "detect-out-a-file",
        "damping-nan",
        "damping-negative",
        "max-new-subsets-negative",
        "config-without-colon",
    ],
)
def test_eval_refuses_bad_settings_before_writing(command, extra, expect, data, tmp_path, capsys):
    (tmp_path / "FILE").write_text("not a folder")
    extra = [str(tmp_path / x) if x in ("FILE", "E") else x for x in extra]
    head = ["eval", command] + (["--data", str(data / "train")] if command == "lds" else [])
    assert main(head + extra) == 1
    assert expect in _err(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]
    assert (tmp_path / "FILE").read_text() == "not a folder"


@pytest.mark.parametrize("damping", ["nan", "-1", "inf"])
def test_an_invalid_damping_leaves_no_lock_file(damping, made, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(made, run, ignore=shutil.ignore_patterns("index"))
    assert main(["index", str(run), "--damping", damping]) == 1
    assert "damping must be a finite number >= 0" in _err(capsys)
    assert not (run / "index").exists()  # no lock file, no folder


# -- words -------------------------------------------------------------------------------------------
def test_runs_of_a_missing_folder_is_an_error(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nonexistent")]) == 1
    assert "does not exist: pass the folder that holds your run directories" in _err(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 0  # an empty folder is no error
    assert "no runs under" in capsys.readouterr().out


def test_compact_compares_with_the_store_as_stored_and_bounds_the_rank(made, tmp_path, capsys):
    from traceprop_engine import Store
    from traceprop_engine.store.sizes import compact_bytes_per_record, stored_bytes_per_record

    run = tmp_path / "run"
    shutil.copytree(made, run)
    with Store(run / "store.h5") as st:
        stored, fact = stored_bytes_per_record(st.layers), compact_bytes_per_record(st.layers, 2)
        widest = max(min(layer.k_out, layer.k_in) for layer in st.layers)
    assert fact > stored  # the default store holds rank-1 int8 factors: rank 2 float32 is larger
    assert main(["compact", str(run), "--rank", "2"]) == 0
    out = capsys.readouterr()
    assert f"{fact} bytes/record (rank 2, float32) vs {stored} as the store holds them" in out.out
    assert f"(rank-1 int8 factors): {fact / stored:.1f}x larger" in out.out
    assert "smaller" not in out.out and "holds them exactly, in more bytes" in out.err
    assert main(["compact", str(run), "--rank", "10000"]) == 1
    err = _err(capsys)
    assert "--rank 10000 is above min(k_out, k_in) of every layer" in err
    assert f"(at most {widest}); --rank {widest} already keeps every sketch exactly" in err
    assert not (run / "factors-c10000.h5").exists()


def test_a_label_on_a_causal_lm_query_gets_a_note(made):
    from traceprop_engine.attribution.query import open_run

    run = open_run(made)
    res = run.query("Where does Ada live?", " Paris", label="yes", top_k=3)
    assert any("the label 'yes' was not used: this run is causal-lm" in n for n in res.notes)
    plain = run.query("Where does Ada live?", " Paris", top_k=3)
    assert not any("label" in n for n in plain.notes)
    assert res.rows["score"].to_list() == plain.rows["score"].to_list()  # same computation


def test_an_audit_trail_records_the_store_schema_version(made, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(made, run, ignore=shutil.ignore_patterns("index"))
    with h5py.File(run / "store.h5", "r+") as f:
        f.attrs["schema_version"] = 1  # a readable older store: the library's constant is 2
    trail = tmp_path / "trail.json"
    argv = ["audit", str(run), "--prompt", "Where does Ada live?", "--completion", " Paris"]
    assert main([*argv, "--out", str(trail), "--top-k", "3"]) == 0
    assert json.loads(trail.read_text())["store_schema_version"] == 1


# -- data files ---------------------------------------------------------------------------------
def _bad_data(tmp_path, case):
    from traceprop_engine.training.readers import MAX_RECORD_BYTES

    d = tmp_path / "data"
    d.mkdir()
    ok = '{"prompt": "Q: x\\nA:", "completion": " y"}\n'
    if case == "lone-surrogate":
        (d / "a.jsonl").write_text(ok + '{"prompt": "Q", "completion": " \\ud800"}\n')
    elif case == "name-not-utf8":
        (d / "a.jsonl").write_text(ok)
        with open(os.path.join(os.fsencode(d), b"caf\xe9.jsonl"), "w") as f:
            f.write(ok)
    elif case == "dangling-link":
        (d / "a.jsonl").write_text(ok)
        (d / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    elif case == "line-over-the-limit":
        (d / "a.jsonl").write_text(ok + json.dumps({"text": "x" * MAX_RECORD_BYTES}) + "\n")
    return d


@pytest.mark.parametrize(
    "case, expect",
    [
        ("lone-surrogate", r"a.jsonl:2: field 'completion' contains a lone surrogate (\ud800)"),
        ("name-not-utf8", r"the data file name b'caf\xe9.jsonl' is not valid UTF-8; rename it"),
        ("dangling-link", "b.jsonl is a symbolic link to"),
        ("line-over-the-limit", "a.jsonl:2: the line is longer than 1048576 bytes (1 MiB)"),
    ],
    ids=["lone-surrogate", "name-not-utf8", "dangling-link", "line-over-the-limit"],
)
def test_bad_data_files_get_a_message(case, expect, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train_flags(_bad_data(tmp_path, case), out)) == 1
    assert expect in _err(capsys)
    assert not (out / "store.h5").exists()


def test_a_long_single_line_file_is_not_read_whole(tmp_path):
    """A 16 MiB one-line file (the issue's 30 MB file took 6.3 GB): refused after reading at
    most one record's bound, so Python's memory peak stays near 1 MiB, not the file's size."""
    import tracemalloc

    from traceprop_engine import DataError
    from traceprop_engine.training.data import load_examples
    from traceprop_engine.training.readers import MAX_RECORD_BYTES

    f = tmp_path / "big.jsonl"
    with open(f, "w") as fh:
        fh.write('{"text": "' + "word " * (16 * 2**20 // 5) + '"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="big.jsonl:1: the line is longer than"):
            load_examples(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_RECORD_BYTES, f"peak {peak / 2**20:.1f} MiB"
    fits = tmp_path / "fits.jsonl"  # a record just under the bound is read as usual
    fits.write_text(json.dumps({"text": "y" * (MAX_RECORD_BYTES - 20)}) + "\n")
    assert len(load_examples(fits)[0][0].text) == MAX_RECORD_BYTES - 20


# -- sharing: permissions and read-only runs --------------------------------------------------------
def test_the_model_and_the_index_follow_the_umask(data, tmp_path):
    out = tmp_path / "run"
    flags = _train_flags(data / "train", out)
    old = os.umask(0o027)
    try:
        assert main(flags) == 0
        assert main(["index", str(out)]) == 0
    finally:
        os.umask(old)
    weights = out / "model" / "model.safetensors"
    assert stat.S_IMODE(weights.stat().st_mode) == 0o640  # safetensors alone writes 0600
    folders = [p for p in (out / "index").iterdir() if p.is_dir()]
    assert folders, "no index folder"
    for d in folders:
        assert stat.S_IMODE(d.stat().st_mode) == 0o750  # mkdtemp alone makes 0700
        for p in d.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o640, p


def _as_unprivileged(cmd: list[str]) -> list[str]:
    """``cmd`` without the power to ignore permission bits (root keeps it otherwise)."""
    if os.geteuid() != 0:
        return cmd
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("running as root without capsh: permission bits cannot be enforced")
    drop = "cap_dac_override,cap_dac_read_search,cap_fowner"
    return [capsh, f"--drop={drop}", "--", "-c", " ".join(map(_quote, cmd))]


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(str(s))


def test_a_read_only_run_without_an_index_is_queried_from_the_user_cache(made, tmp_path):
    run = tmp_path / "shared" / "run"
    shutil.copytree(made, run, ignore=shutil.ignore_patterns("index"))
    cache = tmp_path / "cache"
    cache.mkdir()
    for p in [run, *run.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        query = [sys.executable, "-m", "traceprop_engine", "query", str(run), "--prompt"]
        query += ["Where does Ada live?", "--completion", " Paris", "--top-k", "3"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        env["TRACEPROP_CACHE_DIR"] = str(cache)
        first = subprocess.run(
            _as_unprivileged(query), capture_output=True, text=True, env=env, timeout=300
        )
        assert first.returncode == 0, first.stderr[-2000:]
        assert "cannot write there" in first.stderr and str(cache) in first.stderr
        assert "proponent     1" in first.stdout
        again = subprocess.run(
            _as_unprivileged(query), capture_output=True, text=True, env=env, timeout=300
        )
        assert again.returncode == 0 and "cannot write" not in again.stderr  # reused
        assert again.stdout.splitlines()[-3:] == first.stdout.splitlines()[-3:]
        assert not (run / "index").exists()
        assert list(cache.glob("indexes/*/kfac-cos/index.json"))  # the default, K-FAC
    finally:
        for p in [run, *run.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


# -- while a train is running -----------------------------------------------------------------------
def test_verify_and_info_say_a_run_is_still_training(data, tmp_path):
    out = tmp_path / "live"
    flags = _train_flags(data / "train", out)
    flags[flags.index("--epochs") + 1] = "50"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(tmp_path / "train.log", "wb") as log:  # an unread pipe would block the run
        p = subprocess.Popen(
            [sys.executable, "-m", "traceprop_engine", *flags, "--buffer-records", "16"],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(read_progress(out)) < 4:
            time.sleep(0.2)
        assert len(read_progress(out)) >= 4, "the run never made progress"
        verify = _cli("verify", str(out), text=True)
        info = _cli("info", str(out), text=True)
        assert p.poll() is None, "the train ended before the checks ran"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert verify.returncode == 3
    assert "the run is still training" in verify.stderr
    assert "digest attribute was removed" not in verify.stdout + verify.stderr
    assert info.returncode == 0, info.stderr[-2000:]
    assert "this store is still being written (status 'running'" in info.stdout
    assert "before the run stopped" not in info.stdout


# -- the same kinds, found in other commands -------------------------------------------------------
@pytest.mark.parametrize(
    "argv, expect",
    [
        (["rank", "RUN", "--top-k", "-5"], "argument --top-k: expected an integer >= 1, got -5"),
        (["eval", "detect", "--out", "OUT", "--seeds", "a,b"], "expected comma-separated integers"),
        (["eval", "lds", "--data", "RUN", "--out", "OUT", "--k-sweep", "a"], "comma-separated"),
    ],
    ids=["rank-top-k-negative", "detect-seeds-not-ints", "lds-k-sweep-not-ints"],
)
def test_other_flags_of_the_same_kind_are_usage_errors(argv, expect, made, tmp_path, capsys):
    """`rank --top-k -5` listed all rows but the last 5; the lists raised ValueError."""
    argv = [str(made) if x == "RUN" else str(tmp_path / "o") if x == "OUT" else x for x in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert expect in _err(capsys)
    assert not (tmp_path / "o").exists()


def test_an_output_file_that_cannot_be_written_is_a_message(made, capsys):
    """Any OSError on a file the user named (here EIO writing into /proc) ends with its
    reason, not a traceback."""
    argv = ["query", str(made), "--prompt", "Where does Ada live?", "--completion", " Paris"]
    assert main([*argv, "--top-k", "2", "--csv", "/proc/version"]) == 1
    got = capsys.readouterr()
    assert "proponent" in got.out  # the answer was printed before the file was written
    assert got.err.startswith("error: ") and "Traceback" not in got.err
    assert "Input/output error" in got.err or "Permission denied" in got.err  # root / not


def test_negative_threads_are_refused(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_train_flags(data / "train", out), "--threads", "-1"]) == 1
    assert "threads=-1" in _err(capsys) and not out.exists()
