"""The re-rank's record cache, exact Gram norms, factor-path vectors and the fitted index
projection, against brute force from full sketches; the end-to-end query bench's exactness."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import reference_record_weights, store_only_run, write_factor_store

from traceprop_engine import constants as C
from traceprop_engine.attribution.index.projection import (
    principal_basis,
    side_moments,
    split_sides,
)
from traceprop_engine.attribution.index.run_indexes import PRECOND_FILE, RunIndexes
from traceprop_engine.attribution.precondition import layer as layer_module
from traceprop_engine.attribution.precondition.preconditioner import Preconditioner
from traceprop_engine.attribution.precondition.vectors import _vectors
from traceprop_engine.attribution.score import record_cache
from traceprop_engine.attribution.score.record_cache import RecordCache
from traceprop_engine.settings import IndexSettings
from traceprop_engine.store.reader import Store

SHAPES = [(20, 12), (12, 20), (16, 16)]  # (k_out, k_in): every layer gets an 8 x 8 projection
N_EX, EPOCHS = 150, 3
F32_SCORE_ATOL = 1e-6  # two exact routes over float32-rounded factors, relative to the top score
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache_small_stores(monkeypatch):
    """These stores are small; the cache is written from record_cache.MIN_RECORDS on, and the
    build's stack products split into parts from precondition.layer._PART_MIN on."""
    monkeypatch.setattr(record_cache, "MIN_RECORDS", 0)
    monkeypatch.setattr(layer_module, "_PART_MIN", 8)


def _store(path: Path, dtype: str = "int8", rank: int = 1, epochs: int = EPOCHS) -> Store:
    rng = np.random.default_rng(1)
    ex = np.concatenate([rng.permutation(N_EX) for _ in range(epochs)])
    n = len(ex)
    base = [(rng.normal(size=(5, ko, rank)), rng.normal(size=(5, ki, rank))) for ko, ki in SHAPES]
    arrays = []
    for (bu, bv), (ko, ki) in zip(base, SHAPES, strict=True):  # clustered, like real gradients
        c = rng.integers(0, 5, n)
        u = bu[c] + 0.3 * rng.normal(size=(n, ko, rank))
        v = bv[c] + 0.3 * rng.normal(size=(n, ki, rank))
        arrays.append(np.concatenate([u, v], axis=1).astype(np.float32))
    return write_factor_store(path, SHAPES, arrays, ex, rng, "cache-test", rank, dtype)


def _layer_vectors(store, pre, ids) -> list[np.ndarray]:
    """Per layer the (n, dim) exact per-example vectors ``L (Σ_r w_r X_r) R`` from full
    sketches, in float64 (``w_r``: the default records' weights)."""
    rec = store.records()
    row = np.searchsorted(ids, rec[C.REC_EXAMPLE])
    parts = []
    for li, lp in enumerate(pre.layers):
        u, v = (f.astype(np.float64) for f in store.factors(li))
        x = u @ v.transpose(0, 2, 1)  # the full sketches, in float64
        if lp.left is not None:
            x = lp.left @ x @ lp.right
        acc = np.zeros((len(ids), x[0].size))
        np.add.at(acc, row, x.reshape(len(x), -1) * reference_record_weights(rec)[:, None])
        parts.append(acc)
    return parts


def _brute(store, pre, ids, tests):
    """Exact per-example vectors from full sketches (float64, no index projection), their
    squared norms and the cosine scores of ``tests``."""
    vec = np.concatenate(_layer_vectors(store, pre, ids), axis=1)
    tv = []
    for lp, t in zip(pre.layers, tests, strict=True):
        t = t.astype(np.float64)
        if lp.left is not None:
            t = lp.left @ t @ lp.right
        tv.append(t.reshape(len(t), -1))
    tv = np.concatenate(tv, axis=1)
    sq = (vec**2).sum(1)
    cos = (tv @ vec.T) / np.linalg.norm(tv, axis=1)[:, None] / np.sqrt(sq)
    return sq, cos


