"""Comparing two answers (overlap, rank changes), the score histogram and exports that carry
their query: hand-built tables with known answers, and the sample run's real ones."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from traceprop_engine.attribution.reports.compare import overlap, rank_changes
from traceprop_engine.attribution.reports.distributions import score_histogram
from traceprop_engine.attribution.reports.export import export_with_query, rows_with_query

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "facts"


def _rows(spec):
    """spec: [(kind, rank, score, source, row)]"""
    return pl.DataFrame(
        [
            {
                "kind": k,
                "rank": r,
                "score": s,
                "example_id": 100 + row,
                "source": src,
                "row": row,
                "text": f"{src}:{row}",
            }
            for k, r, s, src, row in spec
        ]
    )


A = _rows(
    [
        ("proponent", 1, 0.9, "a.jsonl", 1),
        ("proponent", 2, 0.8, "a.jsonl", 2),
        ("proponent", 3, 0.7, "b.jsonl", 1),
        ("opponent", 1, -0.5, "b.jsonl", 2),
        ("opponent", 2, -0.4, "b.jsonl", 3),
    ]
)
B = _rows(
    [
        ("proponent", 1, 0.95, "a.jsonl", 2),  # A's #2 moved up to #1
        ("proponent", 2, 0.85, "c.jsonl", 9),  # new
        ("proponent", 3, 0.75, "a.jsonl", 1),  # A's #1 moved down to #3
        ("opponent", 1, -0.6, "b.jsonl", 3),
        ("opponent", 2, -0.3, "b.jsonl", 1),  # a proponent in A: flipped
    ]
)


def test_overlap_counts_shared_examples_by_lineage():
    ov = {r["kind"]: r for r in overlap(A, B).iter_rows(named=True)}
    p = ov["proponent"]
    assert (p["k"], p["in_a"], p["in_b"], p["shared"]) == (3, 3, 3, 2)
    assert p["jaccard"] == pytest.approx(2 / 4) and p["overlap_at_k"] == pytest.approx(2 / 3)
    o = ov["opponent"]
    assert (o["shared"], o["jaccard"], o["overlap_at_k"]) == (1, pytest.approx(1 / 3), 0.5)
    # at k = 1 only the first of each list counts
    ov1 = {r["kind"]: r for r in overlap(A, B, k=1).iter_rows(named=True)}
    assert ov1["proponent"]["shared"] == 0 and ov1["opponent"]["shared"] == 0
    # identical answers overlap completely, even with other example ids (two runs)
    same = overlap(A, A.with_columns(pl.col("example_id") + 1000))
    assert same["jaccard"].to_list() == [1.0, 1.0]
    with pytest.raises(ValueError, match="at least 1"):
        overlap(A, B, k=0)


def test_rank_changes_and_status():
    ch = rank_changes(A, B)
    by = {(r["source"], r["row"]): r for r in ch.iter_rows(named=True)}
    assert len(by) == 6
    assert by[("a.jsonl", 2)]["rank_change"] == 1 and by[("a.jsonl", 2)]["status"] == "both"
    assert by[("a.jsonl", 1)]["rank_change"] == -2
    assert by[("c.jsonl", 9)]["status"] == "only b" and by[("c.jsonl", 9)]["rank_a"] is None
    assert by[("b.jsonl", 2)]["status"] == "only a" and by[("b.jsonl", 2)]["rank_b"] is None
    flip = by[("b.jsonl", 1)]
    assert flip["status"] == "flipped" and flip["rank_change"] is None
    assert (flip["kind_a"], flip["kind_b"]) == ("proponent", "opponent")
    assert by[("b.jsonl", 3)]["score_a"] == -0.4 and by[("b.jsonl", 3)]["score_b"] == -0.6


def test_score_histogram_counts_every_score_by_sign():
    rng = np.random.default_rng(0)
    s = np.concatenate([rng.normal(size=500), [0.0, 0.0]])
    h = score_histogram(s, bins=17)
    assert h.height == 17
    assert h["proponents"].sum() == (s > 0).sum() and h["opponents"].sum() == (s < 0).sum()
    assert h["zero"].sum() == 2
    assert h["left"][0] == s.min() and h["right"][-1] == pytest.approx(s.max())
    # each count is the number of scores in its bin (the last bin closed on the right)
    i = 5
    lo, hi = h["left"][i], h["right"][i]
    assert h["proponents"][i] == ((s > 0) & (s >= lo) & (s < hi)).sum()
    assert score_histogram(np.array([2.0, 2.0]), 3)["proponents"].sum() == 2
    # 0 is an edge: no bin holds both signs
    assert 0.0 in set(h["left"].to_list())
    assert ((h["proponents"] > 0) & (h["opponents"] > 0)).sum() == 0
    for bad, match in (([], "no scores"), ([1.0, np.nan], "not finite")):
        with pytest.raises(ValueError, match=match):
            score_histogram(np.array(bad), 4)
    with pytest.raises(ValueError, match="bins"):
        score_histogram(s, 0)


def test_exports_carry_their_query():
    q = {"run_id": "facts", "prompt": "Q: x?\nA:", "completion": " y", "preconditioner": "kfac"}
    rows = A.with_columns(pl.col("text").alias("text"))
    got = list(csv.DictReader(io.StringIO(export_with_query(rows, q, "csv").decode())))
    assert len(got) == rows.height
    assert {r["query_run_id"] for r in got} == {"facts"}
    assert got[0]["query_prompt"] == "Q: x?\nA:" and got[0]["query_completion"] == " y"
    assert got[0]["query_preconditioner"] == "kfac" and got[0]["query_eval_example"] == ""
    js = json.loads(export_with_query(rows, q, "json"))
    assert js["query"] == q and [r["source"] for r in js["rows"]] == rows["source"].to_list()
    assert rows_with_query(rows, q).width == rows.width + 10
    with pytest.raises(ValueError, match="format"):
        export_with_query(rows, q, "xlsx")


def test_two_preconditioners_on_the_sample_run():
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.settings import IndexSettings

    run = open_run(SAMPLE)
    try:
        ev = int(run.eval_examples()["example_id"][0])
        a = run.query(eval_example=ev, top_k=10)
        b = run.query(eval_example=ev, top_k=10, settings=IndexSettings(preconditioner="kfac"))
    finally:
        run.close()
    ov = {r["kind"]: r for r in overlap(a.rows, b.rows, 10).iter_rows(named=True)}
    for kind in ("proponent", "opponent"):
        sa = set(a.rows.filter(pl.col("kind") == kind)["example_id"])
        sb = set(b.rows.filter(pl.col("kind") == kind)["example_id"])
        assert ov[kind]["shared"] == len(sa & sb)
        assert ov[kind]["jaccard"] == pytest.approx(len(sa & sb) / len(sa | sb))
    ch = rank_changes(a.rows, b.rows)
    assert ch.height == len(set(a.rows["example_id"]) | set(b.rows["example_id"]))
    assert ch.filter(pl.col("status") == "both").height == sum(
        ov[k]["shared"] for k in ("proponent", "opponent")
    )
