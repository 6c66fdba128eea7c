"""One BLAS thread for the query path's products (``with one_blas_thread(): ...``).

numpy's OpenBLAS splits even small products over every core, and its threads busy-wait for each
other. When another process holds one of the cores (a training job started from the app, a test
suite, another query process), every split product waits for a thread that cannot run, and a
query takes many times longer. The re-rank's products are small (a few thousand candidates,
k ≤ 126 per layer), so one thread is no slower on an idle machine either
(``benchmarks/query_threads.py`` measures both).

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
