"""Query-time terms added to the records' scores: a head bias's gradient, which the weight
records leave out.

- A classification query's class prior (``IndexSettings.class_prior``,
  :mod:`~.score.class_prior`): the classifier head's bias at uniform predictions.
- A causal-LM query's LM-bias term (``IndexSettings.lm_bias``, :mod:`~.score.lm_bias`): the
  cosine of the LM head's output-bias gradients, from the records' first column.

At most one applies to a query (a run is a classifier or a causal LM). It is added to every
score after the cosine's division, ranked with the layers, and shown as one more "layer" of a
hit's per-layer scores, the last (:data:`~.score.ranking.CLASS_PRIOR_LAYER`,
:data:`~.score.ranking.LM_BIAS_LAYER`).
"""

from __future__ import annotations

import weakref

import numpy as np

from .. import constants as C
from ..errors import StoreError
from ..settings import IndexSettings
from .query_sketches import label_of
from .score.class_prior import RowClasses
from .score.lm_bias import HeadBias, head_layer
from .score.ranking import CLASS_PRIOR_LAYER, LM_BIAS_LAYER


class QueryTermsMixin:
    """The query-time terms of :class:`~.query.AttributionRun` (``store``, ``indexes``,
    ``settings`` and ``examples`` on the class it is mixed into)."""

    _classes: tuple | None = None  # (index ids, their RowClasses)
    _head_bias: weakref.WeakKeyDictionary  # each index build's scorer -> its HeadBias

    def term_scores(self, sketches, s: IndexSettings, rows: np.ndarray | None = None):
        """The query-time term of one query against index ``rows`` (default: all): its class
        prior (:meth:`class_prior_scores`) or its LM-bias term (:meth:`lm_bias_scores`).

        Returns:
            (n,) float64 in the units of the scores (cosine), or None where none applies.
        """
        prior = self.class_prior_scores(sketches, s, rows)
        return prior if prior is not None else self.lm_bias_scores(sketches, s, rows)

    def term_layer(self, sketches, s: IndexSettings) -> str | None:
        """The name of the query's term among a hit's per-layer scores, or None: where
        :meth:`term_scores` gives one, from what applies, without scoring any row."""
        if self.label_sides(sketches, s) is not None:  # the prior's conditions (RowClasses)
            return CLASS_PRIOR_LAYER
        return LM_BIAS_LAYER if self._lm_bias(sketches, s)[1] is not None else None

    def term_candidates(self, sketches, s: IndexSettings, opponents: bool):
        """What proposes the rows a large term places (``index/candidates.py``): ``(the class
        prior's label sides or None, the LM-bias term's ends as a function of how many rows a
        side, or None)``."""
        sides = self.label_sides(sketches, s)
        hb, q = self._lm_bias(sketches, s)
        return sides, (None if q is None else (lambda k: hb.ends(q, k, opponents)))

    # -- class prior ----------------------------------------------------------------------------
    def class_prior_scores(
        self, sketches, s: IndexSettings, rows: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The class prior of a classification query against index rows ``rows`` (default: all,
        :mod:`~.score.class_prior`): ``class_prior`` for an example of the query's label,
        ``-class_prior/(C-1)`` for another class's, 0 without a label.

        Returns:
            (n,) float64, or None where the prior adds nothing: ``class_prior`` 0 (resolved), a
            query without a label (a causal LM, or sketches made without the encoder), fewer
            than two classes, or a label no indexed example has.
        """
        classes, label, s = self._row_classes(sketches, s)
        return None if classes is None else classes.prior(label, s.class_prior, rows)

    def label_sides(self, sketches, s: IndexSettings):
        """``(rows of the query's label, rows of other labels)`` (bool masks over the index
        rows) where the query gets a class prior, else None (``index/candidates.py``)."""
        classes, label, _ = self._row_classes(sketches, s)
        return None if classes is None else classes.sides(label)

    def _row_classes(self, sketches, s: IndexSettings):
        """``(the index rows' RowClasses or None where no prior applies, label, settings)``."""
        s = self.settings(s)
        label = label_of(sketches)
        if not s.class_prior or label is None:
            return None, label, s
        ids = self.indexes.scorer(s).ids
        if self._classes is None or self._classes[0] is not ids:  # one per index build
            self._classes = (ids, RowClasses(self.examples()["label"].to_numpy()[ids]))
        return self._classes[1], label, s

    # -- LM bias --------------------------------------------------------------------------------
    def lm_bias_scores(
        self, sketches, s: IndexSettings, rows: np.ndarray | None = None
    ) -> np.ndarray | None:
        """``lm_bias`` times the LM-bias term of one causal-LM query against index ``rows``
        (default: all; :mod:`~.score.lm_bias`).

        Returns:
            (n,) float64, or None where it adds nothing: ``lm_bias`` 0 (resolved), no LM head
            recorded with a signed bias column, or sketches without the head's factors.
        """
        hb, q = self._lm_bias(sketches, s)
        if q is None:
            return None
        return self.settings(s).lm_bias * hb.scores(q, rows)

    def _lm_bias(self, sketches, s: IndexSettings):
        """``(the index rows' HeadBias, the query's vector)``, or ``(None, None)``."""
        s = self.settings(s)
        if not s.lm_bias or head_layer(self.store) is None:
            return None, None
        scorer = self.indexes.scorer(s)
        hb = self._head_bias.get(scorer)
        if hb is None:  # once per index build (a rebuilt index has a new scorer)
            hb = self._head_bias[scorer] = HeadBias(self.store, scorer, self._head_moment())
        q = hb.query(sketches)
        return (hb, q) if q is not None else (None, None)

    def _head_moment(self) -> np.ndarray | None:
        """The diagonal the term whitens by: the final model's LM-head output factor's (one
        forward pass over up to 256 stored examples, cached beside the indexes,
        ``model_side/statistics.py head_moment``), or None (the inline factor's) where the store
        keeps no example tokens to fit on."""
        from .model_side.statistics import head_moment

        try:
            return head_moment(self, head_layer(self.store), self.dir / C.INDEX_DIR)
        except StoreError:
            return None
