"""A query's independent stages side by side, on Python threads (``both``, ``split_rows``).

One query's path has stages that do not need each other: the FAISS search of both ends and the
factor lists' scans of their (up to two) layers; and each layer of the re-rank that scores
many candidates splits into parts. Each releases the GIL in its heavy part (FAISS, numpy's
gathers, conversions and one-thread BLAS products), so on a machine with two cores or more they
run at once. Python threads never busy-wait for each other (OpenBLAS's own threads do, which is
why the query's BLAS stays on one thread, :mod:`.blas_threads`): when another process holds a
core, the stages simply take turns.

The pool is process-wide and small (at most :data:`MAX_WORKERS` - 1 threads); the caller's own
thread takes jobs too, so a query finishes even while the pool is busy with other queries (the
app's sessions), and a job that is itself on a pool thread runs its own jobs inline (no pool
thread ever waits for another).
``TRACEPROP_QUERY_THREADS=1`` turns it off (every job inline, in order).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

MAX_WORKERS = 4
"""At most this many threads work on one query (the caller's and ``MAX_WORKERS - 1`` others)."""

MIN_SPLIT_ROWS = 512
"""``split_rows`` splits only this many rows or more: below, a thread's hand-off costs more
than half the work saves."""

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_local = threading.local()


def hands() -> int:
    """Threads one query may use: the usable cores (at most :data:`MAX_WORKERS`), or
    ``TRACEPROP_QUERY_THREADS``."""
    env = os.environ.get("TRACEPROP_QUERY_THREADS", "").strip()
    if env:
        try:
            return max(1, min(int(env), MAX_WORKERS))
        except ValueError:
            raise ValueError(
                f"TRACEPROP_QUERY_THREADS must be a whole number, got {env!r}"
            ) from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=MAX_WORKERS - 1,
                thread_name_prefix="traceprop-query",
                initializer=_mark_worker,
            )
        return _pool


def _mark_worker() -> None:
    _local.worker = True


def both(*jobs: Callable[[], Any]) -> list[Any]:
    """Run ``jobs`` (no arguments each) and return their results in order. The calling thread
    and up to ``hands() - 1`` pool threads each take the next job not yet taken until none is
    left (so give the longest first); inline and in order with one hand or on a pool thread.
    An exception in any job is raised after every taken job has finished."""
    n = min(hands(), len(jobs))
    if n <= 1 or getattr(_local, "worker", False):
        return [job() for job in jobs]
    out: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    taken = itertools.count()  # next() is atomic under the GIL: each job is taken once

    def hand() -> None:
        while True:
            i = next(taken)
            if i >= len(jobs) or errors:
                return
            try:
                out[i] = jobs[i]()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller, below
                errors.append(e)

    pool = _get_pool()
    helpers = [pool.submit(hand) for _ in range(n - 1)]
    hand()
    for f in helpers:  # one still queued behind other queries' work is not waited for
        if not f.cancel():
            f.result()
    if errors:
        raise errors[0]
    return out


def split_rows(
    fn: Callable[[np.ndarray], np.ndarray], rows: np.ndarray, axis: int = -1
) -> np.ndarray:
    """``fn(rows)`` computed as ``fn`` of contiguous parts of ``rows`` on :func:`both`'s threads,
    joined along ``axis`` of the results (``fn`` must treat rows independently: each result
    column depends on its own row only). Fewer than :data:`MIN_SPLIT_ROWS` rows, or one hand:
    one call."""
    n = min(hands(), max(1, len(rows) // (MIN_SPLIT_ROWS // 2)))
    if n <= 1:
        return fn(rows)
    parts: Sequence[np.ndarray] = np.array_split(rows, n)
    return np.concatenate(both(*[lambda p=p: fn(p) for p in parts]), axis=axis)
