"""The class prior of a classification run (``IndexSettings.class_prior``): a query-time term
``c · (+1 same label, -1/(C-1) otherwise)`` added to every score, on by default for a
classifier scored with cosine, absent for a causal LM; checked against the records-alone
scores and a brute-force ranking on a real trained classification run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import train_classifier_run

from traceprop_engine.attribution import open_run
from traceprop_engine.attribution.overview import CLASS_PRIOR_NOTE, describe, resolve_settings
from traceprop_engine.attribution.score.ranking import CLASS_PRIOR_LAYER
from traceprop_engine.cli.main import main as cli_main
from traceprop_engine.constants import ORIGIN_ADAPTER
from traceprop_engine.errors import ConfigError
from traceprop_engine.index_settings import ADAPTER_CLASS_PRIOR, DEFAULT_CLASS_PRIOR
from traceprop_engine.settings import IndexSettings, TrackSettings

LABELS = ("alpha", "beta", "gamma")
EXACT = 1e-9
"""Tolerance of a difference of two float64 scores of the same records (the prior is added
after the records' own score, so their difference is the prior up to rounding)."""
RANK_ATOL = 1e-6
"""Tolerance of a ranked score against the brute-force one (the re-rank sums its layers in
float32 for float32 queries)."""


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    return train_classifier_run(tmp_path_factory.mktemp("cls"), LABELS)


def _labels(run, ids):
    return run.examples()["label"].to_numpy()[ids]


def _scores_add_the_prior(run, res, s, label, weight):
    """Check that every exact score of query ``res`` under ``s`` is the records' alone plus
    ``weight`` for an example of ``label`` and ``-weight/(C-1)`` otherwise; returns ``(the scores
    with the prior, the index's row -> example ids, the prior of each row)``."""
    _, ids, _ = run.index(s)
    with_prior = run.all_scores(res.sketches, s)
    alone = run.all_scores(res.sketches, IndexSettings(class_prior=0))
    same = _labels(run, ids) == label
    want = np.where(same, weight, -weight / (len(LABELS) - 1))
    np.testing.assert_allclose(with_prior - alone, want, rtol=0, atol=EXACT)
    return with_prior, ids, want


def test_the_default_adds_the_class_prior_to_every_score(classifier_run):
    run = open_run(classifier_run)
    s = run.settings()
    assert s.class_prior == DEFAULT_CLASS_PRIOR and CLASS_PRIOR_NOTE in run.notes
    assert run.settings(IndexSettings(cosine=False)).class_prior == 0.0  # dot: no unit to add in
    ev = run.eval_examples()
    for e, label in zip(ev["example_id"].to_list(), ev["label"].to_list(), strict=True):
        res = run.query(eval_example=e, top_k=3)
        assert res.query["class_prior"] == DEFAULT_CLASS_PRIOR
        assert res.layer_names[-1] == CLASS_PRIOR_LAYER
        with_prior, ids, want = _scores_add_the_prior(run, res, s, label, DEFAULT_CLASS_PRIOR)
        # the ranking is the brute-force one of the exact scores, prior included, both ends
        for kind, order in (
            ("proponent", np.argsort(-with_prior)),
            ("opponent", np.argsort(with_prior)),
        ):
            rows = res.rows.filter(res.rows["kind"] == kind)
            got = rows["score"].to_numpy()
            # the brute-force top scores, and each listed example has its own (near-ties of
            # a near-duplicate row may list either of two examples)
            np.testing.assert_allclose(got, with_prior[order[: rows.height]], atol=RANK_ATOL)
            at = [list(ids).index(x) for x in rows["example_id"]]
            np.testing.assert_allclose(got, with_prior[at], atol=RANK_ATOL)
            for r in rows.iter_rows(named=True):  # the prior is its own share, last
                shares = json.loads(r["layer_scores"])
                prior = shares.pop(CLASS_PRIOR_LAYER)
                assert prior == pytest.approx(want[list(ids).index(r["example_id"])])
                assert sum(shares.values()) + prior == pytest.approx(r["score"], abs=1e-6)
        # scores() and example_scores() add the same prior
        np.testing.assert_allclose(run.scores(eval_example=e)[ids], with_prior, atol=EXACT)
        table = run.example_scores(res).sort("example_id")
        np.testing.assert_allclose(table["score"].to_numpy(), with_prior[np.argsort(ids)])


def test_class_prior_zero_a_causal_lm_and_unlabelled_sketches_add_nothing(classifier_run):
    run = open_run(classifier_run)
    e = run.eval_examples()["example_id"][0]
    res = run.query(eval_example=e, top_k=3, settings=IndexSettings(class_prior=0))
    assert res.query["class_prior"] == 0.0 and CLASS_PRIOR_LAYER not in res.layer_names
    assert all(CLASS_PRIOR_LAYER not in json.loads(x) for x in res.rows["layer_scores"])
    # sketches without the query's label (a plain list): the records alone
    plain = tuple(res.sketches)  # no token factors either: T' factored by the scorer
    np.testing.assert_allclose(
        run.all_scores(plain, None),
        run.all_scores(res.sketches, IndexSettings(class_prior=0)),
        rtol=0,
        atol=RANK_ATOL,
    )
    # an explicit prior is used as given, also with dot scores
    dot = IndexSettings(cosine=False, class_prior=1.5)
    _, ids, _ = run.index(dot)
    base = run.all_scores(res.sketches, IndexSettings(cosine=False))
    same = _labels(run, ids) == run.eval_examples()["label"][0]
    want = np.where(same, 1.5, -1.5 / (len(LABELS) - 1))
    scale = max(1.0, float(np.abs(base).max()))  # the sum's rounding grows with the dot's size
    np.testing.assert_allclose(
        run.all_scores(res.sketches, dot) - base, want, rtol=0, atol=EXACT * scale
    )
    # a causal LM: no prior by default (the rule is the task's, whatever the store)
    assert resolve_settings(run.store, None, "causal-lm").class_prior == 0.0


def test_a_classifier_that_trained_adapters_takes_the_adapter_prior(classifier_run, tmp_path):
    """``auto`` resolves by what the run trained: a peft LoRA classifier (``model_origin``
    adapter) gets :data:`ADAPTER_CLASS_PRIOR`, the same classifier fine-tuned in full
    :data:`DEFAULT_CLASS_PRIOR`; the scores carry it and the overview the app reads says it."""
    assert ADAPTER_CLASS_PRIOR != DEFAULT_CLASS_PRIOR  # else this test could not fail
    full = open_run(classifier_run)
    assert describe(full).class_prior == DEFAULT_CLASS_PRIOR
    run = open_run(train_classifier_run(tmp_path, LABELS, lora_rank=2))
    assert run.store.model_origin == ORIGIN_ADAPTER
    s = run.settings()
    assert s.class_prior == ADAPTER_CLASS_PRIOR and CLASS_PRIOR_NOTE in run.notes
    assert describe(run).class_prior == ADAPTER_CLASS_PRIOR
    e, label = run.eval_examples()["example_id"][0], run.eval_examples()["label"][0]
    res = run.query(eval_example=e, top_k=3)
    assert res.query["class_prior"] == ADAPTER_CLASS_PRIOR
    _scores_add_the_prior(run, res, s, label, ADAPTER_CLASS_PRIOR)
    # an explicit prior is the one asked for, adapters or not
    assert run.settings(IndexSettings(class_prior=1.0)).class_prior == 1.0


def test_a_classifier_without_labelled_lineage_gets_no_prior(tmp_path):
    """An own loop's Tracker that wrote no example table: no training labels to compare with,
    so neither the prior nor its note (the scores are the records' alone)."""
    import torch
    from helpers import tiny_bert_classifier, train_own_loop

    rows = [
        torch.randint(1, 97, (6,), generator=torch.Generator().manual_seed(i)) for i in range(6)
    ]
    run = open_run(
        train_own_loop(
            tiny_bert_classifier().train(),
            tmp_path / "run",
            TrackSettings(k_in=4, k_out=4),
            rows,
            class_ids=[0, 1, 2, 0, 1, 2],
            task="classification",
            labels=list(LABELS),
        )
    )
    assert run.settings().class_prior == DEFAULT_CLASS_PRIOR and CLASS_PRIOR_NOTE not in run.notes
    query = {"input_ids": rows[1].tolist(), "label": "beta"}
    res = run.query(**query, top_k=2)
    assert CLASS_PRIOR_LAYER not in res.layer_names
    np.testing.assert_array_equal(
        run.scores(**query), run.scores(**query, settings=IndexSettings(class_prior=0))
    )


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.2"])
def test_a_bad_class_prior_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="class_prior must be"):
        IndexSettings(class_prior=bad)
    assert IndexSettings(class_prior=1).class_prior == 1.0
    # a query-time term: the index (its name and fingerprint) is the same
    assert IndexSettings(class_prior=0.5).name == IndexSettings().name
    assert IndexSettings(class_prior=0.5).to_dict() == IndexSettings().to_dict()


