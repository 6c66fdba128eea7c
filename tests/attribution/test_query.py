"""Index scores equal a brute-force computation from the store; query errors are clear."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import assert_same_ranking, facts_data, fast_settings, reference_record_weights

from traceprop_engine import QueryError, RunError
from traceprop_engine.attribution.query import open_run
from traceprop_engine.settings import IndexSettings, TrackSettings
from traceprop_engine.training.loop import StopFlag, train

# float32 vectors vs float64 reference
RTOL = 2e-4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory):
    return train(
        fast_settings(data, tmp_path_factory.mktemp("runs") / "r", epochs=2, tiny_width=64)
    )


def per_example_sketches(store, records: str = "last-epoch"):
    """Σ_records w_r·Ŝ_r per training example, per layer (float64), and the example ids;
    ``w_r``: ``reference_record_weights`` of ``records`` (the default: the last epoch's)."""
    rec = store.records()
    ids = np.unique(rec["example_index"])
    row = {e: i for i, e in enumerate(ids)}
    weight = reference_record_weights(rec, records)
    out = []
    for li in range(len(store.layers)):
        x = store.sketches(li).astype(np.float64)
        acc = np.zeros((len(ids), *x.shape[1:]))
        for r, e in enumerate(rec["example_index"]):
            acc[row[e]] += weight[r] * x[r]
        out.append(acc)
    return ids, out


def inv_damped(m, lam):
    return np.linalg.inv(m + lam * np.eye(len(m)))


def reference_scores(store, test, kind, damping=0.1, records="last-epoch"):
    """Σ_layers ⟨Ŝ_test, H⁻¹ Ŝ_i⟩ with H⁻¹ built explicitly (Kronecker / eigenbasis) per layer;
    the LM head (``output_head``) is left unwhitened by every kind."""
    ids, per_ex = per_example_sketches(store, records)
    total = np.zeros(len(ids))
    n_rec = store.n_records
    for li in range(len(store.layers)):
        t = test[li][0].astype(np.float64)  # (k_out, k_in)
        X = per_ex[li]
        if kind == "identity" or store.layers[li].output_head:
            total += np.einsum("ab,nab->n", t, X)
            continue
        cov = store.covariance(li)
        A, S = cov.A / cov.n_tokens, cov.S / cov.n_tokens
        raw = store.sketches(li).astype(np.float64)
        if kind == "kfac":
            c = (raw**2).sum() / n_rec / (np.trace(S) * np.trace(A))
            S = c * S
            k_out, k_in = t.shape
            H = np.kron(
                S + damping * np.trace(S) / k_out * np.eye(k_out),
                A + damping * np.trace(A) / k_in * np.eye(k_in),
            )
            Hinv = np.linalg.inv(H)  # row-major vec: vec(S_hat)[a*k_in + b]
            # per-layer trace normalisation: the layer keeps identity's mean squared norm
            flat = raw.reshape(len(raw), -1)
            f2 = (flat**2).sum() / np.einsum("na,ab,nb->", flat, Hinv, flat)
            total += f2 * (X.reshape(len(X), -1) @ Hinv @ t.reshape(-1))
        else:  # ekfac
            _, QA = np.linalg.eigh(A)
            _, QS = np.linalg.eigh(S)
            lam = np.mean([(QS.T @ r @ QA) ** 2 for r in raw], axis=0)
            lam_d = lam + damping * lam.mean()
            lam_d = lam_d * (lam / lam_d).sum() / lam.sum()  # the same trace normalisation
            rot_t = QS.T @ t @ QA
            rot_x = np.einsum("ia,nab,bj->nij", QS.T, X, QA)
            total += np.einsum("ab,nab->n", rot_t / lam_d, rot_x)
    return ids, total


@pytest.mark.parametrize("kind", ["identity", "kfac", "ekfac"])
def test_index_scores_equal_brute_force(run_dir, kind):
    run = open_run(run_dir)
    s = IndexSettings(preconditioner=kind, cosine=False)
    ev = run.eval_examples()["example_id"][0]
    res = run.query(eval_example=int(ev), top_k=5, settings=s)
    enc, _, _ = run.encode(eval_example=int(ev))
    test, _ = run.query_sketches(enc)
    ids, ref = reference_scores(run.store, test, kind)
    atol = RTOL * np.abs(ref).max()  # float32 index vs the float64 reference
    order = np.argsort(-ref)[:5]
    got = res.proponents
    assert_same_ranking(got["example_id"], got["score"], ids[order], ref[order], atol)
    opp = res.opponents
    order_neg = np.argsort(ref)[:5]
    assert_same_ranking(opp["example_id"], opp["score"], ids[order_neg], ref[order_neg], atol)
    # per-layer shares add up to the score
    for r in got.iter_rows(named=True):
        assert sum(json.loads(r["layer_scores"]).values()) == pytest.approx(
            r["score"], rel=1e-3, abs=1e-6
        )


@pytest.mark.parametrize("kind", ["identity", "kfac"])
def test_all_records_score_as_their_brute_force(run_dir, kind):
    """``records="all"``: every example is scored by all its records, each weighted by its
    step's learning rate (the whole trajectory), in the exact scores and the ranked answer; on
    this two-epoch run that is not the default's score (the last epoch's records)."""
    run = open_run(run_dir)
    s = IndexSettings(preconditioner=kind, cosine=False, records="all")
    ev = int(run.eval_examples()["example_id"][0])
    enc, _, _ = run.encode(eval_example=ev)
    test, _ = run.query_sketches(enc)
    ids, ref = reference_scores(run.store, test, kind, records="all")
    _, last = reference_scores(run.store, test, kind)
    assert np.abs(ref - last).max() > 0.1 * np.abs(last).max()  # the choice matters here
    _, row_ids, _ = run.index(s)
    got = np.zeros(len(ids))
    got[np.searchsorted(ids, row_ids)] = run.all_scores(test, s)
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())
    res = run.query(eval_example=ev, top_k=5, settings=s)
    order = np.argsort(-ref)[:5]
    atol = RTOL * np.abs(ref).max()
    got = res.proponents
    assert_same_ranking(got["example_id"], got["score"], ids[order], ref[order], atol)
    run.close()


