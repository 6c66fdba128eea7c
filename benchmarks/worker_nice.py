"""A query's model half in the query worker, by the worker's niceness, idle and with both cores
busy (what a training job launched from the app does to the app's queries).

    python benchmarks/worker_nice.py [--nice 0,10,19] [--repeats 8] [--json out.json]

For each niceness: a fresh `QueryWorker` on the bundled sample run, warmed; then medians of
``--repeats`` `test_side` requests (eval examples in turn) with two pure-Python busy processes
holding the cores, and again idle, in that order. Prints milliseconds per request.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from traceprop_engine.attribution import QueryWorker

RUN = Path(__file__).resolve().parents[1] / "sample_runs" / "facts"


def _burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def _requests(w: QueryWorker, evals: list[int], n: int) -> float:
    times = []
    for i in range(n):
        t = time.perf_counter()
        w.call("test_side", RUN, eval_example=evals[i % len(evals)])
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nice", default="0,10,19", help="comma-separated niceness values")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    from traceprop_engine.attribution import open_run

    evals = [int(e) for e in open_run(RUN).eval_examples()["example_id"].to_list()[:4]]
    out = {}
    for nice in (int(v) for v in a.nice.split(",")):
        with QueryWorker(warm=(str(RUN),), nice=nice) as w:
            w.call("warm", RUN)
            stop = mp.Event()
            procs = [mp.Process(target=_burn, args=(stop,)) for _ in range(2)]
            for pr in procs:
                pr.start()
            time.sleep(1.0)
            busy = _requests(w, evals, a.repeats)
            stop.set()
            for pr in procs:
                pr.join()
            idle = _requests(w, evals, a.repeats)
        out[nice] = {"busy_ms": busy, "idle_ms": idle}
        print(f"niceness {nice:>2}: {busy:7.1f} ms with both cores busy, {idle:5.1f} ms idle")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
