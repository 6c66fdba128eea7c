"""The app's query worker: the runs' models in a process of their own.

The server process never needs torch: a query's model half (its sketches and loss, the model's
greedy answer, an influencer's per-token view, token text) goes to one
:class:`~traceprop_engine.attribution.model_side.worker.QueryWorker` per server process, started
beside the first page (``warmup.start``) and loading the active run's model at once on the other
core; the ranking, the example table and every chart stay here, on numpy, FAISS and the store. The
worker's imports (torch, transformers, the model: ≈ 4 s of one core) then no longer share the
server's interpreter lock with the first page, and the first query finds them done
(benchmarks/README.md, "App speed").

When there is no worker (``TRACEPROP_QUERY_WORKER=0``, warm-up off as in the tests, or it died)
:func:`call` raises ``WorkerUnavailable`` and the caller does the work in this process, as
before; nothing is lost either way. Once the server is stopping (:func:`shutdown`: the server's
exit, or the interpreter's) a call raises :class:`AppExiting` instead, which no caller answers
by importing torch here: a thread left doing that while the interpreter shuts down crashed it
(rc 139, issue 27 item 3).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path

from traceprop_engine.attribution import QueryWorker, WorkerUnavailable

WORKER_NICE = int(os.environ.get("TRACEPROP_WORKER_NICE", "10"))
"""The worker's niceness: its start-up (torch, the model) yields the cores to the server and
the browser drawing the first pages, and has them all once a query waits on it."""
REQUEST_TIMEOUT_S = float(os.environ.get("TRACEPROP_WORKER_TIMEOUT_S", "600"))
"""A request that takes longer is given up (the worker is stopped, the page does the work)."""
_worker: QueryWorker | None = None
_guard = threading.Lock()
_exiting = threading.Event()  # the server or the interpreter is stopping: no fallback work
log = logging.getLogger(__name__)

__all__ = ["AppExiting", "WorkerUnavailable", "call", "enabled", "shutdown", "start", "stop"]


class AppExiting(RuntimeError):
    """The server is stopping: the request was not answered and must not be redone here."""


def enabled() -> bool:
    """TRACEPROP_QUERY_WORKER=0 keeps every query in the server process (benchmarks' A/B)."""
    return os.environ.get("TRACEPROP_QUERY_WORKER", "1") != "0"


def start(run_dir: str | os.PathLike | None, threads: int = 1) -> QueryWorker | None:
    """The process's worker, started on first call (it loads ``run_dir``'s model right after
    its imports); None when turned off or when it cannot start."""
    global _worker
    if not enabled():
        return None
    with _guard:
        if _worker is None:
            warm = (str(Path(run_dir).resolve()),) if run_dir is not None else ()
            try:
                _worker = QueryWorker(threads=threads, warm=warm, nice=WORKER_NICE).start()
            except OSError as e:  # no fork/pipe left: queries run here
                log.warning("query worker not started: %s", e)
                return None
            atexit.register(shutdown)
        return _worker


def call(op: str, run_dir: str | os.PathLike, **kw):
    """``op`` on ``run_dir`` in the worker.

    Raises:
        TracepropError: what the op raised (shown by the page like any query error).
        WorkerUnavailable: no worker: do the work in this process.
        AppExiting: the server is stopping (:func:`shutdown`): do nothing more.
    """
    if _exiting.is_set():
        raise AppExiting(f"the app is stopping: {op} not done")
    w = _worker
    if w is None:
        raise WorkerUnavailable("no query worker in this process")
    try:
        return w.call(op, run_dir, timeout=REQUEST_TIMEOUT_S, **kw)
    except WorkerUnavailable as e:
        if _exiting.is_set():  # closed under this request by shutdown()
            raise AppExiting(f"the app is stopping: {op} not done") from e
        log.warning("query worker: %s; doing %s in the server process", e, op)
        raise


def stop(timeout: float = 5.0) -> None:
    """Stop the worker (tests; the server's exit closes its pipe anyway), killed after
    ``timeout`` s. A request in flight gives up with ``WorkerUnavailable`` (its caller then does
    the work here)."""
    global _worker
    with _guard:
        w, _worker = _worker, None
    if w is not None:
        w.close(timeout)


def exiting() -> bool:
    """Whether :func:`shutdown` was called (the server or the interpreter is stopping)."""
    return _exiting.is_set()


def shutdown() -> None:
    """The server is stopping: every later or in-flight :func:`call` raises :class:`AppExiting`
    (no caller then starts torch work in this process), and the worker is stopped (at once
    when it is still importing: it holds nothing to save)."""
    _exiting.set()
    stop(timeout=1.0)
