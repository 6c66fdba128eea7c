"""Frozen settings, one dataclass per stage, validated on construction."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from enum import Enum

from .errors import ConfigError

# the index stage's settings live in index_settings.py; re-exported here, where callers look
from .index_settings import (  # noqa: E402, F401
    DEFAULT_DAMPING,
    INDEX_DIMS,
    INDEX_SIDE,
    IndexKind,
    IndexSettings,
    LayerWeighting,
    PreconditionerKind,
    RecordChoice,
    StatisticsSource,
)
from .knobs import (  # noqa: F401 - field_help, parse_choice, MAX_SEED: imported from here too
    MAX_SEED,
    check_damping,
    check_seed,
    document_fields,
    field_help,
    knob,
    parse_choice,
)


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


class HalfStepStart(str, Enum):
    """Which side the default rank-1 record's half power step starts from
    (``TrackSettings.half_step_start``)."""

    OUTPUT = "output"  # û = Σ_t g_t / ‖·‖ on every layer: the record û ûᵀ G
    NARROW = "narrow"  # v̂ = Σ_t a_t / ‖·‖ where the input is narrower (not an LM head): G v̂ v̂ᵀ


class ProjectionKind(str, Enum):
    """How ``P_in``, ``P_out`` are drawn (``TrackSettings.projection``)."""

    ORTHOGONAL = "orthogonal"  # k orthonormal rows of a random subspace, scaled by √(d/k)
    GAUSSIAN = "gaussian"  # i.i.d. N(0, 1/k): runs recorded before 2026-12-01


class EmbeddingMode(str, Enum):
    """Whether the input embedding gets a record (``TrackSettings.embedding``)."""

    AUTO = "auto"  # when it is trained and the model was loaded from saved (pretrained) weights
    ON = "on"  # whenever it is trained
    OFF = "off"


RECORDED_BEFORE_KEYS = {
    "share_k": False,
    "projection": ProjectionKind.GAUSSIAN.value,
    "covariance_tokens": 0,
    "vocab_rows": False,
    "embedding": EmbeddingMode.OFF.value,
    "half_step_start": HalfStepStart.OUTPUT.value,
    "free_text_rank": 0,
}
"""How a run recorded before one of these fields existed was tracked (its run.json lacks the
key: :meth:`TrackSettings.from_dict`, ``evaluate.pareto.assess``)."""


class Task(str, Enum):
    CAUSAL_LM = "causal-lm"
    CLASSIFICATION = "classification"


@document_fields
@dataclass(frozen=True)
class TrackSettings:
    """What the capture hooks record.

    The default records a rank-1 approximation of each example's full per-layer gradient,
    ``û ûᵀ G`` with ``û`` the example's summed output gradient ``Σ_t g_t``, projected to
    k = 126 per side and stored as int8 with one float32 scale: 126 + 126 + 4 = 256 bytes per
    layer and record. A run whose examples are free text (more than 16 loss tokens each) records
    rank-16 factors instead (``free_text_rank``), whose first column is that rank-1 record: a
    query of a short answer scores against it or against all 16, whichever gives its scores the
    heavier tails, a free-text query (any length) against all 16 (``IndexSettings.columns``).
    (How the defaults were chosen: benchmarks/EVAL.md.)
    """

    scope: str = knob(
        "all",
        help="'all' (every trainable linear layer), 'last-block' (the trainable linear layers "
        "of the highest-numbered block) or a regular expression matched against module names "
        "(re.search)",
    )
    k_in: int = knob(
        126,
        help="rows of the input-side projection P_in per layer (clamped to the layer's input "
        "width; the width itself means no projection on that side)",
    )
    k_out: int = knob(
        126,
        help="rows of the output-side projection P_out per layer (clamped to the layer's "
        "output width)",
    )
    share_k: bool = knob(
        True,
        help="with factor records (rank >= 1), a side clamped to its layer's width gives the "
        "rows it cannot use to the other side, so every record keeps its rank*(k_in + k_out) "
        "numbers (a 64 -> 512 LM head records k_in 64, k_out 188); no effect on layers wide "
        "enough on both sides nor on full sketches. Runs recorded before it read as false",
    )
    projection: ProjectionKind = knob(
        ProjectionKind.ORTHOGONAL,
        help="orthogonal: k orthonormal rows of a random subspace, scaled by sqrt(d/k); "
        "gaussian: i.i.d. N(0, 1/k) entries. Both keep inner products unbiased, orthogonal "
        "rows with a lower variance at the same cost. Runs recorded before it read as gaussian",
    )
    vocab_rows: bool = knob(
        True,
        help="an LM head's projected output side keeps exact rows for the training data's most "
        "frequent target tokens (up to 3/4 of k_out; needs the targets: traceprop train passes "
        "them, an own loop Tracker(..., targets=...)). Runs recorded before it read as false",
    )
    sketch: SketchKind = knob(
        SketchKind.FACTORED,
        help="factored: (P_out g)(P_in a)^T per example; dense: the materialised per-example "
        "gradient, sparse-JL-projected to dense_k numbers",
    )
    dense_k: int = knob(512, help="output size of the dense sketch")
    dense_nnz: int = knob(2, help="non-zeros per input coordinate of the dense sketch's JL matrix")
    covariance: bool = knob(
        True,
        help="accumulate the K-FAC statistics A, S in the projected space (factored sketches "
        "only: dense layers have no Kronecker factors)",
    )
    rank: int = knob(
        1,
        help="store each factored record as rank-r factors U V^T computed inline on the device "
        "(rank*(k_out + k_in) numbers instead of k_out*k_in); 0 stores the full sketch. Rank 1 "
        "suits targets of a few tokens (answers, labels); on free text, where every token is a "
        "target, a higher rank keeps much more (benchmarks/EVAL.md section 1x: rank 16 scored "
        "0.69 LDS against 0.50 at rank 1, at 16 times the bytes); a layer whose input is at most "
        "r wide (a LoRA B) takes its input width + 1 columns and is recorded exactly (section "
        "1aa); see free_text_rank",
    )
    free_text_rank: int = knob(
        16,
        help="with rank 1, the rank a run's records take when its examples are free text: a "
        "median of more than 16 loss tokens per example (decided from the targets when given, "
        "traceprop train gives them; otherwise at the first step, from the tokens whose output "
        "gradient is not zero). Answers and labels keep rank 1. 0 (or 1) = always rank 1. "
        "Measured (benchmarks/EVAL.md sections 1x, 1y): on free text rank 16 scored 0.16 LDS "
        "above rank 1 and at or above full-gradient cosine; on answers no rank beat rank 1. "
        "Runs recorded before it read as 0",
    )
    factor_dtype: FactorDtype = knob(
        FactorDtype.INT8,
        help="int8 (1 byte a number; U and V each scaled by its max-abs value, the product of "
        "both scales kept as one float32), bfloat16 (2 bytes) or float32",
    )
    factor_space: FactorSpace = knob(
        FactorSpace.FULL,
        help="full: factors of the full per-example gradient G = sum_t g_t a_t^T by power "
        "iteration on the layer's own a and g, then projected (per-token cost independent of "
        "k); sketch: project every token to k, then factor the k_out x k_in sketch",
    )
    power_iters: int = knob(
        0,
        help="power iterations of factor_space full; 0 = half a step (G projected on "
        "sum_t g_t from the left: two batched products)",
    )
    half_step_start: HalfStepStart = knob(
        HalfStepStart.OUTPUT,
        help="the default rank-1 records' half power step: 'output' starts every layer from "
        "its summed output gradient (the record u u^T G, u = sum_t g_t); 'narrow' starts a "
        "layer whose input is narrower than its output (an MLP's up projection, a fused QKV, "
        "LoRA's B; never an LM head or an embedding) from its summed input instead (G v v^T, "
        "v = sum_t a_t, taken in the forward while the input is hot), so its backward hook "
        "reads the output gradient once instead of twice. Measured (benchmarks/EVAL.md section "
        "1u): LDS within noise of 'output' (mean -0.002 on 8 pairs, -0.0005 on 27 in a first "
        "pass), 0.3-1.2 points less overhead at the tiny default shape on Intel Xeon, none at "
        "GPT-2 small, where the LM head's output gradient dominates. Ignored with "
        "optimizer_aware",
    )
    covariance_stride: int = knob(
        32,
        help="with factor_space full, the K-FAC statistics come from every n-th batch (the "
        "first included); 1 = every batch. traceprop train lowers it for a short run so that "
        "at least 16 batches give statistics (a 60-step run: every 3rd)",
    )
    covariance_tokens: int = knob(
        256,
        help="with factor_space full, at most about this many token rows of a statistics "
        "batch: every s-th of its B*T rows, s = ceil(B*T / n), from an offset that rotates "
        "between statistics batches (A and S from the same rows); 0 = every token",
    )
    embedding: EmbeddingMode = knob(
        EmbeddingMode.AUTO,
        help="record the input embedding (nn.Embedding, as one more layer: P_in a_t is the "
        "column of P_in of token t) too: 'auto' when it is trained and the model was loaded "
        "from saved weights (a pretrained model fine-tuned in full; not a model built from a "
        "config, nor LoRA, which freezes it) and scope is 'all'; 'on' whenever it is trained; "
        "'off'. auto also leaves out an embedding tied to the LM head (GPT-2) or one whose "
        "forward rescales its rows other than by a scalar embed_scale. Measured at the default "
        "preconditioner: +0.026 / +0.007 LDS on a pretrained model fine-tuned in full, -0.003 / "
        "-0.010 from scratch (benchmarks/EVAL.md section 1l). Runs recorded before it read as off",
    )
    optimizer_aware: bool = knob(
        False,
        help="scale each record by AdamW's per-parameter step size 1/(sqrt(v_t) + eps) at the "
        "recorded step (its rank-1 fit: same bytes); needs the optimizer (Tracker(..., "
        "optimizer=opt); traceprop train passes its AdamW) and the default factor records",
    )
    seed: int = knob(0, help="seed of the projection matrices")
    buffer_records: int = knob(
        2048, help="records held in the device buffer before one transfer to the host"
    )

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
        object.__setattr__(
            self, "embedding", parse_choice(EmbeddingMode, self.embedding, "embedding")
        )
        object.__setattr__(
            self,
            "half_step_start",
            parse_choice(HalfStepStart, self.half_step_start, "half_step_start"),
        )
        if isinstance(self.power_iters, bool) or not isinstance(self.power_iters, int) or self.power_iters < 0:  # fmt: skip
            raise ConfigError(
                f"power_iters must be a non-negative integer (0 = half a step), got {self.power_iters!r}"
            )
        if not isinstance(self.optimizer_aware, bool):
            raise ConfigError(
                f"optimizer_aware must be true or false, got {self.optimizer_aware!r}"
            )
        for name in ("share_k", "vocab_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(
                f"rank must be a non-negative integer (0 = store full sketches), got {self.rank!r}"
            )
        v = self.free_text_rank
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(
                f"free_text_rank must be a non-negative integer (0 = always rank 1), got {v!r}"
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
        check_seed(self.seed)
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
        d["embedding"] = self.embedding.value
        return d


@document_fields
@dataclass(frozen=True)
class TrainSettings:
    """A tracked (or untracked) fine-tune, as the ``traceprop train`` command runs it."""

    data: str = knob(help="training data file or directory (.jsonl, .csv, .parquet, .txt)")
    out: str = knob(help="run directory to create")
    model: str = knob(
        "tiny",
        help="'tiny' (GPT-NeoX built from a config), 'minilm' (packaged encoder), or a local "
        "Hugging Face directory",
    )
    task: Task = knob(Task.CAUSAL_LM, help="training objective: causal-lm or classification")
    eval_data: str | None = knob(
        None, help="separate eval data (otherwise eval_fraction of the data is held out)"
    )
    eval_fraction: float = knob(0.1, help="held-out fraction when there is no eval data")
    epochs: int = knob(2, help="passes over the training data")
    lr: float = knob(3e-3, help="peak learning rate (AdamW, linear decay to 10 %)")
    weight_decay: float = knob(0.0, help="AdamW weight decay")
    warmup_steps: int = knob(0, help="steps of linear warm-up to the peak learning rate")
    batch_size: int = knob(8, help="examples per step")
    max_length: int = knob(128, help="tokens per example (longer ones are truncated)")
    lora_rank: int = knob(
        0, help="LoRA rank via peft (0 = full fine-tune); the LoRA layers are tracked"
    )
    lora_targets: str = knob(
        "all-linear", help="peft target modules: 'all-linear' or comma-separated names"
    )
    seed: int = knob(0, help="seed of data order, model init and projections")
    track: TrackSettings | None = knob(
        default_factory=TrackSettings, help="what is recorded (None: nothing, the baseline)"
    )
    tiny_layers: int = knob(4, help="layers of the tiny model")
    tiny_width: int = knob(256, help="width of the tiny model (a multiple of 4)")
    tiny_vocab: int = knob(1024, help="tokenizer vocabulary of the tiny model")
    threads: int = knob(0, help="torch CPU threads (0 = torch default)")
    device: str = knob("auto", help="auto, cpu, cuda, cuda:N")
    max_steps: int = knob(0, help="stop after this many steps (0 = all epochs)")
    parallel: str = knob(
        "ddp",
        help="under torchrun: DistributedDataParallel (ddp), or FSDP2 fully_shard (fsdp; "
        "docs/scaling.md)",
    )
    checkpoint_every: int = knob(
        50,
        help="steps between checkpoints that a resume continues from (also on SIGTERM/Ctrl-C; "
        "0 = none; not FSDP)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", parse_choice(Task, self.task, "task"))
        check_seed(self.seed)
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
