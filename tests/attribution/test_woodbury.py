"""The Woodbury (low-rank) preconditioner against a dense reference: the truncated SVD, the
damped inverse square root, and its use in :func:`factor_scores` on a compact store."""

from __future__ import annotations

import numpy as np
import pytest

from traceprop_engine import constants as C
from traceprop_engine.attribution.precondition.woodbury import fit_woodbury, truncated_svd
from traceprop_engine.attribution.score.factor_scores import factor_scores
from traceprop_engine.errors import ConfigError
from traceprop_engine.store.compact import compact_store
from traceprop_engine.store.factor_file import FactorStore
from traceprop_engine.store.reader import Store


def _explicit_inv_sqrt(g, rank, damping):
    """Dense reference: eigen-decompose (1/n) GᵀG, keep the top ``rank`` eigenvalues, add λ I."""
    n, d = g.shape
    h = g.T @ g / n
    e, q = np.linalg.eigh(h)
    lam = damping * np.trace(h) / d
    e = np.where(np.arange(d) >= d - rank, np.clip(e, 0, None), 0.0)  # eigh is ascending
    return (q / np.sqrt(e + lam)) @ q.T, lam


def test_woodbury_equals_explicit_dense_inverse_sqrt():
    rng = np.random.default_rng(3)
    g = rng.normal(size=(60, 12)) * np.linspace(0.1, 3, 12)  # anisotropic, D = 12
    x = rng.normal(size=(5, 3, 4))
    for rank in (12, 5, 1):  # full rank: the exact damped inverse; truncated: its rank-r version
        wp = fit_woodbury(g, rank, 0.1, shape=(3, 4))
        ref, lam = _explicit_inv_sqrt(g, rank, 0.1)
        assert wp.lam == pytest.approx(lam, rel=1e-12) and wp.basis.shape == (12, rank)
        np.testing.assert_allclose(
            wp.dense_inverse_sqrt(), ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max()
        )
        np.testing.assert_allclose(
            wp.apply(x, dtype=np.float64), x.reshape(5, -1) @ ref, rtol=1e-9, atol=1e-12
        )
        np.testing.assert_allclose(
            wp.pullback(x).reshape(5, -1), x.reshape(5, -1) @ ref @ ref, rtol=1e-8, atol=1e-12
        )
    full = fit_woodbury(g, 12, 0.1)
    assert full.info["trace_captured"] == pytest.approx(1.0, rel=1e-12) and full.shape == (12,)


def test_randomized_svd_recovers_the_top_subspace():
    rng = np.random.default_rng(4)
    # rank-6 signal + small noise in D = 200 with n = 300: the randomized path (6 + 10 < 200)
    g = rng.normal(size=(300, 6)) @ (rng.normal(size=(6, 200)) * 5) + 0.01 * rng.normal(
        size=(300, 200)
    )
    s, v = truncated_svd(g, 6)
    s_ref = np.linalg.svd(g, compute_uv=False)[:6]
    np.testing.assert_allclose(s, s_ref, rtol=1e-6)
    _, _, vt = np.linalg.svd(g, full_matrices=False)
    # same subspace: the projector onto span(v) equals the exact one
    np.testing.assert_allclose(v @ v.T, vt[:6].T @ vt[:6], atol=1e-6)
    wp = fit_woodbury(g, 6, 0.1)
    assert wp.info["trace_captured"] > 0.99
    with pytest.raises(ConfigError, match="positive integer"):
        fit_woodbury(g, 0)
    with pytest.raises(ConfigError, match="damping"):
        fit_woodbury(np.zeros((4, 3)), 2)


def test_woodbury_preconditioner_in_factor_scores(synthetic_store, synthetic_queries, tmp_path):
    path = compact_store(synthetic_store, 99, out=tmp_path / "f.h5")
    with Store(synthetic_store) as store, FactorStore(path) as fs:
        wps = [
            fit_woodbury(store.sketches(li), 4, 0.1, name=la.name)
            for li, la in enumerate(store.layers)
        ]
        got = factor_scores(synthetic_queries, fs, wps, dtype=np.float64).scores
        # reference: explicit H^{-1/2} on both sides, per record, lr-weighted per example
        rec = store.records()
        ids = np.unique(rec[C.REC_EXAMPLE])
        ref = np.zeros((3, len(ids)))
        for li, wp in enumerate(wps):
            m = wp.dense_inverse_sqrt()
            x = store.sketches(li).astype(np.float64).reshape(store.n_records, -1) @ m
            t = synthetic_queries[li].reshape(3, -1) @ m
            r = t @ x.T * rec[C.REC_LR].astype(np.float64)
            for qi in range(3):
                ref[qi] += np.bincount(
                    np.searchsorted(ids, rec[C.REC_EXAMPLE]), weights=r[qi], minlength=len(ids)
                )
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
