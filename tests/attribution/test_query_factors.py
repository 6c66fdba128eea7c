"""A query's per-token factors: they rebuild its sketches, and scoring from them (the pulled-back
factors, the index vector, the query's norms) gives the dense path's ranking and scores."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_same_ranking, facts_data, fast_settings

from traceprop_engine.attribution.precondition.layer import LayerPreconditioner
from traceprop_engine.attribution.query import open_run
from traceprop_engine.attribution.query_sketches import QuerySketches, factors_of
from traceprop_engine.attribution.score.factor_scores import LowRankTest
from traceprop_engine.settings import IndexSettings, PreconditionerKind, TrackSettings
from traceprop_engine.training.loop import train

F32_RTOL = 1e-5  # float32 per-token products against the float32 sum the capture made
RANK_RTOL = 2e-4  # float32 index and re-rank, dense against factored query


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = facts_data(tmp_path_factory.mktemp("data"))
    # k = 32 on a width-64 model: a query's few tokens make the factors the cheaper form
    track = TrackSettings(k_in=32, k_out=32)
    d = train(
        fast_settings(data, tmp_path_factory.mktemp("runs") / "r", tiny_width=64, track=track)
    )
    r = open_run(d)
    yield r
    r.close()


def _query(run, i: int = 0) -> QuerySketches:
    ev = run.eval_examples()["example_id"][i]
    enc, _, _ = run.encode(eval_example=int(ev))
    return run.query_sketches(enc)[0]


def test_factors_rebuild_every_layers_sketch_and_keep_only_live_tokens(run):
    ev = run.eval_examples()["example_id"][0]
    enc, _, _ = run.encode(eval_example=int(ev))
    q = run.query_sketches(enc)[0]
    assert isinstance(q, QuerySketches) and factors_of(q) is q.factors
    n_loss = int(enc.loss_mask.sum())
    for info, t, (a, b) in zip(run.store.layers, q, q.factors, strict=True):
        assert a.dtype == b.dtype == np.float32
        assert a.shape[0] == info.k_out and b.shape[0] == info.k_in and a.shape[1] == b.shape[1]
        assert 1 <= a.shape[1] <= len(enc.ids)
        rebuilt = a.astype(np.float64) @ b.astype(np.float64).T
        np.testing.assert_allclose(rebuilt, t[0], rtol=0, atol=F32_RTOL * np.abs(t[0]).max())
    # the LM head's gradient is zero at every token without a loss: one column per loss token
    head = [i for i, info in enumerate(run.store.layers) if info.output_head]
    assert head and q.factors[head[0]][0].shape[1] == n_loss
    # a plain list (or a slice) of the sketches carries no factors: scoring factors T' itself
    assert factors_of(list(q)) is None and factors_of(q[:2]) is None


@pytest.mark.parametrize(
    ("kind", "cosine"), [("identity", True), ("kfac", True), ("kfac", False), ("ekfac", True)]
)
def test_ranking_from_factors_equals_the_dense_path(run, kind, cosine):
    s = IndexSettings(preconditioner=kind, cosine=cosine)
    for i in range(3):
        q = _query(run, i)
        got, _ = run.rank(q, s, top_k=5)
        want, _ = run.rank(list(q), s, top_k=5)
        atol = RANK_RTOL * max(np.abs(np.asarray(want["score"])).max(), 1e-30)
        for kind_ in ("proponent", "opponent"):
            g, w = got.filter(got["kind"] == kind_), want.filter(want["kind"] == kind_)
            assert_same_ranking(g["example_id"], g["score"], w["example_id"], w["score"], atol)


def test_index_vector_and_norms_from_factors_equal_the_dense_ones(run):
    s = IndexSettings(preconditioner="kfac", cosine=True)
    _, _, pre = run.index(s)
    scorer = run.indexes.scorer(s)
    q = _query(run)
    dense = list(q)
    np.testing.assert_allclose(pre.apply(q), pre.apply(dense), rtol=1e-4, atol=1e-6)
    factored = scorer.prepared_lazily(q)
    np.testing.assert_allclose(
        factored.sq_norms(), scorer.prepared_lazily(dense).sq_norms(), rtol=1e-4
    )
    np.testing.assert_allclose(factored.sq_norms().sum(), scorer.query_sq_norm(dense)[0], rtol=1e-4)
    # a layer's entry is the pulled-back factors, and they rebuild the dense pullback, wherever
    # the factors are the smaller form (more tokens than that: T' factored as before)
    n_factored = 0
    for li, info in enumerate(run.store.layers):
        entry = factored[li]
        if q.factors[li][0].shape[1] * (info.k_out + info.k_in) >= info.k_out * info.k_in:
            assert (
                not isinstance(entry, LowRankTest) or entry.a.shape[1] < q.factors[li][0].shape[1]
            )
            continue
        assert isinstance(entry, LowRankTest)
        n_factored += 1
        t = scorer.pre.layers[li].pullback(dense[li])[0]
        np.testing.assert_allclose(
            entry.a.astype(np.float64) @ entry.b.astype(np.float64).T,
            t,
            rtol=0,
            atol=1e-4 * np.abs(t).max(),
        )
    assert n_factored >= len(q) // 2  # the last block's layers and the head at least


def test_apply_factors_matches_apply_with_an_index_projection():
    rng = np.random.default_rng(0)
    ko, ki, t = 12, 9, 3

    def spd(k):
        m = rng.normal(size=(k, k))
        return np.linalg.inv(np.linalg.cholesky(m @ m.T + k * np.eye(k)))

    lp = LayerPreconditioner("x", PreconditionerKind.KFAC, (ko, ki), left=spd(ko), right=spd(ki).T)
    lp = lp.with_index_projection(4, seed=1)
    assert lp.index_left is not None
    a, b = rng.normal(size=(ko, t)), rng.normal(size=(ki, t))
    want = lp.apply((a @ b.T)[None], dtype=np.float64)
    np.testing.assert_allclose(lp.apply_factors(a, b, np.float64), want, rtol=1e-10)
    with pytest.raises(Exception, match="fitted for"):
        lp.apply_factors(a[:5], b)
