"""Optimizer-aware records: each record is the raw record scaled elementwise by the rank-1 fit
of AdamW's step size ``1/(√v̂_t + ε)`` at the recorded step, computed here by hand."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import causal_batch, tiny_neox

from traceprop_engine import ConfigError, RunError, Store, Tracker, TrackSettings
from traceprop_engine.training.losses import causal_lm_losses

# k above every width of the tiny model: no projection, the records are in the full space
# the raw records the optimizer-aware ones scale: every layer from its output side (the
# default), as optimizer_aware records them (it ignores half_step_start)
BASE = dict(k_in=512, k_out=512, factor_dtype="float32", half_step_start="output")
RTOL, ATOL_REL = 1e-4, 1e-6  # the same float32 products, scaled before vs after


def _hand_scale(w: torch.Tensor, opt, kind="linear", ids=None, beta2=0.999, eps=1e-8) -> np.ndarray:
    """``a bᵀ`` of the rank-1 fit of ``1/(√v̂_t + ε)`` with this step's gradient, by hand; for
    an input embedding (weight ``(V, d)``, record ``(d, V)``) the output side's mean over the
    rows of the batch's tokens ``ids`` that have a gradient, times ones."""
    st = opt.state.get(w, {})
    t = int(st["step"]) + 1 if "step" in st else 1
    v = (1 - beta2) * w.grad.double() ** 2
    if "exp_avg_sq" in st:
        v += beta2 * st["exp_avg_sq"].double()
    d = (1 / ((v / (1 - beta2**t)).sqrt() + eps)).numpy()
    if kind == "embedding":  # the rows of the batch's tokens that have a gradient
        seen = (w.grad.abs().sum(1) > 0).numpy() & np.isin(np.arange(len(d)), ids.numpy())
        return np.outer(d[seen].mean(0), np.ones(d.shape[0]))
    return np.outer(d.sum(1), d.sum(0)) / d.sum()


def _train(settings, model, tmp_path, name, hand=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask, labels, _ = causal_batch()
    mods = dict(model.named_modules())
    with Tracker(model, tmp_path / name / "store.h5", settings, background=False) as tr:
        if settings.optimizer_aware:
            tr.attach_optimizer(opt)
        names = [(layer.name, layer.kind) for layer in tr.layers]
        for step in range(3):
            with tr.step([0, 1, 2], padding_mask=mask, step=step, lr=1e-2) as rec:
                rec.losses = causal_lm_losses(
                    model(input_ids=ids, attention_mask=mask).logits, labels
                )
                rec.losses.mean().backward()
            if hand is not None:
                hand.append([_hand_scale(mods[n].weight, opt, kind, ids) for n, kind in names])
            opt.step()
            opt.zero_grad()
    with Store(tmp_path / name / "store.h5") as store:
        return [store.sketches(li) for li in range(len(store.layers))]


def test_records_are_the_raw_records_times_adams_rank1_step_size(tmp_path):
    m1 = tiny_neox()
    m2 = copy.deepcopy(m1)
    hand: list = []
    plain = _train(TrackSettings(**BASE), m1, tmp_path, "plain", hand)
    aware = _train(TrackSettings(**BASE, optimizer_aware=True), m2, tmp_path, "aware")
    assert len(plain) == len(aware) and len(hand) == 3
    for li, (p, a) in enumerate(zip(plain, aware, strict=True)):
        assert p.shape == a.shape and p.shape[0] == 9  # 3 steps × 3 examples
        for r in range(9):
            want = hand[r // 3][li] * p[r]
            np.testing.assert_allclose(a[r], want, rtol=RTOL, atol=ATOL_REL * np.abs(want).max())
        # and the scaling is not a no-op: Adam's step sizes differ across coordinates
        assert not np.allclose(a[3:], p[3:] * (np.abs(a[3:]).max() / np.abs(p[3:]).max()))


def test_optimizer_aware_needs_an_optimizer_and_the_default_records(tmp_path):
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    with pytest.raises(ConfigError, match="default factor records"):
        Tracker(model, tmp_path / "a.h5", TrackSettings(rank=0, optimizer_aware=True))
    with (
        Tracker(model, tmp_path / "b.h5", TrackSettings(optimizer_aware=True)) as tr,
        pytest.raises(RunError, match="needs the optimizer"),
        tr.step([0, 1, 2], padding_mask=mask) as rec,
    ):
        rec.losses = causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        rec.losses.mean().backward()
    with pytest.raises(ConfigError, match="optimizer_aware"):
        TrackSettings(optimizer_aware="yes")


def test_an_embedding_record_takes_the_output_sides_mean_step_size(tmp_path):
    """The input embedding's input side arrives projected, so its record is scaled on the output
    side only, by Adam's step size averaged over the batch's tokens; the linear layers as above."""
    m1 = tiny_neox()
    m2 = copy.deepcopy(m1)
    hand: list = []
    plain = _train(TrackSettings(**BASE, embedding="on"), m1, tmp_path, "plain", hand)
    aware = _train(
        TrackSettings(**BASE, embedding="on", optimizer_aware=True), m2, tmp_path, "aware"
    )
    assert plain[0].shape == (9, 32, 97)  # the embedding first: (records, width, vocabulary)
    for li, (p, a) in enumerate(zip(plain, aware, strict=True)):
        for r in range(9):
            want = hand[r // 3][li] * p[r]
            np.testing.assert_allclose(a[r], want, rtol=RTOL, atol=ATOL_REL * np.abs(want).max())
