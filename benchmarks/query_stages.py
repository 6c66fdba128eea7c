"""Where one end-to-end query's time goes: FAISS, the factor lists, the exact re-rank.

    python benchmarks/query_stages.py 1000000 [--queries 40] [--keep] [--sq8] [--base RUN]

Writes (`candidates.synthetic_run`) `traceprop bench query --end-to-end`'s synthetic store of N
examples (the bundled sample run's records resampled with noise; `--base RUN`: that run's records
and queries) under --work-dir, builds the default index, and times `AttributionRun.rank` for the
base run's real queries with timers wrapped around its stages:
the candidate search (FAISS's search of both ends and the lists' scans, side by side on the
query's threads, `score/two_hands.py`; each also timed on its own, the lists summed over their
layers), the re-rank, and inside it the factoring of each layer's `T'`, the records' gather
from the record cache and their products (summed over the re-rank's parallel parts). Prints the
median and mean of each stage over the queries (a query's stages do not add up to its total:
the indented ones are inside the one above, and side by side ones overlap).
`TRACEPROP_QUERY_THREADS=1` runs every stage on one thread, one after the other.

--sq8: also times the same IVF index with 8-bit scalar-quantised vectors (same coarse lists,
same nprobe) against the IVF-flat one, and the share of IVF-flat's 1000 candidates it returns.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution import query as query_module
from traceprop_engine.attribution.index import candidates as candidates_module
from traceprop_engine.attribution.index.lists import FactorLists
from traceprop_engine.attribution.score import factor_scores, record_cache, scoring
from traceprop_engine.attribution.score.two_hands import hands
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidates import BASE, synthetic_run  # noqa: E402


def _timed(times: dict, name: str, owner, attr: str) -> None:
    f = getattr(owner, attr)

    @functools.wraps(f)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - t

    setattr(owner, attr, wrapper)


def _sq8(run: AttributionRun, s: IndexSettings, queries, k: int = 1000) -> None:
    """IVF-flat against IVF-SQ8 on the same coarse lists: latency and candidate overlap."""
    import faiss

    vindex, _, pre = run.index(s)
    base = vindex.index
    ivf = faiss.extract_index_ivf(base)
    inv = ivf.invlists
    xs, ids = [], []
    for li in range(ivf.nlist):
        n = inv.list_size(li)
        if n:
            codes = faiss.rev_swig_ptr(inv.get_codes(li), n * base.d * 4)
            xs.append(codes.view(np.float32).reshape(n, base.d).copy())
            ids.append(faiss.rev_swig_ptr(inv.get_ids(li), n).copy())
    x, ids = np.concatenate(xs), np.concatenate(ids)
    quantizer = faiss.IndexFlat(base.d, base.metric_type)
    quantizer.add(ivf.quantizer.reconstruct_n(0, ivf.nlist))
    sq = faiss.IndexIVFScalarQuantizer(
        quantizer, base.d, ivf.nlist, faiss.ScalarQuantizer.QT_8bit, base.metric_type
    )
    sq.train(x[np.random.default_rng(0).choice(len(x), min(len(x), 65_536), replace=False)])
    sq.add_with_ids(x, ids)
    sq.nprobe = ivf.nprobe
    t_flat, t_sq, overlap = [], [], []
    for q in queries:
        qv = vindex._prep(pre.apply(q))
        both = np.concatenate([qv, -qv])
        t = time.perf_counter()
        _, i_flat = base.search(both, k)
        t_flat.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, i_sq = sq.search(both, k)
        t_sq.append(time.perf_counter() - t)
        overlap += [len(set(i_flat[r]) & set(i_sq[r])) / k for r in range(2)]
    print(
        f"nprobe {ivf.nprobe}, k {k}: IVF-flat {np.median(t_flat) * 1e3:.2f} ms, IVF-SQ8 "
        f"{np.median(t_sq) * 1e3:.2f} ms (medians); SQ8 returns {np.mean(overlap):.3f} of "
        "IVF-flat's candidates"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, help="examples in the synthetic store")
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--work-dir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the store and index")
    ap.add_argument("--sq8", action="store_true", help="also time an IVF-SQ8 index (see above)")
    ap.add_argument("--base", default=BASE, help="the run resampled (default: the sample run)")
    a = ap.parse_args()
    with synthetic_run(a.n, a.work_dir, "stages", a.keep, a.base) as (run, s):
        queries = e2e.real_queries(a.base, a.queries)
        times: dict[str, float] = {}
        vindex = run.index(s)[0]
        _timed(times, "faiss + lists", candidates_module, "both")  # side by side: wall time
        _timed(times, "  faiss (both ends)", type(vindex), "search_both")
        _timed(times, "  lists (layers summed)", FactorLists, "candidates")
        _timed(times, "re-rank", query_module, "rerank_candidates")
        _timed(times, "  row scores", scoring.ExactScorer, "row_scores")
        _timed(times, "  factoring T'", scoring.ExactScorer, "_prepare_layer")
        _timed(times, "  gather", record_cache.RecordCache, "int8_rows")
        _timed(times, "  products", factor_scores.LowRankTest, "inner_int8")
        run.rank(queries[0], s, 10, True)  # warm-up
        per = []
        for q in queries:
            times.clear()
            t = time.perf_counter()
            run.rank(q, s, 10, True)
            per.append({"total": time.perf_counter() - t, **times})
        print(f"N {a.n}, {len(queries)} queries, nprobe {vindex.nprobe}, query threads {hands()}")
        for name in dict.fromkeys(k for p in per for k in p):  # every stage any query reached
            v = np.array([p.get(name, 0.0) for p in per]) * 1e3
            print(f"{name:20s} median {np.median(v):6.2f} ms   mean {v.mean():6.2f} ms")
        if a.sq8:
            _sq8(run, s, queries)


if __name__ == "__main__":
    main()
