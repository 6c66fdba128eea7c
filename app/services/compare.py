"""The Compare page's data: one query answered by two (run, preconditioner) sides, their
overlap and rank changes (the engine's :mod:`traceprop_engine.attribution.reports.compare`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import polars as pl

from traceprop_engine import attribution

from .queries import open_cached, test_side


@dataclass
class Comparison:
    a: object  # QueryResult of side A
    b: object  # QueryResult of side B
    overlap: pl.DataFrame  # per kind: k, shared, jaccard, overlap_at_k
    changes: pl.DataFrame  # per example: kind, rank and score in A and B, rank change, status


def query_text(run_dir: str | os.PathLike, eval_example: int) -> dict:
    """The text of eval example ``eval_example`` of a run as query arguments (``prompt`` and
    ``completion``, or ``prompt`` and ``label`` for classification), so another run can be asked
    the same question.

    Raises:
        QueryError: no such eval example.
    """
    from traceprop_engine.errors import QueryError

    run, lock = open_cached(run_dir)
    with lock:
        ev = run.eval_examples()
    row = ev.filter(pl.col("example_id") == int(eval_example))
    if row.is_empty():
        raise QueryError(f"{eval_example} is not an eval example of this run")
    r = row.row(0, named=True)
    if r["label"]:
        return {"prompt": r["text"], "label": r["label"]}
    if r["prompt"] or r["completion"]:
        return {"prompt": r["prompt"], "completion": r["completion"]}
    return {"prompt": r["text"]}


def query_side(run_dir, query: dict):
    """The query's model half (``TestSide``) on a run: from the query worker, when there is one."""
    keys = ("prompt", "completion", "eval_example", "label")
    return test_side(run_dir, **{k: query.get(k) for k in keys})


def side_query(run_dir, preconditioner: str, top_k: int, ts, terms: dict | None = None):
    """One side's :class:`QueryResult` of the query whose model half is ``ts`` (from
    :func:`query_side`), ranked under the run's lock (``terms``: the query-time terms' weights,
    ``class_prior`` and ``lm_bias``; one not given is the run's default)."""
    from traceprop_engine.settings import IndexSettings

    s = IndexSettings(preconditioner=preconditioner, **(terms or {}))
    run, lock = open_cached(run_dir)
    with lock:
        return run.query(top_k=top_k, settings=s, test_side=ts)


def compare_sides(side_a: tuple, side_b: tuple, query: dict, top_k: int = 10) -> Comparison:
    """Ask ``query`` on side A and side B (each ``(run_dir, preconditioner)``) for ``top_k``
    proponents and opponents and compare the answers.

    ``query`` holds ``prompt``/``completion``/``label`` (any run) or ``eval_example`` (only when
    both sides are the same run: ids differ between runs, use :func:`query_text` first).

    Raises:
        TracepropError: a side cannot be opened or queried.
        ValueError: an eval example id asked of two different runs.
    """
    if query.get("eval_example") is not None and os.path.realpath(side_a[0]) != os.path.realpath(
        side_b[0]
    ):
        raise ValueError("two runs share no example ids: ask them by the example's text")
    ts_a = query_side(side_a[0], query)
    same = os.path.realpath(side_a[0]) == os.path.realpath(side_b[0])
    ts_b = ts_a if same else query_side(side_b[0], query)  # one run: one model half
    a = side_query(side_a[0], side_a[1], top_k, ts_a)
    b = side_query(side_b[0], side_b[1], top_k, ts_b)
    return Comparison(
        a, b, attribution.overlap(a.rows, b.rows, top_k), attribution.rank_changes(a.rows, b.rows)
    )


def second_choice(preconditioners, first: str) -> str | None:
    """The estimator to triangulate ``first`` with: identity (the one least like the default
    K-FAC), else EK-FAC, else K-FAC (the first of those the run supports that is not
    ``first``); None when the run has no other."""
    for name in ("identity", "ekfac", "kfac", *preconditioners):
        if name != first and name in preconditioners:
            return name
    return None


def second_opinion(run_dir, result, preconditioner: str, ts):
    """Triangulate an answer: rank the same query (its model half ``ts``, the one ``result``
    was ranked from) under ``preconditioner`` for as many examples per kind as ``result`` has,
    with its query-time terms (a class prior, an LM-bias term), and mark the examples both
    estimators rank high.

    Returns:
        ``(marks, overlap)``: ``marks`` has ``kind, example_id, second_rank`` for each example
        in the second estimator's top k (join it on ``kind, example_id``: null means the second
        estimator does not rank it in its top k); ``overlap`` is :func:`~traceprop_engine.attribution.overlap` of the
        two answers.

    Raises:
        TracepropError: the run cannot be queried with ``preconditioner``.
    """
    k = max(1, int(result.query.get("top_k") or result.rows.height))
    # the same query-time terms as the first answer (a classifier's class prior, a free-text
    # run's LM bias; 0 elsewhere)
    terms = {t: result.query.get(t) for t in ("class_prior", "lm_bias")}
    other = side_query(run_dir, preconditioner, k, ts, terms)
    marks = other.rows.select(
        "kind", pl.col("example_id").cast(pl.Int64), pl.col("rank").alias("second_rank")
    )
    return marks, attribution.overlap(result.rows, other.rows, k)
