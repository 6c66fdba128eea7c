"""Recall@10 of the whole query against the number of FAISS candidates re-ranked exactly.

    python benchmarks/candidates.py 100000 --candidates 200,1000,3000 [--queries 24] [--base RUN]
    python benchmarks/candidates.py 1000000 --candidates 1000,500 --scan 0.01/0.04,0.005/0.02 \
        --list-candidates 300,150 --keep   # every combination; the store is kept for a rerun

Writes `traceprop bench query --end-to-end`'s synthetic store of N examples (the bundled sample
run's records resampled with noise, one record per example) under /tmp, builds the default
index once (`--base RUN`: another run's records and queries instead, e.g. a free-text run's
rank-16 records), computes brute-force exact scores for the queries, then for each candidate count
times `AttributionRun.rank` (candidate search + exact re-rank) and measures the recall@10 of
the returned proponents and opponents. Prints one line per candidate count (and, at 10⁶ rows
where the index has factor lists, per lists' scan share ``proponents/opponents`` and rows
proposed per side: ``index/lists.py``'s ``SCAN_FRACTION`` and ``CANDIDATES``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shutil
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution.index import lists as index_lists
from traceprop_engine.attribution.score import ranking
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings

BASE = str(Path(__file__).resolve().parents[1] / "sample_runs" / "facts")


@contextlib.contextmanager
def synthetic_run(n: int, work_dir: str, name: str, keep: bool, base: str = BASE):
    """``--end-to-end``'s synthetic store of ``n`` examples resampled from ``base``'s records
    (default: the bundled sample run) in ``work_dir/traceprop-NAME-n`` (``-NAME-BASE-n`` for
    another base run) with the default index built: ``(run, IndexSettings())``. ``keep``: reuse
    one written before and leave it for the next call; otherwise written afresh and removed at
    the end."""
    tag = name if base == BASE else f"{name}-{Path(base).name}"
    d = Path(work_dir) / f"traceprop-{tag}-{n}"
    ready = d / "ready"
    if not (keep and ready.exists()):
        shutil.rmtree(d, ignore_errors=True)
    try:
        if not ready.exists():
            e2e.write_synthetic_run(base, d, n, 0, 0.5)
        run, s = AttributionRun(d), IndexSettings()
        run.build_index(s, None, reuse=keep)  # keep: an index built before is used as it is
        ready.write_text("store and index written\n")
        try:
            yield run, s
        finally:
            run.close()
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


def _recall(got: np.ndarray, ref: np.ndarray) -> float:
    return len(set(got.tolist()) & set(ref.tolist())) / max(len(ref), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, help="examples in the synthetic store")
    ap.add_argument("--candidates", default="200,1000,3000")
    ap.add_argument("--queries", type=int, default=24)
    ap.add_argument("--scan", default=None, help="lists' scan shares, e.g. 0.01/0.04,0.005/0.02")
    ap.add_argument("--list-candidates", default=None, help="rows the lists propose per side")
    ap.add_argument("--work-dir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the store and index")
    ap.add_argument("--base", default=BASE, help="the run resampled (default: the sample run)")
    a = ap.parse_args()
    with synthetic_run(a.n, a.work_dir, "candidates", a.keep, a.base) as (run, s):
        queries = e2e.real_queries(a.base, a.queries)
        exact = np.concatenate(
            [
                run.exact_scores(
                    [np.concatenate([q[li] for q in batch]) for li in range(len(batch[0]))], s
                )
                for batch in (queries[i : i + 12] for i in range(0, len(queries), 12))
            ]
        )
        scans = (
            [tuple(float(y) for y in x.split("/")) for x in a.scan.split(",")]
            if a.scan
            else [index_lists.SCAN_FRACTION]
        )
        per_side = (
            [int(x) for x in a.list_candidates.split(",")]
            if a.list_candidates
            else [index_lists.CANDIDATES]
        )
        combos = itertools.product((int(x) for x in a.candidates.split(",")), scans, per_side)
        for mc, scan, lc in combos:
            ranking.MIN_CANDIDATES, ranking.MAX_CANDIDATES = mc, mc
            index_lists.SCAN_FRACTION, index_lists.CANDIDATES = scan, lc
            run.rank(queries[0], s, 10, True)  # warm-up
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
                f"N {a.n}  candidates {mc}  lists scan {scan[0]:g}/{scan[1]:g} rows {lc}: "
                f"recall@10 proponents {np.mean(rp):.3f} "
                f"opponents {np.mean(ro):.3f}  p50 {np.median(lat) * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
