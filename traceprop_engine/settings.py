"""Frozen settings, one dataclass per stage, validated on construction."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from enum import Enum

from . import constants as C
from .errors import ConfigError


class SketchKind(str, Enum):
    FACTORED = "factored"
    DENSE = "dense"


class FactorDtype(str, Enum):
    """How rank-r factors are stored: int8 with one float32 scale per record and layer (1 byte
    a number), bfloat16 (2 bytes, float32's range) or float32."""

    INT8 = "int8"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class FactorSpace(str, Enum):
    """Where rank-r factors are computed (``TrackSettings.factor_space``)."""

    FULL = "full"  # of the full per-example gradient, by power iteration, then projected
    SKETCH = "sketch"  # of the k_out × k_in sketch, after projecting every token


class ProjectionKind(str, Enum):
    """How ``P_in``, ``P_out`` are drawn (``TrackSettings.projection``)."""

    ORTHOGONAL = "orthogonal"  # k orthonormal rows of a random subspace, scaled by √(d/k)
    GAUSSIAN = "gaussian"  # i.i.d. N(0, 1/k): runs recorded before 2026-12-01


RECORDED_BEFORE_KEYS = {
    "share_k": False,
    "projection": ProjectionKind.GAUSSIAN.value,
    "covariance_tokens": 0,
}
"""How a run recorded before ``share_k``, ``projection`` or ``covariance_tokens`` existed was
tracked: its run.json lacks the key (:meth:`TrackSettings.from_dict`,
``evaluate.pareto.assess``); before ``covariance_tokens`` every token of a statistics batch was
used."""


class Task(str, Enum):
    CAUSAL_LM = "causal-lm"
    CLASSIFICATION = "classification"


def parse_choice(enum: type[Enum], value: object, what: str) -> Enum:
    """``enum(value)``, or a ConfigError that lists the allowed values."""
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(e.value) for e in enum)
        raise ConfigError(f"{what} must be one of {allowed}, got {value!r}") from None


