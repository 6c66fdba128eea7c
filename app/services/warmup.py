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

Exit: the first :func:`start` registers :func:`shutdown` to run at the interpreter's exit (and
the server's lifespan calls it when the server stops, ``app/main.py``): it stops the warm-up
between steps, makes a request in flight to the worker give up without being redone here
(``model_worker.AppExiting``), and joins the thread. A daemon thread still in torch, h5py or
FAISS while the interpreter tore itself down crashed the process (rc 139, issue 27 item 3).

Imports: the thread imports the engine while a page's script runs. ``streamlit run`` keeps the
app folder on ``sys.path`` for the server's life; Streamlit's ``AppTest`` inserts it for each run
and removes it after, which can make an import under way in this thread skip an entry of
``sys.path`` (site-packages: "No module named 'numpy'"). Put the app folder on ``sys.path``
before an ``AppTest`` with the warm-up on (``tests/app/test_app_exit.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path

from . import model_worker, queries

THREAD_NAME = "traceprop-warmup"
EXIT_JOIN_S = 60.0
"""How long the exit waits for a warm-up step under way (the longest: importing torch and
loading the model in this process when there is no worker, ≈ 4 s of one core unloaded)."""
_started: set[str] = set()
_threads: list[threading.Thread] = []
_guard = threading.Lock()
_page_query = threading.Event()  # a page started a query: the warm-up's own query would delay it
_stop = threading.Event()  # the process is exiting: no further warm-up step
FIRST_PAGE_GRACE_S = float(os.environ.get("TRACEPROP_WARMUP_GRACE_S", "0"))
"""Seconds the warm-up waits before its first step (default none: started beside the first
page, it did not slow that page, whose time is mostly the browser's; benchmarks/README.md)."""
log = logging.getLogger(__name__)


class _NoContextWarning(logging.Filter):
    """Streamlit warns "missing ScriptRunContext" when a cached function runs outside a page's
    script, as the warm-up's do by design (their results are shared by every session)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not threading.current_thread().name.startswith(THREAD_NAME)


logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").addFilter(
    _NoContextWarning()
)


class _Stopped(Exception):
    """The process is exiting: the warm-up ends between two steps."""


def _step() -> None:
    if _stop.is_set():
        raise _Stopped


def warm(run_dir: str | os.PathLike, worker: bool = False) -> None:
    """What the sample question does on the server, once, for ``run_dir``'s first eval example:
    open the cached run and its index, the model (in the query worker when ``worker``, else
    here), the query with every example's score, the model's answer, and the by-source chart's
    figure."""
    from traceprop_engine.errors import TracepropError

    from . import answers, charts
    from .queries import cached_tokenizer, in_process, open_cached, run_query_and_scores

    try:
        _stop.wait(FIRST_PAGE_GRACE_S)
        _step()
        run, lock = open_cached(run_dir)  # the engine, no torch
        with lock:
            ex = run.examples()
            _step()
            if worker and run.settings().uses_final_statistics:
                # the final model's K-FAC statistics need the model: the worker fits and
                # caches them, and no torch is imported here
                model_worker.call("warm", run_dir)
            run.index()  # loaded (or built) while the worker imports torch
        if not worker:  # the model here; a worker loads it with the first request below
            _step()
            run, lock = in_process(run_dir)
            with lock:
                _step()
                run.model()
            cached_tokenizer(str(Path(run_dir).resolve()))
        if _page_query.is_set():  # the user's query does the rest, and no longer waits on ours
            return
        evals = ex.filter(ex["split"] == "eval")["example_id"].to_list()
        if evals:
            _step()
            _, by_source, _, _ = run_query_and_scores(run_dir, eval_example=int(evals[0]))
            _step()
            answers.model_answer(run_dir, eval_example=int(evals[0]))
            charts.by_source_figure(by_source)
        elif worker:  # no eval example to ask: the model alone
            model_worker.call("warm", run_dir)
        _step()
        import pandas  # noqa: F401 - the first table's conversion (st.dataframe), 0.4 s
        import pyarrow  # noqa: F401

        from traceprop_engine.attribution import export_with_query  # noqa: F401 - the query page's
    except (_Stopped, model_worker.AppExiting):
        log.info("warm-up of %s stopped: the app is exiting", run_dir)
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
    t = threading.Thread(target=warm, args=(key, worker), name=THREAD_NAME, daemon=True)
    with _guard:
        if not _threads:
            _at_exit(shutdown)
        _threads.append(t)
    t.start()
    return True


def _at_exit(fn) -> None:
    """Run ``fn`` when the interpreter exits, before every ``atexit`` hook: those of h5py
    (which unregisters its type converters: an h5py read after it leaves HDF5 a converter that
    calls into a finalised interpreter at exit, the rc 139 of issue 27) and of torch run while
    the warm-up may still be using them. ``threading._register_atexit`` (what
    ``concurrent.futures`` uses) runs at the start of the interpreter's shutdown."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython: as early as atexit allows
        atexit.register(fn)
    else:
        register(fn)


def join(timeout: float | None = None) -> bool:
    """Wait for every warm-up started in this process; returns whether all have ended."""
    with _guard:
        threads = list(_threads)
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def shutdown(timeout: float = EXIT_JOIN_S) -> bool:
    """Stop the warm-ups (between steps; a request in flight to the worker gives up), stop the
    worker, and wait for the threads (the server's exit, and the interpreter's: ``atexit``).
    Returns whether every warm-up thread has ended."""
    _stop.set()
    model_worker.shutdown()
    done = join(timeout)
    if not done:
        log.warning("a warm-up step was still running after %.0f s at exit", timeout)
    return done
