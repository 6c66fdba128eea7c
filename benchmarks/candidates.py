"""Recall@10 of the whole query against the number of FAISS candidates re-ranked exactly.

    python benchmarks/candidates.py 100000 --candidates 200,1000,3000 [--queries 24]

Writes `traceprop bench query --end-to-end`'s synthetic store of N examples (the bundled sample
run's records resampled with noise, one record per example) under /tmp, builds the default
index once, computes brute-force exact scores for the queries, then for each candidate count
times `AttributionRun.rank` (candidate search + exact re-rank) and measures the recall@10 of
the returned proponents and opponents. Prints one line per candidate count.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution.score import ranking
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings

BASE = str(Path(__file__).resolve().parents[1] / "sample_runs" / "facts")


def _recall(got: np.ndarray, ref: np.ndarray) -> float:
    return len(set(got.tolist()) & set(ref.tolist())) / max(len(ref), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, help="examples in the synthetic store")
    ap.add_argument("--candidates", default="200,1000,3000")
    ap.add_argument("--queries", type=int, default=24)
    ap.add_argument("--work-dir", default="/tmp")
    a = ap.parse_args()
    d = Path(a.work_dir) / f"traceprop-candidates-{a.n}"
    shutil.rmtree(d, ignore_errors=True)
    try:
        e2e.write_synthetic_run(BASE, d, a.n, 0, 0.5)
        queries = e2e.real_queries(BASE, a.queries)
        run, s = AttributionRun(d), IndexSettings()
        run.build_index(s, None)
        exact = np.concatenate(
            [
                run.exact_scores(
                    [np.concatenate([q[li] for q in batch]) for li in range(len(batch[0]))], s
                )
                for batch in (queries[i : i + 12] for i in range(0, len(queries), 12))
            ]
        )
        for mc in (int(x) for x in a.candidates.split(",")):
            ranking.MIN_CANDIDATES, ranking.MAX_CANDIDATES = mc, mc
            rp, ro, lat = [], [], []
            for j, q in enumerate(queries):
                t = time.perf_counter()
                r, _ = run.rank(q, s, 10, True)
                lat.append(time.perf_counter() - t)
                sc = exact[j]
                ref_p = np.argsort(-sc, kind="stable")[:10]
                ref_o = np.argsort(sc, kind="stable")[:10]
                rp.append(
                    _recall(
                        r.filter(r["kind"] == "proponent")["example_id"].to_numpy(),
                        ref_p[sc[ref_p] > 0],
                    )
                )
                ro.append(
                    _recall(
                        r.filter(r["kind"] == "opponent")["example_id"].to_numpy(),
                        ref_o[sc[ref_o] < 0],
                    )
                )
            print(
                f"N {a.n}  candidates {mc}: recall@10 proponents {np.mean(rp):.3f} "
                f"opponents {np.mean(ro):.3f}  p50 {np.median(lat) * 1e3:.1f} ms"
            )
        run.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
