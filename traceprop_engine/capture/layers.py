"""Which layers are tracked and how: :class:`TrackedLayer` (a Linear/Conv1D layer, or the input
embedding, its widths, projections and sketch kind), found by :func:`find_layers` (and
:func:`embedding_layer`) and built by :func:`build_layers`
from :class:`~traceprop_engine.settings.TrackSettings`; the capture hooks (hooks.py) and the
query side (attribution/model_side/encode.py, :meth:`TrackedLayer.from_stored`) share it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from .. import constants as C
from ..errors import ConfigError
from ..settings import EmbeddingMode, FactorSpace, HalfStepStart, SketchKind, TrackSettings
from .sketch import layer_seed, random_projection, sparse_jl, vocab_projection

try:  # GPT-2 style layers: y = x @ W + b with W of shape (d_in, d_out)
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = ()  # type: ignore[assignment]

_BLOCK_RE = re.compile(r"\.(\d+)\.")


@dataclass
class TrackedLayer:
    """One tracked layer: its module, widths, projections and running covariance."""

    name: str
    module: nn.Module
    kind: str  # "linear" | "conv1d" | "embedding" (inputs: token ids, one-hot of width d_in)
    d_in: int
    d_out: int
    k_in: int
    k_out: int
    sketch: SketchKind
    rank: int = 0  # stored as rank-r factors (0: the full record)
    factor_dtype: str = "float32"  # storage dtype of the factors
    full_factor: bool = False  # factors of the full G by power iteration (no per-token projection)
    power_iters: int = 0
    input_start: bool = False  # rank-1 half step from Σ_t a_t (TrackSettings.half_step_start)
    exact_input: bool = False  # input at most the rank wide (a LoRA B): exact, rank d_in + 1
    cov_stride: int = 1  # K-FAC statistics over every cov_stride-th batch (full_factor layers)
    cov_tokens: int = 0  # at most ≈ this many token rows of such a batch; 0 = all
    P_in: torch.Tensor | None = None  # (k_in, d_in) float32, CPU master copy
    P_out: torch.Tensor | None = None  # (k_out, d_out)
    dense_k: int = 0
    output_head: bool = False  # the model's output embedding (an LM head over the vocabulary)
    vocab_ids: np.ndarray | None = None  # target token ids kept exact by P_out's first rows
    dense_index: torch.Tensor | None = None  # (nnz, d_out*d_in)
    dense_sign: torch.Tensor | None = None
    # device-side working state
    _P_in_T: torch.Tensor | None = field(default=None, repr=False)
    _P_out_T: torch.Tensor | None = field(default=None, repr=False)
    _gather: torch.Tensor | None = field(default=None, repr=False)  # embedding: (d_in, k_in) = Pᵀ
    _ids: torch.Tensor | None = field(default=None, repr=False)  # embedding: the last token ids
    _dense_index: torch.Tensor | None = field(default=None, repr=False)
    _dense_sign: torch.Tensor | None = field(default=None, repr=False)
    A: torch.Tensor | None = field(default=None, repr=False)  # (k_in, k_in) float32 running sum
    S: torch.Tensor | None = field(default=None, repr=False)  # (k_out, k_out)
    a_tokens: torch.Tensor | None = field(
        default=None, repr=False
    )  # float64 tokens of masked batches
    a_rows: int = 0  # tokens of unmasked batches (a host count: no device op per step)
    _stack: list = field(default_factory=list, repr=False)
    _fired: bool = False
    _started: bool = False  # input start: this batch's Σ_t a_t row is written (first use)

    @classmethod
    def from_stored(
        cls,
        info,
        module: nn.Module,
        P_in: np.ndarray | None,
        P_out: np.ndarray | None,
        dense_projection: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> TrackedLayer:
        """A layer a store describes (its ``LayerInfo``), on ``module`` of the rebuilt model.

        For test-side sketches: the training run's projections (``P_in``, ``P_out``, and for a
        dense layer its sparse JL ``(index, sign)``), so the query lives in the space of the
        stored records; full ``(k_out, k_in)`` records (no rank-r factors), since the query is
        scored against every stored form.
        """
        layer = cls(
            name=info.name,
            module=module,
            kind=info.kind,
            d_in=info.d_in,
            d_out=info.d_out,
            k_in=info.k_in,
            k_out=info.k_out,
            sketch=SketchKind(info.sketch),
            P_in=None if P_in is None else torch.from_numpy(P_in),
            P_out=None if P_out is None else torch.from_numpy(P_out),
            dense_k=info.dense_k,
        )
        if dense_projection is not None:
            idx, sign = dense_projection
            layer.dense_index, layer.dense_sign = torch.from_numpy(idx), torch.from_numpy(sign)
        return layer

    @property
    def embedding(self) -> bool:
        """An input embedding: its input ``a_t`` is the one-hot of token ``t``, so the hooks
        take ``P_in a_t`` (a column of ``P_in``) by gathering, and every later step sees inputs
        already projected to ``k_in`` (:attr:`a_width`)."""
        return self.kind == "embedding"

    def embedding_input(self, ids: torch.Tensor) -> torch.Tensor:
        """``P_in a_t`` for the token ids ``(B, T)`` of an input embedding (``a_t`` the one-hot
        of token ``t``): rows of ``P_inᵀ`` (``_gather``, set on attach), or the one-hot itself
        when the input side is not projected. The padding token's row is 0, as its gradient row
        is in autograd."""
        table = self._gather
        a = (
            torch.nn.functional.one_hot(ids.long(), self.d_in).float()
            if table is None
            else torch.nn.functional.embedding(ids, table)
        )
        pad = getattr(self.module, "padding_idx", None)
        if pad is not None:
            a = a * (ids != pad).unsqueeze(-1)
        scale = _output_scale(self.module)  # the gradient of rows · scale is scale · Σ g eᵀ
        if isinstance(scale, torch.Tensor):
            a = a * scale.to(a)
        elif scale != 1:
            a = a * float(scale)
        self._ids = ids  # the batch's tokens (optimizer-aware records, capture/optimizer_scale.py)
        return a

    @property
    def a_width(self) -> int:
        """The width of the input the hooks factor: ``d_in``, or ``k_in`` for an embedding."""
        return self.k_in if self.embedding else self.d_in

    @property
    def record_shape(self) -> tuple[int, ...]:
        """What the hooks write per example: ``(dense_k,)``, ``(k_out, k_in)``, or for
        full-space factors ``(k_out + k_in, r)`` (``U`` rows, then ``V`` rows)."""
        if self.sketch is SketchKind.DENSE:
            return (self.dense_k,)
        if self.full_factor:
            return (self.k_out + self.k_in, self.rank)
        return (self.k_out, self.k_in)


def _widths(module: nn.Module) -> tuple[str, int, int]:
    if isinstance(module, nn.Embedding):  # weight (vocabulary, width): G = Σ_t g_t e_tokᵀ
        return "embedding", module.num_embeddings, module.embedding_dim
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    w = module.weight  # Conv1D: (d_in, d_out)
    return "conv1d", int(w.shape[0]), int(w.shape[1])


def find_layers(model: nn.Module, scope: str = "all") -> list[tuple[str, nn.Module]]:
    """Trainable linear layers of ``model`` in module order, filtered by ``scope``.

    A layer is tracked when it is an ``nn.Linear`` or a GPT-2 ``Conv1D`` whose weight requires
    grad (so with peft LoRA, the ``lora_A``/``lora_B`` layers, not the frozen base layers).
    """
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, Conv1D))
        and getattr(m, "weight", None) is not None
        and m.weight.requires_grad
    ]
    if scope == "all":
        chosen = found
    elif scope == "last-block":
        blocks = [int(b.group(1)) for n, _ in found if (b := _BLOCK_RE.search("." + n + "."))]
        if not blocks:
            raise ConfigError(
                "scope 'last-block' found no numbered blocks (names like 'layers.3.'); use a regex scope"
            )
        last = max(blocks)
        chosen = [(n, m) for n, m in found if f".{last}." in f".{n}."]
    else:
        rx = re.compile(scope)
        chosen = [(n, m) for n, m in found if rx.search(n)]
    if not chosen:
        names = ", ".join(n for n, _ in found[:12]) or "(none: no trainable linear layer)"
        raise ConfigError(f"scope {scope!r} matches no trainable linear layer; layers are: {names}")
    return chosen


def _pretrained(model: nn.Module) -> bool:
    """Whether ``model`` was loaded from saved weights (Hugging Face sets ``config._name_or_path``
    in ``from_pretrained``; a model built from a config has ``""``), through a peft wrapper too."""
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "_name_or_path", "") or getattr(cfg, "name_or_path", ""))


def model_origin(model: nn.Module) -> str:
    """What a run trains (the store's ``MODEL_ORIGIN``): ``ORIGIN_SCRATCH`` (a model built from a
    config), ``ORIGIN_ADAPTER`` (a peft adapter on any model) or ``ORIGIN_PRETRAINED_FULL`` (a
    model loaded from saved weights, every parameter trained)."""
    if hasattr(model, "peft_config"):
        return C.ORIGIN_ADAPTER
    return C.ORIGIN_PRETRAINED_FULL if _pretrained(model) else C.ORIGIN_SCRATCH


def embedding_layer(model: nn.Module, settings: TrackSettings) -> tuple[str, nn.Module] | None:
    """The input embedding to record as one more layer (``TrackSettings.embedding``), or None.

    ``auto`` records it when its weight is trained, the model was loaded from saved weights and
    ``scope`` is ``all`` with factored sketches: fine-tunes of a pretrained model in full, where
    its gradient is worth as much as all linear layers together (benchmarks/EVAL.md §1l); not a
    model built from a config (there it lowered LDS by up to 0.04), nor LoRA (it is frozen).
    ``on`` records it whenever it is trained.

    ``auto`` also leaves out an embedding tied to the LM head, one with ``scale_grad_by_freq`` or
    sparse gradients, and one whose forward rescales its rows other than by a scalar
    ``embed_scale`` (:func:`_output_scale`).

    Raises:
        ConfigError: ``on`` with dense sketches (no Kronecker form of a vocabulary-wide dense
            gradient is kept), or with an embedding whose gradient the record cannot follow.
    """
    mode = settings.embedding
    if mode is EmbeddingMode.OFF:
        return None
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        emb = None
    if not isinstance(emb, nn.Embedding) or not emb.weight.requires_grad:
        return None
    if settings.sketch is SketchKind.DENSE:
        if mode is EmbeddingMode.ON:
            raise ConfigError(
                "embedding='on' needs factored sketches (sketch='factored'): a dense sketch of a "
                "vocabulary-wide gradient is not kept"
            )
        return None
    auto = mode is EmbeddingMode.AUTO
    if auto and (settings.scope != "all" or not _pretrained(model)):
        return None
    head = output_embedding(model)
    if auto and head is not None and getattr(head, "weight", None) is emb.weight:
        return None  # tied to the LM head (GPT-2): two records of one parameter, unmeasured
    unfit = (
        "uses scale_grad_by_freq or sparse gradients"
        if emb.scale_grad_by_freq or emb.sparse
        else "scales its output in a forward the record does not know (no scalar embed_scale)"
        if _output_scale(emb) is None
        else ""
    )
    if unfit:
        if auto:
            return None
        raise ConfigError(f"the input embedding {unfit}: pass embedding='off'")
    name = next(n for n, m in model.named_modules() if m is emb)
    return name, emb


def resolved_embedding(
    settings: TrackSettings, model: nn.Module | None, stored_kinds: list[str] | None = None
) -> TrackSettings:
    """``settings`` with ``embedding='auto'`` decided once for a run (``on`` or ``off``, what its
    manifest then records): by :func:`embedding_layer` on ``model``, or, when the run appends to
    a store that exists (a resume: ``stored_kinds`` are its layers' kinds), by whether that store
    records an embedding. A resumed model is loaded from saved weights, which ``auto`` alone
    would take for a pretrained one."""
    if settings.embedding is not EmbeddingMode.AUTO:
        return settings
    if stored_kinds is None:
        on = embedding_layer(model, settings) is not None
    else:
        on = "embedding" in stored_kinds
    return replace(settings, embedding=EmbeddingMode.ON if on else EmbeddingMode.OFF)


def _output_scale(emb: nn.Module):
    """What an embedding multiplies its looked-up rows by: 1 for ``nn.Embedding`` itself, a
    subclass's scalar ``embed_scale`` (Gemma's and BART's scaled word embeddings: ``super().forward
    (ids) * embed_scale``), None for another forward override."""
    if type(emb).forward is nn.Embedding.forward:
        return 1.0
    scale = getattr(emb, "embed_scale", None)
    if isinstance(scale, (int, float)) or (isinstance(scale, torch.Tensor) and scale.numel() == 1):
        return scale
    return None


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The model's output embedding (a causal LM's head over the vocabulary), or None: Hugging
    Face's ``get_output_embeddings()`` (through a peft wrapper too); classifiers have none."""
    get = getattr(model, "get_output_embeddings", None)
    if not callable(get):
        return None
    try:
        out = get()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return out if isinstance(out, nn.Module) else None


