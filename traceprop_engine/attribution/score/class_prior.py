"""The class prior of a classification query (``IndexSettings.class_prior``, EVAL.md §1s).

A classifier's new head starts from (near) uniform predictions ``p``, where the gradient of an
example's loss with respect to the head's bias is ``p - y``; two examples' bias gradients then
have the inner product ``[y = y'] - 1/C``. The records hold weight gradients only, so their
scores leave this term out. :class:`RowClasses` adds it back at query time, scaled to ``+1`` for
the query's class and ``-1/(C-1)`` for the others, times ``class_prior`` (cosine units).
"""

from __future__ import annotations

import numpy as np


class RowClasses:
    """The class of every index row, from its example's label (``labels``, one per row;
    empty or None: no label), and the classes among them (sorted)."""

    def __init__(self, labels: np.ndarray) -> None:
        self.classes: list[str] = sorted({x for x in labels if x})
        where = {c: i for i, c in enumerate(self.classes)}
        self.codes = np.array([where.get(x, -1) if x else -1 for x in labels], np.int64)
        self._sides: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def sides(self, label: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows of class label, rows of another class)`` as (n,) bool masks, where a prior
        of ``label`` applies (else None): the rows the candidate search looks among for the top
        proponents and opponents a large prior makes (``index/candidates.py``)."""
        if len(self.classes) < 2 or label not in self.classes:
            return None
        if label not in self._sides:  # once per label: two passes over every row
            code = self.classes.index(label)
            self._sides[label] = (self.codes == code, (self.codes >= 0) & (self.codes != code))
        return self._sides[label]

    def prior(self, label: str, weight: float, rows: np.ndarray | None = None) -> np.ndarray | None:
        """``(len(rows),)`` float64: ``weight`` for a row of class ``label``, ``-weight/(C-1)``
        for a row of another class, 0 for a row without a label; None where there is nothing to
        add (fewer than two classes, or ``label`` none of them)."""
        if len(self.classes) < 2 or label not in self.classes:
            return None
        codes = self.codes if rows is None else self.codes[rows]
        out = np.where(codes == self.classes.index(label), 1.0, -1.0 / (len(self.classes) - 1))
        out[codes < 0] = 0.0
        return weight * out


def labelled(labels) -> bool:
    """Whether the examples' labels name two classes or more (the prior can apply)."""
    return len(set(labels) - {"", None}) >= 2
