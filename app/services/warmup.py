"""Warm the query path in the background once the first page has been drawn.

The first page needs no torch (the engine is imported lazily); the first query does: importing
torch and transformers, loading the run's model and fitting its index take seconds on a CPU.
:func:`start` does that work in a daemon thread right after the first page is sent, so that a
user's first click finds it done (or under way: the query then waits on the same imports and
the run's lock instead of starting from scratch). Each step waits until no page script is
running (:func:`page_running`), so pages drawn meanwhile are not slowed by more than one step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

_started: set[str] = set()
_guard = threading.Lock()
_pages = threading.Condition()
_running = 0  # page scripts running now, in every session of this process
IDLE_WAIT_S = 30.0  # a warm-up step waits at most this long for the pages to finish
FIRST_PAGE_GRACE_S = float(os.environ.get("TRACEPROP_WARMUP_GRACE_S", "1.0"))
"""Seconds the warm-up waits before its first step: the server sends the first page and the
browser draws it before torch's import takes the interpreter lock (measured with
benchmarks/app_speed.py on 2 cores: first page 4.2 s with the warm-up starting at once, 3.2 s
with none)."""
log = logging.getLogger(__name__)


@contextlib.contextmanager
def page_running():
    """Mark a page script as running (``app/main.py`` wraps ``nav.run()`` in it): the warm-up
    starts its next step only when no page is running, so a page drawn while the warm-up works
    (the Runs page right after the first one) does not share the interpreter lock with torch's
    and transformers' imports for longer than the step under way."""
    global _running
    with _pages:
        _running += 1
    try:
        yield
    finally:
        with _pages:
            _running -= 1
            _pages.notify_all()


def _wait_idle(timeout: float = IDLE_WAIT_S) -> bool:
    """Wait until no page script runs (at most ``timeout`` s); whether it became idle."""
    with _pages:
        return _pages.wait_for(lambda: _running == 0, timeout)


def warm(run_dir: str | os.PathLike) -> None:
    """Open the cached run, load its model and tokenizer and answer one eval query with the
    default settings (builds or loads the index): what a first query would otherwise do."""
    from traceprop_engine.errors import TracepropError

    from .queries import cached_tokenizer, open_cached

    try:
        time.sleep(FIRST_PAGE_GRACE_S)
        _wait_idle()
        import torch  # noqa: F401 - the first and longest step, on its own

        _wait_idle()
        run, lock = open_cached(run_dir)
        _wait_idle()
        cached_tokenizer(str(Path(run_dir).resolve()))
        _wait_idle()
        with lock:
            run.model()
        _wait_idle()
        with lock:
            ex = run.examples()
            evals = ex.filter(ex["split"] == "eval")["example_id"].to_list()
            if evals:
                run.query(eval_example=int(evals[0]), top_k=1)
    except (TracepropError, OSError, ValueError) as e:  # the page shows the error on use
        log.info("warm-up of %s skipped: %s", run_dir, e)


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
    threading.Thread(target=warm, args=(key,), name="traceprop-warmup", daemon=True).start()
    return True