def _is_classifier(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a peft wrapper holds) is a Hugging Face classifier."""
    base = getattr(model, "base_model", None)
    chain = [model, base, getattr(base, "model", None)]
    return any("Classification" in type(m).__name__ for m in chain if m is not None)


def output_head(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> nn.Module | None:
    """The tracked layer that produces the model's logits, or None.

    It is the output embedding of a causal LM (:func:`output_embedding`). For a Hugging Face
    classifier (``*ForSequenceClassification`` and similar, through a peft wrapper too), it is
    the last of ``layers`` whose output width is ``config.num_labels`` (LoRA's own ``lora_A`` /
    ``lora_B`` excluded): the ``classifier`` / ``score`` / ``out_proj`` layer, or the copy of it
    that peft trains. Every preconditioner leaves this layer unwhitened
    (attribution/precondition/preconditioner.py).
    """
    head = output_embedding(model)
    if head is not None:
        return head
    n = getattr(getattr(model, "config", None), "num_labels", None)
    if not n or not _is_classifier(model):
        return None
    heads = [m for name, m in layers if _widths(m)[2] == n and ".lora_" not in f".{name}"]
    return heads[-1] if heads else None


def target_counts(targets, vocab: int | None = None) -> np.ndarray:
    """``(V,)`` how often each token id is a training target, from an iterable of per-example
    target id arrays (each example's loss-masked token ids)."""
    ids = [np.asarray(t, dtype=np.int64).ravel() for t in targets]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if flat.size and flat.min() < 0:
        raise ConfigError("target token ids must be >= 0 (drop the -100 of unlabelled positions)")
    n = max(int(flat.max()) + 1 if flat.size else 0, vocab or 0)
    return np.bincount(flat, minlength=n).astype(np.float64)


def build_layers(
    model: nn.Module,
    settings: TrackSettings,
    targets: np.ndarray | None = None,
    stored_ranks: list[int] | None = None,
) -> list[TrackedLayer]:
    """Tracked layers with their seeded projections (k per side: :meth:`TrackSettings.layer_k`).

    Args:
        model: the model.
        settings: what to record.
        targets: ``(V,)`` counts of each token id as a training target (:func:`target_counts`);
            with ``settings.vocab_rows`` the LM head's output projection keeps the most frequent
            ones exact (:func:`~.sketch.vocab_projection`). None: a plain projection.
        stored_ranks: a resumed store's rank of each layer (:func:`keep_stored_ranks`).
    """
    found = find_layers(model, settings.scope)
    head = output_head(model, found)
    emb = embedding_layer(model, settings)
    if emb is not None:  # in module order, like the others
        order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        found = sorted([emb, *found], key=lambda nm: order[id(nm[1])])
    layers = []
    for name, module in found:
        kind, d_in, d_out = _widths(module)
        k_in, k_out = settings.layer_k(d_in, d_out)
        layer = TrackedLayer(
            name=name,
            module=module,
            kind=kind,
            d_in=d_in,
            d_out=d_out,
            k_in=k_in,
            k_out=k_out,
            sketch=settings.sketch,
            output_head=head is not None and module is head,
        )
        if settings.sketch is SketchKind.DENSE:
            layer.k_in, layer.k_out = d_in, d_out
            layer.dense_k = settings.dense_k
            layer.dense_index, layer.dense_sign = sparse_jl(
                d_out * d_in,
                settings.dense_k,
                settings.dense_nnz,
                layer_seed(settings.seed, name, "dense"),
            )
        else:
            kind = settings.projection.value
            layer.P_in = random_projection(
                kind, layer.k_in, d_in, layer_seed(settings.seed, name, "in")
            )
            out_seed = layer_seed(settings.seed, name, "out")
            if layer.output_head and settings.vocab_rows and targets is not None:
                layer.P_out, layer.vocab_ids = vocab_projection(
                    kind, layer.k_out, d_out, out_seed, targets
                )
            else:
                layer.P_out = random_projection(kind, layer.k_out, d_out, out_seed)
            set_rank(layer, settings)
        layers.append(layer)
    if stored_ranks is not None:
        keep_stored_ranks(layers, stored_ranks)
    return layers


def keep_stored_ranks(layers: list[TrackedLayer], ranks: list[int]) -> None:
    """A resumed store's records keep their form: a narrow-input layer whose store holds another
    rank (written before exact narrow-input records existed) goes on with the Gaussian token
    start at the stored rank."""
    for layer, rank in zip(layers, ranks, strict=False):
        if layer.exact_input and rank and rank != layer.rank:
            layer.exact_input, layer.rank = False, rank


def set_rank(layer: TrackedLayer, settings: TrackSettings) -> None:
    """A factored layer's record form from ``settings``: its rank (clamped to the layer), factor
    dtype and space, power iterations, half-step start and statistics sampling. Also used to
    change a layer's rank before its first record is stored (:mod:`.free_text`)."""
    if not settings.rank:
        return
    layer.rank = min(settings.rank, layer.k_out, layer.k_in)
    layer.factor_dtype = settings.factor_dtype.value
    layer.full_factor = settings.factor_space is FactorSpace.FULL
    layer.power_iters = settings.power_iters
    # an input at most rank wide (a LoRA B): Σ_t g_t + G's columns record G exactly (full_factors)
    layer.exact_input = (
        layer.full_factor
        and layer.power_iters == 0
        and layer.kind != "embedding"
        and settings.rank > 1
        and layer.d_in <= settings.rank
        and layer.d_in + 1 <= min(layer.k_out, layer.d_out)
    )
    if layer.exact_input:
        layer.rank = layer.d_in + 1
    layer.input_start = (
        settings.half_step_start is HalfStepStart.NARROW
        and not settings.optimizer_aware
        and layer.full_factor
        and layer.rank == 1
        and layer.power_iters == 0
        and not layer.output_head
        and not layer.embedding
        and layer.d_in < layer.d_out
    )
    layer.cov_stride = settings.covariance_stride if layer.full_factor else 1
    layer.cov_tokens = settings.covariance_tokens if layer.full_factor else 0
