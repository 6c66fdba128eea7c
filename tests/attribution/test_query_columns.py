"""A free-text run records rank-r factors (``TrackSettings.free_text_rank``); a query of a few
loss tokens scores against their first column, which is the rank-1 record a run with the
free-text rank turned off keeps, and a free-text query against every column
(``IndexSettings.columns`` auto, benchmarks/EVAL.md §1y)."""

from __future__ import annotations

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


def test_a_short_query_scores_the_rank_1_records_and_a_long_one_every_column(runs):
    text, rank1 = runs["text"], runs["rank1"]
    assert {i.rank for i in text.store.layers} == {4} and {i.rank for i in rank1.store.layers} == {
        1
    }
    short = dict(prompt="the model reads every", completion=" token")
    res = text.query(**short, top_k=3)
    assert res.query["columns"] == 1
    assert any("first of the records' 4 columns" in n and "answer of 2" in n for n in res.notes)
    a, b = text.scores(**short), rank1.scores(**short)
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
    table = text.example_scores(res)
    np.testing.assert_allclose(
        table.sort("example_id")["score"].to_numpy(), a[np.sort(table["example_id"].to_numpy())]
    )
    assert (text.dir / C.INDEX_DIR / f"{text.settings().name}-c1").is_dir()


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
