"""Vocabulary rows of the LM head's output projection (``TrackSettings.vocab_rows``): the most
frequent training targets get exact coordinates, the rest a random projection, and the records
stay the sketch of the per-example autograd gradient under that projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import (
    VOCAB,
    assert_close,
    causal_batch,
    record_step,
    reference_sketches,
    single_causal_losses,
    tiny_neox,
)

from traceprop_engine import Tracker, TrackSettings
from traceprop_engine.capture.layers import build_layers, output_embedding, target_counts
from traceprop_engine.capture.sketch import VOCAB_ROWS_SHARE, vocab_projection
from traceprop_engine.errors import ConfigError
from traceprop_engine.store.reader import Store
from traceprop_engine.training.losses import causal_lm_losses

# E[PᵀP] = I over seeds: the mean of 400 draws of a diagonal entry of the projected block has a
# standard deviation of about sqrt(2/k)/sqrt(400) ≈ 0.03 at k = 6; 0.15 is five of them
MEAN_TOL = 0.15


def test_vocab_projection_keeps_the_most_frequent_targets_exact():
    counts = np.zeros(40)
    counts[[5, 9, 12, 30]] = [3, 7, 3, 1]  # 9 first, then 5 and 12 (tie: smaller id), then 30
    p, ids = vocab_projection("orthogonal", 8, 40, seed=1, target_counts=counts)
    assert ids.tolist() == [9, 5, 12, 30]
    p = p.numpy()
    for row, tok in enumerate(ids):  # unit rows on the exact coordinates, nothing else there
        want = np.zeros(40)
        want[tok] = 1.0
        np.testing.assert_array_equal(p[row], want)
        np.testing.assert_array_equal(p[len(ids) :, tok], 0.0)
    # the rest: a projection of the other 36 coordinates onto the other 4 rows, E[PᵀP] = I
    x = np.zeros(40)
    x[[9, 5]] = [2.0, -1.0]
    y = np.zeros(40)
    y[[9, 5, 3]] = [0.5, 4.0, 1.0]
    assert np.allclose((p @ x)[4:], 0.0)  # x lives on exact rows only: its product is exact
    assert (p @ x) @ (p @ y) == pytest.approx(x @ y)


def test_vocab_projection_caps_the_exact_rows_and_is_unbiased_on_the_rest():
    counts = np.arange(60, dtype=float)  # 59 targets seen, more than the cap
    k = 8
    m = int(VOCAB_ROWS_SHARE * k)
    diag = np.zeros(60)
    for seed in range(400):
        p, ids = vocab_projection("gaussian", k, 60, seed=seed, target_counts=counts)
        assert len(ids) == m and ids.tolist() == list(range(59, 59 - m, -1))
        diag += np.diag(p.numpy().T @ p.numpy())
    diag /= 400
    np.testing.assert_allclose(diag[59 - m + 1 :], 1.0)  # exact coordinates
    np.testing.assert_allclose(diag[: 60 - m], 1.0, atol=MEAN_TOL)  # projected: E[PᵀP] = I


def test_no_targets_or_a_wide_enough_head_means_a_plain_projection():
    p, ids = vocab_projection("orthogonal", 8, 40, seed=1, target_counts=np.zeros(40))
    assert len(ids) == 0 and p.shape == (8, 40)
    p, ids = vocab_projection("orthogonal", 40, 40, seed=1, target_counts=np.ones(40))
    assert p is None and len(ids) == 0


def test_target_counts_and_its_errors():
    np.testing.assert_array_equal(
        target_counts([np.array([1, 3, 3]), [0]], vocab=5), [1, 1, 0, 2, 0]
    )
    with pytest.raises(ConfigError, match="-100"):
        target_counts([np.array([1, -100])])


def _neox_head_projected():
    """tiny GPT-NeoX with a head wider than k: 32 -> 97, k = 6 per side."""
    return tiny_neox(), TrackSettings(k_in=6, k_out=6)


def test_only_the_output_embedding_gets_vocabulary_rows():
    model, settings = _neox_head_projected()
    ids, _, labels, _ = causal_batch()
    targets = [ids[b][labels[b] != -100].numpy() for b in range(len(ids))]
    layers = build_layers(model, settings, target_counts(targets, VOCAB))
    heads = [layer for layer in layers if layer.output_head]
    assert [layer.module for layer in heads] == [output_embedding(model)]
    head = heads[0]
    seen = np.unique(np.concatenate(targets))
    assert len(head.vocab_ids) == min(len(seen), int(VOCAB_ROWS_SHARE * head.k_out))
    assert set(head.vocab_ids.tolist()) <= set(seen.tolist())
    assert all(layer.vocab_ids is None for layer in layers if not layer.output_head)
    # vocab_rows=False, or no targets: the plain seeded projection of before
    plain = build_layers(model, TrackSettings(k_in=6, k_out=6, vocab_rows=False), None)
    again = build_layers(model, settings, None)
    assert torch.equal(plain[-1].P_out, again[-1].P_out)
    assert not torch.equal(plain[-1].P_out, head.P_out)


@pytest.mark.parametrize("rank", [0, 1])
def test_records_with_vocabulary_rows_are_the_autograd_sketch(tmp_path, rank):
    """The store holds ``P_out G P_inᵀ`` of the per-example autograd gradient under the
    vocabulary projection, and says which layer is the head. Rank 0 stores full sketches; the
    default rank-1 factors are exact for the head when each example has one target token (the
    head's gradient is then ``g aᵀ``, rank 1)."""
    model, _ = _neox_head_projected()
    settings = TrackSettings(k_in=6, k_out=6, rank=rank, factor_dtype="float32")
    ids, mask, labels, lengths = causal_batch()
    if rank:  # one target token per example: its last one
        labels = torch.full_like(labels, -100)
        for b, n in enumerate(lengths):
            labels[b, n - 1] = ids[b, n - 1]
    targets = [ids[b][labels[b] != -100].numpy() for b in range(len(ids))]
    path = tmp_path / "store.h5"
    with (
        Tracker(model, path, settings, background=False, targets=targets) as tracker,
        tracker.step(list(range(len(ids))), padding_mask=mask) as rec,
    ):
        losses = causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        losses.mean().backward()
        rec.losses = losses
    store = Store(path)
    layers = tracker.layers
    head_i = next(i for i, layer in enumerate(layers) if layer.output_head)
    assert [info.output_head for info in store.layers] == [i == head_i for i in range(len(layers))]
    np.testing.assert_array_equal(store.projection(head_i, "out"), layers[head_i].P_out.numpy())
    manifest_layers = tracker.tracking_manifest()["layers"]
    assert manifest_layers[head_i]["vocab_rows"] == len(layers[head_i].vocab_ids) > 0
    ref = reference_sketches(model, layers, single_causal_losses(model, ids, labels, lengths))
    got = store.sketches(head_i)
    for b in range(len(lengths)):
        assert_close(got[b], ref[b][head_i], f"head, example {b}")
    store.close()


def test_record_step_without_targets_keeps_the_plain_projection(tmp_path):
    model, settings = _neox_head_projected()
    ids, mask, labels, _ = causal_batch()
    store = record_step(
        tmp_path / "s.h5", model, settings, ids, mask, lambda lg: causal_lm_losses(lg, labels)
    )
    head_i = next(i for i, info in enumerate(store.layers) if info.output_head)
    plain = build_layers(model, settings, None)[head_i].P_out.numpy()
    np.testing.assert_array_equal(store.projection(head_i, "out"), plain)
    store.close()
