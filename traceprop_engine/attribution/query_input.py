"""What a query asks: :class:`Query`, the one owner of a query's arguments and of the rules
between them.

A query is text (``prompt`` / ``completion``, through the run's tokenizer), an example of the
run (``eval_example``), or token ids (``input_ids``, with ``labels`` -100 where no loss is
taken, or a 0/1 ``loss_mask``; neither: the loss on every token after the first); ``label`` is
the class of a classification run's text. The query methods of
:class:`~traceprop_engine.attribution.query.AttributionRun` (``query``, ``test_side``,
``encode``, ``scores``) take a Query, or its fields as keywords. Plain data: no torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..errors import QueryError

__all__ = ["Query"]


@dataclass(frozen=True, eq=False)
class Query:
    """One query, or a batch of them for ``scores()`` (lists, or 2-D ``input_ids``).

    Raises:
        QueryError: token ids together with text or an example; ``labels`` / ``loss_mask``
            without ``input_ids``.
    """

    prompt: Any = None
    completion: Any = None
    eval_example: Any = None
    label: Any = None
    input_ids: Any = None
    labels: Any = None
    loss_mask: Any = None

    def __post_init__(self) -> None:
        if self.input_ids is not None:
            if (
                self.prompt is not None
                or self.completion is not None
                or self.eval_example is not None
            ):
                raise QueryError(
                    "give the query either as input_ids (+ labels or loss_mask), or as "
                    "prompt/completion, or as eval_example, not several"
                )
        elif self.labels is not None or self.loss_mask is not None:
            raise QueryError("labels/loss_mask go with input_ids: pass input_ids=... as well")

    @classmethod
    def of(cls, prompt: Any = None, completion: Any = None, **given: Any) -> Query:
        """``prompt`` itself when it is a Query (and nothing else is given), else the Query of
        the fields given."""
        if isinstance(prompt, Query):
            if completion is not None or any(v is not None for v in given.values()):
                raise QueryError("give a Query or the fields of one, not both")
            return prompt
        return cls(prompt, completion, **given)

    @classmethod
    def from_description(cls, query: Mapping[str, Any]) -> Query:
        """The query a result describes (``QueryResult.query``): its example when it names one,
        else its token ids, else its text."""
        if query.get("eval_example") is not None:
            return cls(eval_example=query["eval_example"], label=query.get("label"))
        if query.get("input_ids") is not None:
            return cls(
                input_ids=query["input_ids"],
                loss_mask=query.get("loss_mask"),
                label=query.get("label"),
            )
        return cls(query.get("prompt"), query.get("completion"), label=query.get("label"))

    def given(self) -> dict[str, Any]:
        """The fields that are set, as keywords."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def split(self) -> tuple[list[Query], bool]:
        """The single queries of a batch, and whether this was a batch."""
        if self.input_ids is not None:
            if not _is_batch(self.input_ids):
                return [self], False
            n = len(self.input_ids)
            for name, v in (("labels", self.labels), ("loss_mask", self.loss_mask)):
                if v is not None and len(v) != n:
                    raise QueryError(f"{name} holds {len(v)} rows for {n} queries in input_ids")
            lab = _per_query(self.label, n)
            return [
                Query(
                    input_ids=self.input_ids[i],
                    labels=None if self.labels is None else self.labels[i],
                    loss_mask=None if self.loss_mask is None else self.loss_mask[i],
                    label=lab[i],
                )
                for i in range(n)
            ], True
        if isinstance(self.eval_example, list | tuple):
            return [Query(eval_example=int(e), label=self.label) for e in self.eval_example], True
        if isinstance(self.prompt, list | tuple):
            n = len(self.prompt)
            comp, lab = _per_query(self.completion, n), _per_query(self.label, n)
            if len(comp) != n or len(lab) != n:
                raise QueryError(f"completion/label must give one entry per prompt ({n})")
            return [
                Query(p, c, label=la) for p, c, la in zip(self.prompt, comp, lab, strict=True)
            ], True
        return [self], False


def _per_query(value: Any, n: int) -> list:
    return list(value) if isinstance(value, list | tuple) else [value] * n


def _is_batch(x) -> bool:
    if x is None or isinstance(x, str):
        return False
    if hasattr(x, "ndim"):  # a numpy array or a torch tensor
        return x.ndim == 2
    return isinstance(x, list | tuple) and len(x) > 0 and not np.isscalar(x[0])
