"""A free-text run records rank-r factors (``TrackSettings.free_text_rank``); their first column
is the rank-1 record a run with the free-text rank turned off keeps. A free-text query and a long
answer score against every column; a short answer against the view whose scores have the heavier
tails (``IndexSettings.columns`` auto, attribution/column_choice.py, benchmarks/EVAL.md §1y-§1aa)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import FREE_TEXT_WORDS, fast_settings, free_text_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.settings import IndexSettings, TrackSettings
from traceprop_engine.training.loop import train

# the same float32 records through two paths (the rank-1 deferred projection, the rank-r QR and
# per-layer projection), then the same scoring: products in another order
F32_RTOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("columns")
    free_text_data(root / "data")
    out = {}
    for name, ftr in (("text", 16), ("rank1", 0)):
        track = TrackSettings(k_in=4, k_out=4, factor_dtype="float32", free_text_rank=ftr)
        out[name] = open_run(train(fast_settings(root / "data", root / name, track=track)))
    yield out
    for run in out.values():
        run.close()


def kurtosis(x: np.ndarray) -> float:
    """Excess kurtosis, the reference for the engine's (scipy.stats.kurtosis's default)."""
    d = x - x.mean()
    return float((d**4).mean() / (d**2).mean() ** 2 - 3)


def test_the_first_column_is_the_rank_1_record_and_a_long_query_scores_every_column(runs):
    text, rank1 = runs["text"], runs["rank1"]
    assert {i.rank for i in text.store.layers} == {4} and {i.rank for i in rank1.store.layers} == {
        1
    }
    short = dict(prompt="the model reads every", completion=" token")
    first = IndexSettings(columns=1, lm_bias=0)  # the records alone (no LM-bias term)
    a, b = text.scores(**short, settings=first), rank1.scores(**short, settings=first)
    np.testing.assert_allclose(a, b, rtol=F32_RTOL, atol=F32_RTOL * np.abs(b).max())
    # a long query (every token of a row a target): every column, another score than rank 1's
    long = " ".join(FREE_TEXT_WORDS * 2)
    assert text.query(long, top_k=3).query["columns"] == 0
    every = text.scores(long)
    np.testing.assert_allclose(
        every, text.scores(long, settings=IndexSettings(columns=0)), rtol=1e-12
    )
    assert not np.allclose(every, rank1.scores(long), rtol=1e-2)
    # free text scores every column at any length: a text of three tokens too (no prompt)
    short_text = " ".join(FREE_TEXT_WORDS[:3])
    res_text = text.query(short_text, top_k=3)
    assert res_text.query["columns"] == 0
    assert any("all 4 columns" in n and "free text" in n for n in res_text.notes)
    # a choice the caller made, and a rank-1 run: no note on the columns
    given = text.query(short_text, top_k=3, settings=IndexSettings(columns=0)).notes
    assert not any("columns of the records" in n for n in given)
    assert not any("columns" in n for n in rank1.query(short_text, top_k=3).notes)
    np.testing.assert_allclose(
        text.scores(short_text), text.scores(short_text, settings=IndexSettings(columns=0))
    )
    # a result's by-example scores follow the columns it was ranked with
    res = text.query(**short, top_k=3, settings=first)
    table = text.example_scores(res)
    np.testing.assert_allclose(
        table.sort("example_id")["score"].to_numpy(), a[np.sort(table["example_id"].to_numpy())]
    )
    assert (text.dir / C.INDEX_DIR / f"{text.settings().name}-c1").is_dir()


# short answers after a prompt of two words or more (a prompt of one token is free text), whose
# tails differ clearly between the two views on this run: both choices occur
SHORT_ANSWERS = [(3, 2), (10, 3), (3, 1), (6, 3), (11, 3)]


def test_a_short_answer_scores_the_view_whose_scores_have_the_heavier_tails(runs):
    text = runs["text"]
    w, picked = FREE_TEXT_WORDS, []
    for n_prompt, n_words in SHORT_ANSWERS:
        q = dict(prompt=" ".join(w[:n_prompt]), completion=" " + " ".join(w[n_prompt:][:n_words]))
        tails = []
        for cols in (1, 0):  # the reference: each view's records' scores of every example
            ix = IndexSettings(columns=cols, lm_bias=0)
            tails.append(kurtosis(text.scores(**q, settings=ix)[text.index(ix)[1]]))
        res = text.query(**q, top_k=3)
        want = 0 if tails[1] > tails[0] else 1
        assert res.query["columns"] == want, (q, tails)
        np.testing.assert_allclose(
            text.scores(**q), text.scores(**q, settings=IndexSettings(columns=want)), rtol=1e-12
        )
        note = next(n for n in res.notes if "heavier tails" in n)
        said = re.search(r"kurtosis (-?[\d.]+) against (-?[\d.]+)", note)
        assert said, note  # the chosen view's kurtosis first, to the note's one decimal
        assert float(said[1]) == pytest.approx(tails[1 - want], abs=0.051)
        assert float(said[2]) == pytest.approx(tails[want], abs=0.051)
        assert ("first of the records' 4 columns" in note) == (want == 1)
        assert "the query is an answer of" in note
        picked.append(want)
    assert set(picked) == {0, 1}


def test_the_tails_of_a_large_index_are_measured_on_a_seeded_sample(runs, monkeypatch):
    """Above ``TAIL_SAMPLE`` index rows the kurtosis is measured on that many rows, drawn the
    same for both views and every query (here 6 of the 12)."""
    from traceprop_engine.attribution import column_choice

    text = runs["text"]
    q = dict(prompt="the model reads every", completion=" token of")
    ts = text.test_side(**q)
    s = text.settings()
    monkeypatch.setattr(column_choice, "TAIL_SAMPLE", 6)
    rows = np.sort(np.random.default_rng(0).choice(12, 6, replace=False))
    for cols in (1, 0):
        ix = IndexSettings(columns=cols, lm_bias=0)  # the tails are the records' alone
        want = kurtosis(text.scores(**q, settings=ix)[text.index(ix)[1]][rows])
        got = column_choice.score_tails(text, s, ts.sketches, cols)
        assert got == pytest.approx(want, rel=1e-9)
    assert len(text.index(s)[1]) == 12


def test_the_answer_tokens_of_a_query_pick_its_columns():
    """``query_targets``: a label counts 1, an answer its loss tokens after the prompt, free text
    (a loss on every token after the first) None, which scores every column at any length."""
    from traceprop_engine.attribution import query_targets
    from traceprop_engine.store.column_view import query_columns
    from traceprop_engine.training.models import Encoded

    ids = np.arange(6, dtype=np.int32)
    answer = Encoded(ids, np.array([0, 0, 0, 1, 1, 1], np.uint8))
    text = Encoded(ids, np.array([0, 1, 1, 1, 1, 1], np.uint8))
    label = Encoded(ids, np.ones(6, np.uint8), label=2)
    assert (query_targets(answer), query_targets(text), query_targets(label)) == (3, None, 1)
    padded = Encoded(ids, np.array([0, 1, 1, 1, 0, 0], np.uint8))  # free text, then padding
    assert query_targets(padded) is None
    long_answer = Encoded(np.arange(40, dtype=np.int32), np.r_[np.zeros(3), np.ones(37)])
    assert query_targets(long_answer) == 37
    layers = [type("L", (), {"rank": 16})()]
    picked = [query_columns(layers, query_targets(e)) for e in (answer, text, label, long_answer)]
    assert picked == [1, 0, 1, 0]
