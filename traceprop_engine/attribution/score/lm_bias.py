"""The LM-bias term of a causal-LM query (``IndexSettings.lm_bias``, benchmarks/EVAL.md §1ab).

A causal LM's head ``z_t = W h_t`` (most have no bias) is trained by the output gradients
``g_t = p_t − e_{y_t}`` of its target tokens. The gradient of an example's loss with respect to
a (zero) output bias is ``σ = Σ_t g_t``: what the example teaches the next token's marginal,
whatever the context. The weight records (``Σ_t g_t h_tᵀ``) mix it with the contexts ``h_t``, and
their scores leave it out; it is the part of the answer keyword search on the answer word finds
(retrained models' answer losses on facts as running text follow how many training texts have
the answer as a target). A classifier's head bias is added back the same way by the class prior
(``class_prior.py``).

The records carry it already: a head's record starts from ``Σ_t g_t`` (``capture/sketch.py
full_factors``), so its first ``U`` column is the direction ``û = P_out σ / ‖P_out σ‖``, sign
included in a store written since 2026-12-07 (the layer attribute ``bias_column``). The query's
``P_out σ_q`` is the sum of its head factor's token columns (``query_sketches.py``). Both are
divided by ``√s``, ``s`` the diagonal of the head's K-FAC output factor **of the final model**
(the output gradients' second moment per projected coordinate, damped by :data:`DAMPING` of its
mean; ``model_side/statistics.py head_moment`` fits it once, a forward pass over 256 stored
examples, and caches it beside the indexes), so a frequent
token's share of every ``σ`` does not decide the similarity. The inline factor, summed over the
whole trajectory, weighs the tokens as the first steps' near-uniform predictions did: whitened
by it the term lost up to 0.05 LDS on prose where the final model's gained (benchmarks/EVAL.md
§1ab). The term is the cosine:

    b(q, i) = ⟨s^{-1/2} P σ_q, s^{-1/2} û_i⟩ / (‖s^{-1/2} P σ_q‖ ‖s^{-1/2} û_i‖)   ∈ [−1, 1],

an example's ``û_i`` the weighted sum of its records' (``IndexSettings.records``), and the score
``cosine + lm_bias · b``. Only ``σ``'s direction is kept, so the term has no natural weight
against the records'; :data:`~traceprop_engine.index_settings.DEFAULT_LM_BIAS` was measured.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..query_sketches import factors_of

DAMPING = 1e-3
"""``s`` is damped by this fraction of its mean: a coordinate no training token moved (a
vocabulary row of unseen tokens) would otherwise divide by 0."""

_BLOCK = 65_536  # records read at a time

TEXT_SAMPLE = 256
"""Stored examples (evenly spaced) :func:`trained_on_text` reads the loss masks of."""
_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> trained_on_text


def trained_on_text(store) -> bool:
    """Whether the run was trained on text: most of its examples (of :data:`TEXT_SAMPLE`
    stored ones) take a loss on every token after the first, at any length, where a run on
    answers or labels takes it on a few (the term's default, ``overview.default_lm_bias``).
    False for a store that keeps no example tokens."""
    if store not in _TEXT:
        n = int(store.n_examples)
        ids = np.unique(np.linspace(0, n - 1, min(n, TEXT_SAMPLE)).round().astype(np.int64))
        every = [bool(np.all(m[1:])) for m in (store.tokens(int(i))[1] for i in ids) if len(m) > 1]
        _TEXT[store] = bool(every) and 2 * sum(every) > len(every)
    return _TEXT[store]


def head_layer(store) -> int | None:
    """The store's output head whose records carry the signed bias column, or None (no LM head
    recorded: a classifier, LoRA adapters; or a store written before the column was signed)."""
    for info in store.layers:
        if info.output_head and getattr(info, "bias_column", False) and info.rank:
            return info.index
    return None


class HeadBias:
    """The whitened unit bias directions of every index row of one scorer, and a query's.

    Args:
        store: the run's store (its head layer's records).
        scorer: the index's :class:`~.scoring.ExactScorer` (its rows, and each record's row and
            weight).
        moment: the diagonal of the head's K-FAC output factor that whitens (the final
            model's, ``head_moment``; None: the store's inline factor's; none there either:
            unwhitened).

    Raises:
        ValueError: the store has no head with a bias column (check :func:`head_layer` first).
    """

    def __init__(self, store, scorer, moment: np.ndarray | None = None) -> None:
        li = head_layer(store)
        if li is None:
            raise ValueError("the store records no LM head with a signed bias column")
        self.layer = li
        k_out = store.layers[li].k_out
        cov = store.covariance(li) if moment is None else None
        if moment is not None:
            s = np.maximum(np.asarray(moment, np.float64), 0.0)
        elif cov is not None and cov.n_tokens:
            s = np.maximum(np.diag(cov.S) / cov.n_tokens, 0.0)
        else:  # no statistics (a partial store): unwhitened
            s = np.ones(k_out)
        s = s + DAMPING * max(float(s.mean()), 1e-30)
        self.inv_sqrt = 1.0 / np.sqrt(s)
        rows = np.zeros((scorer.n_rows, k_out))
        for start in range(0, store.n_records, _BLOCK):
            u = store.factors(li, start, start + _BLOCK, columns=1)[0][:, :, 0].astype(np.float64)
            u /= np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-30)
            row = scorer.rec_row[start : start + len(u)]
            w = scorer.rec_weight[start : start + len(u)]
            keep = (row >= 0) & (w != 0)
            np.add.at(rows, row[keep], u[keep] * w[keep, None])
        rows *= self.inv_sqrt
        rows /= np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
        self.vectors = rows.astype(np.float32)  # (n_rows, k_out), unit (0: no weighted record)

    def query(self, sketches) -> np.ndarray | None:
        """The query's whitened unit ``s^{-1/2} P σ_q`` (k_out,) float32, or None where its
        sketches carry no factors (several queries, or made without the capture) or its head
        gradient is 0 (no loss token)."""
        f = factors_of(sketches)
        if f is None or self.layer >= len(f) or f[self.layer] is None:
            return None
        q = np.asarray(f[self.layer][0], np.float64).sum(1) * self.inv_sqrt
        n = np.linalg.norm(q)
        return (q / n).astype(np.float32) if n > 0 else None

    def scores(self, q: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """``b(q, i)`` of index ``rows`` (default: all), (n,) float64."""
        x = self.vectors if rows is None else self.vectors[rows]
        return (x @ q).astype(np.float64)

    def ends(self, q: np.ndarray, k: int, opponents: bool) -> np.ndarray:
        """The ``k`` rows of the largest ``b`` (and, with ``opponents``, the ``k`` of the
        smallest): candidates for the exact re-rank, which a large weight can place above the
        rows FAISS finds on the records alone (``index/candidates.py``)."""
        b = self.scores(q)
        if k >= len(b):
            return np.arange(len(b), dtype=np.int64)
        top = np.argpartition(-b, k - 1)[:k]
        if opponents:
            top = np.concatenate([top, np.argpartition(b, k - 1)[:k]])
        return top.astype(np.int64)
