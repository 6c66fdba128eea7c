"""Query re-rank with one BLAS thread vs numpy's default, on an idle or a loaded machine.

    python benchmarks/query_threads.py RUN_DIR [--queries 12] [--repeats 5] [--load]

Times ``AttributionRun.rank`` (candidate search + exact re-rank of the default candidates, the
query's forward/backward excluded) for ``--queries`` held-out questions of the run, alternating
two arms in every repeat: ``one`` (the engine as it is: the re-rank under
:func:`~traceprop_engine.attribution.score.blas_threads.one_blas_thread`) and ``default`` (the same
calls with BLAS left at its default thread count). ``--load`` starts a busy process on one core
for the whole measurement, like a training job started from the app. Prints each arm's median of
the per-repeat p50 and their ratio; the rankings of both arms are checked to be identical.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution import query as query_mod
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings


def _busy() -> None:  # one core's worth of pure-Python work, until terminated
    x = 0
    while True:
        x += 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load", action="store_true", help="a busy process on one core throughout")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    queries = e2e.real_queries(a.run_dir, a.queries)
    run = AttributionRun(a.run_dir)
    s = IndexSettings()
    run.index(s)
    engine_cm = query_mod.one_blas_thread
    arms = {"one": engine_cm, "default": contextlib.nullcontext}
    hog = mp.get_context("spawn").Process(target=_busy, daemon=True) if a.load else None
    if hog is not None:
        hog.start()
        time.sleep(1.0)
    p50 = {k: [] for k in arms}
    try:
        for _ in range(a.repeats):
            ranked = {}
            for arm, cm in arms.items():
                query_mod.one_blas_thread = cm
                lat, ranked[arm] = [], []
                for q in queries:
                    t = time.perf_counter()
                    rows, _ = run.rank(q, s, 10, True)
                    lat.append(time.perf_counter() - t)
                    ranked[arm].append(rows["example_id"].to_list())
                p50[arm].append(statistics.median(lat) * 1e3)
            if ranked["one"] != ranked["default"]:
                raise SystemExit("the two arms ranked differently")
    finally:
        query_mod.one_blas_thread = engine_cm
        if hog is not None:
            hog.terminate()
        run.close()
    out = {k: round(statistics.median(v), 1) for k, v in p50.items()}
    out["ratio_default_over_one"] = round(out["default"] / out["one"], 2)
    out.update(load=a.load, repeats=a.repeats, queries=a.queries, run=str(a.run_dir))
    for arm in arms:
        print(f"{arm:>8}: p50 {out[arm]:8.1f} ms  per repeat {[round(x, 1) for x in p50[arm]]}")
    print(f"default / one: {out['ratio_default_over_one']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
