"""What a run opened for attribution offers a reader (the app's Influencers page, a script):
its size, its notes, the preconditioners its store supports and the tokens of an example.

Callers use these instead of reaching into ``AttributionRun.store``; the caller serialises
them with its queries (the store is one HDF5 handle, not safe to read from two threads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import constants as C
from ..index_settings import ADAPTER_CLASS_PRIOR, DEFAULT_CLASS_PRIOR, DEFAULT_LM_BIAS
from ..settings import (
    IndexSettings,
    LayerWeighting,
    PreconditionerKind,
    SketchKind,
    StatisticsSource,
    Task,
)
from .score.class_prior import labelled
from .score.lm_bias import head_layer, trained_on_text
from .score.ranking import ZERO_LR_NOTE

NO_STATISTICS_NOTE = (
    "this run has no K-FAC statistics (trained with --no-covariance, or stopped before they were "
    "written): it is scored with identity preconditioning instead of the default K-FAC"
)


CLASSIFIER_FULL_NOTE = (
    "a pretrained classifier fine-tuned in full is scored with EK-FAC by default: on every such "
    "run measured K-FAC scored below it (benchmarks/EVAL.md section 1r); --preconditioner kfac "
    "or identity picks another"
)


CLASS_PRIOR_NOTE = (
    "a classification run's scores add a class prior by default: class_prior x (+1 for an "
    "example of the query's label, -1/(C-1) otherwise), the similarity of the classifier head's "
    "bias gradients at the start of fine-tuning, which the weight records leave out "
    "(benchmarks/EVAL.md sections 1s-1t; 0.2 for a run that trained adapters, section 1v); "
    "--class-prior 0 scores the records alone"
)

LM_BIAS_NOTE = (
    "a causal-LM run trained on text adds the LM-bias term to its scores by default: lm_bias "
    "x the cosine of the query's and the example's LM-head output-bias gradients (the next "
    "token's marginal, which the weight records leave out; benchmarks/EVAL.md section 1ab); "
    "--lm-bias 0 scores the records alone"
)


def usable_preconditioners(store) -> list[PreconditionerKind]:
    """K-FAC, identity and EK-FAC when the store has K-FAC covariance (factored sketches
    recorded with ``covariance``) or holds dense sketches (fitted from the records); identity
    alone otherwise. :func:`describe` lists them with the run's own default first."""
    if store.has_covariance or SketchKind(store.sketch) is SketchKind.DENSE:
        return [PreconditionerKind.KFAC, PreconditionerKind.IDENTITY, PreconditionerKind.EKFAC]
    return [PreconditionerKind.IDENTITY]


def resolve_settings(store, s: IndexSettings | None, task: str = "causal-lm") -> IndexSettings:
    """``s`` (default: ``IndexSettings()``) as this store can answer it: ``preconditioner='auto'``,
    the default, becomes EK-FAC on a pretrained classifier fine-tuned in full
    (:func:`ekfac_by_default`, :data:`CLASSIFIER_FULL_NOTE`) and K-FAC otherwise; either on a
    run without K-FAC statistics becomes identity (:data:`NO_STATISTICS_NOTE`); an explicit
    EK-FAC there stays an error where it is fitted. ``weighting='auto'`` becomes ``fisher`` for
    a causal LM pretrained and fine-tuned in full (:func:`pretrained_full`) and ``recorded``
    otherwise (a pretrained classifier fine-tuned in full fell from 0.78 to 0.56 with fisher,
    EVAL.md §1p);
    identity, which whitens nothing, is always ``recorded``. ``statistics='auto'`` becomes
    ``both`` (the mean of the inline and the final model's statistics) where the weighting is
    ``fisher`` and the store keeps the example tokens to fit on, ``inline`` otherwise (EVAL.md
    §1q); identity uses none and is always ``inline``. ``class_prior=None`` becomes
    :func:`default_class_prior` for a classification run scored with cosine and 0 otherwise
    (EVAL.md §1s, §1v); ``lm_bias=None`` :func:`default_lm_bias` likewise. ``columns`` at or
    above every layer's rank becomes 0 (every column);
    ``None`` is left for the query to decide (``AttributionRun.for_query``)."""
    s = s or IndexSettings()
    auto = s.preconditioner is PreconditionerKind.AUTO
    if auto:
        ekfac = ekfac_by_default(store, task)
        kind = PreconditionerKind.EKFAC if ekfac else PreconditionerKind.KFAC
        s = dataclasses.replace(s, preconditioner=kind)
    if (
        s.preconditioner is PreconditionerKind.KFAC or auto
    ) and s.preconditioner not in usable_preconditioners(store):
        s = dataclasses.replace(s, preconditioner=PreconditionerKind.IDENTITY)
    weighting = s.weighting
    if s.preconditioner is PreconditionerKind.IDENTITY:
        weighting = LayerWeighting.RECORDED
    elif weighting is LayerWeighting.AUTO:
        fisher = task == Task.CAUSAL_LM.value and pretrained_full(store)
        weighting = LayerWeighting.FISHER if fisher else LayerWeighting.RECORDED
    statistics = s.statistics
    if s.preconditioner is PreconditionerKind.IDENTITY:
        statistics = StatisticsSource.INLINE
    elif statistics is StatisticsSource.AUTO:
        both = weighting is LayerWeighting.FISHER and store.n_examples > 0
        statistics = StatisticsSource.BOTH if both else StatisticsSource.INLINE
    prior = s.class_prior
    if prior is None:
        classifier = task == Task.CLASSIFICATION.value and s.cosine
        prior = default_class_prior(store) if classifier else 0.0
    lm_bias = s.lm_bias
    if lm_bias is None:
        lm_bias = default_lm_bias(store, task) if s.cosine else 0.0
    columns = s.columns  # c columns of records no wider than c: every column, one index
    if columns and not any(info.rank > columns for info in store.layers):
        columns = 0
    return dataclasses.replace(
        s,
        weighting=weighting,
        statistics=statistics,
        class_prior=prior,
        lm_bias=lm_bias,
        columns=columns,
    )