def test_query_sketch_equals_stored_record_and_ranks_itself_first(data, tmp_path):
    """With lr = 0 the final model is the training model, so the query path (tokens, hooks,
    projections, loss) must reproduce each stored record, and every example is its own top hit."""
    run_dir = train(
        fast_settings(
            data,
            tmp_path / "lr0",
            lr=0.0,
            tiny_width=64,
            track=TrackSettings(k_in=4, k_out=4, rank=0),
        )
    )
    run = open_run(run_dir)
    rec = run.store.records()
    s = IndexSettings(preconditioner="kfac", cosine=True, per_record=True)
    for r in range(0, run.store.n_records, 7):
        e = int(rec["example_index"][r])
        enc, _, _ = run.encode(eval_example=e)
        test, _ = run.query_sketches(enc)
        for li in range(len(run.store.layers)):
            want = run.store.sketches(li, r, r + 1)[0]
            np.testing.assert_allclose(test[li][0], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        res = run.query(eval_example=e, top_k=1, opponents=False, settings=s)
        assert int(res.rows["example_id"][0]) == e


@pytest.mark.parametrize("track", ["full-k16", "default"])
def test_trained_examples_mostly_rank_themselves_first(data, tmp_path, track):
    # after training the final-model gradient differs from the recorded ones; still, most
    # training examples should find themselves: full 16 x 16 sketches with K-FAC, and the
    # default capture (rank-1 factors of the full gradient, k = 64 = the width) with the
    # default index (identity, cosine)
    if track == "default":
        tr, s = TrackSettings(), IndexSettings()
    else:
        tr, s = TrackSettings(k_in=16, k_out=16, rank=0), IndexSettings("kfac", cosine=False)
    run_dir = train(fast_settings(data, tmp_path / "r", epochs=2, tiny_width=64, track=tr))
    run = open_run(run_dir)
    ids = run.examples().filter(run.examples()["split"] == "train")["example_id"].to_list()
    hits = sum(
        int(run.query(eval_example=e, top_k=1, opponents=False, settings=s).rows["example_id"][0])
        == e
        for e in ids
    )
    assert hits / len(ids) > 0.5


def test_query_errors(run_dir, tmp_path):
    run = open_run(run_dir)
    with pytest.raises(QueryError, match="prompt is empty"):
        run.query("   ", "")
    with pytest.raises(QueryError, match="does not exist"):
        run.query(eval_example=10**6)
    with pytest.raises(QueryError, match="top_k"):
        run.query("Q: x\nA:", " y", top_k=0)
    res = run.query("Q: " + "very long question " * 60 + "\nA:", " teal")
    assert any("truncated" in n for n in res.notes)
    no_model = tmp_path / "nomodel"
    shutil.copytree(run_dir, no_model)
    shutil.rmtree(no_model / "model")
    with pytest.raises(RunError, match="no saved model"):
        open_run(no_model).query("Q: a\nA:", " b")


def test_stale_index_is_rebuilt_not_used(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    run = open_run(copy)
    s = IndexSettings(preconditioner="identity", cosine=False)
    run.index(s)
    meta = copy / "index" / s.name / "index.json"
    m = json.loads(meta.read_text())
    m["fingerprint"] = "from-another-store"
    meta.write_text(json.dumps(m))
    fresh = open_run(copy)
    fresh.index(s)
    assert json.loads(meta.read_text())["fingerprint"] != "from-another-store"


def test_an_index_of_an_older_build_answers_exactly_and_says_so(
    run_dir, tmp_path, monkeypatch, capsys
):
    from traceprop_engine.attribution.index import run_indexes as index_store

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    s = IndexSettings()
    with monkeypatch.context() as m:  # an index as an earlier release wrote it
        m.setattr(index_store, "BUILD_FORMAT", 1)
        before = open_run(copy)
        before.index(s, rebuild=True)
        old = before.query(eval_example=0, settings=s, top_k=5)
    assert index_store.OLD_BUILD_NOTE not in old.notes  # its own build, in this process
    fresh = open_run(copy)  # a later release opens it: reused, exact, and says so
    got = fresh.query(eval_example=0, settings=s, top_k=5)
    assert index_store.OLD_BUILD_NOTE in got.notes
    assert got.rows["example_id"].to_list() == old.rows["example_id"].to_list()
    np.testing.assert_allclose(got.rows["score"].to_numpy(), old.rows["score"].to_numpy())
    from traceprop_engine.cli.main import main

    assert main(["index", str(copy)]) == 0  # the command reuses it and says so too
    assert index_store.OLD_BUILD_NOTE in capsys.readouterr().err
    fresh.index(s, rebuild=True)
    assert index_store.OLD_BUILD_NOTE not in fresh.query(eval_example=0, settings=s).notes
    assert main(["index", str(copy)]) == 0
    assert index_store.OLD_BUILD_NOTE not in capsys.readouterr().err
    assert index_store.OLD_BUILD_NOTE not in open_run(copy).query(eval_example=0).notes


def test_partial_run_is_queryable_and_says_so(data, tmp_path):
    stop = StopFlag()

    def on_progress(line):
        if line["step"] == 2:
            stop.requested = True

    run_dir = train(
        fast_settings(data, tmp_path / "partial", epochs=3), on_progress=on_progress, stop=stop
    )
    run = open_run(run_dir)
    res = run.query(eval_example=int(run.eval_examples()["example_id"][0]), top_k=3)
    assert res.rows.height > 0
    assert any("partial" in n for n in res.notes)
    assert run.store.n_records == 16


def test_influence_by_source_sums_all_scores(run_dir):
    """Per source file: the sum of the brute-force scores of all its training examples (not
    just the top k), their positive and negative parts, and how many there are."""
    run = open_run(run_dir)
    s = IndexSettings(preconditioner="identity", cosine=False)
    ev = int(run.eval_examples()["example_id"][0])
    res = run.query(eval_example=ev, top_k=3, settings=s)
    agg = run.influence_by_source(res, s)
    test, _ = run.query_sketches(run.encode(eval_example=ev)[0])
    ids, ref = reference_scores(run.store, test, "identity")
    source = dict(zip(run.examples()["example_id"], run.examples()["source"], strict=True))
    want = {}
    for e, score in zip(ids, ref, strict=True):
        w = want.setdefault(
            source[int(e)], {"total": 0.0, "positive": 0.0, "negative": 0.0, "n": 0}
        )
        w["total"] += score
        w["positive"] += max(score, 0.0)
        w["negative"] += min(score, 0.0)
        w["n"] += 1
    assert len(want) > 1 and sorted(agg["source"]) == sorted(want)
    assert agg["examples"].sum() == run.store.manifest["data"]["n_train"] == len(ids)
    scale = np.abs(ref).sum()
    for row in agg.iter_rows(named=True):
        w = want[row["source"]]
        assert row["examples"] == w["n"]
        for k in ("total", "positive", "negative"):
            assert row[k] == pytest.approx(w[k], rel=RTOL, abs=RTOL * scale), (row["source"], k)
    assert list(agg["total"]) == sorted(agg["total"], reverse=True)


def test_a_model_that_does_not_match_the_store_is_refused(data, run_dir, tmp_path):
    from traceprop_engine import ModelMismatchError

    other = train(fast_settings(data, tmp_path / "other", tiny_width=32))
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "model")
    shutil.copytree(other / "model", copy / "model")  # same layer names, other widths
    # the fingerprint check refuses the swapped model first
    with pytest.raises(ModelMismatchError, match="is not the one this run saved"):
        open_run(copy).query("Q: a\nA:", " b")
    # with run.json made to vouch for it, the shape check against the store still refuses it
    manifest = json.loads((copy / "run.json").read_text())
    other_manifest = json.loads((other / "run.json").read_text())
    manifest["model"]["fingerprint"] = other_manifest["model"]["fingerprint"]
    (copy / "run.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelMismatchError, match="does not match the store"):
        open_run(copy).query("Q: a\nA:", " b")
