"""The LM-bias term (``IndexSettings.lm_bias``, attribution/score/lm_bias.py): the cosine of the
query's and each example's LM-head output-bias gradient ``σ = Σ_t (p_t − e_{y_t})``, projected and
whitened by the head's K-FAC output factor's diagonal, read from the records' first column; added
by default on free-text runs (benchmarks/EVAL.md §1ab)."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from helpers import FREE_TEXT_WORDS, facts_data, fast_settings, free_text_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import HeadBias, open_run
from traceprop_engine.attribution.overview import LM_BIAS_NOTE
from traceprop_engine.attribution.score import lm_bias
from traceprop_engine.attribution.score.ranking import LM_BIAS_LAYER
from traceprop_engine.cli.main import main as cli_main
from traceprop_engine.errors import ConfigError
from traceprop_engine.index_settings import DEFAULT_LM_BIAS
from traceprop_engine.settings import IndexSettings, TrackSettings
from traceprop_engine.training.loop import train

# the records are taken along the trajectory, the reference on the final model: at a learning
# rate of 1e-7 over two steps the output gradients move by about that much; float32 records
TRAJECTORY_ATOL = 1e-4
F32_ATOL = 1e-5  # float32 records and projections, float64 whitening and cosine
QUERIES = [
    " ".join(FREE_TEXT_WORDS[:9]),
    " ".join(FREE_TEXT_WORDS[4:14]),
    dict(prompt="the model reads every", completion=" token of"),
    dict(prompt="as a target of", completion=" the model"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_bias")
    free_text_data(root / "data")
    out = {}
    for name, ftr, iters, lr in (
        ("text", 4, 0, 3e-2),  # four epochs: the final model is not the first steps
        ("still", 4, 0, 1e-7),  # the final model is the recorded one, to 1e-7
        ("rank1", 0, 0, 3e-3),
        ("power", 4, 1, 3e-3),  # a power-iterated record's first column is not Σ_t g_t
    ):
        track = TrackSettings(
            k_in=4, k_out=8, factor_dtype="float32", free_text_rank=ftr, power_iters=iters
        )
        epochs = 4 if name == "text" else 1
        out[name] = train(
            fast_settings(root / "data", root / name, track=track, lr=lr, epochs=epochs)
        )
    # answers after questions: a loss on a few tokens of each example
    facts = facts_data(root / "facts")
    out["answers"] = train(
        fast_settings(facts, root / "answers", track=TrackSettings(k_in=4, k_out=8))
    )
    return out


def _reference(run, queries, records: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, b)``: the term by hand on the final model: ``σ`` from its logits, projected by the
    store's ``P_out``, whitened by the diagonal of the final model's output factor over every
    trained example (each token's ``(p_t − e_{y_t}) / n`` with ``n`` its example's loss tokens, as
    a per-example mean loss gives it); cosine. With ``records`` the training side's ``P_out σ``
    is read from each example's record's first column instead (one epoch: one record each)."""
    store = run.store
    head = next(i for i in store.layers if i.output_head)
    p = store.projection(head.index, "out").astype(np.float64)
    model = run.model().model.eval()

    def grads(enc) -> np.ndarray:  # (n, V): p_t − e_{y_t} at the example's loss tokens
        ids = np.asarray(enc.ids)
        t = np.flatnonzero(np.asarray(enc.loss_mask).astype(bool))
        t = t[t >= 1]
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0]
        g = torch.softmax(logits.double(), -1).numpy()[t - 1]
        g[np.arange(len(t)), ids[t]] -= 1.0
        return g

    ids = np.asarray(run.index(run.settings())[1])
    train_g = [grads(run.encode(eval_example=int(e))[0]) for e in ids]
    s = sum((((g / len(g)) @ p.T) ** 2).sum(0) for g in train_g)
    s = s + lm_bias.DAMPING * s.mean()

    def unit(x) -> np.ndarray:
        x = x / np.sqrt(s)
        return x / np.linalg.norm(x)

    if records:
        rec = store.records()[C.REC_EXAMPLE]
        u = store.factors(head.index, columns=1)[0][:, :, 0].astype(np.float64)
        last = {int(e): r for r, e in enumerate(rec)}  # each example's last (epoch's) record
        train_x = np.stack([unit(u[last[int(e)]]) for e in ids])
    else:
        train_x = np.stack([unit(p @ g.sum(0)) for g in train_g])
    q = np.stack([unit(p @ grads(run.encode(**_query(q))[0]).sum(0)) for q in queries])
    return ids, q @ train_x.T


def _query(q) -> dict:
    return {"prompt": q} if isinstance(q, str) else q


