"""one_blas_thread: BLAS runs on one thread inside, and the setting comes back only when the last
of overlapping users leaves (the app's sessions query from several threads; they enter and leave
in any order). Checked from one thread: OpenBLAS's ``get_num_threads`` reports another thread's
setting unreliably, though the setting applies to every thread."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_info

from traceprop_engine.attribution.score.blas_threads import one_blas_thread


def _blas_threads() -> set[int]:
    np.ones((8, 8)) @ np.ones((8, 8))  # numpy's BLAS is loaded
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_one_thread_inside_and_restored_after():
    before = _blas_threads()
    assert before, "numpy's BLAS is not visible to threadpoolctl"
    with one_blas_thread():
        assert _blas_threads() == {1}
    assert _blas_threads() == before


def test_overlapping_users_restore_only_when_the_last_leaves():
    before = _blas_threads()
    first, second = one_blas_thread(), one_blas_thread()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first to enter leaves first (not nested)
    assert _blas_threads() == {1}
    second.__exit__(None, None, None)
    assert _blas_threads() == before
    with one_blas_thread():  # and it limits again after a full restore
        assert _blas_threads() == {1}
    assert _blas_threads() == before
