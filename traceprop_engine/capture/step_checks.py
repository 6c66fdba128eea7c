"""What a caller hands :meth:`~traceprop_engine.capture.tracker.Tracker.step`, checked at the
call: example ids, learning rate, loss scale, padding mask, and the per-example losses set in
the block. Anything that would make a record silently wrong (a NaN or negative learning rate,
a NaN loss) is refused here instead of being recorded."""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import constants as C
from ..errors import ConfigError, RunError

MAX_EXAMPLE_ID = 2**31 - 1


def example_ids(example_index) -> np.ndarray:
    """The step's example ids as int64, checked: integers in ``[0, MAX_EXAMPLE_ID]``."""
    if isinstance(example_index, torch.Tensor):
        example_index = example_index.detach().cpu().numpy()
    arr = np.asarray(example_index)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(
            f"example ids must be a non-empty 1-D sequence (one per example of the micro-batch), "
            f"got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise ConfigError(
            f"example ids must be integers, got {arr.dtype} ({arr[:3].tolist()}...): pass the "
            "examples' integer indices (e.g. batch['example_index'])"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > MAX_EXAMPLE_ID:
        raise ConfigError(
            f"example ids must lie in [0, {MAX_EXAMPLE_ID}], got {lo if lo < 0 else hi}: number "
            "the training examples 0..N-1 (they index the example table)"
        )
    return arr.astype(np.int64)


def _as_float(x) -> float:
    if isinstance(x, (str, bytes)):  # float("0.1") would pass: a number is asked for
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def check_step_args(b: int, lr, padding_mask, loss_scale) -> None:
    # a negative lr flips every score's sign (proponents become opponents), a NaN one makes
    # every score NaN: both are refused here rather than recorded
    if isinstance(lr, bool) or not math.isfinite(_as_float(lr)) or _as_float(lr) < 0:
        raise ConfigError(
            f"Tracker.step(lr=...) must be the step's learning rate, a finite number >= 0, got "
            f"{lr!r} (a query weights each record by it)"
        )
    if loss_scale is not None and (
        isinstance(loss_scale, bool)
        or not math.isfinite(_as_float(loss_scale))
        or _as_float(loss_scale) <= 0
    ):
        raise ConfigError(
            f"Tracker.step(loss_scale=...) must be a finite number > 0, got {loss_scale!r}"
        )
    if padding_mask is not None and (padding_mask.dim() != 2 or padding_mask.shape[0] != b):
        raise ConfigError(
            f"Tracker.step got {b} example ids but a padding_mask of shape "
            f"{tuple(padding_mask.shape)}: give the (B, T) attention mask of the same {b} examples"
        )


def check_losses(losses, b: int, step: int = 0, lr: float = 0.0):
    """``rec.losses`` as set in a step: ``b`` per-example losses (kept on their device)."""
    if losses is None:
        raise RunError(
            "rec.losses was not set in this Tracker.step() block: assign the (B,) per-example "
            "losses inside the block (rec.losses = losses)"
        )
    n = losses.numel() if isinstance(losses, torch.Tensor) else np.asarray(losses).size
    if n != b:
        raise RunError(
            f"rec.losses holds {n} values for a micro-batch of {b} examples: give one loss per "
            "example (the (B,) losses before the mean)"
        )
    # one host check per step (a device sync, as the loss a training loop logs anyway)
    values = (
        losses.detach().float().cpu().numpy()
        if isinstance(losses, torch.Tensor)
        else np.asarray(losses, np.float64)
    )
    bad = values[~np.isfinite(values)]
    if bad.size:
        raise RunError(
            f"the training loss became {float(bad.flat[0])} at step {step} (learning rate "
            f"{float(lr):g}) in rec.losses: the run diverged, and this step was not recorded; "
            "lower the learning rate (or check the data) and train again"
        )
    return losses


def check_tokens_in_vocab(model: torch.nn.Module, tokens) -> None:
    """ConfigError when a stored token id is outside the model's input vocabulary (a query
    would fail on it with an IndexError)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is None or not len(tokens):
        return
    flat = np.concatenate([np.asarray(t).ravel() for t in tokens])
    if flat.size == 0 or int(flat.max()) < vocab:
        return
    lengths = np.fromiter((np.size(t) for t in tokens), np.int64, len(tokens))
    pos = int(np.flatnonzero(flat >= vocab)[0])
    i = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
    raise ConfigError(
        f"example {i}: token id {int(flat[pos])} is outside the model's vocabulary of {vocab} "
        "(input embedding rows): store the ids the model was trained on"
    )


def short_run_stride(batches: int) -> int:
    """The ``covariance_stride`` that gives a run of ``batches`` statistics from at least
    :data:`~traceprop_engine.constants.MIN_COVARIANCE_BATCHES` of them (1 when it has fewer)."""
    return max(1, batches // C.MIN_COVARIANCE_BATCHES)


def few_statistics(batches: int, stride: int) -> str | None:
    """A warning when a run's K-FAC statistics (what the default preconditioner uses) came from
    fewer than :data:`~traceprop_engine.constants.MIN_COVARIANCE_BATCHES` of its ``batches``
    while a smaller ``covariance_stride`` would have given more; None otherwise."""
    seen = -(-batches // stride)  # batches 1, 1 + stride, ...
    better = short_run_stride(batches)
    if seen >= C.MIN_COVARIANCE_BATCHES or better >= stride:
        return None
    return (
        f"the K-FAC statistics (the default preconditioner's) come from {seen} of this run's "
        f"{batches} batches (every {stride}th): for a run this short pass "
        f"TrackSettings(covariance_stride={better}), as `traceprop train` does"
    )


def warn_silent_embedding(embeddings, warned: bool) -> bool:
    """Warn once per run (returns whether it has been) when a tracked input embedding (of
    ``embeddings``, the run's embedding layers) took no part in a step whose other layers did
    (the model was called with ``inputs_embeds``, or its embedding was replaced after the
    Tracker was built): its records are zero."""
    if warned or not embeddings:
        return warned
    silent = [x.name for x in embeddings if not x._fired]
    if silent:
        logging.getLogger("traceprop_engine.capture.tracker").warning(
            "the tracked input embedding %s took no part in a step (a forward with "
            "inputs_embeds, or an embedding replaced after the Tracker was built?): its records "
            "are zero; pass TrackSettings(embedding='off') if that is intended",
            silent[0],
        )
        return True
    return warned


def padding_mask_of(padding_mask, token_mask):
    """``Tracker.step``'s padding mask, given as ``padding_mask`` or by its deprecated alias
    ``token_mask`` (a warning).

    Raises:
        ConfigError: both given.
    """
    if token_mask is None:
        return padding_mask
    if padding_mask is not None:
        raise ConfigError(
            "Tracker.step got both padding_mask and token_mask: pass padding_mask only"
        )
    warnings.warn(
        "Tracker.step(token_mask=...) is deprecated: it is the padding (attention) mask, "
        "pass padding_mask=...",
        DeprecationWarning,
        stacklevel=4,
    )
    return token_mask


def check_store_path(store_path, new: bool) -> None:
    """A Tracker's store path: a file name, and (``new``: no store reopened, no overwrite asked)
    no file there yet.

    Raises:
        ConfigError: a directory; an existing file where a new store would go.
    """
    if Path(store_path).is_dir():
        raise ConfigError(
            f"the store path {store_path} is a directory: give the store's file name, "
            f"e.g. {Path(store_path) / C.STORE_FILE}"
        )
    if new and os.path.lexists(store_path):
        raise ConfigError(
            f"{store_path} already exists (the store of an earlier run?): a new Tracker "
            "would replace it with an empty store. Give another path, or pass "
            "overwrite=True to replace it"
        )
