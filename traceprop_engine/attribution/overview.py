"""What a run opened for attribution offers a reader (the app's Influencers page, a script):
its size, its notes, the preconditioners its store supports and the tokens of an example.

Callers use these instead of reaching into ``AttributionRun.store``; the caller serialises
them with its queries (the store is one HDF5 handle, not safe to read from two threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..settings import PreconditionerKind, SketchKind


def usable_preconditioners(store) -> list[PreconditionerKind]:
    """Identity always; K-FAC and EK-FAC when the store has K-FAC covariance (factored
    sketches recorded with ``covariance``) or holds dense sketches (fitted from the records)."""
    if store.has_covariance or SketchKind(store.sketch) is SketchKind.DENSE:
        return list(PreconditionerKind)
    return [PreconditionerKind.IDENTITY]


@dataclass(frozen=True)
class RunOverview:
    """One line's worth of facts about a run opened for attribution."""

    run_id: str
    task: str
    n_records: int
    n_layers: int
    notes: tuple[str, ...]  # e.g. a partial store (cancelled or failed run)
    preconditioners: tuple[str, ...]


def describe(run) -> RunOverview:
    """The overview of an :class:`~traceprop_engine.attribution.query.AttributionRun`."""
    return RunOverview(
        run_id=run.run_id,
        task=run.task,
        n_records=int(run.store.n_records),
        n_layers=len(run.store.layers),
        notes=tuple(run.notes),
        preconditioners=tuple(k.value for k in usable_preconditioners(run.store)),
    )


def example_tokens(run, example_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The token ids and loss mask example ``example_id`` was trained on (from the store)."""
    return run.store.tokens(int(example_id))