@pytest.mark.parametrize(
    ("kind", "dtype", "rank", "epochs"),
    [
        ("identity", "int8", 1, EPOCHS),
        ("kfac", "int8", 1, EPOCHS),
        ("kfac", "float32", 1, 1),
        ("kfac", "float32", 2, EPOCHS),
        ("kfac", "int8", 5, 1),
    ],
)
def test_cached_rerank_and_gram_norms_equal_brute_force(tmp_path, kind, dtype, rank, epochs):
    """Three records a row (pairs of records), and one a row (each record's Gram with itself:
    at rank 5 the free-text runs' case); K-FAC at rank 1 takes 2-D GEMMs, above it stacks."""
    store = _store(tmp_path / "store.h5", dtype, rank, epochs)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(preconditioner=kind)
    ix.build(s)
    _, ids, pre = ix.get(s)
    scorer = ix.scorer(s)
    assert isinstance(scorer.cache, RecordCache)
    # the cache holds exactly what the store holds
    recs = np.array([3, 40, 41, 100, len(ids) * epochs - 1])
    for li in range(len(SHAPES)):
        for got, want in zip(
            scorer.cache.factors_at(li, recs), store.factors_at(li, recs), strict=True
        ):
            np.testing.assert_array_equal(got, want)
    rng = np.random.default_rng(5)
    tests = [rng.normal(size=(3, ko, ki)) for ko, ki in SHAPES]
    sq, cos = _brute(store, pre, ids, tests)
    np.testing.assert_allclose(ix.row_sq_norms(s), sq, rtol=1e-9)  # exact, from the factors
    rows = rng.permutation(len(ids))[:40]  # scattered rows, unsorted: the re-rank's reads

    run = store_only_run(ix)
    got = run.exact_scores(tests, s, rows=rows)
    np.testing.assert_allclose(got, cos[:, rows], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(run.exact_scores(tests, s), cos, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rank", [1, 3])
def test_side_moments_are_those_of_the_rebuilt_unit_records(rank):
    """The index projection's ``Σ X̂ X̂ᵀ`` and ``Σ X̂ᵀ X̂`` from the factors (Grams, one GEMM
    over the stack) equal those of the records ``X = U Vᵀ`` rebuilt and normalised."""
    rng = np.random.default_rng(2)
    u, v = rng.normal(size=(40, 9, rank)), rng.normal(size=(40, 6, rank))
    x = u @ v.transpose(0, 2, 1)
    x /= np.linalg.norm(x, axis=(1, 2), keepdims=True)
    ml, mr = side_moments(u, v)
    np.testing.assert_allclose(ml, np.einsum("nab,ncb->ac", x, x), rtol=1e-10)
    np.testing.assert_allclose(mr, np.einsum("nba,nbc->ac", x, x), rtol=1e-10)


def test_factor_path_vectors_and_fitted_projection(tmp_path):
    store = _store(tmp_path / "store.h5")
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(index_side=4, index_dims=24)  # 3 layers x 16 = 48 dims < 150 rows -> 24
    ix.build(s)
    _, _, pre = ix.get(s)
    for lp in pre.layers:  # principal directions: orthonormal rows
        for p in (lp.index_left, lp.index_right):
            assert p.shape[0] == 4
            np.testing.assert_allclose(p @ p.T, np.eye(4), atol=1e-9)
    assert pre.full_dim == 48 and pre.dim == 24 and pre.reduce.shape == (48, 24)
    np.testing.assert_allclose(pre.reduce.T @ pre.reduce, np.eye(24), atol=1e-5)
    assert ix.vectors(s).shape == (N_EX, 24)
    # the reduction survives the round trip through the index folder
    np.testing.assert_array_equal(Preconditioner.load(ix.dir(s) / PRECOND_FILE).reduce, pre.reduce)
    # the training side (through the factors) and the query side (sketches) agree
    sk = [store.sketches(li, 0, 100) for li in range(len(SHAPES))]
    np.testing.assert_allclose(
        _vectors(store, pre, 0, 100), pre.apply(sk, dtype=np.float64), rtol=1e-4, atol=1e-6
    )
    # the reduction keeps the records' principal subspace: no 24 directions keep more energy
    full = Preconditioner(pre.kind, pre.layers, pre.damping)
    x = _vectors(store, full, 0, store.n_records).astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    best = np.linalg.eigvalsh(x.T @ x)[::-1][:24].sum()
    kept = (np.linalg.norm(x @ pre.reduce, axis=1) ** 2).sum()
    assert kept >= 0.99 * best, (kept, best)
    # fewer rows (150) than dimensions (3 x 64): no reduction, the vectors stay as they are
    wide = IndexSettings(index_side=8, index_dims=48)
    ix.build(wide)
    assert ix.get(wide)[2].reduce is None and ix.vectors(wide).shape == (N_EX, 192)


@pytest.mark.slow
def test_principal_basis_is_the_top_subspace_and_keeps_small_sets_exactly():
    rng = np.random.default_rng(3)
    # low rank plus noise, wide enough for the randomized route (f > 2 (d + oversampling))
    x = (
        rng.normal(size=(3000, 20)) * np.linspace(3, 1, 20)  # decaying spectrum
    ) @ rng.normal(size=(20, 400))
    x = (x + 0.3 * rng.normal(size=x.shape)).astype(np.float32)
    b = principal_basis(x, 32)
    assert b.shape == (400, 32)
    np.testing.assert_allclose(b.T @ b, np.eye(32), atol=1e-4)
    w = np.linalg.eigvalsh(x.T.astype(np.float64) @ x)[::-1]
    kept = (np.linalg.norm(x.astype(np.float64) @ b, axis=1) ** 2).sum()
    assert kept >= 0.995 * w[:32].sum()
    few = x[:10]  # at most d rows: their span, so inner products with them are exact
    bf = principal_basis(few, 32)
    assert bf.shape == (400, 10)
    q = rng.normal(size=(5, 400)).astype(np.float32)
    np.testing.assert_allclose((q @ bf) @ (few @ bf).T, q @ few.T, rtol=1e-4, atol=1e-3)


def test_old_index_without_cache_reads_the_store(tmp_path):
    store = _store(tmp_path / "store.h5")
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings()
    ix.build(s)
    d = ix.dir(s)
    assert RecordCache.open(d, store) is not None
    (d / "records-000.npy").unlink()
    assert RecordCache.open(d, store) is None


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "sample_runs/facts/store.h5").exists(), reason="no sample run")
def test_end_to_end_bench_returns_exact_scores(tmp_path):
    from traceprop_engine.bench.query_e2e import measure, real_queries, write_synthetic_run

    d = write_synthetic_run(ROOT / "sample_runs/facts", tmp_path / "run", 2000, noise=0.5)
    store = Store(d / C.STORE_FILE)
    assert store.n_records == 2000 and store.layers[0].factor_dtype == "int8"
    store.close()
    row = measure(d, real_queries(ROOT / "sample_runs/facts", 6))
    assert row["n"] == 2000 and row["n_queries"] == 6
    # every returned score is the brute-force one, to the float32 precision of the query's
    # sketch (both sides score a float32 query through its factors in float32; cosines ≤ 1)
    assert row["max_abs_score_error"] < 1e-6
    assert 0.5 <= row["recall_at_10"] <= 1.0


