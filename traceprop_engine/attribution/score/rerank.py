"""The exact re-rank of a query's candidates, layer by layer, dropping rows that cannot place.

The score of index row ``j`` is a sum over layers, ``τ_j = Σ_l ⟨T'_l, x_{j,l}⟩`` with
``T'_l = pullback_l(T_l)`` (:mod:`~traceprop_engine.attribution.score.scoring`), and every
preconditioner here is one linear map per layer, ``apply_l`` (identity, K-FAC's ``L X R``, EK-FAC's
scaled eigenbasis), with ``⟨T'_l, x⟩ = ⟨apply_l(T_l), apply_l(x)⟩``. So by Cauchy–Schwarz

    |⟨T'_l, x_{j,l}⟩| ≤ ‖apply_l(T_l)‖ · ‖apply_l(x_{j,l})‖ = q_l · n_{j,l}

and after the layers ``S`` are scored, ``τ_j`` lies within ``Σ_{l∉S} q_l n_{j,l}`` of the
partial sum. The query's norms ``q_l`` cost one inner product per layer; the rows' ``n_{j,l}``
are kept with the index (``layer_norms.npy``, exact, rounded up). The layers are scored in the
order of the query's ``q_l``, largest first, and after each one a row is dropped when its
upper bound is below the ``k``-th largest lower bound (it cannot be a top-``k`` proponent) and
its lower bound above the ``k``-th smallest upper bound (nor an opponent), or when its bounds
rule out the sign. Rows dropped this way cannot change the result: the ranking of the rows
left is the full re-rank's, with every score and every per-layer share exact.

A query whose score sits in one layer (often the LM head) then scores its thousands of
candidates at that layer only and the few dozen left at the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .two_hands import split_rows

if TYPE_CHECKING:
    from .scoring import PreparedQuery

MARGIN = 1e-4
"""Slack added to every bound, relative to ``‖q‖ · ‖x_j‖`` (cosine units: a score of 1e-4):
the partial sums are computed in float32 for float32 queries, the bounds must cover that."""


def as_bounds(layer_sq: np.ndarray) -> np.ndarray:
    """(n, L) per-layer squared norms as the index keeps them: float32, each rounded up to the
    next float32 so that it stays an upper bound (``layer_norms.npy``)."""
    return np.nextafter(np.asarray(layer_sq).astype(np.float32), np.inf)


def bounded_rerank(
    scorer,
    prepared: PreparedQuery,
    query_sq: np.ndarray,
    rows: np.ndarray,
    layer_sq: np.ndarray,
    top_k: int,
    opponents: bool = True,
    divisor: np.ndarray | None = None,
    offset: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact per-layer scores of the candidate ``rows`` of one query that can still place.

    Args:
        scorer: the index's :class:`~traceprop_engine.attribution.score.scoring.ExactScorer`.
        prepared: the query's ``scorer.prepared_lazily(...)`` (one query; each layer factored
            only when many rows need it).
        query_sq: (L,) ``‖apply_l(T_l)‖²`` of the query, per layer.
        rows: candidate index rows (int64), in the order ties are broken.
        layer_sq: (n_rows, L) ``‖apply_l(x_{j,l})‖²`` of the index (rounded up).
        top_k: how many rows a side the caller keeps.
        opponents: whether the negative end is kept too.
        divisor: (len(rows),) positive numbers the ranked scores are divided by (cosine: the
            rows' norms), or None.
        offset: (len(rows),) exact numbers added to the ranked scores after the division (a
            classification query's class prior, in the units of the ranked scores: times the
            query's norm for cosine), or None.

    Returns:
        ``(kept rows, (L, n_kept) per-layer scores, their positions in rows)``: the rows in
        their given order, each with every layer scored; the top ``top_k`` of each side among
        them are those of ``rows``.
    """
    rows = np.asarray(rows, dtype=np.int64)
    n_layers = len(prepared)
    qn = np.sqrt(np.maximum(np.asarray(query_sq, dtype=np.float64), 0.0))
    order = [int(li) for li in np.argsort(-qn, kind="stable") if qn[li] > 0]
    # a layer with q_l = 0 has apply_l(T_l) = 0: its scores are 0 and are not computed
    xn = np.sqrt(np.asarray(layer_sq[rows], dtype=np.float64))  # (n, L)
    slack = MARGIN * float(np.sqrt(np.sum(qn**2))) * np.sqrt(np.sum(xn**2, axis=1))
    alive = np.arange(len(rows))
    per = np.zeros((n_layers, len(rows)))
    for step, li in enumerate(order):
        one = [None] * n_layers  # this layer's entry only (the raw T' for a few rows)
        one[li] = prepared.for_rows(li, len(alive))
        # a layer with many rows left (the first scores every candidate) in parts, side by side
        per[li, alive] = split_rows(
            lambda r, one=one, li=li: scorer.row_scores(one, r, [li], 1)[0, 0], rows[alive]
        )
        rest = order[step + 1 :]
        if not rest:
            break
        part = per[:, alive].sum(0)
        bound = xn[alive][:, rest] @ qn[rest] + slack[alive]
        lo, hi = part - bound, part + bound
        if divisor is not None:
            lo, hi = lo / divisor[alive], hi / divisor[alive]
        if offset is not None:
            lo, hi = lo + offset[alive], hi + offset[alive]
        keep = _placeable(lo, hi, top_k, opponents)
        alive = alive[keep]
    return rows[alive], per[:, alive], alive