@dataclass(frozen=True)
class TrackSettings:
    """What the capture hooks record.

    The defaults come from the LDS, overhead and bytes measurements in benchmarks/EVAL.md:
    a rank-1 approximation of the full per-example gradient, ``û ûᵀ G`` with ``û`` the
    example's summed output gradient ``Σ_t g_t`` (half a power-iteration step in the backward
    hook: two batched products, whatever k is), projected per example to k = 126 per side and
    stored as int8 with one float32 scale: 126 + 126 + 4 = 256 bytes per layer and record, the
    bytes of the former default (a full 8 × 8 float32 sketch), at 0.16–0.37 higher LDS.

    Args:
        scope: ``"all"`` (every trainable linear layer), ``"last-block"`` (the trainable linear
            layers of the highest-numbered block) or a regular expression matched against module
            names (``re.search``).
        k_in: rows of the input-side projection ``P_in`` (clamped to the layer's input width;
            equal to the width means no projection on that side).
        k_out: rows of the output-side projection ``P_out`` (clamped likewise).
        share_k: with factor records (``rank ≥ 1``), a side clamped to its layer's width gives
            the rows it cannot use to the other side, so every record keeps its
            ``rank·(k_in + k_out)`` numbers: a layer ``64 → 512`` (a narrow model's LM head)
            records ``k_in = 64, k_out = 188`` instead of ``64, 126``, at the same bytes as a
            wide layer. No effect on layers at least ``k_in`` wide on the input side and
            ``k_out`` on the output side (every layer of the default tiny model), nor on full
            sketches, whose bytes are ``k_out·k_in``. Runs recorded before this setting read
            as ``False``.
        projection: ``orthogonal`` (default): ``P`` has ``k`` orthonormal rows of a random
            subspace, scaled by ``√(d/k)``; ``gaussian``: i.i.d. ``N(0, 1/k)`` entries. Both
            keep inner products unbiased; orthogonal rows give them a lower variance, at the
            same cost per use: mean cosine LDS over four projection seeds +0.027 / +0.014 on
            facts24, +0.005 / −0.009 on the hard set (benchmarks/EVAL.md §1c). Runs recorded
            before this setting read as ``gaussian``.
        sketch: ``factored`` (``(P_out g)(P_in a)^T`` per example) or ``dense`` (materialised
            per-example gradient + sparse JL projection to ``dense_k`` numbers).
        dense_k: output size of the dense sketch.
        dense_nnz: non-zeros per input coordinate of the sparse JL matrix.
        covariance: accumulate K-FAC statistics ``A``, ``S`` in the projected space (factored
            sketches only: dense layers have no Kronecker factors).
        rank: store each factored record as rank-``rank`` factors ``U Vᵀ`` computed inline on
            the device (subspace iteration, :func:`traceprop_engine.capture.sketch.top_factors`):
            ``rank·(k_out + k_in)`` numbers instead of ``k_out·k_in``. ``0`` stores the full
            sketch. Per-example records are nearly rank 1, so a large k stored as rank-1
            factors beats a small full sketch of the same bytes (benchmarks/EVAL.md).
        factor_dtype: ``int8`` (1 byte per number, each record's ``U`` and ``V`` scaled by
            their own max-abs value, the product of both scales kept as one float32),
            ``bfloat16`` (2 bytes, float32's exponent range) or ``float32``.
        factor_space: ``full`` (default): the factors of the full per-example gradient
            ``G = Σ_t g_t a_tᵀ``, found by ``power_iters`` power iterations on the layer's own
            ``a`` and ``g`` in the backward hook (a few batched matrix-vector products, no
            per-token projection), then projected per example (``P_out u``, ``P_in v``): the
            per-token cost does not grow with k. ``sketch``: project every token to k and
            factor the ``k_out × k_in`` sketch (cost grows with k).
        power_iters: power iterations of ``factor_space='full'``; 0 = half a step (the
            projection of ``G`` on ``Σ_t g_t`` from the left: two batched products, not four).
        covariance_stride: with ``factor_space='full'``, the K-FAC statistics ``A``, ``S`` are
            accumulated over every ``covariance_stride``-th batch (the first included, all its
            tokens), which keeps their per-token projections cheap; 1 = every batch.
        covariance_tokens: with ``factor_space='full'``, at most about this many token rows of
            a statistics batch are projected: every s-th row of the flattened ``(B·T)`` tokens,
            ``s = ⌈B·T / covariance_tokens⌉``, from an offset that rotates between statistics
            batches (``A`` and ``S`` from the same rows, counted as such). ``0`` = every token.
            The statistics cost a full batch's projection otherwise (≈ 80 ms, a quarter of a
            step on the default tiny model with 1024 tokens a batch); benchmarks/EVAL.md says
            what it does to K-FAC quality.
        optimizer_aware: scale each record by AdamW's per-parameter step size at the recorded
            step, ``1/(√v̂_t + ε)`` (its rank-1 fit, so the record stays rank 1 at the same
            bytes; ``capture/optimizer_scale.py``), instead of the raw gradient. Needs the
            optimizer (``Tracker(..., optimizer=opt)``; ``traceprop train`` passes its AdamW)
            and the default factor records. Off by default: benchmarks/EVAL.md §1d.
        seed: seed of the projection matrices.
        buffer_records: records held in the device buffer before one transfer to the host.
    """

    scope: str = "all"
    k_in: int = 126
    k_out: int = 126
    share_k: bool = True
    projection: ProjectionKind = ProjectionKind.ORTHOGONAL
    sketch: SketchKind = SketchKind.FACTORED
    dense_k: int = 512
    dense_nnz: int = 2
    covariance: bool = True
    rank: int = 1
    factor_dtype: FactorDtype = FactorDtype.INT8
    factor_space: FactorSpace = FactorSpace.FULL
    power_iters: int = 0
    covariance_stride: int = 32
    covariance_tokens: int = 256
    optimizer_aware: bool = False
    seed: int = 0
    buffer_records: int = 2048

    def __post_init__(self) -> None:
        object.__setattr__(self, "sketch", parse_choice(SketchKind, self.sketch, "sketch"))
        object.__setattr__(
            self, "projection", parse_choice(ProjectionKind, self.projection, "projection")
        )
        object.__setattr__(
            self, "factor_dtype", parse_choice(FactorDtype, self.factor_dtype, "factor_dtype")
        )
        object.__setattr__(
            self, "factor_space", parse_choice(FactorSpace, self.factor_space, "factor_space")
        )
        if (
            isinstance(self.power_iters, bool)
            or not isinstance(self.power_iters, int)
            or self.power_iters < 0
        ):
            raise ConfigError(
                f"power_iters must be a non-negative integer (0 = half a step), got {self.power_iters!r}"
            )
        if not isinstance(self.optimizer_aware, bool):
            raise ConfigError(
                f"optimizer_aware must be true or false, got {self.optimizer_aware!r}"
            )
        if not isinstance(self.share_k, bool):
            raise ConfigError(f"share_k must be true or false, got {self.share_k!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(
                f"rank must be a non-negative integer (0 = store full sketches), got {self.rank!r}"
            )
        for name in (
            "k_in",
            "k_out",
            "dense_k",
            "dense_nnz",
            "buffer_records",
            "covariance_stride",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        _check_seed(self.seed)
        v = self.covariance_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(
                f"covariance_tokens must be a non-negative integer (0 = every token), got {v!r}"
            )
        if self.scope not in ("all", "last-block"):
            try:
                re.compile(self.scope)
            except re.error as e:
                raise ConfigError(
                    f"scope must be 'all', 'last-block' or a valid regular expression; "
                    f"{self.scope!r} does not compile: {e}"
                ) from None

    @classmethod
    def from_dict(cls, d: dict) -> TrackSettings:
        """The settings a run's manifest recorded (unknown keys ignored; a record from before
        ``share_k`` and ``projection`` existed reads as ``share_k=False``, ``gaussian``: how it
        was recorded)."""
        known = set(cls.__dataclass_fields__)
        return cls(**{**RECORDED_BEFORE_KEYS, **{k: v for k, v in d.items() if k in known}})

    def layer_k(self, d_in: int, d_out: int) -> tuple[int, int]:
        """``(k_in, k_out)`` of a layer ``d_in → d_out``: each clamped to its side's width, then
        (``share_k`` with factor records) the rows a clamped side cannot use go to the other."""
        k_in, k_out = min(self.k_in, d_in), min(self.k_out, d_out)
        if self.share_k and self.rank >= 1 and self.sketch is SketchKind.FACTORED:
            k_in, k_out = min(d_in, k_in + self.k_out - k_out), min(d_out, k_out + self.k_in - k_in)
        return k_in, k_out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sketch"] = self.sketch.value
        d["projection"] = self.projection.value
        d["factor_dtype"] = self.factor_dtype.value
        d["factor_space"] = self.factor_space.value
        return d


@dataclass(frozen=True)
class TrainSettings:
    """A tracked (or untracked) fine-tune, as the ``traceprop train`` command runs it."""

    data: str
    out: str
    model: str = "tiny"
    task: Task = Task.CAUSAL_LM
    eval_data: str | None = None
    eval_fraction: float = 0.1
    epochs: int = 2
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    batch_size: int = 8
    max_length: int = 128
    lora_rank: int = 0
    lora_targets: str = "all-linear"
    seed: int = 0
    track: TrackSettings | None = field(default_factory=TrackSettings)
    tiny_layers: int = 4
    tiny_width: int = 256
    tiny_vocab: int = 1024
    threads: int = 0
    device: str = "auto"
    max_steps: int = 0
    parallel: str = "ddp"  # several processes (torchrun): "ddp" or "fsdp" (FSDP2 fully_shard)
    checkpoint_every: int = 50  # steps between checkpoints for --resume (0 = none; not FSDP)

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", parse_choice(Task, self.task, "task"))
        _check_seed(self.seed)
        checks = {
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "max_length": self.max_length >= 2,
            "lora_rank": self.lora_rank >= 0,
            "lr": math.isfinite(self.lr) and self.lr >= 0,
            "eval_fraction": 0.0 <= self.eval_fraction < 1.0,
            "tiny_layers": self.tiny_layers >= 1,
            "tiny_width": self.tiny_width >= 8 and self.tiny_width % 4 == 0,
            "tiny_vocab": self.tiny_vocab >= 300,
            "max_steps": self.max_steps >= 0,
            "parallel": self.parallel in ("ddp", "fsdp"),
            "checkpoint_every": self.checkpoint_every >= 0,
            "threads": self.threads >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            vals = ", ".join(f"{k}={getattr(self, k)!r}" for k in bad)
            raise ConfigError(
                f"invalid training settings: {vals} (epochs/batch_size >= 1, max_length >= 2, "
                "lora_rank >= 0, lr a finite number >= 0, 0 <= eval_fraction < 1, tiny_layers >= 1, "
                "tiny_width >= 8 and a multiple of 4, tiny_vocab >= 300, max_steps >= 0, "
                "parallel ddp or fsdp, checkpoint_every >= 0, threads >= 0 (0: torch default))"
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["task"] = self.task.value
        d["track"] = self.track.to_dict() if self.track is not None else None
        return d


class PreconditionerKind(str, Enum):
    """Which approximation of the Fisher/Gauss-Newton ``H`` to invert
    (:mod:`traceprop_engine.attribution.precondition.preconditioner`)."""

    IDENTITY = "identity"
    KFAC = "kfac"
    EKFAC = "ekfac"


class IndexKind(str, Enum):
    """Which FAISS index to build (:mod:`traceprop_engine.attribution.index.vector_index`)."""

    AUTO = "auto"
    FLAT = "flat"
    IVF = "ivf"
    IVFPQ = "ivfpq"
    HNSW = "hnsw"


INDEX_SIDE = 16
"""m of the m × m index projection of layers with larger sketches (IndexSettings.index_side):
the top-m principal directions of each side of a layer's records, m² numbers per layer, then
reduced to ``INDEX_DIMS`` for all layers together. Its scores only pick candidates: every
returned score is recomputed exactly from the store
(:mod:`traceprop_engine.attribution.score.scoring`). On a real run of 10⁵ examples, m = 16 put the
true top 10 within 4000 candidates for 1.00 /
0.98 of proponents / opponents, m = 8 for 0.99 / 0.93 (benchmarks/README.md §2b)."""
INDEX_DIMS = 256
"""Index vectors are reduced to their top principal directions over all layers
(IndexSettings.index_dims; 0: no reduction): 1 KB per example whatever the model, 256 of 2304
dims held 99.7 % of the energy on that run and the same recall as all of them."""


MAX_SEED = 2**32 - 1
"""Seeds run from 0 to this (what every generator of the run, numpy's and torch's, accepts)."""


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")


DEFAULT_DAMPING = 0.1
"""Damping as a fraction of each factor's mean eigenvalue (a common heuristic; overridable)."""


def _check_damping(damping) -> None:
    """ConfigError unless ``damping`` is None (the default) or a finite number >= 0."""
    if damping is None:
        return
    try:
        d = float(damping)
    except (TypeError, ValueError):
        d = math.nan
    if isinstance(damping, bool) or not math.isfinite(d) or d < 0:
        raise ConfigError(
            f"damping must be a finite number >= 0 (a fraction of each factor's mean "
            f"eigenvalue), got {damping!r}; leave it out for the default"
        )


@dataclass(frozen=True)
class IndexSettings:
    """How the index of a run is built (part of its fingerprint).

    Default: identity preconditioning with cosine scores (TracIn directions along the
    trajectory, normalised). On both LDS data sets it matched or beat identity, K-FAC and
    EK-FAC at k ≥ 32 (benchmarks/EVAL.md), and unlike raw inner products it does not let a few
    large-gradient examples top every query.
    """

    preconditioner: PreconditionerKind = PreconditionerKind(C.DEFAULT_PRECONDITIONER)
    damping: float | None = None
    cosine: bool = True
    per_record: bool = False
    kind: IndexKind = IndexKind.AUTO
    index_side: int = INDEX_SIDE
    index_dims: int = INDEX_DIMS
    lists: bool | None = None
    """A second candidate search over the own records of the layers holding most of the
    gradient energy (``attribution/index/lists.py``): None builds it from
    ``index_lists.MIN_ROWS`` index rows (where FAISS is an IVF index), True on any run whose
    records allow it, False never."""

    def __post_init__(self) -> None:
        if self.lists is not None and not isinstance(self.lists, bool):
            raise ConfigError(f"lists must be True, False or None (auto), got {self.lists!r}")
        _check_damping(self.damping)  # here, before anything is locked or written under index/
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

    @property
    def name(self) -> str:
        parts = [self.preconditioner.value]
        if self.damping is not None:
            parts.append(f"d{self.damping:g}")
        if self.cosine:
            parts.append("cos")
        if self.per_record:
            parts.append("rec")
        if self.kind is not IndexKind.AUTO:
            parts.append(self.kind.value)
        if self.index_side != INDEX_SIDE:  # another projection: its own folder and cache entry
            parts.append(f"m{self.index_side}")
        if self.index_dims != INDEX_DIMS:
            parts.append(f"r{self.index_dims}")
        if self.lists is not None:
            parts.append("lists" if self.lists else "nolists")
        return "-".join(parts)

    def to_dict(self) -> dict:
        return {
            "preconditioner": self.preconditioner.value,
            "damping": self.damping,
            "cosine": self.cosine,
            "per_record": self.per_record,
            "kind": self.kind.value,
            "index_side": self.index_side,
            "index_dims": self.index_dims,
            # only when set: the default's fingerprint (and every index built before) unchanged
            **({} if self.lists is None else {"lists": self.lists}),
        }
