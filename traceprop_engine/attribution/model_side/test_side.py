"""The test side of a run opened for attribution: its saved model and a query's sketches on it.

:class:`TestSideMixin` gives :class:`~traceprop_engine.attribution.query.AttributionRun` the
methods that need torch (the model, the query's tokens, its backward with the capture hooks),
through a :class:`~traceprop_engine.attribution.model_side.encode.QueryEncoder` made on first use:
opening a run, its examples, its index and the ranking of given sketches import no torch, so an app
can leave the model to another process (:mod:`~traceprop_engine.attribution.model_side.worker`) and
rank here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..query_input import Query
from ..result import TestSide

if TYPE_CHECKING:
    from ...capture.layers import TrackedLayer
    from .encode import QueryEncoder


class TestSideMixin:
    """Needs ``dir``, ``manifest``, ``store``, ``task``, ``examples``, ``device`` and
    ``_encoder`` (None until first use) on the class it is mixed into."""

    __test__ = False  # not a pytest test class

    @property
    def encoder(self) -> QueryEncoder:
        """The test side (the saved model, torch): opening a run, its examples, index and
        rankings of given sketches import no torch (a query worker can hold the model)."""
        if self._encoder is None:
            from .encode import QueryEncoder

            self._encoder = QueryEncoder(
                self.dir, self.manifest, self.store, self.task, self.examples, self.device
            )
        return self._encoder

    def model(self):
        """The run's final model, tokenizer and labels (a ``LoadedModel``), loaded once."""
        return self.encoder.model()

    def tracked_layers(self) -> list[TrackedLayer]:
        """The store's tracked layers on the loaded model (what the query-side hooks capture)."""
        return self.encoder.tracked_layers()

    def encode(self, prompt: Query | str | None = None, completion: str | None = None, **query):
        """Tokens of a query (a :class:`~traceprop_engine.attribution.query_input.Query`, or its
        fields) as training saw them; returns ``(Encoded, query description, notes)``."""
        return self.encoder.encode(Query.of(prompt, completion, **query))

    def query_sketches(self, enc) -> tuple[list[np.ndarray], float]:
        """Per-layer ``(1, *record_shape)`` sketches of the query's loss on the final model."""
        return self.encoder.query_sketches(enc)

    def representations(self, encs) -> np.ndarray:
        """Mean-pooled final hidden state of each encoded example (representation-similarity baseline)."""
        return self.encoder.representations(encs)

    def test_side(
        self, prompt: Query | str | None = None, completion: str | None = None, **query
    ) -> TestSide:
        """The query's sketches and loss on the final model (the torch part of :meth:`query`);
        the query as for :meth:`encode`.

        Raises:
            QueryError: as for :meth:`query`.
        """
        t0 = time.perf_counter()
        q = Query.of(prompt, completion, **query)
        enc, desc, notes = self.encoder.encode(q)
        if q.input_ids is not None:
            desc = {
                "prompt": None,
                "completion": None,
                "input_ids": enc.ids.tolist(),
                "loss_mask": enc.loss_mask.tolist(),
            }
        sk, qloss = self.query_sketches(enc)
        elapsed = (time.perf_counter() - t0) * 1e3
        notes = [*self.encoder.model_notes, *notes]
        return TestSide(
            sk, qloss, desc, notes, elapsed, self.encoder.model_fingerprint, query_targets(enc)
        )


def query_targets(enc) -> int | None:
    """The answer tokens of an encoded query, which pick the record columns it scores against
    (:func:`~traceprop_engine.attribution.column_choice.resolve_columns`): 1 for a classification label
    (its mask marks every token); a causal LM query's loss tokens where a prompt comes before
    them (an answer, a completion); None for free text, a query whose loss starts at its second
    token (the first has no prediction; padding after the last target does not count): it scores
    against every column at any length (free-text queries of 2-16 tokens lost 0.13-0.16 LDS
    against the first column alone, benchmarks/EVAL.md §1z)."""
    if getattr(enc, "label", -1) >= 0:
        return 1
    targets = np.flatnonzero(np.asarray(enc.loss_mask))
    return None if len(targets) and targets[0] <= 1 else int(len(targets))