def _placeable(lo: np.ndarray, hi: np.ndarray, top_k: int, opponents: bool) -> np.ndarray:
    """Mask of the rows whose score bounds ``[lo, hi]`` leave them a place in the top ``top_k``
    proponents (score > 0) or, with ``opponents``, opponents (score < 0)."""
    n = len(lo)
    if n <= top_k:
        return np.ones(n, dtype=bool)
    kth_lo = np.partition(lo, n - top_k)[n - top_k]  # k rows score at least this
    keep = (hi >= kth_lo) & (hi >= 0)
    if opponents:
        kth_hi = np.partition(hi, top_k - 1)[top_k - 1]  # k rows score at most this
        keep |= (lo <= kth_hi) & (lo <= 0)
    return keep


def rerank_candidates(
    indexes,
    s,
    sketches,
    cand: np.ndarray,
    top_k: int,
    opponents: bool,
    prepared=None,
    offset: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`bounded_rerank` of one query's candidates ``cand`` against the index ``s``
    of ``indexes`` (:class:`~traceprop_engine.attribution.index.run_indexes.RunIndexes`), with its
    scores as ``exact_scores`` gives them (cosine: divided by both norms); None when the index keeps
    no per-layer norms (built before them, or too large to norm exactly) or for several queries at
    once. ``prepared``: the query's ``scorer.prepared_lazily(...)`` when the caller has it.
    ``offset``: ``(len(cand),)`` numbers added to each candidate's score (a classification
    query's class prior), ranked with the layers and returned as one more row, the last."""
    layer_sq = indexes.row_layer_sq_norms(s)
    if layer_sq is None or len(sketches[0]) != 1:
        return None
    scorer = indexes.scorer(s)
    if prepared is None:
        prepared = scorer.prepared_lazily(sketches)
    query_sq = prepared.sq_norms()
    xn = indexes.row_norms(s, cand) if s.cosine else None  # exact_scores' divisions
    qn = np.sqrt(max(float(query_sq.sum()), 1e-60)) if s.cosine else 1.0
    # the bounds rank scores times the query's norm (the same for every row): so is the offset
    kept, per_layer, at = bounded_rerank(
        scorer,
        prepared,
        query_sq,
        cand,
        layer_sq,
        top_k,
        opponents,
        divisor=xn,
        offset=None if offset is None else offset * qn,
    )
    if s.cosine:
        per_layer = per_layer / qn
        per_layer /= indexes.row_norms(s, kept)
    if offset is not None:  # each kept row's own offset, after its layers
        per_layer = np.concatenate([per_layer, offset[at][None, :]])
    return kept, per_layer
