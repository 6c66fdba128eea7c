"""What a first-column read of rank-16 records costs (``IndexSettings.columns``; EVAL.md §1z).

A free-text run stores rank-16 factors; a short answer's index reads only their first column
(``store/column_view.py``). This times reading two layers' ``U``, ``V`` (k = 126 a side, int8,
the engine's chunked datasets with Fletcher-32) of ``N`` records in the index build's chunks of
4096: the first column read on its own (``Store.factors(..., columns=1)``, what a column view
does), every column read and then sliced (what it did before stop 54), and every column.
Medians of interleaved repeats, ratios to the second.

Usage: ``python benchmarks/column_read.py [N] [REPEATS]`` (default 16384, 7).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import write_factor_store  # noqa: E402

from traceprop_engine.bench.machine import cpu_model  # noqa: E402

RANK, SHAPES, CHUNK = 16, [(126, 126), (126, 126)], 4096


def main(n: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        rng = np.random.default_rng(0)
        arrays = [rng.normal(size=(n, ko + ki, RANK)).astype(np.float32) for ko, ki in SHAPES]
        store = write_factor_store(Path(d) / "s.h5", SHAPES, arrays, np.arange(n), rng, "t", RANK)

        def read(columns: int | None, slice_after: bool) -> None:
            for li in range(len(SHAPES)):
                for s in range(0, n, CHUNK):
                    u, v = store.factors(li, s, s + CHUNK, columns)
                    if slice_after:
                        np.ascontiguousarray(u[..., :1]), np.ascontiguousarray(v[..., :1])

        arms = {
            "first column, read alone": (1, False),
            "every column read, then sliced": (None, True),
            "every column": (None, False),
        }
        times = {name: [] for name in arms}
        for _ in range(repeats):
            for name, args in arms.items():
                t = time.perf_counter()
                read(*args)
                times[name].append(time.perf_counter() - t)
        store.close()
    base = np.median(times["every column read, then sliced"])
    print(f"CPU: {cpu_model()}; {n} records, {len(SHAPES)} layers, rank {RANK}, {repeats} repeats")
    for name, ts in times.items():
        print(
            f"  {name:32s} median {np.median(ts) * 1e3:7.1f} ms, ratio {np.median(ts) / base:.2f}"
        )


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [16384, 7][len(args) :]))