@pytest.mark.parametrize("kind", ["identity", "kfac"])
def test_low_rank_float32_queries_take_the_factored_route_and_match_brute_force(
    tmp_path, kind, monkeypatch
):
    """A query's sketch is float32 and has rank ≤ its tokens: the re-rank scores it through its
    truncated SVD (O((k_out + k_in)·t) per record). Only singular values at float32 rounding are
    dropped, so the scores match the float64 brute force to float32 precision."""
    from traceprop_engine.attribution.score import factor_scores

    store = _store(tmp_path / "store.h5", "int8", 1)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(preconditioner=kind)
    ix.build(s)
    _, ids, pre = ix.get(s)
    rng = np.random.default_rng(7)
    tests = [  # rank 3, rounded to float32 (full rank at the 1e-7 level)
        np.einsum("qot,qit->qoi", rng.normal(size=(2, ko, 3)), rng.normal(size=(2, ki, 3))).astype(
            np.float32
        )
        for ko, ki in SHAPES
    ]
    calls = []
    maybe = factor_scores.LowRankTest.maybe.__func__

    def spy(cls, t, dtype, rtol=factor_scores.LOWRANK_RTOL, ranged=True):
        out = maybe(cls, t, dtype, rtol, ranged)
        calls.append(None if out is None else out.a.shape[1])
        return out

    monkeypatch.setattr(factor_scores.LowRankTest, "maybe", classmethod(spy))
    run = store_only_run(ix)
    rows = rng.permutation(len(ids))[:40]
    got = run.exact_scores(tests, s, rows=rows)
    assert calls == [6] * len(SHAPES)  # 2 queries x rank 3 per layer: the factored route
    _, cos = _brute(store, pre, ids, tests)
    np.testing.assert_allclose(got, cos[:, rows], rtol=1e-5, atol=1e-6 * np.abs(cos).max())


