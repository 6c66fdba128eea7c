"""The statistics fitted from a large store's records come from a bounded, evenly spread sample
(``precondition.layer.fit_sample``): every record below the budget, as before; above it, the
EK-FAC eigenvalues and K-FAC's calibration are exactly those of the sampled blocks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import write_factor_store
from traceprop_engine.attribution.precondition import layer as layer_module
from traceprop_engine.attribution.precondition import vectors
from traceprop_engine.attribution.precondition.kfac import fit_layer
from traceprop_engine.attribution.precondition.layer import (
    FIT_BLOCKS,
    EkfacMoments,
    fit_sample,
)
from traceprop_engine.settings import IndexSettings, PreconditionerKind


def _rows(blocks):
    return np.concatenate([np.arange(a, b) for a, b in blocks])


@pytest.mark.parametrize("rank", [1, 2, 16])
def test_every_record_below_the_budget_in_order(rank):
    n = layer_module.FIT_COLUMNS // rank
    blocks = fit_sample(n, rank, 4096)
    np.testing.assert_array_equal(_rows(blocks), np.arange(n))
    assert all(b - a <= 4096 for a, b in blocks)


@pytest.mark.parametrize("rank", [1, 16])
def test_evenly_spread_blocks_above_the_budget(rank):
    n = 10**6
    budget = layer_module.FIT_COLUMNS // rank
    blocks = fit_sample(n, rank, 8192)
    rows = _rows(blocks)
    assert len(blocks) >= FIT_BLOCKS
    assert len(np.unique(rows)) == len(rows)  # no record twice
    assert 0.9 * budget <= len(rows) <= budget
    assert rows.min() == 0 and rows.max() == n - 1  # from the first step to the last
    gaps = np.diff([a for a, _ in blocks])
    assert gaps.max() - gaps.min() <= 1  # evenly spaced
    assert blocks == fit_sample(n, rank, 8192)  # a rebuild fits the same records


def test_a_large_store_fits_its_moments_from_the_sample(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    shapes, n, rank = [(6, 5)], 640, 2
    arrays = [rng.normal(size=(n, 11, rank)).astype(np.float32)]
    store = write_factor_store(
        tmp_path / "store.h5", shapes, arrays, np.arange(n) % 160, rng, "sample", rank=rank,
        dtype="float32",
    )  # fmt: skip
    monkeypatch.setattr(layer_module, "FIT_COLUMNS", 200)  # 100 rank-2 records of 640
    blocks = fit_sample(n, rank, vectors.CHUNK)
    assert len(_rows(blocks)) < n
    seen = []
    real = EkfacMoments.update_factors

    def spy(self, u, v):
        seen.append(len(u))
        return real(self, u, v)

    monkeypatch.setattr(EkfacMoments, "update_factors", spy)
    s = IndexSettings(preconditioner=PreconditionerKind.EKFAC, index_side=0, index_dims=0)
    pre = vectors.fit_preconditioner(store, s)
    assert sum(seen) == len(_rows(blocks))

    # EK-FAC fitted by hand from exactly the sampled records, and from every record
    cov = store.covariance(0)
    u, v = store.factors(0, 0, n)
    rows = _rows(blocks)
    fits = []
    for r in (rows, np.arange(n)):
        m = EkfacMoments.from_factors(cov.A / cov.n_tokens, cov.S / cov.n_tokens)
        real(m, u[r], v[r])
        fits.append(fit_layer("ekfac", cov.A, cov.S, cov.n_tokens, sketch_moments=m).scale)
    got = pre.layers[0].scale
    np.testing.assert_allclose(got, fits[0], rtol=1e-6)
    assert not np.allclose(got, fits[1], rtol=1e-3)  # the sample is what counts
    store.close()
