"""The query's sketch factorisation in the exact re-rank: random range vs eigendecomposition.

    python benchmarks/query_factoring.py RUN_DIR [--queries 12] [--repeats 5] [--json out.json]

Every exact score factors the query's pulled-back sketch of each layer, ``T' = A Bᵀ``
(``LowRankTest.maybe``). Arm ``spectral`` forces the former route (an eigendecomposition of
``T'ᵀT'`` per layer); arm ``range`` is the default (a few random directions, checked, with the
eigendecomposition as the fallback). Both arms run ``AttributionRun.rank`` on the same
held-out questions of RUN_DIR's default index, alternating in every repeat; the rankings must
be identical. Prints the medians of the per-query time of each arm and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution import factor_scores
from traceprop_engine.attribution.query import AttributionRun
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings


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
    ranged = factor_scores._range_factors
    arms = {"range": ranged, "spectral": lambda t, rtol: None}
    times: dict[str, list[float]] = {k: [] for k in arms}
    seen: dict[str, list] = {k: [] for k in arms}
    for q in queries[:2]:  # warm: page cache, first-call costs
        run.rank(q, s, 10, True)
    for rep in range(a.repeats):
        for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
            factor_scores._range_factors = arms[name]
            out = []
            t = time.perf_counter()
            for q in queries:
                out.append(run.rank(q, s, 10, True)[0])
            times[name].append((time.perf_counter() - t) / len(queries))
            if rep == 0:
                seen[name] = out
    factor_scores._range_factors = ranged
    for x, y in zip(seen["range"], seen["spectral"], strict=True):
        assert x["example_id"].to_list() == y["example_id"].to_list(), "rankings differ"
        np.testing.assert_allclose(x["score"].to_numpy(), y["score"].to_numpy(), rtol=1e-4)
    row = {
        "n": int(index.n),
        "kind": index.kind.value,
        "queries": len(queries),
        "repeats": a.repeats,
        "spectral_ms": round(float(np.median(times["spectral"])) * 1e3, 1),
        "range_ms": round(float(np.median(times["range"])) * 1e3, 1),
    }
    row["ratio"] = round(row["spectral_ms"] / row["range_ms"], 2)
    print(json.dumps(row))
    run.close()
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
