"""One BLAS thread for the query path's products (``with one_blas_thread(): ...``).

numpy's OpenBLAS splits even small products over every core, and its threads busy-wait for each
other. When another process holds one of the cores (a training job started from the app, a test
suite, another query process), every split product waits for a thread that cannot run: on the
project's 2-core CPU, with a one-thread training job beside it, one ``rank`` on a real run of
10⁵ examples (1000 candidates per side, exact re-rank) took 1.27 s instead of 0.06 s, and the
brute-force scores of 48 queries 60 s instead of 9 s (benchmarks/README.md §2b). The re-rank's
products are small (a few thousand candidates, k ≤ 126 per layer): on an idle machine one
thread was faster too (50.8 vs 61.7 ms p50, ``benchmarks/query_threads.py``).

Process-wide (BLAS has one thread setting): the first caller sets it, the last one to leave
restores it, so concurrent queries (the app's sessions) never leave it at one thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_users = 0
_limit = None  # the threadpoolctl limiter while any caller is inside
_controller = None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the block with numpy's BLAS (and LAPACK) on one thread."""
    global _users, _limit, _controller
    with _lock:
        if _users == 0:
            if _controller is None:  # inspects the loaded libraries once (≈ 1 ms)
                from threadpoolctl import ThreadpoolController

                _controller = ThreadpoolController()
            _limit = _controller.limit(limits=1, user_api="blas")
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _limit.restore_original_limits()
                _limit = None
