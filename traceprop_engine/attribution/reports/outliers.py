"""Query-independent rankings of training examples (``traceprop rank``): self-influence, gradient
norm, or the last recorded training loss, highest first, joined with each example's source."""

from __future__ import annotations

from enum import Enum

import numpy as np
import polars as pl

from ... import constants as C
from ...settings import parse_choice


class RankBy(str, Enum):
    SELF_INFLUENCE = "self-influence"  # τ(i, i) = ‖H^-1/2 S_i‖² under the preconditioner
    GRADIENT_NORM = "gradient-norm"  # the raw sketch norm
    LOSS = "loss"  # the example's last recorded training loss

    @property
    def column(self) -> str:
        return self.value.replace("-", "_")


def last_training_loss(store) -> pl.DataFrame:
    """``example_id, loss``: each example's loss at the last step that recorded it."""
    rec = store.records()
    df = pl.DataFrame(
        {"example_id": rec[C.REC_EXAMPLE], "step": rec[C.REC_STEP], "loss": rec[C.REC_LOSS]}
    )
    return df.sort("step").group_by("example_id").agg(pl.col("loss").last())


def rank_examples(run, by: RankBy | str = RankBy.SELF_INFLUENCE, settings=None) -> pl.DataFrame:
    """Every example of ``run`` ranked by ``by``, highest first (missing values last).

    Args:
        run: an :class:`~traceprop_engine.attribution.query.AttributionRun`.
        by: what to rank by.
        settings: the ``IndexSettings`` of self-influence and gradient norm (its preconditioner).

    Returns:
        ``example_id, <by's column>, source, row, sha256, text, rank`` (``rank`` from 1); the
        score column is ``by.column`` (``self_influence``, ``gradient_norm`` or ``loss``).
    """
    by = parse_choice(RankBy, by, "rank by")
    df = last_training_loss(run.store) if by is RankBy.LOSS else run.self_influence(settings)
    ex = run.examples().select("example_id", "source", "row", "sha256", "text")
    df = df.join(ex, on="example_id", how="left").sort(by.column, descending=True, nulls_last=True)
    return df.with_columns(pl.Series("rank", np.arange(1, df.height + 1)))
