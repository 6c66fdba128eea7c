"""Optimizer-aware records (``TrackSettings.optimizer_aware``): Adam's per-parameter scaling.

A raw-gradient record ``lr · G_i`` ignores what AdamW does with the gradient: the update of
weight ``W`` at step ``t`` is ``−lr · m̂_t / (√v̂_t + ε)``, so an example's own contribution to
it is about ``−lr · D_t ⊙ G_i`` with ``D_t = 1 / (√v̂_t + ε)`` (elementwise; momentum spreads it
over later steps, which this ignores). ``D_t`` is read at the recorded step, *with* that step's
gradient: ``v_t = β₂ v_{t−1} + (1 − β₂) ḡ_t²`` from the optimizer's ``exp_avg_sq`` and the
batch gradient in ``W.grad`` (what ``optimizer.step()`` is about to compute), bias-corrected
by ``1 − β₂^t``.

The default record is rank 1 (``σ wᵀ / ‖σ‖²`` before the projections, ``project.py``); an
elementwise product with a full ``D`` would not be. ``D`` is replaced by its Adafactor-style
rank-1 fit ``a bᵀ`` with ``a = D 1 / √(1ᵀD1)``, ``b = Dᵀ1 / √(1ᵀD1)`` (exact when ``D`` is
rank 1), and ``(a bᵀ) ⊙ (σ wᵀ) = (a ⊙ σ)(b ⊙ w)ᵀ``: the record stays rank 1, at the same bytes.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, RunError


def param_groups_of(optimizer) -> dict[int, dict]:
    """``id(parameter) -> its param group`` (betas, eps)."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def adam_row_scales(layers, optimizer, groups: dict[int, dict]) -> dict[int, tuple]:
    """Per tracked layer index ``(a (d_out,), b (d_in,))``: the rank-1 fit of ``1/(√v̂_t + ε)``.

    Layers whose weight has no gradient in this step are left out (their records are zero).
    An input embedding's record takes only the output side's scale (averaged over the rows of
    the batch's tokens): its input side is projected before the hooks see it.

    Raises:
        ConfigError: the optimizer keeps no Adam second moment (no ``betas`` in its group).
    """
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(layers):
            w = layer.module.weight
            if w.grad is None:
                continue
            group = groups.get(id(w))
            if group is None or "betas" not in group:
                raise ConfigError(
                    "optimizer_aware records need an Adam-type optimizer (Adam, AdamW) that "
                    f"updates the tracked layer {layer.name}; got {type(optimizer).__name__}"
                )
            beta2, eps = float(group["betas"][1]), float(group["eps"])
            state = optimizer.state.get(w, {})
            t = float(state["step"]) + 1 if "step" in state else 1.0
            g = w.grad.float()
            v = (1 - beta2) * g * g
            if "exp_avg_sq" in state:
                v = v + beta2 * state["exp_avg_sq"].float()
            d = 1.0 / ((v / (1 - beta2**t)).sqrt() + eps)
            if layer.embedding:  # weight (vocabulary, width); its input side arrives projected
                # the output side's mean over the rows of the micro-batch's tokens with a
                # gradient (an unseen row's 1/ε would swamp the mean; a tied LM head gives every
                # row a gradient, so the ids pick the rows too), from masks: no device sync; the
                # input side is not scaled
                seen = (g.abs().sum(1) > 0).to(d.dtype)
                if layer._ids is not None:
                    ids = torch.zeros_like(seen)
                    ids.index_fill_(0, layer._ids.reshape(-1).to(d.device, torch.long), 1.0)
                    seen = seen * ids
                a = (d * seen[:, None]).sum(0) / seen.sum().clamp_min(1.0)
                out[i] = (a, torch.ones(layer.k_in, device=d.device))
                continue
            root = d.sum().sqrt()
            out[i] = (d.sum(1) / root, d.sum(0) / root)
    return out


def check_optimizer_aware(layers, deferrable) -> None:
    """Optimizer-aware records exist for the default factors only (rank 1, half a step)."""
    bad = [layer.name for layer in layers if not deferrable(layer)]
    if bad:
        raise ConfigError(
            "optimizer_aware records need the default factor records (factored sketch, rank 1, "
            f"factor_space full, power_iters 0); layers {bad[:3]} are recorded otherwise"
        )


def missing_optimizer() -> RunError:
    return RunError(
        "TrackSettings(optimizer_aware=True) needs the optimizer: Tracker(..., optimizer=opt) "
        "or tracker.attach_optimizer(opt) before the first step"
    )