def test_the_term_is_the_cosine_of_the_whitened_output_bias_gradients(runs):
    run = open_run(runs["still"])
    head = next(i for i in run.store.layers if i.output_head)
    assert head.rank == 4 and head.bias_column
    ids, want = _reference(run, QUERIES)
    one = IndexSettings(lm_bias=1.0)
    for q, row in zip(QUERIES, want, strict=True):
        sk = run.query_sketches(run.encode(**_query(q))[0])[0]
        got = run.lm_bias_scores(sk, one)
        np.testing.assert_allclose(got, row, atol=TRAJECTORY_ATOL)
        # the default adds DEFAULT_LM_BIAS times it to the records' cosine
        diff = run.scores(**_query(q)) - run.scores(**_query(q), settings=IndexSettings(lm_bias=0))
        np.testing.assert_allclose(diff[ids], DEFAULT_LM_BIAS * got, rtol=1e-9, atol=1e-12)
    assert np.ptp(want) > 0.05  # the term tells the examples apart here
    run.close()


def test_a_trained_run_whitens_by_the_final_models_output_factor(runs, monkeypatch):
    """On a run that learned (the trajectory's records are not the final model's), the term is
    the records' first columns whitened by the final model's output factor, which is not the
    inline (trajectory) factor here."""
    run = open_run(runs["text"])
    ids, want = _reference(run, QUERIES, records=True)
    one = IndexSettings(lm_bias=1.0)
    got = [
        run.lm_bias_scores(run.query_sketches(run.encode(**_query(q))[0])[0], one) for q in QUERIES
    ]
    np.testing.assert_allclose(np.stack(got), want, atol=F32_ATOL)
    # whitened by the inline (trajectory) factor instead, another term
    inline = HeadBias(run.store, run.indexes.scorer(run.settings()))
    sk = run.query_sketches(run.encode(**_query(QUERIES[0]))[0])[0]
    assert np.abs(inline.scores(inline.query(sk)) - got[0]).max() > 100 * F32_ATOL
    run.close()
    # the final model's moment is fitted once per run and read back from beside the indexes
    assert (runs["text"] / C.INDEX_DIR / "head-moment.npz").is_file()
    from traceprop_engine.attribution.model_side import statistics

    def no_fit(*a, **k):
        raise AssertionError("fitted again")

    monkeypatch.setattr(statistics, "fit_head_moment", no_fit)
    again = open_run(runs["text"])
    sk = again.query_sketches(again.encode(**_query(QUERIES[0]))[0])[0]
    np.testing.assert_allclose(again.lm_bias_scores(sk, one), got[0], rtol=1e-12)
    again.close()


def test_the_default_adds_it_on_runs_trained_on_text_scored_with_cosine(runs):
    text, rank1, answers = (open_run(runs[k]) for k in ("text", "rank1", "answers"))
    assert text.settings().lm_bias == DEFAULT_LM_BIAS
    assert text.settings(IndexSettings(cosine=False)).lm_bias == 0.0
    assert text.settings(IndexSettings(lm_bias=0.3)).lm_bias == 0.3
    # text recorded at rank 1 (free_text_rank 0, or texts of at most 16 tokens) takes it too
    assert {i.rank for i in rank1.store.layers} == {1}
    assert rank1.settings().lm_bias == DEFAULT_LM_BIAS and LM_BIAS_NOTE in rank1.notes
    # answers after a prompt: none by default (mixed there, EVAL.md §1aa) ...
    assert answers.settings().lm_bias == 0.0 and LM_BIAS_NOTE not in answers.notes
    q = dict(prompt=answers.eval_examples()["prompt"][0], completion=" x")
    np.testing.assert_array_equal(
        answers.scores(**q), answers.scores(**q, settings=IndexSettings(lm_bias=0))
    )
    # ... but asked for, it applies: a rank-1 record's column is Σ_t g_t's direction too
    added = answers.scores(**q, settings=IndexSettings(lm_bias=0.5)) - answers.scores(**q)
    assert np.abs(added).max() > 1e-3
    for run in (text, rank1, answers):
        run.close()


def test_a_query_ranks_with_the_term_and_shows_it_as_a_layer(runs):
    run = open_run(runs["text"])
    for q in QUERIES:
        res = run.query(**_query(q), top_k=3)
        assert res.query["lm_bias"] == DEFAULT_LM_BIAS and res.layer_names[-1] == LM_BIAS_LAYER
        assert LM_BIAS_NOTE in res.notes
        exact = run.scores(**_query(q))
        for kind, sign in (("proponent", 1), ("opponent", -1)):
            rows = res.rows.filter(res.rows["kind"] == kind)
            top = np.argsort(-sign * exact, kind="stable")[:3]
            want = [int(i) for i in top if sign * exact[i] > 0]
            assert rows["example_id"].to_list() == want
            np.testing.assert_allclose(rows["score"].to_numpy(), exact[want], rtol=1e-9)
        term = run.lm_bias_scores(run.query_sketches(run.encode(**_query(q))[0])[0], run.settings())
        ids = np.asarray(run.index(run.settings())[1]).tolist()
        for r in res.rows.iter_rows(named=True):
            shares = (
                json.loads(r["layer_scores"])
                if isinstance(r["layer_scores"], str)
                else r["layer_scores"]
            )
            assert list(shares)[-1] == LM_BIAS_LAYER
            assert shares[LM_BIAS_LAYER] == pytest.approx(
                term[ids.index(r["example_id"])], rel=1e-9
            )
            assert sum(shares.values()) == pytest.approx(r["score"], rel=1e-6)
        # by-example scores follow the weight the result was ranked with
        alone = run.query(**_query(q), top_k=3, settings=IndexSettings(lm_bias=0))
        assert alone.layer_names[-1] != LM_BIAS_LAYER
        table = run.example_scores(alone).sort("example_id")
        np.testing.assert_allclose(
            table["score"].to_numpy(),
            run.scores(**_query(q), settings=IndexSettings(lm_bias=0))[
                table["example_id"].to_numpy()
            ],
            rtol=1e-9,
        )
    run.close()


