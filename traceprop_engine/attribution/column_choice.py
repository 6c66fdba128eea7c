"""Which record columns a query scores against (``IndexSettings.columns`` auto).

A free-text run records rank-r factors whose first column is the rank-1 record
(:mod:`~traceprop_engine.store.column_view`). A free-text query (a loss on every token) and a
long answer score against every column; a short answer after a prompt (at most
:data:`~traceprop_engine.constants.FREE_TEXT_TARGETS` loss tokens) or a label is scored against
the view in which its scores have the heavier tails: the larger excess kurtosis of its exact
scores over the index rows (a seeded sample of :data:`TAIL_SAMPLE` rows on a larger index).

Why the tails: the two kinds of short answer measured want opposite views. A fact's answer after
a question, on training texts of several facts, scores far higher against the first column (LDS
0.670 / 0.514 against 0.297 / 0.410 every column); a continuation of prose after a prompt scores
higher against every column (+0.09 to +0.23), and no property of the query or of the records
alone told them apart (benchmarks/EVAL.md §1z). The view that ranks a few training examples far
above the rest is the one that found the examples the answer came from: the first column's
scores are heavy-tailed on the facts (median kurtosis 4.0–4.3 against 0.4–0.9) and every column's
on the prose (1.6–6.5 against 0.9–1.7), and the choice per query keeps the facts' LDS while taking
most of every column's on prose (benchmarks/EVAL.md §1aa).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..settings import IndexSettings
from ..store.column_view import columns_note, query_columns

# index rows the tails are measured on (all of them on a smaller index): a seeded sample, the same
# rows for both views. 1024 keeps the kurtosis's sampling error (about 0.15 for normal scores,
# more for heavy tails) well under the gaps measured (3-5), and bounds the choice's cost: two
# exact scorings of 1024 rows (on 3888 rank-16 records, all rows of both views took 1.2 s)
TAIL_SAMPLE = 1024


def excess_kurtosis(x: np.ndarray) -> float:
    """``E[(x − μ)⁴] / σ⁴ − 3`` of one score row (nan for a constant row)."""
    x = np.asarray(x, np.float64)
    d = x - x.mean()
    m2 = np.mean(d * d)
    return float(np.mean(d**4) / (m2 * m2) - 3.0) if m2 > 0 else float("nan")


def score_tails(run, s: IndexSettings, sketches: list[np.ndarray], columns: int) -> float:
    """The excess kurtosis of a query's exact scores against the first ``columns`` record
    columns (0: every one) under ``s``, over :data:`TAIL_SAMPLE` index rows at most (the mean
    over the query's rows when ``sketches`` hold several). On the records' scores alone: the
    LM-bias term (``IndexSettings.lm_bias``) is the same under both views and only blurs them."""
    sc = dataclasses.replace(s, columns=columns, lm_bias=0.0)
    n = len(run.index(sc)[1])
    rows = np.arange(n)  # given rows: read through the index's record cache where it has one
    if n > TAIL_SAMPLE:
        rows = np.sort(np.random.default_rng(0).choice(n, TAIL_SAMPLE, replace=False))
    scores = run.exact_scores(sketches, sc, rows=rows)
    return float(np.mean([excess_kurtosis(r) for r in scores]))


def resolve_columns(
    run, s: IndexSettings, n_targets: int | None, sketches: list[np.ndarray] | None = None
) -> tuple[IndexSettings, str | None]:
    """``s`` (resolved by ``run.settings``) with the record columns a query of ``n_targets``
    answer tokens scores against, and the note that says which and why (None when ``s`` named
    its columns, or the records are rank 1).

    ``columns=None``: every column for free text (``n_targets`` None) and a long answer; for a
    short answer or a label on records of rank above 1, the view whose scores have the heavier
    tails (:func:`score_tails`) given the query's ``sketches``; without them (an index wanted
    before any query is known) the first column."""
    if s.columns is not None:
        return s, None
    layers = run.store.layers
    columns, tails = query_columns(layers, n_targets), None
    if columns == 1 and sketches is not None:
        tails = (score_tails(run, s, sketches, 1), score_tails(run, s, sketches, 0))
        columns = 0 if tails[1] > tails[0] else 1
    return dataclasses.replace(s, columns=columns), columns_note(layers, columns, n_targets, tails)
