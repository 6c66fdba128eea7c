"""Compact (rank-c factored) storage and the scores from its factors against naive references."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from helpers import SYNTHETIC_SHAPES, facts_data, fast_settings, write_synthetic_store

from traceprop_engine import constants as C
from traceprop_engine.attribution.precondition.layer import EkfacMoments, LayerStats
from traceprop_engine.attribution.precondition.preconditioner import Preconditioner
from traceprop_engine.attribution.score.factor_scores import factor_scores, sketch_scores
from traceprop_engine.errors import ConfigError, IndexStaleError, StoreError
from traceprop_engine.store.compact import compact_store, factorize_chunk
from traceprop_engine.store.factor_file import FactorStore
from traceprop_engine.store.reader import Store

RTOL_F64 = 1e-9  # float64 arithmetic on float32-stored factors of the same float32 sketches
RTOL_F32 = 2e-4  # float32 products vs float64 reference
ATOL_SVD = 2e-6  # float32 storage of exact SVD factors, relative to the sketch norm
SHAPES = SYNTHETIC_SHAPES


def _fit(store, kind):
    stats = []
    for li, layer in enumerate(store.layers):
        cov = store.covariance(li)
        mom = EkfacMoments.from_factors(cov.A, cov.S)
        mom.update(store.sketches(li))
        stats.append(
            LayerStats(
                layer.name,
                layer.record_shape,
                cov.A,
                cov.S,
                int(cov.n_tokens),
                moments=mom,
            )
        )
    return Preconditioner.fit(kind, stats)


def _naive_scores(store, pre, tests):
    """Σ_records lr · ⟨P T, P Ŝ_r⟩ per example, preconditioning every record explicitly (float64)."""
    rec = store.records()
    ids = np.unique(rec[C.REC_EXAMPLE])
    vec = pre.apply(
        [store.sketches(li) for li in range(len(store.layers))], dtype=np.float64
    )  # (n_rec, D)
    per_ex = np.zeros((len(ids), vec.shape[1]))
    np.add.at(
        per_ex,
        np.searchsorted(ids, rec[C.REC_EXAMPLE]),
        vec * rec[C.REC_LR].astype(np.float64)[:, None],
    )
    return ids, pre.apply(tests, dtype=np.float64) @ per_ex.T  # (q, n_ex)


# -- factorisation -----------------------------------------------------------------------------


def test_factorize_chunk_is_the_truncated_svd():
    x = np.random.default_rng(1).normal(size=(9, 6, 4)).astype(np.float32)
    u, v = factorize_chunk(x, 2)
    assert u.shape == (9, 6, 2) and v.shape == (9, 4, 2) and u.dtype == np.float32
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    rec = u.astype(np.float64) @ np.swapaxes(v, 1, 2)
    # Eckart-Young: the residual's Frobenius norm is the discarded singular values' 2-norm
    np.testing.assert_allclose(
        np.linalg.norm(x - rec, axis=(1, 2)), np.sqrt((s[:, 2:] ** 2).sum(1)), rtol=1e-5
    )
    u_full, v_full = factorize_chunk(x, 99)  # clamped to min(k_out, k_in) = 4: exact
    assert u_full.shape[2] == 4
    np.testing.assert_allclose(
        u_full @ np.swapaxes(v_full, 1, 2), x, atol=ATOL_SVD * np.abs(x).max() * 10
    )
    with pytest.raises(ConfigError, match="positive integer"):
        factorize_chunk(x, 0)
    with pytest.raises(ConfigError, match="dense"):
        factorize_chunk(x.reshape(9, -1), 2)


def test_compact_store_round_trip_and_metadata(synthetic_store, tmp_path):
    with Store(synthetic_store) as store:
        full = compact_store(synthetic_store.parent, 99)  # lossless
        assert full.name == "factors-c99.h5"
        with FactorStore(synthetic_store.parent, rank=99) as fs:
            assert (
                fs.lossless
                and fs.n_records == store.n_records
                and fs.layer_names == [la.name for la in store.layers]
            )
            assert fs.source["source_fingerprint"] == store.fingerprint
            assert (
                fs.source["source_run_id"] == "synthetic-0"
                and fs.source["source_n_records"] == store.n_records
            )
            fs.check_source(store)
            for k, v in store.records().items():
                np.testing.assert_array_equal(fs.records()[k], v)
            for li in range(len(store.layers)):
                x = store.sketches(li)
                np.testing.assert_allclose(fs.reconstruct(li), x, atol=ATOL_SVD * np.abs(x).max())
                np.testing.assert_allclose(
                    fs.reconstruct(li, 5, 17), x[5:17], atol=ATOL_SVD * np.abs(x).max()
                )
                assert fs.layers[li].relative_residual == 0.0

        # rank 2, streamed in chunks of 7 records: factors of each record are its own truncated SVD
        path = compact_store(synthetic_store, 2, out=tmp_path / "f2.h5", chunk=7)
        with FactorStore(path) as fs:
            assert not fs.lossless and [la.rank for la in fs.layers] == [2, 2, 2]
            assert fs.nbytes_per_record() == 4 * 2 * sum(ko + ki for ko, ki in SHAPES)
            for li in range(len(store.layers)):
                x = store.sketches(li).astype(np.float64)
                u, s, vt = np.linalg.svd(x, full_matrices=False)
                ref = (u[:, :, :2] * s[:, None, :2]) @ vt[:, :2]
                np.testing.assert_allclose(fs.reconstruct(li), ref, atol=ATOL_SVD * np.abs(x).max())
                fro, nuc = fs.residual_norms(li)
                np.testing.assert_allclose(fro, np.linalg.norm(x - ref, axis=(1, 2)), rtol=1e-4)
                np.testing.assert_allclose(nuc, s[:, 2:].sum(1), rtol=1e-5)
                rel = np.sqrt(((x - ref) ** 2).sum() / (x**2).sum())
                assert fs.layers[li].relative_residual == pytest.approx(rel, rel=1e-4)


def test_factor_file_errors(synthetic_store, tmp_path):
    dense = write_synthetic_store(tmp_path / "dense" / C.STORE_FILE, sketch="dense")
    with pytest.raises(ConfigError, match="dense sketches"):
        compact_store(dense, 2)
    with pytest.raises(StoreError, match="compact_store"):
        FactorStore(tmp_path, rank=3)
    with pytest.raises(StoreError, match="not a Traceprop factor file"):
        FactorStore(synthetic_store)
    with pytest.raises(ConfigError, match="positive integer"):
        compact_store(synthetic_store, 0)
    path = compact_store(synthetic_store, 1, out=tmp_path / "f1.h5")
    with h5py.File(path, "a") as f:
        f.attrs["status"] = C.STATUS_RUNNING
    with pytest.raises(StoreError, match="unfinished"):
        FactorStore(path)
    other = write_synthetic_store(tmp_path / "other" / C.STORE_FILE, seed=1)
    f2 = compact_store(synthetic_store, 2, out=tmp_path / "f2.h5")
    with Store(other) as st, FactorStore(f2) as fs, pytest.raises(IndexStaleError, match="rebuild"):
        fs.check_source(st)


# -- queries from factors ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["identity", "kfac", "ekfac"])
def test_lossless_factor_scores_equal_full_sketch_scores(
    synthetic_store, synthetic_queries, tmp_path, kind
):
    path = compact_store(synthetic_store, 99, out=tmp_path / "f.h5", chunk=11)
    with Store(synthetic_store) as store, FactorStore(path) as fs:
        pre = _fit(store, kind)
        ids, ref = _naive_scores(store, pre, synthetic_queries)
        got = factor_scores(synthetic_queries, fs, pre, chunk=13, dtype=np.float64)
        full = sketch_scores(synthetic_queries, store, pre, chunk=13, dtype=np.float64)
        np.testing.assert_array_equal(got.example_ids, ids)
        scale = np.abs(ref).max()
        # float32-stored factors of float32 sketches: agreement to float32 round-off of Ŝ
        np.testing.assert_allclose(got.scores, ref, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(full.scores, ref, rtol=RTOL_F64, atol=RTOL_F64 * scale)
        assert np.abs(got.bound).max() < 1e-5 * scale  # lossless: the bound is round-off only
        f32 = factor_scores(synthetic_queries, fs, pre)  # default float32 products
        np.testing.assert_allclose(f32.scores, ref, rtol=0, atol=RTOL_F32 * scale)
        one = factor_scores(
            [t[0] for t in synthetic_queries], fs, pre, dtype=np.float64
        )  # a single (k_out, k_in) query
        np.testing.assert_allclose(one.scores[0], got.scores[0], rtol=1e-12, atol=1e-12 * scale)
        # low-rank queries (a test gradient has rank ≤ its target tokens): the O((k_out+k_in)c t) route
        rng = np.random.default_rng(11)
        low = [
            np.einsum("qkt,qlt->qkl", rng.normal(size=(3, ko, 2)), rng.normal(size=(3, ki, 2)))
            for ko, ki in SHAPES
        ]
        _, ref_low = _naive_scores(store, pre, low)
        got_low = factor_scores(low, fs, pre, chunk=13, dtype=np.float64)
        np.testing.assert_allclose(
            got_low.scores, ref_low, rtol=0, atol=1e-6 * np.abs(ref_low).max()
        )


def test_truncated_factor_scores_stay_within_the_stored_bound(
    synthetic_store, synthetic_queries, tmp_path
):
    with Store(synthetic_store) as store:
        pre = _fit(store, "kfac")
        full = sketch_scores(synthetic_queries, store, pre, dtype=np.float64).scores
        prev_bound = None
        for c in (1, 2, 3):
            with FactorStore(compact_store(synthetic_store, c, out=tmp_path / f"f{c}.h5")) as fs:
                got = factor_scores(synthetic_queries, fs, pre, dtype=np.float64)
            err = np.abs(got.scores - full)
            assert err.max() > 1e-6 * np.abs(full).max()  # truncation really changes the scores
            assert np.all(err <= got.bound * (1 + 1e-6) + 1e-9 * np.abs(full).max())
            if prev_bound is not None:  # the discarded tail shrinks as c grows
                assert np.all(got.bound <= prev_bound * (1 + 1e-6))
            prev_bound = got.bound


def test_factor_scores_reject_mismatched_inputs(synthetic_store, synthetic_queries, tmp_path):
    path = compact_store(synthetic_store, 2, out=tmp_path / "f.h5")
    with Store(synthetic_store) as store, FactorStore(path) as fs:
        pre = _fit(store, "kfac")
        with pytest.raises(ConfigError, match="for 2 layers, the store has 3"):
            factor_scores(synthetic_queries[:2], fs, pre)
        with pytest.raises(StoreError, match="blk.0"):
            factor_scores([np.zeros((2, 2))] + synthetic_queries[1:], fs, pre)
        with pytest.raises(ConfigError, match="no layer"):
            factor_scores(synthetic_queries, fs, pre.layers[:2])


# -- end to end on a trained run ------------------------------------------------------------------


def test_factor_scores_match_the_run_index_on_a_trained_run(tmp_path):
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.settings import IndexSettings
    from traceprop_engine.training.loop import train

    data = facts_data(tmp_path / "data")
    run_dir = train(fast_settings(data, tmp_path / "r", epochs=2))
    run = open_run(run_dir)
    try:
        # factor_scores sums every record, lr-weighted: the index of all records
        s = IndexSettings(preconditioner="kfac", cosine=False, records="all")
        _, ids, pre = run.index(s)
        enc, _, _ = run.encode(eval_example=int(run.eval_examples()["example_id"][0]))
        sk, _ = run.query_sketches(enc)
        want = run.all_scores(pre.apply(sk), s)  # the FAISS-side vectors (query.py)
        with FactorStore(compact_store(run.store, 99)) as fs:
            fs.check_source(run.store)
            got = factor_scores(sk, fs, pre)
        np.testing.assert_array_equal(got.example_ids, ids)
        np.testing.assert_allclose(got.scores[0], want, rtol=0, atol=RTOL_F32 * np.abs(want).max())
    finally:
        run.close()
