"""The per-example loss, as defined by the store format (constants.LOSS_DEFINITION)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over each example's target tokens.

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` token ids, ``-100`` where no loss is taken (prompt, padding).

    Returns:
        ``(B,)`` per-example losses (0 for an example with no target token).
    """
    logits = logits[:, :-1].float()  # (B, T-1, V)
    target = labels[:, 1:]  # (B, T-1)
    tok = F.cross_entropy(
        logits.transpose(1, 2), target, ignore_index=-100, reduction="none"
    )  # (B, T-1)
    n = (target != -100).sum(1).clamp(min=1)
    return tok.sum(1) / n


def classification_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` logits, ``(B,)`` class ids -> ``(B,)`` cross-entropy."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def example_losses(model_output, batch: dict, task: str) -> torch.Tensor:
    """Per-example losses of a Hugging Face model output for ``batch`` (``labels`` included)."""
    if task == "classification":
        return classification_losses(model_output.logits, batch["labels"])
    return causal_lm_losses(model_output.logits, batch["labels"])