def test_the_cli_takes_class_prior(classifier_run, tmp_path, capsys):
    run = open_run(classifier_run)
    e = int(run.eval_examples()["example_id"][0])
    run.close()
    shares = {}
    for name, flags in (("default", []), ("alone", ["--class-prior", "0"])):
        out = tmp_path / f"{name}.json"
        argv = ["query", str(classifier_run), "--eval-example", str(e), "--json", str(out)]
        assert cli_main([*argv, *flags]) == 0
        shares[name] = [json.loads(r["layer_scores"]) for r in json.loads(out.read_text())]
    assert "note: " + CLASS_PRIOR_NOTE in capsys.readouterr().err
    # a query-time flag: `index` does not take it (it would change nothing there)
    with pytest.raises(SystemExit):
        cli_main(["index", str(classifier_run), "--class-prior", "0"])
    assert "unrecognized arguments: --class-prior" in capsys.readouterr().err
    assert all(CLASS_PRIOR_LAYER in x for x in shares["default"])
    assert not any(CLASS_PRIOR_LAYER in x for x in shares["alone"])


def test_few_candidates_still_find_the_labels_top_rows(classifier_run, monkeypatch):
    """FAISS proposes only three rows a side here (as it proposes a small share of a large
    index): its two ends by the records' score miss rows the prior lifts, and the searches among
    the queried label's rows (proponents) and the other labels' (opponents) find them, so the
    ranking is brute force's with the prior."""
    from traceprop_engine.attribution.query import AttributionRun
    from traceprop_engine.attribution.score import ranking

    monkeypatch.setattr(ranking, "CANDIDATES", 1)
    monkeypatch.setattr(ranking, "MIN_CANDIDATES", 3)
    monkeypatch.setattr(ranking, "CANDIDATE_FRACTION", 10**9)
    s = IndexSettings(class_prior=2.0)
    run = open_run(classifier_run)
    ids = np.asarray(run.index(s)[1])
    missed = 0
    for ev in run.eval_examples()["example_id"]:
        q = run.query_sketches(run.encode(eval_example=int(ev))[0])[0]
        exact = run.exact_scores(q, s)[0]
        got = {True: run.rank(q, s, 3, True)[0]}
        with monkeypatch.context() as m:  # FAISS's two ends and nothing else
            m.setattr(AttributionRun, "label_sides", lambda *a: None)
            got[False] = run.rank(q, s, 3, True)[0]
        for kind, sign in (("proponent", 1), ("opponent", -1)):
            top = np.argsort(-sign * exact, kind="stable")[:3]
            want = set(ids[top[sign * exact[top] > 0]].tolist())
            for sides, rows in got.items():
                mine = set(rows.filter(rows["kind"] == kind)["example_id"].to_list())
                if sides:
                    assert mine == want, (kind, ev)
                else:
                    missed += mine != want
    run.close()
    assert missed > 0  # without the label searches, the same few candidates miss some
