"""The candidate search of both ends: one FAISS call per end (the engine) vs one call for both.

    python benchmarks/query_search.py RUN_DIR [--queries 12] [--repeats 7] [--load] [--json F]

Times ``VectorIndex.search_both`` on the default index of RUN_DIR for ``--queries`` held-out
questions with the default candidate count, alternating two arms in every repeat:

- ``two calls``: ``VectorIndex.search_both`` as the engine runs it, the query and its negation
  searched one after the other;
- ``one call``: both in one batch of two queries, which FAISS could spread over its threads
  (measured no faster at 10⁶: benchmarks/README.md §2b, so not adopted).

The arms must return the same candidates. ``--load`` keeps one core busy (as a training job
started from the app would). Prints the median per-query time of each arm and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution.index.vector_index import SearchResult
from traceprop_engine.attribution.score.ranking import n_candidates
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings


def _busy() -> None:  # one core's worth of pure-Python work, until terminated
    x = 0
    while True:
        x = (x * 7 + 1) % 1_000_003


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    run = AttributionRun(a.run_dir)
    s = IndexSettings()
    index, _, pre = run.index(s)
    k = n_candidates(10, index.n)
    vecs = [pre.apply(q) for q in e2e.real_queries(a.run_dir, a.queries)]

    def one_call(qv):
        q = index._prep(qv)
        sc, ids = index._search_prepped(np.concatenate([q, -q]), k)
        ns, ni = sc[len(q) :], ids[len(q) :]
        neg = np.where(ni < 0, np.inf, -ns).astype(np.float32)
        return SearchResult(sc[: len(q)], ids[: len(q)], neg, ni)

    arms = {"two calls": lambda qv: index.search_both(qv, k), "one call": one_call}
    busy = mp.Process(target=_busy, daemon=True) if a.load else None
    if busy:
        busy.start()
    try:
        for qv in vecs[:2]:  # warm
            for f in arms.values():
                f(qv)
        times: dict[str, list[float]] = {name: [] for name in arms}
        seen: dict[str, list[SearchResult]] = {}
        for rep in range(a.repeats):
            for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
                t = time.perf_counter()
                out = [arms[name](qv) for qv in vecs]
                times[name].append((time.perf_counter() - t) / len(vecs))
                if rep == 0:
                    seen[name] = out
    finally:
        if busy:
            busy.terminate()
    for x, y in zip(seen["two calls"], seen["one call"], strict=True):
        for f in ("proponent_ids", "opponent_ids"):
            assert np.array_equal(getattr(x, f), getattr(y, f)), f"{f} differ"
    row = {"n": int(index.n), "kind": index.kind.value, "nprobe": index.nprobe, "candidates": k}
    row.update(queries=len(vecs), repeats=a.repeats, load=a.load)
    for name in arms:
        row[f"{name.replace(' ', '_')}_ms"] = round(float(np.median(times[name])) * 1e3, 2)
    row["speedup"] = round(row["two_calls_ms"] / row["one_call_ms"], 2)
    e2e.emit(row, a.json)
    run.close()


if __name__ == "__main__":
    main()
