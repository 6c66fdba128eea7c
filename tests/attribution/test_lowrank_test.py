"""The factorisation of a query's pulled-back sketch ``T' = A Bᵀ`` (LowRankTest): the random-range
route must give what the spectral route gives, and step aside when the rank is too high."""

from __future__ import annotations

import numpy as np
import pytest

from traceprop_engine.attribution.score import factor_scores as fs
from traceprop_engine.attribution.score.factor_scores import (
    FLOAT32_RTOL,
    LOWRANK_RTOL,
    LowRankTest,
    _range_factors,
    _spectral_factors,
)

RECONSTRUCT_RTOL = 1e-5
"""Relative Frobenius error of ``A Bᵀ`` against ``T`` allowed at the float32 cut (1e-6 per
singular value, a few of them)."""


def _low_rank(rng, ko, ki, r, f32=False):
    t = rng.normal(size=(ko, r)) @ rng.normal(size=(r, ki))
    return t.astype(np.float32).astype(np.float64) if f32 else t


@pytest.mark.parametrize(
    ("ko", "ki", "r"), [(126, 126, 1), (126, 126, 3), (64, 96, 7), (126, 126, 20), (126, 126, 40)]
)
def test_range_factors_reconstruct_low_rank_sketches(ko, ki, r):
    rng = np.random.default_rng(r)
    for f32, rtol in ((False, LOWRANK_RTOL), (True, FLOAT32_RTOL)):
        t = _low_rank(rng, ko, ki, r, f32)
        a, b = _range_factors(t, rtol)
        assert a.shape == (ko, r) and b.shape == (ki, r)  # the rank, not the trial width
        err = np.linalg.norm(a @ b.T - t) / np.linalg.norm(t)
        assert err < (1e-12 if not f32 else RECONSTRUCT_RTOL)


def test_range_factors_step_aside_above_their_widths_and_for_zero():
    rng = np.random.default_rng(0)
    assert _range_factors(_low_rank(rng, 126, 126, 60), LOWRANK_RTOL) is None  # > 48 directions
    assert _range_factors(rng.normal(size=(126, 126)), FLOAT32_RTOL) is None  # full rank
    assert _range_factors(_low_rank(rng, 12, 12, 2), LOWRANK_RTOL) is None  # k too small to gain
    a, b = _range_factors(np.zeros((126, 126)), LOWRANK_RTOL)
    assert a.shape == (126, 0) and b.shape == (126, 0)


@pytest.mark.parametrize("f32", [False, True])
def test_maybe_scores_equal_the_spectral_route(monkeypatch, f32):
    """Mixed queries: rank 2, rank 60 (the spectral fallback) and zero; inner products with
    rank-1 records agree with the spectral factorisation of every query."""
    rng = np.random.default_rng(3)
    rtol = FLOAT32_RTOL if f32 else LOWRANK_RTOL
    t = np.stack(
        [_low_rank(rng, 126, 126, 2, f32), _low_rank(rng, 126, 126, 60, f32), np.zeros((126, 126))]
    )
    u, v = rng.normal(size=(50, 126, 1)), rng.normal(size=(50, 126, 1))
    got = LowRankTest.maybe(t, np.float64, rtol)
    assert got is not None and list(np.bincount(got.owner, minlength=3)) == [2, 60, 0]
    monkeypatch.setattr(fs, "_range_factors", lambda t, rtol: None)  # the spectral route only
    ref = LowRankTest.maybe(t, np.float64, rtol)
    dense = np.einsum("qoi,no,ni->qn", t, u[:, :, 0], v[:, :, 0])
    scale = np.abs(dense).max()
    np.testing.assert_allclose(
        got.inner(u, v, 3), dense, atol=1e-9 * scale if not f32 else 1e-5 * scale
    )
    np.testing.assert_allclose(
        got.inner(u, v, 3), ref.inner(u, v, 3), atol=1e-9 * scale if not f32 else 1e-5 * scale
    )


def test_maybe_still_declines_full_rank():
    rng = np.random.default_rng(1)
    assert LowRankTest.maybe(rng.normal(size=(2, 126, 126)), np.float64) is None
    assert len(_spectral_factors(rng.normal(size=(2, 8, 8)), LOWRANK_RTOL)) == 2


def test_maybe_skips_the_random_range_when_told_the_sketch_is_full_rank(monkeypatch):
    """EK-FAC's pullback is full rank: the scorer says so and no range is tried."""

    def never(t, rtol):
        raise AssertionError("random range tried")

    monkeypatch.setattr(fs, "_range_factors", never)
    rng = np.random.default_rng(2)
    assert LowRankTest.maybe(rng.normal(size=(1, 126, 126)), np.float64, ranged=False) is None
    low = LowRankTest.maybe(_low_rank(rng, 126, 126, 2)[None], np.float64, ranged=False)
    assert low is not None and len(low.owner) == 2  # the spectral route still factors it
