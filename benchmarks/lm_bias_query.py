"""What the LM-bias term costs a query on a free-text run, and whether its candidates hold.

    traceprop train --data D --out RUN --epochs 1 --max-length 48   # D: free text, ~4000 texts
    python benchmarks/lm_bias_query.py RUN [--repeats 4]

Times building the index rows' bias directions once (``HeadBias``: one pass over the LM head's
first record columns, on a query's first use of an index), then four short answers and two
free-text queries with the default (``lm_bias`` auto) and with ``lm_bias=0``, interleaved, and
prints the medians and their ratio; and, per query, whether ``query()``'s top 10 proponents and
opponents with the term are brute force's (every row scored exactly), the check that FAISS's
candidates plus the term's ends find them (EVAL.md §1ab).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from traceprop_engine.attribution import HeadBias, open_run
from traceprop_engine.settings import IndexSettings

QUERIES = [
    dict(prompt="Return the number of", completion=" elements in"),
    dict(prompt="Compute the mean of", completion=" the array"),
    dict(prompt="Create a new", completion=" tensor"),
    dict(prompt="Write the data to", completion=" the file"),
    dict(prompt="Return a copy of the array with the given shape."),
    dict(prompt="Read the configuration file and return its values as a dictionary."),
]


def _top(scores: np.ndarray, ids: np.ndarray, k: int, sign: int) -> list[int]:
    order = np.argsort(-sign * scores, kind="stable")[:k]
    return [int(ids[i]) for i in order if sign * scores[i] > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    run = open_run(a.run)
    s = run.settings()
    if not s.lm_bias:
        raise SystemExit(
            f"{a.run}: no LM-bias term by default (not a free-text run, or recorded before it)"
        )
    sides = [run.test_side(**q) for q in QUERIES]
    for ts in sides:  # both views' indexes built, both terms' directions made: not timed
        run.query(test_side=ts, top_k=10)
    scorer = run.indexes.scorer(run.for_query(None, None))
    build = []
    for _ in range(3):
        t0 = time.perf_counter()
        HeadBias(run.store, scorer)
        build.append((time.perf_counter() - t0) * 1e3)
    print(
        f"{scorer.n_rows} index rows; the rows' bias directions built in "
        f"{np.median(build):.1f} ms (median of 3)"
    )
    arms = {"default (lm_bias auto)": None, "lm_bias 0": IndexSettings(lm_bias=0)}
    ms: dict = {}
    for _ in range(a.repeats):
        for name, ix in arms.items():
            for ts in sides:
                t0 = time.perf_counter()
                run.query(test_side=ts, top_k=10, settings=ix)
                ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
    base = np.median(ms["lm_bias 0"])
    for name in arms:
        print(f"{name:24s} {np.median(ms[name]):7.1f} ms  ratio {np.median(ms[name]) / base:.2f}")
    for q, ts in zip(QUERIES, sides, strict=True):
        res = run.query(test_side=ts, top_k=10)
        sq = run.for_query(None, ts.n_targets, ts.sketches)
        ids, exact = run.index(sq)[1], run.all_scores(ts.sketches, sq)
        same = all(
            res.rows.filter(res.rows["kind"] == kind)["example_id"].to_list()
            == _top(exact, ids, 10, sign)
            for kind, sign in (("proponent", 1), ("opponent", -1))
        )
        print(
            f"{q['prompt'][:40]!r:44s} columns {res.query['columns']}: top 10 as brute force: {same}"
        )
    run.close()


if __name__ == "__main__":
    main()
