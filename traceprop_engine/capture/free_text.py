"""The records' rank from the data: rank 1 for answers and labels, ``free_text_rank`` for free text.

An example's per-layer gradient is ``G = Σ_t g_t a_tᵀ``. Where the loss is taken on a few
tokens (an answer, a label) it is nearly rank 1, and the default rank-1 record keeps what the
scores need. Where every token is a target (free text) ``G`` sums many tokens with different
targets; its rank-1 record keeps one direction of it and scored 0.07–0.21 LDS below
full-gradient cosine on real prose, while rank 16 scored at or above it (benchmarks/EVAL.md
§1x, §1y). On answer sets no rank beat rank 1. So a run with ``TrackSettings.rank == 1`` and
``free_text_rank > 1`` takes ``free_text_rank`` when its examples' median number of loss tokens
is above :data:`FREE_TEXT_TARGETS`.

Where the count comes from: the targets given to the :class:`~.tracker.Tracker` (``traceprop
train`` gives them), decided when it is built; without them, the first step's output
gradients (:class:`TargetProbe`): a position with no loss has an exactly zero output gradient
at the layers that write the last block's output (an LM head, a residual branch's output
projection), and every other layer sees at least as many non-zero positions, so the smallest
count over the tracked layers is the number of loss tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Sequence

import numpy as np
import torch

from .. import constants as C
from ..settings import SketchKind, TrackSettings
from .layers import set_rank

log = logging.getLogger(__name__)

FREE_TEXT_TARGETS = C.FREE_TEXT_TARGETS
"""Examples with more loss tokens than this (median) are free text: each one's per-layer
gradient sums many tokens with different targets, which a rank-1 record cannot keep."""


def adapts(settings: TrackSettings) -> bool:
    """Whether the rank is decided from the data: rank-1 factor records with a free-text rank."""
    return (
        settings.rank == 1
        and settings.free_text_rank > 1
        and settings.sketch is SketchKind.FACTORED
        and not settings.optimizer_aware  # its row scales need rank-1 records
    )


def rank_for(settings: TrackSettings, median_targets: float) -> TrackSettings:
    """``settings`` with the rank its data asks for (unchanged unless :func:`adapts`)."""
    if not adapts(settings) or median_targets <= FREE_TEXT_TARGETS:
        return settings
    log.info(
        "the training examples are free text (a median of %.0f loss tokens each): the records "
        "take rank %d instead of 1, which keeps much more of each example's gradient "
        "(benchmarks/EVAL.md section 1y; free_text_rank=0 keeps rank 1)",
        median_targets,
        settings.free_text_rank,
    )
    return dataclasses.replace(settings, rank=settings.free_text_rank)


def median_targets(targets: Sequence[np.ndarray]) -> float:
    """The median number of target tokens per example (0 for no examples)."""
    return float(statistics.median(len(np.asarray(t).ravel()) for t in targets)) if targets else 0.0


def free_text_note(track: TrackSettings, targets: Sequence[np.ndarray]) -> str | None:
    """Log (and return) a note when rank-1 records are kept on free text, where they keep too
    little: the other side of :func:`rank_for`, for a run with ``free_text_rank`` off.

    Measured (benchmarks/EVAL.md §1x): on causal LMs whose loss covers every token of a
    docstring, rank-1 records score 0.50 / 0.37 LDS (from scratch / LoRA on a pretrained base)
    against 0.71 / 0.50 for full-gradient cosine; rank 16 scores 0.69 / 0.52, at 16 times the
    bytes. On answer-only targets (a few tokens) rank 1 is as good as any rank. ``targets``: each
    training example's target ids."""
    if track.rank != 1 or adapts(track) or not targets:
        return None
    median = median_targets(targets)
    if median <= FREE_TEXT_TARGETS:
        return None
    note = (
        f"the training examples are free text (a median of {median:.0f} target tokens each) "
        "and the records are kept at rank 1, which keeps one direction of each example's "
        "gradient: on such runs benchmarks/EVAL.md §1x measured them 0.07-0.21 LDS below "
        "full-gradient similarity; --free-text-rank 16 (the default) recovers that at 16 times "
        "the bytes per record"
    )
    log.info(note)
    return note


class TargetProbe:
    """Counts, in one batch, each example's positions with a non-zero output gradient per layer.

    :meth:`add` is called from a backward hook with the layer's output gradient (no device
    sync: the counts stay on the device until :meth:`median`).
    """

    def __init__(self) -> None:
        self._counts: list[torch.Tensor] = []

    def add(self, g: torch.Tensor) -> None:
        if g.dim() == 2:  # (B, d_out): one position an example (a classifier's head)
            self._counts.append((g != 0).any(-1).to(torch.int64))
        else:
            self._counts.append((g != 0).any(-1).sum(1))

    def median(self) -> float | None:
        """The median over the batch's examples of the smallest count over the layers whose
        gradient was not zero everywhere (LoRA's A at initialisation is); None: no such layer."""
        live = [c for c in (c.cpu() for c in self._counts) if bool(c.any())]
        if not live:
            return None
        per_example = torch.stack(live).amin(0)  # every count is (B,): one per example
        return float(statistics.median(per_example.tolist()))


def rank_from_first_step(tracker, slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Decide ``tracker``'s record rank from its first step's loss positions (its probe; no
    targets were given) and return the step's slots in that layout.

    A step recorded at rank 1 keeps its records as the first column of the new rank's, the others
    zero: the same records. The store, the buffer and the capture's scratch are laid out again
    (nothing is stored yet: the step is not committed).
    """
    probe, tracker.capture.probe = tracker.capture.probe, None
    median = None if probe is None else probe.median()
    new = tracker.settings if median is None else rank_for(tracker.settings, median)
    agreed = _agreed_rank(new.rank)
    if agreed != new.rank:
        new = dataclasses.replace(tracker.settings, rank=agreed)
    if new.rank == tracker.settings.rank:
        return slots
    tracker.capture.write_deferred()  # this step's rank-1 records, into the slots
    kept = [s.clone() for s in slots]
    tracker.settings = new
    for layer in tracker.layers:
        if layer.rank:
            set_rank(layer, new)
    tracker.capture.relayout()
    tracker.writer.relayout(tracker.layers)
    tracker.buffer = tracker._make_buffer()
    slots = tracker.buffer.reserve(len(kept[0]))
    for slot, old in zip(slots, kept, strict=True):
        if slot.shape == old.shape:
            slot.copy_(old)
        else:  # (B, k_out + k_in, 1) -> (B, k_out + k_in, r)
            slot.zero_()
            slot[..., : old.shape[-1]].copy_(old)
    return slots


def _agreed_rank(rank: int) -> int:
    """The highest rank any process of a distributed run chose at its first step (every rank's
    store shard must have the same layout to be read as one store); ``rank`` alone otherwise.
    Every process calls it at its first ``Tracker.step``, as they all record that step."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return rank
    on = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )
    t = torch.tensor([rank], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
