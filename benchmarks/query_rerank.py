"""The exact re-rank's shortcuts, each against the route it replaced, in one process.

    python benchmarks/query_rerank.py RUN_DIR [--queries 12] [--repeats 5] [--json out.json]

Arms (``AttributionRun.rank`` on the same held-out questions of RUN_DIR's default index, the
arms' order alternating in every repeat; the arms must return the same rows with the same
scores, to float32 rounding, whose near-ties may swap places):

- ``former``: the query's pulled-back sketch of each layer factored by an eigendecomposition
  (``_spectral_factors``), the int8 records decoded to float32 factors before the products;
- ``range``: the sketch factored from a few random directions (``_range_factors``, checked);
- ``range+bytes``: also the products straight from the int8 bytes (``LowRankTest.inner_int8``);
- ``bounded``: also layer by layer, the query's largest layers first, dropping the candidates
  whose score bounds cannot place (``rerank.bounded_rerank``). It needs the index's
  ``layer_norms.npy``: an index built before it gets them here first (the same numbers a build
  writes);
- ``bounded+lazy``: also each layer's query factored only when it scores many rows (the few
  rows left at most layers take the raw pulled-back sketch, ``scoring.PreparedQuery``), and a
  one-record-per-row candidate set scattered without a summing matrix; the default.

Prints the median per-query time of each arm and its ratio to ``former``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution.score import factor_scores, scoring
from traceprop_engine.attribution.score.factor_scores import LowRankTest
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings
from traceprop_engine.store.format import decode_factors

TIE_RTOL = 1e-5
"""Scores of the arms agree to float32 rounding; rows closer than this may swap places."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    queries = e2e.real_queries(a.run_dir, a.queries)
    run = AttributionRun(a.run_dir)
    s = IndexSettings()
    index, _, _ = run.index(s)
    ranged, from_bytes = factor_scores._range_factors, LowRankTest.inner_int8
    e2e.with_layer_norms(run, s)  # an index built before layer_norms.npy
    layer_norms = run.indexes.row_layer_sq_norms

    def decoded(low, uv, scale, k_out, q):  # the former route: decode, then the products
        c = uv.shape[1] // (k_out + low.b.shape[0])
        u = np.ascontiguousarray(uv[:, : k_out * c]).reshape(len(uv), k_out, c)
        v = np.ascontiguousarray(uv[:, k_out * c :]).reshape(len(uv), -1, c)
        return low.inner(*decode_factors(u, v, "int8", scale), q)

    def spectral(t, rtol):
        return None

    accumulate, raw_max = scoring.ExactScorer._accumulate, scoring.RAW_PRODUCTS_MAX

    def summed(self, out, pb, recs, cols, where, layers=None, distinct=False):
        return accumulate(self, out, pb, recs, cols, where, layers)  # always the summing matrix

    lazy = (accumulate, raw_max)
    eager = (summed, -1)  # every layer factored, the sparse summing matrix: stop 15's route
    arms = {
        "former": (spectral, decoded, False, eager),
        "range": (ranged, decoded, False, eager),
        "range+bytes": (ranged, from_bytes, False, eager),
        "bounded": (ranged, from_bytes, True, eager),
        "bounded+lazy": (ranged, from_bytes, True, lazy),
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    seen: dict[str, list] = {k: [] for k in arms}
    for q in queries[:2]:  # warm: page cache, first-call costs
        run.rank(q, s, 10, True)
    for rep in range(a.repeats):
        for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
            factor_scores._range_factors, LowRankTest.inner_int8, bounded, route = arms[name]
            scoring.ExactScorer._accumulate, scoring.RAW_PRODUCTS_MAX = route
            run.indexes.row_layer_sq_norms = layer_norms if bounded else (lambda s: None)
            out = []
            t = time.perf_counter()
            for q in queries:
                out.append(run.rank(q, s, 10, True)[0])
            times[name].append((time.perf_counter() - t) / len(queries))
            if rep == 0:
                seen[name] = out
    factor_scores._range_factors, LowRankTest.inner_int8 = ranged, from_bytes
    scoring.ExactScorer._accumulate, scoring.RAW_PRODUCTS_MAX = lazy
    for name in arms:
        for x, y in zip(seen[name], seen["former"], strict=True):
            # the same rows; an order may differ only between float32 near-ties
            assert sorted(x["example_id"]) == sorted(y["example_id"]), f"{name}: rows differ"
            np.testing.assert_allclose(x["score"].to_numpy(), y["score"].to_numpy(), rtol=TIE_RTOL)
    row = {
        "n": int(index.n),
        "kind": index.kind.value,
        "queries": len(queries),
        "repeats": a.repeats,
    }
    base = float(np.median(times["former"]))
    for name in arms:
        med = float(np.median(times[name]))
        row[f"{name}_ms"] = round(med * 1e3, 1)
        row[f"{name}_speedup"] = round(base / med, 2)
    e2e.emit(row, a.json)
    run.close()


if __name__ == "__main__":
    main()
