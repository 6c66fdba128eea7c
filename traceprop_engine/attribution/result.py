"""What a query produces: the test side (the query's sketches on the final model), the ranked
answer, the model's own answer and an influencer's per-token shares.

All are plain data (numpy, polars, str) defined without torch: they pickle, so the model's part
can run in another process (:mod:`~traceprop_engine.attribution.model_side.worker`) and be used
where the store is open without importing torch there."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from .score.ranking import SIGN_NOTE


@dataclass
class TestSide:
    """A query's tokens sent through the run's final model once, with the capture hooks.

    Attributes:
        sketches: per layer, the ``(1, *record_shape)`` sketch of the query's loss gradient.
        loss: the query's loss on the final model.
        query: the query's description (prompt, completion, eval example, label or token ids).
        notes: what the encoding noticed (e.g. a truncated prompt).
        elapsed_ms: the time the encoding and backward took.
        model_fingerprint: the fingerprint of the model the sketches were taken on (checked
            against the run's record when it was loaded).
        n_targets: the query's answer tokens (1 for a classification label; None: free text,
            or not known), which pick the record columns it scores against
            (``IndexSettings.columns``; :func:`~.model_side.test_side.query_targets`).
    """

    __test__ = False  # not a pytest test class

    sketches: list[np.ndarray]
    loss: float
    query: dict
    notes: list[str] = field(default_factory=list)
    elapsed_ms: float = 0.0
    model_fingerprint: str | None = None
    n_targets: int | None = None


@dataclass
class QueryResult:
    """A ranked answer with everything needed to show, export or audit it."""

    rows: pl.DataFrame
    query: dict
    notes: list[str] = field(default_factory=list)
    layer_names: list[str] = field(default_factory=list)
    elapsed_ms: float = 0.0
    sign_note: str = SIGN_NOTE
    sketches: list[np.ndarray] | None = field(default=None, repr=False)  # the query's raw sketches
    model_fingerprint: str | None = None  # of the model the query's side was computed on

    @property
    def proponents(self) -> pl.DataFrame:
        return self.rows.filter(pl.col("kind") == "proponent")

    @property
    def opponents(self) -> pl.DataFrame:
        return self.rows.filter(pl.col("kind") == "opponent")


@dataclass(frozen=True)
class ModelAnswer:
    """What the run's final model does on a query.

    Attributes:
        loss: the query's loss (mean cross-entropy over its target tokens; the same number as
            ``QueryResult.query["query_loss"]``).
        queried: the queried output (completion text, or label).
        greedy: the model's own greedy output of the same length (or its predicted label).
        matches: the greedy output equals the queried one, token for token.
        queried_ids / greedy_ids: the token ids (causal LM) or label index (classification).
    """

    loss: float
    queried: str
    greedy: str
    matches: bool
    queried_ids: tuple[int, ...]
    greedy_ids: tuple[int, ...]


@dataclass
class TokenContributions:
    """Per token of one training example: its share of the example's score against a query."""

    example_id: int
    token_ids: np.ndarray  # (n,) the example's tokens
    loss_mask: np.ndarray  # (n,) 1 where the token is a target (has a loss)
    contributions: np.ndarray  # (n,) float64; 0 on tokens without a loss
    score: float  # the recomputed score: the sum of the contributions
    stored_score: float | None  # the ranking's exact score from the stored records
    cosine: bool
