"""A store read through the first ``c`` columns of its rank-r factor records.

A record stored at rank ``r > 1`` (a free-text run, ``TrackSettings.free_text_rank``) is
``U Vᵀ = Σ_j u_j v_jᵀ``, and its first column ``u_0 v_0ᵀ`` is exactly the rank-1 record the
default keeps (``û ûᵀ G``, ``û = Σ_t g_t / ‖·‖``: the half power step starts its first column
there, :func:`~traceprop_engine.capture.sketch.full_factors`). A free-text query (a loss on
every token, short or long) is scored best against every column, a short answer against that
column alone or against every column, by the query
(:mod:`~traceprop_engine.attribution.column_choice`, benchmarks/EVAL.md §1y-§1aa):
:class:`ColumnView` is the store as rank-``c`` records, for the indexes and scorers of such
queries (``IndexSettings.columns``).

Everything but the factors (records table, examples, statistics, projections) is the store's.
An int8 record keeps its one scale: the first columns decode to the same numbers as in the
whole record.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import constants as C
from ..errors import StoreError


class ColumnView:
    """``store`` with every factor layer of rank above ``columns`` read as its first ``columns``.

    Args:
        store: a :class:`~.reader.Store` or :class:`~.sharded.ShardedStore`.
        columns: the columns kept (>= 1).
    """

    def __init__(self, store, columns: int) -> None:
        if columns < 1:
            raise StoreError(f"a column view keeps at least one column, got {columns}")
        self.base = store
        self.columns = int(columns)
        self.layers = [
            dataclasses.replace(info, rank=min(info.rank, self.columns)) if info.rank else info
            for info in store.layers
        ]

    def __getattr__(self, name: str):  # everything else is the store's
        return getattr(self.base, name)

    @property
    def fingerprint(self) -> str:
        return f"{self.base.fingerprint}:columns{self.columns}"

    @property
    def dim(self) -> int:
        return sum(layer.dim for layer in self.layers)

    def factors(
        self, layer: int, start: int = 0, stop: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        c = self.layers[layer].rank
        if not c:
            return self.base.factors(layer, start, stop)  # raises: full sketches
        return self.base.factors(layer, start, stop, columns=c)  # only those columns read

    def factors_at(self, layer: int, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = self.layers[layer].rank
        if not c:
            return self.base.factors_at(layer, records)  # raises: full sketches
        return self.base.factors_at(layer, records, columns=c)  # only those columns read

    def sketches(self, layer: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        if not self.layers[layer].rank:
            return self.base.sketches(layer, start, stop)
        u, v = self.factors(layer, start, stop)
        return np.matmul(u, v.transpose(0, 2, 1))

    def sketches_at(self, layer: int, records: np.ndarray) -> np.ndarray:
        if not self.layers[layer].rank:
            return self.base.sketches_at(layer, records)
        u, v = self.factors_at(layer, records)
        return np.matmul(u, v.transpose(0, 2, 1))


def column_view(store, columns: int):
    """``store`` read through its first ``columns`` factor columns; ``store`` itself when no
    layer has more (or ``columns`` is 0: every column)."""
    if columns and any(info.rank > columns for info in store.layers):
        return ColumnView(store, columns)
    return store


def query_columns(layers, n_targets: int | None) -> int:
    """The columns a query of ``n_targets`` answer tokens scores against by its length alone: 1
    for a short answer or a label (at most :data:`~traceprop_engine.constants.FREE_TEXT_TARGETS`)
    on records of rank above 1, which
    :func:`~traceprop_engine.attribution.column_choice.resolve_columns` then settles by the
    query's scores; every column (0) otherwise: a longer answer, and free text at any length
    (``n_targets`` None, :func:`~traceprop_engine.attribution.model_side.test_side.query_targets`)."""
    short = n_targets is not None and n_targets <= C.FREE_TEXT_TARGETS
    return 1 if short and any(info.rank > 1 for info in layers) else 0


def columns_note(
    layers, columns: int, n_targets: int | None, tails: tuple[float, float] | None = None
) -> str | None:
    """What a query's automatic choice of record columns was, and why (records of rank above 1
    only; None otherwise): the query's note beside its result. ``tails``: the excess kurtosis of
    its scores against the first column and against every column, when they chose."""
    rank = max((info.rank for info in layers), default=0)
    if rank <= 1:
        return None
    where = (
        f"the first of the records' {rank} columns (the rank-1 record)"
        if columns == 1
        else f"all {rank} columns of the records"
    )
    if tails is not None:
        one = n_targets == 1
        what = "a label or a one-token answer" if one else f"an answer of {n_targets} loss tokens"
        return (
            f"scored against {where}: the query is {what}, and its scores there have the heavier "
            f"tails (kurtosis {tails[1 - columns]:.1f} against {tails[columns]:.1f}); "
            f"--columns {1 - columns} (IndexSettings(columns={1 - columns})) scores "
            + ("every column" if columns == 1 else "the first column alone")
        )
    if columns == 1:  # chosen without the query's scores
        return f"scored against {where}: the query is a short answer"
    why = (
        "free text (a loss on every token)"
        if n_targets is None
        else f"an answer of {n_targets} loss tokens, more than {C.FREE_TEXT_TARGETS}"
    )
    return f"scored against {where}: the query is {why}"
