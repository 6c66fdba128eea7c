"""How a run's index is built: :class:`IndexSettings` (preconditioner, damping, cosine, index kind
and its knobs) and its choices; part of every index's fingerprint. Re-exported by
:mod:`traceprop_engine.settings` with the other stages' settings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from . import constants as C
from .errors import ConfigError
from .knobs import check_damping, document_fields, knob, parse_choice


class PreconditionerKind(str, Enum):
    """Which approximation of the Fisher/Gauss-Newton ``H`` to invert
    (:mod:`traceprop_engine.attribution.precondition.preconditioner`)."""

    AUTO = "auto"  # the run's default: kfac, ekfac or identity (overview.resolve_settings)
    IDENTITY = "identity"
    KFAC = "kfac"
    EKFAC = "ekfac"

    @property
    def fitted(self) -> PreconditionerKind:
        """The kind fitted where the run's task is unknown (``RunIndexes``,
        ``fit_preconditioner``, ``fit_layer``, index names and fingerprints): ``auto`` is
        ``kfac`` there, as it was before ``auto`` existed; ``AttributionRun.settings`` resolves
        ``auto`` per run first (EK-FAC for a pretrained classifier fine-tuned in full, identity
        for a run without statistics)."""
        return PreconditionerKind.KFAC if self is PreconditionerKind.AUTO else self


class RecordChoice(str, Enum):
    """Which of an example's records score it
    (:func:`~traceprop_engine.attribution.score.record_weights.record_weights`)."""

    ALL = "all"
    LAST_EPOCH = "last-epoch"


class LayerWeighting(str, Enum):
    """How K-FAC / EK-FAC weigh the layers against each other
    (:mod:`traceprop_engine.attribution.precondition.preconditioner`)."""

    AUTO = "auto"  # fisher for a pretrained causal LM fine-tuned in full, recorded otherwise
    RECORDED = "recorded"  # each layer keeps its records' share; the output head unwhitened
    FISHER = "fisher"  # every layer, the head too, at the per-example Fisher's own scale


class StatisticsSource(str, Enum):
    """Which K-FAC statistics K-FAC / EK-FAC whiten with
    (:mod:`traceprop_engine.attribution.model_side.statistics`)."""

    AUTO = "auto"  # both where the weighting resolves to fisher, inline otherwise
    INLINE = "inline"  # the run's own, recorded in the training backward (the store's)
    FINAL = "final"  # fitted on the final model over the stored training examples
    BOTH = "both"  # the mean of the inline and the final model's per-token statistics


class IndexKind(str, Enum):
    """Which FAISS index to build (:mod:`traceprop_engine.attribution.index.vector_index`)."""

    AUTO = "auto"
    FLAT = "flat"
    IVF = "ivf"
    IVFPQ = "ivfpq"
    HNSW = "hnsw"


INDEX_SIDE = 16
"""m of the m × m index projection of layers with larger sketches (IndexSettings.index_side):
the top-m principal directions of each side of a layer's records, m² numbers per layer. Its
scores only pick candidates: every returned score is recomputed exactly from the store."""
INDEX_DIMS = 256
"""Index vectors are reduced to their top principal directions over all layers
(IndexSettings.index_dims; 0: no reduction): 1 KB per example whatever the model."""


DEFAULT_DAMPING = 0.1
"""Damping as a fraction of each factor's mean eigenvalue (a common heuristic; overridable)."""

DEFAULT_CLASS_PRIOR = 1.0
"""The class prior of a classification run scored with cosine (``IndexSettings.class_prior``
left at auto), in cosine units: the best mean LDS over fifteen classification pairs of three
kinds (MiniLM fine-tuned in full, with LoRA, and a classifier trained from random weights), checked
on four held-out ones (benchmarks/EVAL.md §1t; 0.2 until stop 48, §1s). A run that trained
adapters takes :data:`ADAPTER_CLASS_PRIOR` instead."""
ADAPTER_CLASS_PRIOR = 0.2
"""The class prior of a classification run that trained adapters (peft LoRA; the store's
``model_origin`` is ``adapter``), whose records order a class better than its label alone: 0.2
scored above 1 on 7 of 9 LoRA classifier pairs of two models, a mean +0.009 (+0.006 on the four
held out when it was chosen; benchmarks/EVAL.md §1v)."""

DEFAULT_LM_BIAS = 0.2
"""The LM-bias term of a free-text causal-LM run (``IndexSettings.lm_bias`` left at auto), in
cosine units (:mod:`~traceprop_engine.attribution.score.lm_bias`): the best mean LDS over fourteen
free-text pairs of five kinds (facts as running text, prose, continuations of prose), above the
records alone on every one (+0.004 to +0.188; 0.1: +0.027 mean, 0.3: two pairs below), checked on
five held-out pairs (benchmarks/EVAL.md §1ab)."""


