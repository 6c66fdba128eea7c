"""``traceprop bench overhead``'s accounting: the costs that recur every few steps (buffer
flushes, the K-FAC statistics of every ``covariance_stride``-th batch, the default factors'
projections once per buffer of steps) are spread over the steps instead of being dropped by the
median of per-round ratios."""

from __future__ import annotations

import numpy as np
import pytest

from traceprop_engine.bench.overhead import _overheads, run_overhead_bench


def _rounds(tracked, logging, plain, *, flush=None, cov=None, proj=None):
    z = [0.0] * len(plain)
    return {
        "projection": {"plain": z, "tracked": proj or z, "logging": proj or z},
        "wall": {"plain": plain, "tracked": tracked, "logging": logging},
        "cpu": {"plain": plain, "tracked": tracked, "logging": logging},
        "flush": {"plain": z, "tracked": flush or z, "logging": z},
        "covariance": {"plain": z, "tracked": cov or z, "logging": z},
    }


def test_a_covariance_batch_is_spread_over_the_steps_not_dropped():
    """Ten rounds, plain 100 ms, logging 102 ms, tracked 102 ms except one round holding a
    40 ms covariance batch: the median of the raw ratios would say +2 %; spread over the ten
    steps it is 4 ms a step: +6 %, and the covariance adds +3.92 % to the logging arm."""
    n = 10
    tracked = [102.0] * n
    tracked[3] += 40.0
    cov = [0.0] * n
    cov[3] = 40.0
    got = _rounds(tracked, [102.0] * n, [100.0] * n, cov=cov)
    res, ratio = _overheads(got, {"tracked": 0.0, "logging": 0.0}, {"tracked": 0, "logging": 0}, n)
    assert res["overhead_pct"] == pytest.approx(6.0)
    assert res["logging_pct"] == pytest.approx(2.0)
    assert res["covariance_pct"] == pytest.approx(100 * (106 / 102 - 1))
    assert res["covariance_batch_ms_per_step"] == {"tracked": 4.0, "logging": 0.0}
    assert res["n_covariance_batches_in_loop"] == {"tracked": 1, "logging": 0}
    np.testing.assert_allclose(ratio["tracked"], 0.06)
    # without the covariance timing the same rounds read as the median ignores the batch
    raw, _ = _overheads(
        _rounds(tracked, [102.0] * n, [100.0] * n),
        {"tracked": 0.0, "logging": 0.0},
        {"tracked": 0, "logging": 0},
        n,
    )
    assert raw["overhead_pct"] == pytest.approx(2.0)


def test_flush_and_covariance_in_one_round_are_both_spread():
    n = 4
    got = _rounds(
        [150.0, 100.0, 100.0, 100.0],
        [100.0] * n,
        [100.0] * n,
        flush=[20.0, 0.0, 0.0, 0.0],
        cov=[30.0, 0.0, 0.0, 0.0],
    )
    res, ratio = _overheads(got, {"tracked": 0.0, "logging": 0.0}, {"tracked": 0, "logging": 0}, n)
    np.testing.assert_allclose(ratio["tracked"], 50.0 / 4 / 100)
    assert res["flush_ms_per_step"]["tracked"] == 5.0
    assert res["covariance_batch_ms_per_step"]["tracked"] == 7.5


def test_the_factor_projections_are_spread_over_the_steps():
    """Both tracked arms hold one 12 ms round of deferred projections in four: 3 ms a step each,
    not the 0 the median of raw ratios would report."""
    n = 4
    got = _rounds(
        [112.0, 100.0, 100.0, 100.0],
        [100.0, 100.0, 112.0, 100.0],
        [100.0] * n,
        proj=None,
    )
    got["projection"]["tracked"] = [12.0, 0.0, 0.0, 0.0]
    got["projection"]["logging"] = [0.0, 0.0, 12.0, 0.0]
    res, ratio = _overheads(got, {"tracked": 0.0, "logging": 0.0}, {"tracked": 0, "logging": 0}, n)
    np.testing.assert_allclose(ratio["tracked"], 0.03)
    np.testing.assert_allclose(ratio["logging"], 0.03)
    assert res["projection_ms_per_step"] == {"tracked": 3.0, "logging": 3.0}
    assert res["n_projections_in_loop"] == {"tracked": 1, "logging": 1}


def test_the_bench_times_the_due_covariance_batches():
    """A real, tiny bench run with ``covariance_stride=2``: batches 1, 3, 5, … of the tracked
    arm's tracker accumulate ``A`` and ``S`` (3 warm-up batches, then 6 timed: 5, 7 and 9
    are due), the logging arm none; their time is counted and spread."""
    res = run_overhead_bench(
        layers=1,
        width=32,
        vocab=64,
        batch=2,
        seq=8,
        repeats=6,
        track_extra={"covariance_stride": 2},
        progress=False,
    )
    assert res["n_covariance_batches_in_loop"] == {"tracked": 3, "logging": 0}
    assert res["covariance_batch_ms_per_step"]["tracked"] > 0
    assert res["covariance_batch_ms_per_step"]["logging"] == 0
    assert res["config"]["covariance_stride"] == 2


def test_the_bench_times_the_deferred_projections():
    """A real, tiny bench run whose buffer holds two steps (4 records, batch 2): the default
    factors are projected before each flush, timed, and spread over the steps."""
    res = run_overhead_bench(
        layers=1, width=32, vocab=64, batch=2, seq=8, repeats=6, buffer_records=4, progress=False
    )
    for arm in ("tracked", "logging"):
        assert res["n_projections_in_loop"][arm] >= 2
        assert res["projection_ms_per_step"][arm] > 0
