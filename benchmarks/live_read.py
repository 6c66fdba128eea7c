"""Reading a store while its train writes it (store/live.py): how many opens and reads fail.

    python benchmarks/live_read.py [--epochs 3] [--work-dir W]

Starts a real ``traceprop train`` (the tiny model, one epoch over the standard library's
docstrings a pass, rank-1 records so that flushes come often) and, until it ends, opens its
running store in a loop and reads what a query or the app reads (the records table, a layer's
last records, the example table), counting what fails and why. It does this twice, one train
after the other: readers taking the store's lock (the engine), then readers that do not (as
before the lock; the writer still takes it), and prints both.

``--cost`` instead times ``StoreWriter.append`` with the writer's lock and without it (16 records a
flush, as ``benchmarks/torn_tail.py --cost``), interleaved, and prints the medians' ratio:

    python benchmarks/live_read.py --cost --repeats 21
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from traceprop_engine.errors import StoreError
from traceprop_engine.evaluate.prose_data import stdlib_docstrings
from traceprop_engine.store import live
from traceprop_engine.store.reader import Store


def poll(out: Path, data: Path, epochs: int) -> dict:
    """Train into ``out`` and read its store until the train ends."""
    cmd = ["traceprop", "train", "--data", str(data), "--out", str(out), "--epochs", str(epochs)]
    cmd += ["--max-length", "32", "--free-text-rank", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    errors: collections.Counter = collections.Counter()
    ok, t0 = 0, time.monotonic()
    while proc.poll() is None:
        if not (out / "store.h5").exists():
            time.sleep(0.05)
            continue
        try:
            with Store(out) as s:
                n = s.n_records
                if n:
                    s.records()
                    s.factors(0, max(0, n - 64), n)
                s.examples()
            ok += 1
        except StoreError as e:
            errors[str(e).split(": ", 1)[-1][:100]] += 1
        except Exception as e:  # noqa: BLE001 - what a reader meets, counted by kind
            errors[f"{type(e).__name__}: {str(e)[:90]}"] += 1
    return {
        "train_rc": proc.returncode,
        "seconds": round(time.monotonic() - t0, 1),
        "reads_ok": ok,
        "reads_failed": sum(errors.values()),
        "failures": dict(errors.most_common()),
    }


def cost(repeats: int, flushes: int = 64, batch: int = 16) -> None:
    """Median time of ``append`` with the writer's lock and without, interleaved."""
    from torn_tail import _patched, interleaved_appends  # the same store shape and loop

    arms = {"lock": contextlib.nullcontext, "no lock": lambda: _patched(live, "fcntl", None)}
    times = interleaved_appends(arms, repeats, flushes, batch, 1, 64)
    med = {k: float(np.median(v.sum(1))) for k, v in times.items()}
    one = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    print(
        f"append of {batch} records x {flushes} flushes, medians of {repeats} interleaved "
        f"repeats: without the lock {1e3 * med['no lock'] / flushes:.3f} ms a flush, with it "
        f"{1e3 * med['lock'] / flushes:.3f} ms, ratio {med['lock'] / med['no lock']:.3f}; the "
        f"median single flush {one['no lock']:.3f} against {one['lock']:.3f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cost", action="store_true", help="time the writer's lock instead")
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args()
    if a.cost:
        cost(a.repeats)
        return
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="live-read-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_docstrings()))
    fcntl = live.fcntl
    results = {}
    for name, lock in (("readers lock", True), ("readers do not lock", False)):
        live.fcntl = fcntl if lock else None
        results[name] = poll(work / name.replace(" ", "-"), data, a.epochs)
        r = results[name]
        print(
            f"{name:20s} reads ok {r['reads_ok']:5d}, failed {r['reads_failed']:5d} "
            f"(train rc {r['train_rc']}, {r['seconds']} s)",
            flush=True,
        )
        for why, count in r["failures"].items():
            print(f"    {count:5d}  {why}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    if any(r["train_rc"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
