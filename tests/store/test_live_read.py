"""A store read while another process writes it (store/live.py): every open and read of the
running store succeeds and returns the rows that were written, however the reads fall between
the writer's flushes; the lock file goes when the writer closes the store."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from traceprop_engine import Store
from traceprop_engine import constants as C
from traceprop_engine.store import live
from traceprop_engine.store.live import lock_path

BATCH = 24  # records a flush

WRITER = textwrap.dedent(
    """
    import sys, time
    from types import SimpleNamespace
    import numpy as np
    from traceprop_engine import constants as C
    from traceprop_engine.store.writer import StoreWriter

    path, flushes, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    layers = [
        SimpleNamespace(name="blk.0", kind="linear", d_in=8, d_out=8, k_in=4, k_out=3,
                        P_in=None, P_out=None, record_shape=(3, 4)),
        SimpleNamespace(name="blk.1", kind="linear", d_in=8, d_out=8, k_in=5, k_out=6, rank=2,
                        factor_dtype="float32", P_in=None, P_out=None, record_shape=(6, 5)),
    ]
    w = StoreWriter(path, layers, {"run_id": "live"}, "factored", compression="gzip")
    print("started", flush=True)
    for f in range(flushes):
        n0 = f * batch
        ids = np.arange(n0, n0 + batch)
        w.append(
            [
                np.broadcast_to(ids[:, None, None], (batch, 3, 4)).astype(np.float32),
                np.broadcast_to(ids[:, None, None], (batch, 11, 2)).astype(np.float32),
            ],
            {
                C.REC_EXAMPLE: ids, C.REC_STEP: ids // 4, C.REC_EPOCH: np.ones(batch, int),
                C.REC_LR: np.full(batch, 1e-3, np.float32), C.REC_LOSS: np.ones(batch, np.float32),
            },
        )
        w.set_attrs(progress=f)
    w.close("completed")
    """
)


def _start_writer(path, flushes: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(flushes), str(BATCH)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "started"  # the store exists, first flush done
    return proc


def _read_while_writing(path, proc: subprocess.Popen) -> tuple[int, list[str]]:
    """Open, read and check the store until the writer ends: (reads, failures)."""
    reads, failures = 0, []
    while proc.poll() is None:
        try:
            with Store(path) as s:
                n = s.n_records
                for _ in range(3):  # reads after the open, while the writer goes on
                    rows = s.sketches(0, 0, n)[:, 0, 0]
                    ex = s.records()[C.REC_EXAMPLE]
                    u = s.factors(1, max(0, n - 2 * BATCH), n)[0][:, 0, 0]
                    if not (
                        np.array_equal(rows, np.arange(n))
                        and np.array_equal(ex, np.arange(n))
                        and np.array_equal(u, np.arange(max(0, n - 2 * BATCH), n))
                    ):
                        failures.append(f"wrong rows at n_records={n}")
            reads += 1
        except Exception as e:  # noqa: BLE001 - every failure counts, whatever its type
            failures.append(f"{type(e).__name__}: {e}")
    assert proc.wait() == 0
    return reads, failures


def test_a_running_store_reads_back_exactly_while_its_writer_flushes(tmp_path):
    path = tmp_path / "store.h5"
    proc = _start_writer(path, flushes=200)
    assert lock_path(path).exists()
    reads, failures = _read_while_writing(path, proc)
    assert reads >= 20, f"only {reads} reads overlapped the writer"
    assert not failures, f"{len(failures)} of {reads} reads failed, first: {failures[0]}"
    assert not lock_path(path).exists()  # closed: readers need no lock
    with Store(path) as s:
        assert s.status == "completed" and s.n_records == 200 * BATCH
        assert s.verify_content()["status"] == "ok"


def test_without_the_lock_the_same_reads_fail(tmp_path, monkeypatch):
    """The check above can fail: with locking off (as on a system without fcntl) readers of the
    same writer meet half-flushed files."""
    monkeypatch.setattr(live, "fcntl", None)  # this process's readers take no lock
    path = tmp_path / "store.h5"
    failed = 0
    for _ in range(3):  # rare enough per read that one run could miss it
        proc = _start_writer(path, flushes=200)
        failed += len(_read_while_writing(path, proc)[1])
        if failed:
            break
    assert failed, "no read failed without the lock: the test above cannot tell"


def test_a_reader_of_a_replaced_store_says_so(tmp_path):
    path = tmp_path / "store.h5"
    proc = _start_writer(path, flushes=200)
    reader = Store(path)
    try:
        time.sleep(0.05)
        assert proc.wait() == 0
        proc = _start_writer(path, flushes=1)  # a new run over the same folder
        assert proc.wait() == 0
        with pytest.raises(Exception, match="replaced by another run"):
            reader.sketches(0, 0, 1)
    finally:
        reader.close()


def test_a_filesystem_without_flock_writes_and_reads_as_before(tmp_path, monkeypatch, caplog):
    """Some network filesystems refuse flock: the store is written and read without the lock,
    and the writer says what that costs."""
    import errno
    from types import SimpleNamespace

    from traceprop_engine.store.writer import StoreWriter

    class NoLocks:
        LOCK_SH, LOCK_EX, LOCK_UN, LOCK_NB = 1, 2, 8, 4

        @staticmethod
        def flock(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(live, "fcntl", NoLocks)
    layer = SimpleNamespace(
        name="blk.0", kind="linear", d_in=8, d_out=8, k_in=4, k_out=3, P_in=None, P_out=None,
        record_shape=(3, 4),
    )  # fmt: skip
    path = tmp_path / "store.h5"
    with caplog.at_level("WARNING", logger=live.__name__):
        w = StoreWriter(path, [layer], {"run_id": "nolock"}, "factored")
    assert "no file lock" in caplog.text
    ids = np.arange(4)
    meta = {
        C.REC_EXAMPLE: ids, C.REC_STEP: ids, C.REC_EPOCH: np.ones(4, int),
        C.REC_LR: np.full(4, 1e-3, np.float32), C.REC_LOSS: np.ones(4, np.float32),
    }  # fmt: skip
    w.append([np.ones((4, 3, 4), np.float32)], meta)
    assert live.ReadLock.open(path) is None  # a reader takes no lock either
    w.close("completed")
    assert not lock_path(path).exists()
    with Store(path) as s:
        assert s.n_records == 4 and s.sketches(0, 0, 4).sum() == 48
