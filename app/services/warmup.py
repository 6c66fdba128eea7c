"""Warm the query path in the background, starting beside the first page.

The first page needs no torch (the engine is imported lazily), and neither does the server's
half of a query (opening the run, the index search and re-rank, every example's score); the
model's half does: importing torch and transformers and loading the run's model take about 4 s
of one core on this project's CPUs. :func:`start` (called by ``app/navigation.py`` before the first
page's script) starts the query worker (``model_worker``), which loads the active run's model
at once in its own process, on the other core, without holding this process's interpreter
lock; then a daemon thread does the sample question's server side once (open the run and its
index, the query with every example's score through the worker, the model's answer, the
by-source chart's figure, the first table's imports), so a user's first click finds them done
or under way.

With no worker (``TRACEPROP_QUERY_WORKER=0``) the same thread loads the model here, as before
(benchmarks/README.md, "App speed", measured both ways). It stops before its own query once a
page has started one (:func:`page_query_started`: that query would hold the run's lock the
user's waits on).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from . import model_worker, queries

_started: set[str] = set()
_guard = threading.Lock()
_page_query = threading.Event()  # a page started a query: the warm-up's own query would delay it
FIRST_PAGE_GRACE_S = float(os.environ.get("TRACEPROP_WARMUP_GRACE_S", "0"))
"""Seconds the warm-up waits before its first step (default none: started beside the first
page, it did not slow that page, whose time is mostly the browser's; benchmarks/README.md)."""
log = logging.getLogger(__name__)


def warm(run_dir: str | os.PathLike, worker: bool = False) -> None:
    """What the sample question does on the server, once, for ``run_dir``'s first eval example:
    open the cached run and its index, the model (in the query worker when ``worker``, else
    here), the query with every example's score, the model's answer, and the by-source chart's
    figure."""
    from traceprop_engine.errors import TracepropError

    from . import answers, charts
    from .queries import cached_tokenizer, in_process, open_cached, run_query_and_scores

    try:
        time.sleep(FIRST_PAGE_GRACE_S)
        run, lock = open_cached(run_dir)  # the engine, no torch
        with lock:
            ex = run.examples()
            run.index()  # loaded (or built) while the worker imports torch
        if not worker:  # the model here; a worker loads it with the first request below
            run, lock = in_process(run_dir)
            with lock:
                run.model()
            cached_tokenizer(str(Path(run_dir).resolve()))
        if _page_query.is_set():  # the user's query does the rest, and no longer waits on ours
            return
        evals = ex.filter(ex["split"] == "eval")["example_id"].to_list()
        if evals:
            _, by_source, _ = run_query_and_scores(run_dir, eval_example=int(evals[0]))
            answers.model_answer(run_dir, eval_example=int(evals[0]))
            charts.by_source_figure(by_source)
        elif worker:  # no eval example to ask: the model alone
            model_worker.call("warm", run_dir)
        import pandas  # noqa: F401 - the first table's conversion (st.dataframe), 0.4 s
        import pyarrow  # noqa: F401

        from traceprop_engine.attribution import export  # noqa: F401 - the query page's
    except (TracepropError, OSError, ValueError, model_worker.WorkerUnavailable) as e:
        # the page shows the error on use (and does without a worker that is gone)
        log.info("warm-up of %s skipped: %s", run_dir, e)


def page_query_started() -> None:
    """Called by the Influencers page before its query: the warm-up skips what is left of its
    own query steps (they hold the run's lock the page's query waits on)."""
    _page_query.set()


def start_worker() -> bool:
    """Start the query worker on the default active run (the first run listed: the bundled
    sample on a fresh install) when the server starts, before any browser connects
    (``app/main.py``'s lifespan); :func:`start` then finds it under way. Returns whether a
    worker runs. Off with TRACEPROP_NO_WARMUP=1 or TRACEPROP_QUERY_WORKER=0."""
    from . import config, runs

    if os.environ.get("TRACEPROP_NO_WARMUP") == "1":
        return False
    try:
        active = runs.ensure_active_run(config.AppConfig.from_env(), {})
    except Exception:  # noqa: BLE001 - the pages report a bad configuration; the worker can wait
        log.exception("query worker: no active run to warm")
        active = None
    return model_worker.start(active, threads=queries.app_threads()) is not None


def start(run_dir: str | os.PathLike | None) -> bool:
    """Start warming ``run_dir`` once per process (no-op for None or an already warmed run).
    Returns whether a thread was started. TRACEPROP_NO_WARMUP=1 turns it off (benchmarks)."""
    if run_dir is None or os.environ.get("TRACEPROP_NO_WARMUP") == "1":
        return False
    key = str(Path(run_dir).resolve())
    with _guard:
        if key in _started:
            return False
        _started.add(key)
    # the worker's imports start now, in their own process: they need no lock of this one
    worker = model_worker.start(key, threads=queries.app_threads()) is not None
    threading.Thread(target=warm, args=(key, worker), name="traceprop-warmup", daemon=True).start()
    return True
