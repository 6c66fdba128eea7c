"""FAISS index against brute-force numpy search."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_same_ranking

from traceprop_engine.attribution.index.build import (
    RECALL_MARGIN,
    _calibration_rows,
    build_index,
    calibration_target,
)
from traceprop_engine.attribution.index.nprobe import tune_nprobe
from traceprop_engine.attribution.index.vector_index import (
    INDEX_META_FILE,
    VectorIndex,
    l2_normalize,
)
from traceprop_engine.errors import ConfigError, IndexStaleError, StoreError
from traceprop_engine.settings import IndexKind

SCORE_RTOL = 1e-4  # float32 faiss vs float64 numpy scores
MIN_IVF_RECALL = 0.95  # the default target_recall, on 100 held-out queries per side


def _structured(n: int, dim: int, seed: int = 0, rank: int = 12) -> np.ndarray:
    """Low-rank + noise, like preconditioned sketches (a few dominant directions)."""
    rng = np.random.default_rng(seed)
    basis = rng.normal(size=(rank, dim))
    coef = rng.normal(size=(n, rank)) * (2.0 ** -np.arange(rank) * 4)
    return (coef @ basis + 0.3 * rng.normal(size=(n, dim))).astype(np.float32)


def _chunked(x: np.ndarray, size: int = 700):
    return lambda: (x[i : i + size] for i in range(0, len(x), size))


def _recall(got: np.ndarray, ref: np.ndarray) -> float:
    """Mean recall@k of the rows of ``got`` against those of ``ref`` (k = the width of ``ref``)."""
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got, ref, strict=True)]))


def _brute(x: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    s = q.astype(np.float64) @ x.astype(np.float64).T
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, ids, 1), ids


def _same_rows(ids, scores, ref_i, ref_s, atol) -> None:
    """Per query, the reference's ranking up to round-off (FAISS's float32 kernels differ by
    CPU: a near tie may come in either order)."""
    for r in range(len(ref_i)):
        assert_same_ranking(ids[r], scores[r], ref_i[r], ref_s[r], atol, f"query {r}")


def test_flat_equals_brute_force_and_opponents():
    x = _structured(3000, 32)
    q = _structured(20, 32, seed=1)
    idx = build_index(_chunked(x), 32, len(x), kind="flat")
    assert idx.kind is IndexKind.FLAT and idx.n == 3000
    scores, ids = idx.search(q, 10)
    ref_s, ref_i = _brute(x, q, 10)
    np.testing.assert_allclose(
        scores, ref_s, rtol=SCORE_RTOL, atol=SCORE_RTOL * np.abs(ref_s).max()
    )
    _same_rows(ids, scores, ref_i, ref_s, SCORE_RTOL * np.abs(ref_s).max())

    both = idx.search_both(q, 5)
    _same_rows(both.proponent_ids, both.proponent_scores, ref_i[:, :5], ref_s[:, :5],
               SCORE_RTOL * np.abs(ref_s).max())  # fmt: skip
    neg_s, neg_i = _brute(-x, q, 5)  # most negative ⟨q, x⟩
    np.testing.assert_allclose(
        both.opponent_scores, -neg_s, rtol=SCORE_RTOL, atol=SCORE_RTOL * np.abs(neg_s).max()
    )
    _same_rows(both.opponent_ids, both.opponent_scores, neg_i, -neg_s,
               SCORE_RTOL * np.abs(neg_s).max())  # fmt: skip
    assert np.all(np.diff(both.opponent_scores, axis=1) >= 0)  # most negative first
    assert np.all(both.opponent_scores < 0)


def test_cosine_normalisation_equals_brute_force_cosine():
    x = _structured(2000, 24, seed=2)
    x[7] = 0.0  # a zero vector must not produce NaNs
    q = _structured(10, 24, seed=3)
    idx = build_index(x, 24, len(x), kind="flat", normalize=True)
    scores, ids = idx.search(q, 10)
    xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    ref_s, ref_i = _brute(xn, qn, 10)
    np.testing.assert_allclose(scores, ref_s, rtol=SCORE_RTOL, atol=SCORE_RTOL)
    _same_rows(ids, scores, ref_i, ref_s, SCORE_RTOL)
    assert np.all(scores <= 1 + 1e-5)
    assert np.isfinite(l2_normalize(x)).all()


def test_ivf_recall_against_exact():
    x = _structured(20_000, 64, seed=4)
    q = _structured(100, 64, seed=5)  # held-out queries from the same generator
    idx = build_index(_chunked(x, 4000), 64, len(x), kind="ivf", nlist=64, seed=0)
    assert idx.nprobe is not None and idx.tuned_recall >= calibration_target(0.95)
    assert idx.nprobe < 64  # the margin is met without probing every list
    _, ref = _brute(x, q, 10)
    _, ref_opp = _brute(x, -q, 10)
    for side, queries, exact in (("proponents", q, ref), ("opponents", -q, ref_opp)):
        _, got = idx.search(queries, 10)
        recall = _recall(got, exact)
        assert recall >= MIN_IVF_RECALL, f"{side}: recall@10 {recall:.3f} at nprobe={idx.nprobe}"
    # probing every list is exact
    idx.set_nprobe(64)
    _, got = idx.search(q, 10)
    np.testing.assert_array_equal(np.sort(got, 1), np.sort(ref, 1))


def test_a_smaller_recall_margin_probes_no_more_lists():
    """``recall_margin`` (less for an index with factor lists) is what the calibration reaches."""
    x = _structured(20_000, 64, seed=4)
    probes = {}
    for margin in (RECALL_MARGIN, 0.0):
        idx = build_index(
            _chunked(x, 4000), 64, len(x), kind="ivf", nlist=64, seed=0, recall_margin=margin
        )
        assert idx.tuned_recall >= calibration_target(0.95, margin)
        probes[margin] = idx.nprobe
    assert probes[0.0] <= probes[RECALL_MARGIN]
    assert calibration_target(0.95, 0.01) == pytest.approx(0.96)


def test_calibration_rows_are_left_out_of_the_kmeans_sample():
    rng = np.random.default_rng(0)
    train = np.sort(rng.choice(30_000, size=10_000, replace=False))
    rows = _calibration_rows(30_000, train, rng)
    assert len(rows) == len(np.unique(rows)) == 200
    assert not np.isin(rows, train).any() and rows.min() >= 0 and rows.max() < 30_000
    # too few rows left out: any distinct rows
    rows = _calibration_rows(10_100, np.arange(10_000), rng)
    assert len(np.unique(rows)) == 200


def test_calibration_target_keeps_a_margin_below_one():
    assert calibration_target(0.95) == pytest.approx(0.95 + RECALL_MARGIN)
    assert calibration_target(0.99) == pytest.approx(0.996)
    assert calibration_target(1.0) == 1.0


def test_tuning_needs_both_groups_to_reach_the_target():
    x = _structured(20_000, 32, seed=1)
    idx = build_index(_chunked(x, 5000), 32, len(x), kind="ivf", nlist=128, nprobe=1, seed=0)
    q = _structured(60, 32, seed=2)
    _, exact = _brute(x, q, 10)
    _, exact_far = _brute(x, -q, 10)
    both = np.concatenate([q, -q])
    groups = np.repeat([0, 1], 60)
    p_all, rec_all = tune_nprobe(idx, both, np.concatenate([exact, exact_far]), 0.97)
    p_min, rec_min = tune_nprobe(idx, both, np.concatenate([exact, exact_far]), 0.97, groups=groups)
    assert p_min >= p_all and rec_min >= 0.97
    for g, (qq, ee) in enumerate(((q, exact), (-q, exact_far))):
        _, got = idx.search(qq, 10)
        r = _recall(got, ee)
        assert r >= 0.97, f"group {g}: {r:.3f} at nprobe {p_min}"


@pytest.mark.slow
def test_ivfpq_reranks_exactly_from_full_vectors():
    x = _structured(4000, 64, seed=6)
    q = _structured(30, 64, seed=7)
    fetched = []

    def fetch(ids):
        assert np.all(np.diff(ids) > 0)
        fetched.append(len(ids))
        return x[ids]

    idx = build_index(x, 64, len(x), kind="ivfpq", nlist=32, pq_m=16, rerank=300, fetch=fetch)
    idx.set_nprobe(32)  # exhaustive over lists: remaining error is PQ's, fixed by re-ranking
    scores, ids = idx.search(q, 10)
    ref_s, ref_i = _brute(x, q, 10)
    recall = _recall(ids, ref_i)
    assert recall >= 0.97
    hit = ids == ref_i
    np.testing.assert_allclose(scores[hit], ref_s[hit], rtol=SCORE_RTOL, atol=SCORE_RTOL * 10)
    assert fetched and max(fetched) == 300


def test_save_load_round_trip_and_stale_fingerprint(tmp_path):
    x = _structured(1500, 16, seed=8)
    q = _structured(5, 16, seed=9)
    for kind in ("flat", "ivf", "hnsw"):
        idx = build_index(x, 16, len(x), kind=kind, nlist=16, normalize=(kind == "ivf"))
        d = tmp_path / kind
        idx.save(d, fingerprint="abc123")
        meta = json.loads((d / INDEX_META_FILE).read_text())
        assert meta["kind"] == kind and meta["n"] == 1500 and meta["dim"] == 16
        back = VectorIndex.load(d, "abc123")
        assert back.normalize == idx.normalize and back.nprobe == idx.nprobe
        s0, i0 = idx.search(q, 7)
        s1, i1 = back.search(q, 7)
        np.testing.assert_array_equal(i0, i1)
        np.testing.assert_array_equal(s0, s1)
        with pytest.raises(IndexStaleError, match="--rebuild"):
            VectorIndex.load(d, "other")


def test_errors_and_small_n():
    x = _structured(5, 8)
    idx = build_index(x, 8, 5)
    s, i = idx.search(x[0], 8)  # k > n pads with -1 / -inf
    assert (i[0, 5:] == -1).all() and np.isneginf(s[0, 5:]).all()
    both = idx.search_both(x[:2], 8)  # both ends, k > n: every row once per end, then padding
    ref = x[:2].astype(np.float64) @ x.astype(np.float64).T
    for r in range(2):
        np.testing.assert_array_equal(both.proponent_ids[r, :5], np.argsort(-ref[r]))
        np.testing.assert_array_equal(both.opponent_ids[r, :5], np.argsort(ref[r]))
    assert (both.proponent_ids[:, 5:] == -1).all() and (both.opponent_ids[:, 5:] == -1).all()
    assert np.isneginf(both.proponent_scores[:, 5:]).all()
    assert np.isposinf(both.opponent_scores[:, 5:]).all()
    with pytest.raises(ConfigError, match="dimension"):
        idx.search(np.zeros((1, 9)), 3)
    with pytest.raises(ConfigError, match="index kind must be one of"):
        build_index(x, 8, 5, kind="lsh")
    with pytest.raises(StoreError, match="announced"):
        build_index(x, 8, 6, kind="flat")
    with pytest.raises(StoreError, match="traceprop index"):
        VectorIndex.load("/nonexistent/dir", "x")


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw", "ivfpq"])
def test_search_among_is_the_top_k_of_the_chosen_rows(kind):
    """``search_among`` (the class prior's label searches): the top k of ± the score over the
    chosen rows only, brute force's up to round-off (IVF probing every list; HNSW and IVF-PQ
    at high recall), and never a row outside them."""
    x = _structured(3000, 32, seed=11)
    q = _structured(6, 32, seed=12)
    among = np.random.default_rng(0).random(len(x)) < 0.3
    rows = np.flatnonzero(among)
    fetch = (lambda ids: x[ids]) if kind == "ivfpq" else None
    idx = build_index(x, 32, len(x), kind=kind, nlist=16, pq_m=8, rerank=600, fetch=fetch, seed=0)
    if kind in ("ivf", "ivfpq"):
        idx.set_nprobe(16)
    for sign in (1.0, -1.0):
        ref_s, ref_i = _brute(x[rows], sign * q, 10)
        scores, ids = idx.search_among(q, 10, among, sign)
        assert among[ids[ids >= 0]].all()
        if kind in ("flat", "ivf"):
            _same_rows(ids, scores, rows[ref_i], ref_s, SCORE_RTOL * np.abs(ref_s).max())
        else:
            assert _recall(ids, rows[ref_i]) >= 0.9
    with pytest.raises(ValueError, match="3000 rows"):
        idx.search_among(q, 10, among[:-1])
