"""A query on a free-text run (rank-16 records): with the index's record cache and without it.

    traceprop train --data D --out RUN --epochs 1 --max-length 48   # D: free text, ~4000 texts
    python benchmarks/free_text_query.py RUN [--repeats 4]

Rebuilds the run's first-column and every-column indexes (a cache is written where the records
hold ``record_cache.MIN_BYTES``), then times four short-answer queries against each view given
and with the column choice by the tails (``IndexSettings.columns=None``), each repeat once with
the cache and once reading the store, interleaved. Prints the medians, their ratio and whether
the rankings are the same (EVAL.md §1aa).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from traceprop_engine.attribution import open_run
from traceprop_engine.settings import IndexSettings

QUERIES = [
    ("Return the number of", " elements in"),
    ("Compute the mean of", " the array"),
    ("Create a new", " tensor"),
    ("Write the data to", " the file"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    run = open_run(a.run)
    views = (IndexSettings(columns=1), IndexSettings(columns=0))
    for ix in views:
        run.index(ix, rebuild=True)
    scorers = [run.indexes.scorer(run.settings(ix)) for ix in views]
    caches = [s.cache for s in scorers]
    print(f"{len(run.index(views[1])[1])} index rows; caches: {[c is not None for c in caches]}")
    sides = [run.test_side(prompt=p, completion=c) for p, c in QUERIES]
    arms = {"first column": views[0], "every column": views[1], "by the tails": None}
    ms: dict = {}
    for _ in range(a.repeats):
        for cached in (True, False):
            for s, c in zip(scorers, caches, strict=True):
                s.cache = c if cached else None
            for name, ix in arms.items():
                for ts in sides:
                    t0 = time.perf_counter()
                    r = run.query(test_side=ts, top_k=10, settings=ix)
                    ms.setdefault((name, cached), []).append((time.perf_counter() - t0) * 1e3)
                    ms.setdefault((name, cached, "ids"), []).append(r.rows["example_id"].to_list())
    for name in arms:
        c, s = np.median(ms[(name, True)]), np.median(ms[(name, False)])
        same = ms[(name, True, "ids")] == ms[(name, False, "ids")]
        print(f"{name:13s} cache {c:7.1f} ms, store {s:7.1f} ms, ratio {c / s:.2f}, same: {same}")


if __name__ == "__main__":
    main()