def test_few_candidates_still_find_the_terms_top_rows(runs, monkeypatch):
    """FAISS proposes three rows a side here (as it proposes a small share of a large index):
    its ends by the records' score miss rows a large weight lifts, and the term's own ends find
    them, so the ranking is brute force's."""
    from traceprop_engine.attribution.query import AttributionRun
    from traceprop_engine.attribution.score import ranking

    monkeypatch.setattr(ranking, "CANDIDATES", 1)
    monkeypatch.setattr(ranking, "MIN_CANDIDATES", 3)
    monkeypatch.setattr(ranking, "CANDIDATE_FRACTION", 10**9)
    s = IndexSettings(lm_bias=20.0)
    run = open_run(runs["text"])
    ids = np.asarray(run.index(s)[1])
    missed = 0
    for q in QUERIES:
        sk = run.query_sketches(run.encode(**_query(q))[0])[0]
        exact = run.exact_scores(sk, s)[0]
        got = {True: run.rank(sk, s, 3, True)[0]}
        with monkeypatch.context() as m:  # FAISS's two ends and nothing else
            m.setattr(AttributionRun, "term_candidates", lambda *a: (None, None))
            got[False] = run.rank(sk, s, 3, True)[0]
        for kind, sign in (("proponent", 1), ("opponent", -1)):
            top = np.argsort(-sign * exact, kind="stable")[:3]
            want = set(ids[top[sign * exact[top] > 0]].tolist())
            for ends, rows in got.items():
                mine = set(rows.filter(rows["kind"] == kind)["example_id"].to_list())
                if ends:
                    assert mine == want, (kind, q)
                else:
                    missed += mine != want
    run.close()
    assert missed > 0  # without the term's ends, the few candidates miss some


def test_records_without_a_signed_first_column_get_no_term(runs, tmp_path):
    # power iteration: the first column is G's top direction, not Σ_t g_t's
    power = open_run(runs["power"])
    assert not any(i.bias_column for i in power.store.layers)
    assert power.settings().lm_bias == 0.0
    q = _query(QUERIES[0])
    sk = power.query_sketches(power.encode(**q)[0])[0]
    assert power.lm_bias_scores(sk, IndexSettings(lm_bias=1.0)) is None
    power.close()
    # a store written before the column was signed (no attribute): none, even when asked for
    old = tmp_path / "old"
    shutil.copytree(runs["text"], old, ignore=shutil.ignore_patterns(C.INDEX_DIR))
    with h5py.File(old / C.STORE_FILE, "r+") as f:
        for g in f[C.G_LAYERS].values():
            g.attrs.pop(C.L_BIAS_COLUMN, None)
    run = open_run(old)
    assert run.settings().lm_bias == 0.0 and LM_BIAS_NOTE not in run.notes
    np.testing.assert_array_equal(
        run.scores(**q, settings=IndexSettings(lm_bias=1.0)),
        run.scores(**q, settings=IndexSettings(lm_bias=0)),
    )
    run.close()


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.2"])
def test_a_bad_lm_bias_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="lm_bias must be"):
        IndexSettings(lm_bias=bad)
    assert IndexSettings(lm_bias=1).lm_bias == 1.0
    # a query-time term: the index (its name and fingerprint) is the same
    assert IndexSettings(lm_bias=0.5).name == IndexSettings().name
    assert IndexSettings(lm_bias=0.5).to_dict() == IndexSettings().to_dict()


def test_the_cli_takes_lm_bias(runs, tmp_path, capsys):
    shares = {}
    for name, flags in (("default", []), ("alone", ["--lm-bias", "0"])):
        out = tmp_path / f"{name}.json"
        argv = ["query", str(runs["text"]), "--prompt", QUERIES[0], "--json", str(out)]
        assert cli_main([*argv, *flags]) == 0
        shares[name] = [json.loads(r["layer_scores"]) for r in json.loads(out.read_text())]
    assert "note: " + LM_BIAS_NOTE in capsys.readouterr().err
    assert all(LM_BIAS_LAYER in x for x in shares["default"])
    assert not any(LM_BIAS_LAYER in x for x in shares["alone"])
