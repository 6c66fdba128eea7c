"""Kills a store writer with SIGKILL at random moments and reads what it left (store/torn_tail.py).

A child process appends records to a real store (:class:`StoreWriter`, 6 layers of int8
factors, a flush every ``--batch`` records) until it is killed. After each kill this counts:

- ``torn``: stores where HDF5 alone cannot read a record dataset's first ``n_records`` rows
  (a chunk half written: what made a partial store unreadable before stop 58);
- ``short``: stores where a record dataset is shorter than ``n_records`` (the flush's metadata
  half written: refused as "damaged or incomplete" before stop 58);
- ``read``: stores whose records and factors the reader returns (torn ones recovered);
- ``resumed``: stores that ``StoreWriter.reopen`` reopens and appends to;
- ``damaged``: stores the reader refuses (the CRC does not match).

``--cost`` instead times ``StoreWriter.append`` with and without the tail CRCs, interleaved,
and prints the median ratio (the writer runs in the tracker's background thread).

    python benchmarks/torn_tail.py --kills 200
    python benchmarks/torn_tail.py --cost --repeats 15
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np

from traceprop_engine import Store, StoreError
from traceprop_engine import constants as C
from traceprop_engine.store.writer import StoreWriter


def _layers(rank: int, width: int):
    return [
        SimpleNamespace(
            name=f"blk.{i}",
            kind="linear",
            d_in=width,
            d_out=width,
            k_in=width,
            k_out=width,
            rank=rank,
            factor_dtype="int8",
            P_in=None,
            P_out=None,
            record_shape=(width, width),
        )  # fmt: skip
        for i in range(6)
    ]


def _batch(rng, n0: int, n: int, rank: int, width: int):
    arrays = [rng.normal(size=(n, 2 * width, rank)).astype(np.float32) for _ in range(6)]
    meta = {
        C.REC_EXAMPLE: np.arange(n0, n0 + n),
        C.REC_STEP: np.arange(n0, n0 + n) // 4,
        C.REC_EPOCH: np.arange(n0, n0 + n) // 1000,
        C.REC_LR: np.full(n, 1e-3, np.float32),
        C.REC_LOSS: rng.random(n).astype(np.float32),
    }
    return arrays, meta


def _child(path: str, batch: int, rank: int, width: int) -> None:
    rng = np.random.default_rng(0)
    w = StoreWriter(path, _layers(rank, width), {"run_id": "torn-tail-bench"}, "factored")
    print("ready", flush=True)
    n0 = 0
    while True:
        w.append(*_batch(rng, n0, batch, rank, width))
        n0 += batch


def _plain_reads(path: Path) -> tuple[bool, bool]:
    """``(torn, short)``: HDF5 alone fails to read a record dataset's counted rows (a chunk's
    checksum fails); a record dataset is shorter than ``n_records`` says."""
    with h5py.File(path, "r", locking=False) as f:
        n = int(f.attrs["n_records"])
        names = [f"{C.G_RECORDS}/{k}" for k in C.RECORD_FIELDS]
        names += [f"{C.G_LAYERS}/{g}/{k}" for g in f[C.G_LAYERS] for k in (C.L_U, C.L_V, C.L_SCALE)]
        short = any(f[name].shape[0] < n for name in names)
        try:
            for name in names:
                f[name][:n]
        except OSError:
            return True, short
    return False, short


def kills(a) -> None:
    counts = dict(kills=0, torn=0, short=0, read=0, resumed=0, damaged=0, empty=0)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.kills):
            path = Path(tmp) / f"store-{i}.h5"
            argv = [sys.executable, __file__, "--child", str(path), "--batch", str(a.batch)]
            argv += ["--rank", str(a.rank), "--width", str(a.width)]
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
            p.stdout.readline()
            time.sleep(random.uniform(0.05, a.max_wait))
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            counts["kills"] += 1
            with h5py.File(path, "r", locking=False) as f:
                n = int(f.attrs["n_records"])
            if n == 0:
                counts["empty"] += 1
                continue
            torn, short = _plain_reads(path)
            counts["torn"] += torn
            counts["short"] += short
            try:
                with Store(path) as s:
                    n = s.n_records  # fewer than the attribute says when a dataset is short
                    s.records()
                    sq = []
                    for li in range(len(s.layers)):
                        s.factors(li)
                        sq.append(s.sq_norm_sum(li))
                counts["read"] += 1
            except StoreError as e:
                counts["damaged"] += 1
                print(f"kill {i}: {e}", file=sys.stderr)
                continue
            w = StoreWriter.reopen(path, n, sq)
            w.append(*_batch(np.random.default_rng(1), n, a.batch, a.rank, a.width))
            w.close(C.STATUS_FAILED)
            counts["resumed"] += _plain_reads(path) == (False, False)
            path.unlink()
    print(" ".join(f"{k} {v}" for k, v in counts.items()))


def interleaved_appends(arms: dict, repeats: int, flushes: int, batch: int, rank: int, width: int):
    """``{arm: (repeats, flushes) seconds}`` of each ``StoreWriter.append``: a fresh store per arm
    and repeat, the arms in turn (their order reversed every other repeat), each under its
    ``arms[name]()`` context (what the arm switches on or off). Also used by live_read.py."""
    rng = np.random.default_rng(0)
    batches = [_batch(rng, i * batch, batch, rank, width) for i in range(flushes)]
    names = list(arms)
    out = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in names if r % 2 else names[::-1]:
                with arms[name]():
                    w = StoreWriter(Path(tmp) / "store.h5", _layers(rank, width), {}, "factored")
                    times = []
                    for arrays, meta in batches:
                        t0 = time.perf_counter()
                        w.append(arrays, meta)
                        times.append(time.perf_counter() - t0)
                    w.close(C.STATUS_COMPLETED)
                out[name].append(times)
    return {name: np.asarray(v) for name, v in out.items()}


@contextlib.contextmanager
def _patched(obj, attr: str, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def cost(a) -> None:
    """Median time of ``append`` with the tail CRCs and without (``wrote`` a no-op), interleaved."""
    from traceprop_engine.store import torn_tail  # here: --kills also runs on engines before it

    arms = {
        "with": contextlib.nullcontext,
        "without": lambda: _patched(torn_tail.TailSums, "wrote", lambda *x: None),
    }
    times = interleaved_appends(arms, a.repeats, a.flushes, a.batch, a.rank, a.width)
    med = {k: float(np.median(v.sum(1))) for k, v in times.items()}
    per = {k: 1e3 * v / a.flushes for k, v in med.items()}
    print(
        f"append of {a.batch} records x {a.flushes} flushes (rank {a.rank}, width {a.width}): "
        f"without {per['without']:.3f} ms, with {per['with']:.3f} ms a flush, "
        f"ratio {med['with'] / med['without']:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="records a flush")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--width", type=int, default=64, help="k_in = k_out of each layer")
    ap.add_argument("--max-wait", type=float, default=0.4, help="seconds before the kill, at most")
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--flushes", type=int, default=64)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.batch, a.rank, a.width)
    elif a.cost:
        cost(a)
    else:
        kills(a)


if __name__ == "__main__":
    main()