@document_fields
@dataclass(frozen=True)
class IndexSettings:
    """How the index of a run is built (part of its fingerprint).

    Default: K-FAC preconditioning from the run's inline statistics with cosine scores
    (normalised, so a few large-gradient examples do not top every query), each example scored
    by its records of the last epoch it was trained in; ``preconditioner='auto'`` answers a
    pretrained classifier fine-tuned in full with EK-FAC, and a run without K-FAC statistics
    with identity, and a classification run adds the class prior ``class_prior``
    (``AttributionRun.settings``).
    """

    preconditioner: PreconditionerKind = knob(
        PreconditionerKind(C.DEFAULT_PRECONDITIONER),
        help="the approximation of H^-1: kfac (K-FAC from the stored statistics; identity on a "
        "run without them), identity, ekfac (K-FAC with eigenvalues corrected from the stored "
        "records) or auto (kfac, except ekfac for a pretrained classifier fine-tuned in full, "
        "where EK-FAC scored above K-FAC on every run measured, benchmarks/EVAL.md section 1r; "
        "identity on a run without statistics)",
    )
    damping: float | None = knob(
        None,
        help="damping as a fraction of each factor's mean eigenvalue (None: the default, "
        "DEFAULT_DAMPING)",
    )
    cosine: bool = knob(True, help="cosine scores (normalised vectors) or raw inner products")
    per_record: bool = knob(
        False, help="one vector per record (example x epoch) instead of per example"
    )
    records: RecordChoice = knob(
        RecordChoice.LAST_EPOCH,
        help="which of an example's records score it: last-epoch (those of the last epoch the "
        "example was trained in, each at that epoch's mean learning rate) or all (the whole "
        "trajectory, each at its step's learning rate)",
    )
    weighting: LayerWeighting = knob(
        LayerWeighting.AUTO,
        help="how K-FAC / EK-FAC weigh the layers: recorded (each layer keeps its records' share "
        "of the score, the output head scored as recorded), fisher (every layer, the output head "
        "too, whitened at the per-example Fisher's own scale, as kronfluence scores) or auto "
        "(fisher for a pretrained causal LM fine-tuned in full, recorded otherwise: from scratch "
        "the head carries the attribution and fisher drops LDS to ~0.1, and it lowered LoRA runs "
        "and a pretrained classifier too; benchmarks/EVAL.md §1p)",
    )
    statistics: StatisticsSource = knob(
        StatisticsSource.AUTO,
        help="the K-FAC statistics K-FAC / EK-FAC whiten with: inline (the run's own, recorded "
        "during training), final (fitted on the final model over up to 1024 of the stored "
        "training examples, once, cached beside the indexes), both (the mean of the two) or "
        "auto (both where the weighting resolves to fisher, inline otherwise: on a pretrained "
        "causal LM fine-tuned in full the inline statistics alone lost up to 0.05 LDS; "
        "benchmarks/EVAL.md §1q)",
    )
    kind: IndexKind = knob(IndexKind.AUTO, help="FAISS index (auto: exact up to 200k vectors)")
    index_side: int = knob(
        INDEX_SIDE,
        help="m of the m x m index projection of layers with larger sketches (0: none); "
        "candidates only, every returned score is exact",
    )
    index_dims: int = knob(
        INDEX_DIMS,
        help="index vectors reduced to their top principal directions over all layers (0: no "
        "reduction)",
    )
    lists: bool | None = knob(
        None,
        help="factor lists: a second candidate search over the records of the layers holding "
        "most of the gradient energy (None: from 200k index rows on, where FAISS is an IVF "
        "index; True: on any run whose records allow it; False: never)",
    )
    columns: int | None = knob(
        None,
        help="the columns of rank-r records that score (a free-text run records rank 16, "
        "TrackSettings.free_text_rank; the first column is the rank-1 record): None = auto, "
        "per query: every column for free text (a loss on every token) of any length and for an "
        "answer of more than 16 loss tokens; for a shorter answer after a prompt, or a label, "
        "the first column or every column, whichever gives its scores the heavier tails (excess "
        "kurtosis; attribution/column_choice.py); 0 = every column; c = the first c. Measured "
        "(benchmarks/EVAL.md sections 1y-1aa): a fact's answer scored against every column lost "
        "up to 0.37 LDS, a free-text query against the first column alone 0.16-0.28, a short "
        "continuation of prose 0.09-0.23; the tails keep the facts' and take most of the prose's. "
        "No effect on runs recorded at rank 1",
    )
    class_prior: float | None = knob(
        None,
        help="classification: add class_prior x (+1 when the example's label is the query's, "
        "-1/(C-1) otherwise) to every score, the similarity of the classifier head's bias "
        "gradients at uniform predictions (the new head's first steps), which the weight records "
        "leave out; a query-time term, the index is the same (None: auto, DEFAULT_CLASS_PRIOR "
        "for a classification run scored with cosine, ADAPTER_CLASS_PRIOR for one that trained "
        "adapters, 0 otherwise; 0: the records alone)",
    )
    lm_bias: float | None = knob(
        None,
        help="causal LM: add lm_bias x the cosine of the query's and the example's LM-head "
        "output-bias gradients, sum over the loss tokens of (p_t - y_t), each divided by the "
        "square root of the head's output-gradient second moment on the final model (its K-FAC "
        "output factor's diagonal, one forward pass over 256 stored examples, cached); "
        "the tiny and most causal LMs have no such bias, and the weight records leave its "
        "gradient out, the marginal of the next token that keyword search on the answer word "
        "finds. Read from the records' first column (a store written since 2026-12-07); a "
        "query-time term, the index is the same (None: auto, DEFAULT_LM_BIAS for a run trained on "
        "text, a loss on every token of most examples, scored with cosine, 0 otherwise: answers, "
        "labels, LoRA runs, which record no head; 0: the records alone)",
    )

    def __post_init__(self) -> None:
        if self.lists is not None and not isinstance(self.lists, bool):
            raise ConfigError(f"lists must be True, False or None (auto), got {self.lists!r}")
        check_damping(self.damping)  # here, before anything is locked or written under index/
        for name in ("class_prior", "lm_bias"):
            _check_weight(self, name)
        c = self.columns
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ConfigError(
                f"columns must be an integer >= 0 (0: every column) or None (auto), got {c!r}"
            )
        for name, zero in (("index_side", "no index projection"), ("index_dims", "no reduction")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (0: {zero}), got {v!r}")
        object.__setattr__(
            self,
            "preconditioner",
            parse_choice(PreconditionerKind, self.preconditioner, "preconditioner"),
        )
        object.__setattr__(self, "kind", parse_choice(IndexKind, self.kind, "index kind"))
        object.__setattr__(self, "records", parse_choice(RecordChoice, self.records, "records"))
        weighting = parse_choice(LayerWeighting, self.weighting, "weighting")
        object.__setattr__(self, "weighting", weighting)
        statistics = parse_choice(StatisticsSource, self.statistics, "statistics")
        object.__setattr__(self, "statistics", statistics)
        if self.per_record and self.records is not RecordChoice.ALL:  # one row per record
            object.__setattr__(self, "records", RecordChoice.ALL)

    @property
    def uses_final_statistics(self) -> bool:
        """Whether the index needs the final model's K-FAC statistics (``final`` or ``both``;
        ``auto`` is resolved per run first, ``AttributionRun.settings``)."""
        return self.statistics in (StatisticsSource.FINAL, StatisticsSource.BOTH)

    @property
    def name(self) -> str:
        parts = [self.preconditioner.fitted.value]
        if self.damping is not None:
            parts.append(f"d{self.damping:g}")
        if self.cosine:
            parts.append("cos")
        if self.per_record:
            parts.append("rec")
        if self.records is RecordChoice.ALL and not self.per_record:
            parts.append("all")
        if self.weighting is LayerWeighting.FISHER:
            parts.append("fisher")
        if self.uses_final_statistics:
            parts.append(f"stats-{self.statistics.value}")
        if self.kind is not IndexKind.AUTO:
            parts.append(self.kind.value)
        if self.index_side != INDEX_SIDE:  # another projection: its own folder and cache entry
            parts.append(f"m{self.index_side}")
        if self.index_dims != INDEX_DIMS:
            parts.append(f"r{self.index_dims}")
        if self.lists is not None:
            parts.append("lists" if self.lists else "nolists")
        if self.columns:  # the first c columns of the records: another index
            parts.append(f"c{self.columns}")
        return "-".join(parts)

    def to_dict(self) -> dict:
        return {
            "preconditioner": self.preconditioner.fitted.value,
            "damping": self.damping,
            "cosine": self.cosine,
            "per_record": self.per_record,
            "kind": self.kind.value,
            "index_side": self.index_side,
            "index_dims": self.index_dims,
            # only when set: the default's fingerprint (and every index built before) unchanged
            **({} if self.lists is None else {"lists": self.lists}),
            # records: every index built before the choice scored all records (no key)
            **({} if self.records is RecordChoice.ALL else {"records": self.records.value}),
            # weighting: only fisher changes the vectors of an index built before it (auto is
            # resolved per store first, AttributionRun.settings)
            **({"weighting": "fisher"} if self.weighting is LayerWeighting.FISHER else {}),
            # statistics: inline is what every index built before it used (auto is resolved
            # per run first, AttributionRun.settings)
            **({"statistics": self.statistics.value} if self.uses_final_statistics else {}),
            # columns: every index built before it scored every column (no key)
            **({"columns": self.columns} if self.columns else {}),
        }


def _check_weight(s: IndexSettings, name: str) -> None:
    """A query-time term's weight (``class_prior``, ``lm_bias``): a finite number >= 0, kept as
    a float, or None (auto). Raises ConfigError otherwise."""
    v = getattr(s, name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(
            f"{name} must be a finite number >= 0 (0: the records alone) or None (auto), got {v!r}"
        )
    object.__setattr__(s, name, float(v))