def test_small_stores_get_no_record_cache_and_the_same_scores(tmp_path, monkeypatch):
    store = _store(tmp_path / "store.h5")
    s = IndexSettings()
    ix = RunIndexes(tmp_path, store)
    ix.build(s)
    cached = ix.scorer(s)
    rng = np.random.default_rng(2)
    tests = [rng.normal(size=(2, ko, ki)) for ko, ki in SHAPES]
    rows = rng.permutation(N_EX)[:30]
    want = cached.scores(tests, rows=rows)
    monkeypatch.setattr(record_cache, "MIN_RECORDS", store.n_records + 1)
    small = RunIndexes(tmp_path / "small", store)
    small.build(s)
    assert not list(small.dir(s).glob("records-*.npy")) and small.scorer(s).cache is None
    np.testing.assert_allclose(small.scorer(s).scores(tests, rows=rows), want, rtol=1e-12)


def test_a_store_of_few_but_large_records_gets_a_record_cache(tmp_path, monkeypatch):
    """Below ``MIN_RECORDS`` a store still gets a cache once its records hold ``MIN_BYTES``
    (rank-16 records of a free-text run), and a column view counts its base store's bytes: its
    reads decompress the base's whole chunks."""
    from traceprop_engine.store.column_view import ColumnView

    store = _store(tmp_path / "store.h5", "int8", rank=4)
    monkeypatch.setattr(record_cache, "MIN_RECORDS", store.n_records + 1)
    row = sum(4 * (ko + ki) + 4 for ko, ki in SHAPES)  # int8 U, V at rank 4 and one scale
    view = ColumnView(store, 1)
    for limit, want in ((store.n_records * row, True), (store.n_records * row + 1, False)):
        monkeypatch.setattr(record_cache, "MIN_BYTES", limit)
        assert record_cache.wanted(store) is want and record_cache.wanted(view) is want
    monkeypatch.setattr(record_cache, "MIN_BYTES", store.n_records * row)
    s = IndexSettings()
    ix = RunIndexes(tmp_path, store)
    ix.build(s)
    assert ix.scorer(s).cache is not None


def test_split_sides_gives_the_flat_side_more_directions():
    flat = np.ones(64)  # energy spread evenly over 64 directions
    peaked = np.r_[np.full(4, 100.0), np.full(60, 0.01)]  # nearly all energy in 4 directions
    assert split_sides(flat, flat, 16) == (16, 16)  # alike sides: the balanced split (tie rule)
    assert split_sides(flat, peaked, 16) == (64, 4)  # 16² numbers, 1.00 x 0.9999 of the energy
    assert split_sides(peaked, flat, 16) == (4, 64)
    # capped by the sides' widths, and a side without energy keeps the balanced split
    assert split_sides(np.ones(6), peaked, 8) == (6, 8)
    assert split_sides(np.zeros(8), flat, 4) == (4, 4)
    for m in range(1, 20):  # never more than m² numbers, whatever m and the spectra
        for e_out, e_in in ((flat, peaked), (peaked, flat), (flat, flat)):
            a, b = split_sides(e_out, e_in, m)
            assert min(a, b) >= 1 and a * b <= m * m, (m, a, b)


