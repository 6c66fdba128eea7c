"""One query on one thread against its stages side by side (``score/two_hands.py``), at N rows.

    python benchmarks/query_hands.py 1000000 [--queries 40] [--repeats 5] [--load] [--keep]

Writes (``candidates.synthetic_run``) ``traceprop bench query``'s synthetic store of N examples
under --work-dir, builds the default index, then times ``AttributionRun.rank`` (candidate search
+ exact re-rank + result rows; the query's forward/backward excluded) for the bundled sample's
real queries, each query in both arms back to back (their order alternating): ``one``
(``TRACEPROP_QUERY_THREADS=1``: every stage on the caller's thread, one after the other) and
``hands`` (the default: FAISS's two ends and the lists' scans side by side, the re-rank's larger
layers in parts). Prints each arm's p50 and p90 over all queries and repeats, and the median
(and interquartile range) of the per-query ratio, which a drifting machine cannot bias; both
arms' rankings are checked to be the same rows with the same scores. ``--load`` keeps one core
busy with another process for the whole measurement (a training job started from the app).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution.score.two_hands import hands
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.bench.machine import cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidates import BASE, synthetic_run  # noqa: E402

ARMS = {"one": "1", "hands": ""}  # TRACEPROP_QUERY_THREADS per arm ("": the default)
SCORE_RTOL = 1e-6  # the same products in parts or whole: summation order only


def _busy() -> None:  # one core's worth of pure-Python work, until terminated
    x = 0
    while True:
        x += 1


def _set(value: str) -> None:
    if value:
        os.environ["TRACEPROP_QUERY_THREADS"] = value
    else:
        os.environ.pop("TRACEPROP_QUERY_THREADS", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, help="examples in the synthetic store")
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work-dir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the store and index")
    ap.add_argument("--load", action="store_true", help="one core busy with another process")
    a = ap.parse_args()
    env = os.environ.get("TRACEPROP_QUERY_THREADS")
    with synthetic_run(a.n, a.work_dir, "stages", a.keep) as (run, s):
        queries = e2e.real_queries(BASE, a.queries)
        run.rank(queries[0], s, 10, True)  # warm-up: tables, norms, record maps
        busy = mp.Process(target=_busy, daemon=True) if a.load else None
        if busy:
            busy.start()
        lat: dict[str, list[float]] = {arm: [] for arm in ARMS}
        first: dict[str, list] = {arm: [] for arm in ARMS}
        try:
            for rep in range(a.repeats):
                for qi, q in enumerate(queries):  # both arms on each query, in turn: drift-proof
                    order = list(ARMS) if (rep + qi) % 2 == 0 else list(ARMS)[::-1]
                    for arm in order:
                        _set(ARMS[arm])
                        t = time.perf_counter()
                        r, _ = run.rank(q, s, 10, True)
                        lat[arm].append(time.perf_counter() - t)
                        if rep == 0:
                            first[arm].append(r)
        finally:
            if busy:
                busy.terminate()
            _set(env or "")
        for x, y in zip(first["one"], first["hands"], strict=True):
            assert x["example_id"].to_list() == y["example_id"].to_list(), "rankings differ"
            np.testing.assert_allclose(y["score"], x["score"], rtol=SCORE_RTOL, atol=0)
        print(
            f"N {a.n}, {len(queries)} queries, {a.repeats} repeats, nprobe {run.index(s)[0].nprobe},"
            f" hands {hands()}, load {'one busy core' if a.load else 'none'}; "
            f"cpu: {cpu_model()}"
        )
        for arm in ARMS:
            v = np.asarray(lat[arm]) * 1e3
            print(f"  {arm:6s} p50 {np.median(v):.2f} ms, p90 {np.percentile(v, 90):.2f} ms")
        ratio = np.asarray(lat["hands"]) / np.asarray(lat["one"])  # the same query, back to back
        lo, hi = np.percentile(ratio, [25, 75])
        print(
            f"  hands / one, per query: median {np.median(ratio):.3f} [IQR {lo:.3f}, {hi:.3f}];"
            f" rankings identical, scores within {SCORE_RTOL:g}"
        )


if __name__ == "__main__":
    main()