def default_class_prior(store) -> float:
    """The class prior ``auto`` gives a classification run scored with cosine:
    :data:`~traceprop_engine.index_settings.ADAPTER_CLASS_PRIOR` where it trained adapters (the
    store's ``model_origin``), :data:`~traceprop_engine.index_settings.DEFAULT_CLASS_PRIOR`
    otherwise (a store written before ``model_origin`` included)."""
    return ADAPTER_CLASS_PRIOR if store.model_origin == C.ORIGIN_ADAPTER else DEFAULT_CLASS_PRIOR


def default_lm_bias(store, task: str) -> float:
    """The LM-bias weight ``auto`` gives a run scored with cosine:
    :data:`~traceprop_engine.index_settings.DEFAULT_LM_BIAS` for a causal LM trained on text (a
    loss on every token, :func:`~.score.lm_bias.trained_on_text`, short texts too; or its LM
    head recorded at rank above 1, ``capture/free_text.py``) whose head records carry the signed
    bias column (:func:`~.score.lm_bias.head_layer`), 0 otherwise: on runs trained on answers
    alone the term was mixed (benchmarks/EVAL.md sections 1aa, 1ab)."""
    li = head_layer(store) if task == Task.CAUSAL_LM.value else None
    if li is None:
        return 0.0
    return DEFAULT_LM_BIAS if store.layers[li].rank > 1 or trained_on_text(store) else 0.0


def ekfac_by_default(store, task: str) -> bool:
    """Whether the default answers this run with EK-FAC: a pretrained classifier fine-tuned in
    full, where EK-FAC-cosine scored above K-FAC-cosine on every run measured (docs8 and
    pkgdocs6, three seeds each, EVAL.md §1r). An explicit ``kfac`` is K-FAC as asked."""
    return task == Task.CLASSIFICATION.value and pretrained_full(store)


def pretrained_full(store) -> bool:
    """Whether the run fine-tuned a pretrained model in full: the store's ``model_origin``, or in
    a store written before it, an input embedding among the tracked layers (recorded under
    ``embedding='auto'`` only for such a run)."""
    if store.model_origin:
        return store.model_origin == C.ORIGIN_PRETRAINED_FULL
    return any(layer.kind == "embedding" for layer in store.layers)


@dataclass(frozen=True)
class RunOverview:
    """One line's worth of facts about a run opened for attribution."""

    run_id: str
    task: str
    n_records: int
    n_layers: int
    notes: tuple[str, ...]  # e.g. a partial store (cancelled or failed run)
    preconditioners: tuple[str, ...]
    class_prior: float = 0.0  # the default's, resolved (0: none, e.g. a causal LM)
    lm_bias: float = 0.0  # the default's, resolved (0: none, e.g. answers or a classifier)


def describe(run) -> RunOverview:
    """The overview of an :class:`~traceprop_engine.attribution.query.AttributionRun`; its
    preconditioners are the run's default first (what the app selects before a reader picks)."""
    default = run.settings()
    first = default.preconditioner
    usable = usable_preconditioners(run.store)
    return RunOverview(
        run_id=run.run_id,
        task=run.task,
        n_records=int(run.store.n_records),
        n_layers=len(run.store.layers),
        notes=tuple(run.notes),
        preconditioners=tuple(k.value for k in [first, *(k for k in usable if k is not first)]),
        class_prior=float(default.class_prior),  # resolved: never None
        lm_bias=float(default.lm_bias),
    )


def example_tokens(run, example_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The token ids and loss mask example ``example_id`` was trained on (from the store)."""
    return run.store.tokens(int(example_id))


def run_notes(run) -> list[str]:
    """What every query of ``run`` (an ``AttributionRun``) should say: a partial store, what
    the default preconditioner resolved to where it is not K-FAC, a class prior in use, records
    of learning rate 0, and the example table's own notes."""
    out = []
    default = run.settings()
    if run.store.is_partial:  # says so when it has no covariance
        out.append(run.store.describe_partial())
    else:  # what the default (auto) resolved to on this run, where it is not K-FAC
        if default.preconditioner is PreconditionerKind.IDENTITY:  # no statistics
            out.append(NO_STATISTICS_NOTE)
        elif default.preconditioner is PreconditionerKind.EKFAC:  # pretrained classifier, full
            out.append(CLASSIFIER_FULL_NOTE)
    if run._labelled is None:  # lineage with two labels or more: a prior can apply
        run._labelled = labelled(run.examples()["label"].unique().to_list())
    if run.task == "classification" and default.class_prior and run._labelled:
        out.append(CLASS_PRIOR_NOTE)
    if default.lm_bias:
        out.append(LM_BIAS_NOTE)
    if run._zero_lr is None:
        lr = run.store.records()[C.REC_LR]
        run._zero_lr = bool(len(lr)) and not np.any(lr)
    if run._zero_lr:
        out.append(ZERO_LR_NOTE)
    return out + run._notes_extra