def test_unequal_index_sides_agree_between_records_and_queries(tmp_path):
    store = _store(tmp_path / "store.h5")
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(index_side=4, index_dims=0)
    ix.build(s)
    _, _, pre = ix.get(s)
    rng = np.random.default_rng(3)
    layers = []
    for lp in pre.layers:  # 8 output x 2 input directions instead of 4 x 4
        lq = np.linalg.qr(rng.standard_normal((lp.index_left.shape[1], 8)))[0].T
        rq = np.linalg.qr(rng.standard_normal((lp.index_right.shape[1], 2)))[0].T
        layers.append(dataclasses.replace(lp, index_left=lq, index_right=rq))
    uneven = Preconditioner(pre.kind, layers, pre.damping)
    assert [lp.dim for lp in uneven.layers] == [16] * len(SHAPES)
    sk = [store.sketches(li, 0, 100) for li in range(len(SHAPES))]
    np.testing.assert_allclose(
        _vectors(store, uneven, 0, 100), uneven.apply(sk, dtype=np.float64), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize(
    ("dtype", "rank"), [(np.float64, 2), (np.float32, 2), (np.float32, 1), (np.float32, 7)]
)
def test_inner_int8_from_bytes_equals_decoding_first(tmp_path, monkeypatch, dtype, rank):
    """The re-rank's int8 route (the factors converted from their bytes, scale on the products;
    rank 1 by one block-diagonal GEMM, higher ranks side by side, a few records at a time) gives
    :meth:`LowRankTest.inner` of the decoded factors: rank-1, 2 and 7 records, a rank-3 and a
    rank-1 query, scattered unsorted records. (Against ``factors_at``, which folds the scale in
    in float32, a float64 query differs at 2e-8 of the largest score: its rounding, not ours.)"""
    from traceprop_engine.attribution.score import factor_scores
    from traceprop_engine.attribution.score.factor_scores import LowRankTest

    # rank > 1 converts blocks of records: a few a block here, the last one ragged
    monkeypatch.setattr(factor_scores, "_INT8_BLOCK", 1000)
    store = _store(tmp_path / "store.h5", "int8", rank=rank)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings()
    ix.build(s)
    cache = ix.scorer(s).cache
    rng = np.random.default_rng(11)
    recs = rng.permutation(store.n_records)[:57]
    for li, (ko, ki) in enumerate(SHAPES):
        t = np.stack([rng.normal(size=(ko, r)) @ rng.normal(size=(r, ki)) for r in (3, 1)]).astype(
            np.float64
        )
        low = LowRankTest.maybe(t, dtype)
        assert low is not None and len(low.owner) == 4
        got = low.inner_int8(*cache.int8_rows(li, recs), ko, 2)
        u8, v8, scale = cache._split(li, recs)  # the stored bytes, decoded in float64 here
        u = u8.astype(np.float64) * scale.astype(np.float64)[:, None, None]
        want = low.inner(u, v8.astype(np.float64), 2)
        assert got.shape == (2, len(recs))
        tol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize(
    ("kind", "dtype", "rank"), [("identity", "int8", 1), ("kfac", "float32", 2)]
)
def test_layer_norms_bound_every_layer_and_sum_to_the_row_norms(tmp_path, kind, dtype, rank):
    ix = RunIndexes(tmp_path, _store(tmp_path / "store.h5", dtype, rank))
    s = IndexSettings(preconditioner=kind)
    _, ids, pre = ix.get(s)  # built here
    got = np.load(ix.dir(s) / "layer_norms.npy")  # as written, read back from the folder
    assert got.dtype == np.float32 and got.shape == (len(ids), len(SHAPES))
    for li, x in enumerate(_layer_vectors(ix.store, pre, ids)):  # brute force, per layer
        want = (x**2).sum(1)
        assert np.all(got[:, li] >= want)  # rounded up: the re-rank's bounds stay bounds
        np.testing.assert_allclose(got[:, li], want, rtol=3e-7)
    np.testing.assert_allclose(got.sum(1), ix.row_sq_norms(s), rtol=1e-6)


def _full_and_bounded(ix, s, tests, top_k, opponents=True):
    """``signed_hits`` of every candidate scored at every layer, and of the bounded re-rank."""
    from traceprop_engine.attribution.score.ranking import signed_hits
    from traceprop_engine.attribution.score.rerank import rerank_candidates

    run = store_only_run(ix)
    cand = np.arange(ix.get(s)[0].n, dtype=np.int64)  # every row a candidate: the hard case
    full = run.exact_scores(tests, s, rows=cand, per_layer=True)[0]
    kept, per = rerank_candidates(ix, s, tests, cand, top_k, opponents)
    return signed_hits(cand, full, top_k, opponents), signed_hits(kept, per, top_k, opponents), kept


@pytest.mark.parametrize(
    ("kind", "cosine", "weights"),
    [
        ("identity", True, (1.0, 1e-2, 1e-2)),  # one layer holds the score: most rows drop
        ("kfac", False, (1e-2, 1.0, 1e-3)),
        ("ekfac", True, (1e-3, 1e-2, 1.0)),  # norms from the accumulated vectors, not Grams
        ("identity", True, (1.0, 1.0, 1.0)),  # balanced: the bounds may keep every row
    ],
)
def test_bounded_rerank_returns_the_full_rerank(tmp_path, kind, cosine, weights):
    store = _store(tmp_path / "store.h5", "int8", 2)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(preconditioner=kind, cosine=cosine)
    ix.build(s)
    rng = np.random.default_rng(11)
    for trial in range(4):
        tests = [
            w * rng.normal(size=(1, ko, ki)) for w, (ko, ki) in zip(weights, SHAPES, strict=True)
        ]
        tests = [t.astype(np.float32) for t in tests] if trial % 2 else tests
        for top_k, opp in [(10, True), (3, False)]:
            (want, wn), (got, gn), kept = _full_and_bounded(ix, s, tests, top_k, opp)
            assert gn == wn
            assert [h[:3] for h in got] == [h[:3] for h in want]  # kind, rank, row
            for g, w in zip(got, want, strict=True):  # scores and per-layer shares, exact
                np.testing.assert_allclose(g[3], w[3], rtol=1e-9)
                np.testing.assert_allclose(g[4], w[4], rtol=1e-9, atol=1e-12)
        if weights[1] < 0.1:
            assert len(kept) < N_EX // 4  # the dominant layer alone placed most rows out


@pytest.mark.parametrize("raw_max", [0, 1 << 40])  # always factored / always the raw T'
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bounded_rerank_of_low_rank_queries_either_way(tmp_path, monkeypatch, raw_max, dtype):
    """Real queries' ``T'`` have rank ≤ their tokens, so every layer is factored
    (:class:`LowRankTest`) unless few rows are left at it, which then take the raw ``T'``
    (``RAW_PRODUCTS_MAX``): both routes give the full re-rank's rows and scores."""
    from traceprop_engine.attribution.score import scoring

    monkeypatch.setattr(scoring, "RAW_PRODUCTS_MAX", raw_max)
    store = _store(tmp_path / "store.h5", "int8", 2)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings()
    ix.build(s)
    rng = np.random.default_rng(5)
    for _ in range(3):
        tests = [
            (w * rng.normal(size=(1, ko, 2)) @ rng.normal(size=(1, 2, ki))).astype(dtype)
            for w, (ko, ki) in zip((1.0, 3e-2, 1e-2), SHAPES, strict=True)
        ]
        prepared = ix.scorer(s).prepared(tests)
        assert all(isinstance(p, scoring.LowRankTest) for p in prepared)  # rank 2: factored
        (want, wn), (got, gn), _ = _full_and_bounded(ix, s, tests, 10)
        assert gn == wn
        assert [h[:3] for h in got] == [h[:3] for h in want]
        # the raw route reads the factors decoded to float32 (scale folded into U), the
        # factored one the int8 bytes: equal to float32 rounding of the record
        scale = max(abs(h[3]) for h in want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g[3], w[3], rtol=0, atol=F32_SCORE_ATOL * scale)
            np.testing.assert_allclose(g[4], w[4], rtol=0, atol=F32_SCORE_ATOL * scale)


def test_bounded_rerank_of_an_all_zero_query_keeps_the_note(tmp_path):
    store = _store(tmp_path / "store.h5", "int8", 1)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings()
    ix.build(s)
    tests = [np.zeros((1, ko, ki)) for ko, ki in SHAPES]
    (want, wn), (got, gn), kept = _full_and_bounded(ix, s, tests, 10)
    assert got == want == [] and gn == wn and len(kept) == N_EX


def test_placeable_never_drops_a_top_row():
    """Against brute force on random scores with ties and zeros, and bounds around them."""
    from traceprop_engine.attribution.score.rerank import _placeable

    rng = np.random.default_rng(2)
    for _ in range(500):
        n, k = int(rng.integers(1, 60)), int(rng.integers(1, 12))
        exact = rng.choice([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0], n) + (
            rng.random(n) < 0.5
        ) * rng.normal(size=n)
        lo = exact - rng.exponential(size=n) * (rng.random(n) < 0.7)
        hi = exact + rng.exponential(size=n) * (rng.random(n) < 0.7)
        opp = bool(rng.random() < 0.5)
        keep = _placeable(lo, hi, k, opp)
        pos = np.argsort(-exact, kind="stable")
        top = [j for j in pos if exact[j] > 0][:k]
        if opp:
            neg = np.argsort(exact, kind="stable")
            top += [j for j in neg if exact[j] < 0][:k]
        assert keep[top].all()
        # a kept row set reproduces the brute-force lists (ties broken in the same order)
        idx = np.flatnonzero(keep)
        sub = exact[idx]
        got = [idx[j] for j in np.argsort(-sub, kind="stable") if sub[j] > 0][:k]
        assert got == [j for j in pos if exact[j] > 0][:k]


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "sample_runs/facts/store.h5").exists(), reason="no sample run")
def test_end_to_end_bench_command_makes_its_work_dir(tmp_path, capsys):
    """``traceprop bench query --end-to-end --work-dir NEW``: the folder is made, the stores
    written there are removed afterwards, and every returned score is the brute-force one."""
    from traceprop_engine.cli.main import main

    work = tmp_path / "not" / "yet"
    out = tmp_path / "e2e.json"
    argv = ["bench", "query", "--end-to-end", "--sizes", "800", "--queries", "4"]
    assert main([*argv, "--work-dir", str(work), "--json", str(out), "--lists", "on"]) == 0
    assert work.is_dir() and not any(work.iterdir())
    row = json.loads(out.read_text())
    row = row[0] if isinstance(row, list) else row
    assert row["n"] == 800 and row["max_abs_score_error"] < 1e-6
    assert row["lists"] and row["index"] == "kfac-cos-lists"  # built on request (the default K-FAC)
    # the default against identity on the same store, one row each, both exact; the whole
    # ranking path is the command's default mode, without --end-to-end
    pre = ["--preconditioners", "kfac,identity", "--lists", "off", "--json", str(out)]
    default_mode = [x for x in argv if x != "--end-to-end"]
    assert main([*default_mode, "--work-dir", str(work), *pre]) == 0
    rows = json.loads(out.read_text())
    assert [r["index"] for r in rows] == ["kfac-cos-nolists", "identity-cos-nolists"]
    assert all(r["max_abs_score_error"] < 1e-6 and r["recall_at_10"] == 1.0 for r in rows)
