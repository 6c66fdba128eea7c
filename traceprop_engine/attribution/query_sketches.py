"""A query's sketches with the per-token factors they are sums of.

The query-side capture (:meth:`~traceprop_engine.attribution.model_side.encode.QueryEncoder.query_sketches`)
computes each factored layer's sketch as ``T = Σ_t (P_out g_t)(P_in a_t)ᵀ``, so it has the factors
``T = A Bᵀ`` with ``A = [P_out g_t]`` ``(k_out, t)`` and ``B = [P_in a_t]`` ``(k_in, t)`` in hand:
one column per token whose gradient is not zero (at the LM head the loss tokens, at the first
layers the whole sequence). Scoring keeps them
(:class:`~traceprop_engine.attribution.score.scoring.PreparedQuery`): the preconditioned query is
then ``T' = (L² A)(R² B)ᵀ`` for K-FAC (two thin products instead of two ``k × k × k`` ones) and
``⟨T', U Vᵀ⟩`` of a stored rank-r record costs ``O((k_out + k_in) r t)``, with no factoring of
``T'`` per query (``benchmarks/EVAL.md`` §1m).

:class:`QuerySketches` is a ``list`` of the per-layer ``(1, *record_shape)`` sketches, so every
caller that takes a query's sketches takes it unchanged, and it carries ``factors`` beside them:
per layer ``(A, B)`` float32, or None (a dense layer, or sketches made without the capture).
For a classification query it also carries ``label``, the queried class, which the class prior
compares with each training example's label. Anything that builds a new list from it (a slice,
a copy) keeps the sketches only: scoring falls back to factoring ``T'`` itself, and adds no
class prior.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

Factors = tuple[np.ndarray, np.ndarray]


class QuerySketches(list):
    """Per-layer sketches of one query (a list of arrays) with ``factors``: per layer ``(A, B)``
    with ``A Bᵀ`` equal to the layer's sketch up to float32 rounding, or None; and ``label``,
    the queried class of a classification query (what its class prior compares the training
    labels with, ``IndexSettings.class_prior``), or None."""

    def __init__(
        self,
        sketches: Iterable[np.ndarray],
        factors: Sequence[Factors | None],
        label: str | None = None,
    ) -> None:
        super().__init__(sketches)
        if len(factors) != len(self):
            raise ValueError(f"{len(factors)} layers of factors for {len(self)} sketches")
        self.factors: list[Factors | None] = list(factors)
        self.label = label


def label_of(sketches) -> str | None:
    """The queried class of one classification query's sketches, or None (a causal-LM query,
    or sketches made without the encoder)."""
    return getattr(sketches, "label", None)


def factors_of(sketches) -> list[Factors | None] | None:
    """The per-layer factors of one query's sketches, or None (no factors, or not one query)."""
    f = getattr(sketches, "factors", None)
    if f is None or len(f) != len(sketches) or len(np.shape(sketches[0])) < 1:
        return None
    return f if np.shape(sketches[0])[0] == 1 else None
