"""The exact re-rank's int8 products on rank-c records: column by column against block-diagonal.

    python benchmarks/int8_rerank.py [--records 4096] [--rank 16] [--cols 24] [--repeats 9]
    python benchmarks/int8_rerank.py --run RUN [--repeats 4]   # whole queries on a free-text run

``LowRankTest.inner_int8`` contracts a batch of int8 records with a query's factors ``A``, ``B``.
Until stop 57 it did so for every rank with one GEMM against a block-diagonal ``[A 0; 0 B]``
repeated per record column: right at rank 1, but at rank 16 (what a free-text run records) the
GEMM multiplied 31 zero blocks for each useful one. The shipped route converts each side's columns
and contracts them with ``A`` or ``B`` alone. This script times both in one process, interleaved
(the block-diagonal route is kept here as the baseline), checks they agree, and prints the
medians and their ratio: on synthetic records of one layer, or, with ``--run``, on whole queries
of a run (both routes patched in turn; four short answers and two free-text prompts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution import open_run
from traceprop_engine.attribution.score.factor_scores import LowRankTest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_bias_query import QUERIES  # noqa: E402  (four short answers, two free-text prompts)


def block_diagonal(self, uv: np.ndarray, scale: np.ndarray, k_out: int, q: int) -> np.ndarray:
    """The route before stop 57: one GEMM with ``[A 0; 0 B]`` repeated per record column."""
    cols = self.a.shape[1]
    c = uv.shape[1] // (k_out + self.b.shape[0])
    nu = k_out * c
    w = np.zeros((uv.shape[1], 2 * c * cols), self.a.dtype)
    for j in range(c):
        w[j:nu:c, j * cols : (j + 1) * cols] = self.a
        w[nu + j :: c, (c + j) * cols : (c + j + 1) * cols] = self.b
    y = uv.astype(self.a.dtype) @ w
    per_col = (y[:, : c * cols] * y[:, c * cols :]).reshape(len(uv), c, cols).sum(1)
    return self._by_query((per_col * scale[:, None].astype(self.a.dtype)).T, q)


ROUTES = {"block-diagonal": block_diagonal, "by column": LowRankTest.inner_int8}


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def synthetic(a: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    k = a.k
    uv = rng.integers(-127, 128, (a.records, 2 * k * a.rank), dtype=np.int8)
    scale = rng.random(a.records).astype(np.float32)
    low = LowRankTest(
        rng.standard_normal((k, a.cols)).astype(np.float32),
        rng.standard_normal((k, a.cols)).astype(np.float32),
        np.repeat(np.arange(2), [a.cols // 2, a.cols - a.cols // 2]),
    )
    out = {name: f(low, uv, scale, k, 2) for name, f in ROUTES.items()}
    ref = np.abs(out["block-diagonal"]).max()
    diff = np.abs(out["by column"] - out["block-diagonal"]).max() / ref
    times = {name: [] for name in ROUTES}
    for r in range(a.repeats):
        for name in ROUTES if r % 2 else reversed(list(ROUTES)):
            t0 = time.perf_counter()
            ROUTES[name](low, uv, scale, k, 2)
            times[name].append(time.perf_counter() - t0)
    print(
        f"{a.records} records, rank {a.rank}, k {k} a side, {a.cols} query columns, "
        f"{a.repeats} interleaved repeats; largest difference {diff:.1e} of the largest score"
    )
    _report(times)


def whole_queries(a: argparse.Namespace) -> None:
    run = open_run(a.run)
    sides = [run.test_side(**q) for q in QUERIES]
    for ts in sides:  # indexes, caches and the LM-bias directions built: not timed
        run.query(test_side=ts, top_k=10)
    times = {name: [] for name in ROUTES}
    tops: dict[str, list] = {name: [] for name in ROUTES}
    for r in range(a.repeats):
        for name in ROUTES if r % 2 else reversed(list(ROUTES)):
            LowRankTest.inner_int8 = ROUTES[name]
            t0 = time.perf_counter()
            res = [run.query(test_side=ts, top_k=10) for ts in sides]
            times[name].append((time.perf_counter() - t0) / len(sides))
            if r == 0:
                tops[name] = [x.rows["example_id"].to_list() for x in res]
    LowRankTest.inner_int8 = ROUTES["by column"]
    same = tops["block-diagonal"] == tops["by column"]
    print(
        f"{a.run}: {run.store.n_records} records (rank {run.store.layers[0].rank}), "
        f"{len(sides)} queries, {a.repeats} interleaved repeats; top 10 the same: {same}"
    )
    _report(times, "a query")


def _report(times: dict[str, list[float]], unit: str = "a call") -> None:
    base = _median_ms(times["block-diagonal"])
    for name, xs in times.items():
        m = _median_ms(xs)
        print(f"  {name:15s} median {m:9.2f} ms {unit}   {m / base:5.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="time whole queries on this run instead of synthetic records")
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--k", type=int, default=126, help="rows of each factor side")
    p.add_argument("--cols", type=int, default=24, help="the query's factor columns")
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    (whole_queries if a.run else synthetic)(a)


if __name__ == "__main__":
    main()
