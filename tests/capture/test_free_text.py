"""The records' rank from the data (``TrackSettings.free_text_rank``): free text (a median of more
than FREE_TEXT_TARGETS loss tokens an example) takes the free-text rank, answers keep rank 1,
decided from the targets when the Tracker has them and from the first step's output gradients
when it has not; either way the store holds the same records."""

from __future__ import annotations

from pathlib import Path

import helpers
import numpy as np
import pytest
import torch
from helpers import run_torchrun, tiny_neox

from traceprop_engine import Store, Tracker, TrackSettings
from traceprop_engine import constants as C
from traceprop_engine.capture.free_text import (
    FREE_TEXT_TARGETS,
    TargetProbe,
    adapts,
    median_targets,
    rank_for,
)
from traceprop_engine.training.hf_trainer import rank_store_path
from traceprop_engine.training.losses import causal_lm_losses

T = FREE_TEXT_TARGETS + 8  # tokens an example
VOCAB = helpers.VOCAB
# the records of one run decided at construction and one decided at the first step are the same
# float32 products (the same kernels, the same order): equal up to int8 rounding of one unit
INT8_STEP = 1.0 / 127


def _batches(answer_tokens: int | None, n_steps: int = 3, b: int = 4, seed: int = 0):
    """``n_steps`` batches of ``b`` examples of T tokens: every token a target (free text) or
    the last ``answer_tokens`` (answers)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n_steps):
        ids = torch.randint(1, VOCAB, (b, T), generator=g)
        labels = ids.clone()
        if answer_tokens is not None:
            labels[:, : T - answer_tokens] = -100
        out.append((list(range(s * b, (s + 1) * b)), ids, labels))
    return out


def _targets(batches):
    return [row[row >= 0][1:].numpy() for _, _, labels in batches for row in labels]


def _record(path, batches, settings, targets=None):
    model = tiny_neox()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Tracker(model, path, settings, background=False, targets=targets) as tracker:
        for step, (idx, ids, labels) in enumerate(batches):
            with tracker.step(idx, step=step, lr=0.1) as rec:
                losses = causal_lm_losses(model(input_ids=ids).logits, labels)
                losses.mean().backward()
                rec.losses = losses
            opt.step()
            opt.zero_grad()
    return tracker


def _ranks(path) -> set[int]:
    with Store(path) as store:
        return {info.rank for info in store.layers}


def test_the_rule_free_text_above_the_threshold_and_only_for_rank_1_factor_records():
    base = TrackSettings()
    assert adapts(base) and base.free_text_rank == 16
    assert rank_for(base, FREE_TEXT_TARGETS).rank == 1  # at the threshold: answers
    assert rank_for(base, FREE_TEXT_TARGETS + 1).rank == 16
    for other in (
        TrackSettings(rank=4),
        TrackSettings(rank=0),
        TrackSettings(free_text_rank=0),
        TrackSettings(free_text_rank=1),
        TrackSettings(sketch="dense"),
        TrackSettings(optimizer_aware=True),
    ):
        assert not adapts(other) and rank_for(other, 100) == other
    assert median_targets([np.arange(3), np.arange(40), np.arange(41)]) == 40
    assert median_targets([]) == 0


def test_the_probe_counts_loss_positions_at_the_layer_nearest_the_loss():
    """Per example the smallest count over the layers (a layer further from the loss sees more
    non-zero positions), layers with no gradient at all left out (LoRA's A at first)."""
    probe = TargetProbe()
    near = torch.zeros(3, 10, 4)
    near[0, :2] = 1.0
    near[1, :7] = 1.0
    near[2, 5:] = 1.0  # 5 positions
    far = torch.ones(3, 10, 4)  # every position (attention spreads the gradient back)
    probe.add(far)
    probe.add(torch.zeros(3, 10, 4))
    probe.add(near)
    assert probe.median() == 5
    assert TargetProbe().median() is None
    head = TargetProbe()
    head.add(torch.ones(3, 2))  # a classifier's head: one position an example
    assert head.median() == 1


@pytest.mark.parametrize("given_targets", [True, False])
def test_free_text_takes_the_free_text_rank_and_answers_keep_rank_1(tmp_path, given_targets):
    for name, answer, want in (("text", None, 16), ("answers", 3, 1)):
        batches = _batches(answer)
        path = tmp_path / f"{name}.h5"
        tracker = _record(
            path, batches, TrackSettings(), _targets(batches) if given_targets else None
        )
        with Store(path) as store:
            assert store.n_records == 12 and store.status == C.STATUS_COMPLETED
        # every layer of the tiny model is at least 16 wide on its narrower side
        assert _ranks(path) == {want}, name
        assert tracker.settings.rank == want
        assert tracker.tracking_manifest()["rank"] == want


def test_a_rank_decided_at_the_first_step_stores_the_records_of_one_decided_up_front(tmp_path):
    """Steps after the first: the same records as a run told the targets. The first step was
    recorded at rank 1 before the decision: its records are the rank-1 records, kept as the
    first column (the others zero), which is also the first column of the up-front run's."""
    batches = _batches(None)
    _record(tmp_path / "probe.h5", batches, TrackSettings())
    _record(tmp_path / "given.h5", batches, TrackSettings(), _targets(batches))
    _record(tmp_path / "one.h5", batches, TrackSettings(free_text_rank=0))
    with (
        Store(tmp_path / "probe.h5") as probe,
        Store(tmp_path / "given.h5") as given,
        Store(tmp_path / "one.h5") as one,
    ):
        for li, info in enumerate(probe.layers):
            assert info.rank == 16
            pu, pv = probe.factors(li)
            gu, gv = given.factors(li)
            ou, ov = one.factors(li)
            later = slice(4, None)
            scale = max(float(np.abs(gu[later]).max()), 1e-30)
            np.testing.assert_allclose(pu[later], gu[later], atol=INT8_STEP * scale, rtol=0)
            np.testing.assert_allclose(pv[later], gv[later], atol=INT8_STEP, rtol=0)
            # the first step: rank-1 records in the first column, zeros beside them
            first = slice(0, 4)
            assert not pu[first][..., 1:].any() and not pv[first][..., 1:].any()
            rec = np.einsum("nir,njr->nij", pu[first], pv[first])
            want = np.einsum("nir,njr->nij", ou[first], ov[first])
            top = max(float(np.abs(want).max()), 1e-30)
            np.testing.assert_allclose(rec, want, atol=2 * INT8_STEP * top, rtol=0)


def test_an_explicit_rank_or_free_text_rank_0_is_kept(tmp_path):
    batches = _batches(None, n_steps=1)
    _record(tmp_path / "r4.h5", batches, TrackSettings(rank=4))
    assert _ranks(tmp_path / "r4.h5") == {4}
    _record(tmp_path / "off.h5", batches, TrackSettings(free_text_rank=0), _targets(batches))
    assert _ranks(tmp_path / "off.h5") == {1}


@pytest.mark.slow  # a torchrun job of 2 ranks
def test_the_ranks_of_a_distributed_loop_agree_on_the_rank(tmp_path):
    """Rank 0's first batch is free text, rank 1's answers: both shards take rank 16."""
    script = Path(__file__).parents[1] / "training" / "first_step_rank_loop.py"
    run_torchrun(2, [str(script), str(tmp_path)])
    for r in range(2):
        assert _ranks(rank_store_path(tmp_path / "store.h5", r, 2)) == {16}, r
