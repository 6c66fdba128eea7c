"""Recorded sketches equal P_out (∇_W ℓ_i) P_inᵀ from a per-example autograd reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import (
    VOCAB,
    assert_close,
    causal_batch,
    check_causal,
    per_example_grads,
    record_causal_step,
    record_step,
    reference_sketches,
    single_causal_losses,
    tiny_bert_classifier,
    tiny_gpt2,
    tiny_neox,
    tiny_neox_lora,
)
from peft import LoraConfig, get_peft_model

from traceprop_engine import RunError, Store, Tracker, TrackSettings
from traceprop_engine.capture.hooks import Capture
from traceprop_engine.capture.layers import build_layers
from traceprop_engine.training.losses import causal_lm_losses, classification_losses


def test_gpt_neox_factored_matches_autograd(tmp_path):
    model = tiny_neox()
    store, layers = check_causal(tmp_path, model, TrackSettings(rank=0, k_in=4, k_out=6))
    assert len(layers) == 2 * 4 + 1  # qkv, dense, h_to_4h, 4h_to_h per block + embed_out
    assert store.layers[0].k_in == 4 and store.layers[0].k_out == 6
    assert np.all(np.isfinite(store.records()["loss"]))


def test_gpt2_conv1d_matches_autograd(tmp_path):
    model = tiny_gpt2()
    # lm_head is tied to the token embedding: its weight.grad mixes both uses, so leave it out
    _, layers = check_causal(
        tmp_path, model, TrackSettings(rank=0, k_in=5, k_out=3, scope=r"^transformer\.")
    )
    assert {layer.kind for layer in layers} == {"conv1d"}


def test_exact_when_k_equals_width(tmp_path):
    model = tiny_neox()
    _, layers = check_causal(
        tmp_path, model, TrackSettings(rank=0, k_in=10_000, k_out=10_000, scope="last-block")
    )
    assert all(layer.P_in is None and layer.P_out is None for layer in layers)
    assert all(".1." in layer.name for layer in layers)


def test_lora_layers_match_autograd(tmp_path):
    model = tiny_neox_lora()
    _, layers = check_causal(tmp_path, model, TrackSettings(rank=0, k_in=3, k_out=3))
    names = [layer.name for layer in layers]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)


def test_dense_sketch_matches_autograd(tmp_path):
    model = tiny_neox()
    settings = TrackSettings(rank=0, sketch="dense", dense_k=64, scope="last-block")
    ids, mask, labels, lengths = causal_batch(1)
    store = record_step(
        tmp_path / "store.h5", model, settings, ids, mask, lambda lg: causal_lm_losses(lg, labels)
    )
    layers = build_layers(model, settings)
    grads = per_example_grads(model, layers, single_causal_losses(model, ids, labels, lengths))
    for li, layer in enumerate(layers):
        got = store.sketches(li)
        idx, sign = store.dense_projection(li)
        for b in range(3):
            flat = grads[b][li].flatten()  # row-major vec(G), (d_out * d_in,)
            want = np.zeros(64)
            for j in range(idx.shape[0]):
                np.add.at(want, idx[j], sign[j] * flat)
            assert_close(got[b], want, f"dense {layer.name} example {b}")


@pytest.mark.parametrize("embedding", ["auto", "on"])
def test_classifier_matches_autograd(tmp_path, embedding):
    """BERT classifier layers; with embedding='on' its word embeddings too (their output is
    summed with the position and token-type embeddings, then normalised)."""
    model = tiny_bert_classifier()
    settings = TrackSettings(
        rank=0,
        k_in=6,
        k_out=6,
        scope=r"(encoder\.layer\.1\.|classifier|pooler)",
        embedding=embedding,
    )
    g = torch.Generator().manual_seed(3)
    lengths = [8, 5, 6, 3]
    ids = torch.zeros(4, 8, dtype=torch.long)
    mask = torch.zeros(4, 8, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, :n] = 1
    y = torch.tensor([0, 2, 1, 2])
    store = record_step(
        tmp_path / "store.h5", model, settings, ids, mask, lambda lg: classification_losses(lg, y)
    )
    layers = build_layers(model, settings)
    assert any(layer.name == "classifier" for layer in layers)
    assert (layers[0].kind == "embedding") == (embedding == "on")
    # the classifier is the layer every preconditioner leaves unwhitened
    assert [info.output_head for info in store.layers] == [
        layer.name == "classifier" for layer in layers
    ]

    def single(b):
        n = lengths[b]
        return lambda: classification_losses(
            model(input_ids=ids[b : b + 1, :n]).logits, y[b : b + 1]
        )[0]

    ref = reference_sketches(model, layers, [single(b) for b in range(4)])
    for li, layer in enumerate(layers):
        got = store.sketches(li)
        for b in range(4):
            assert_close(got[b], ref[b][li], f"layer {layer.name}, example {b}")


def test_a_classifiers_output_head_is_its_last_num_labels_wide_layer():
    """The layer producing the logits: ``classifier`` of a plain BERT classifier, the copy peft
    trains under LoRA; never a ``lora_A`` of the same width (here r = num_labels = 3); none for
    a model that is not a classifier and has no output embedding."""
    model = tiny_bert_classifier()
    heads = [layer.name for layer in build_layers(model, TrackSettings()) if layer.output_head]
    assert heads == ["classifier"]
    cfg = LoraConfig(
        r=3,
        lora_alpha=6,
        target_modules=["query", "value", "dense"],
        modules_to_save=["classifier"],
    )
    lora = get_peft_model(tiny_bert_classifier(), cfg)
    layers = build_layers(lora, TrackSettings())
    assert any(layer.name.endswith("lora_A.default") and layer.d_out == 3 for layer in layers)
    heads = [layer.name for layer in layers if layer.output_head]
    assert heads == ["base_model.model.classifier.modules_to_save.default"]
    encoder = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3))
    assert not any(layer.output_head for layer in build_layers(encoder, TrackSettings()))


def test_covariance_equals_hand_computation():
    model = tiny_neox()
    settings = TrackSettings(rank=0, k_in=4, k_out=5, scope=r"layers\.0\.mlp\.dense_4h_to_h")
    layers = build_layers(model, settings)
    (layer,) = layers
    ids, mask, labels, _ = causal_batch(2)
    seen = {}

    def spy(module, inputs, output):
        seen["a"] = inputs[0].detach()
        output.register_hook(lambda g: seen.update(g=g.detach()))

    h1 = layer.module.register_forward_hook(spy)
    slots = [torch.zeros(3, layer.k_out, layer.k_in)]
    try:
        with Capture(model, layers) as cap, cap.batch(slots, token_mask=mask, loss_scale=3):
            causal_lm_losses(
                model(input_ids=ids, attention_mask=mask).logits, labels
            ).mean().backward()
    finally:
        h1.remove()
    a = seen["a"].double() @ layer.P_in.double().T  # (B, T, k_in)
    g = 3 * seen["g"].double() @ layer.P_out.double().T  # (B, T, k_out), per-example scale
    m = mask.bool()
    A = sum(
        a[b, t][:, None] @ a[b, t][None, :] for b in range(3) for t in range(a.shape[1]) if m[b, t]
    )
    S = sum(g[b, t][:, None] @ g[b, t][None, :] for b in range(3) for t in range(g.shape[1]))
    cov = cap.covariance_arrays()[0]
    np.testing.assert_allclose(cov.A, A.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cov.S, S.numpy(), rtol=1e-4, atol=1e-9 * float(S.abs().max()))
    assert cov.n_tokens == int(mask.sum())


def test_hooks_idle_without_grad_and_removed_after_error(tmp_path):
    model = tiny_neox()
    n_hooks = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    ids, mask, labels, _ = causal_batch()
    with (
        pytest.raises(KeyboardInterrupt),
        Tracker(
            model,
            tmp_path / "s.h5",
            TrackSettings(
                rank=0,
            ),
            background=False,
        ) as tracker,
    ):
        assert n_hooks() == 9
        # no grad: no hook on outputs, and a step without backward is refused (nothing recorded)
        with (
            pytest.raises(RunError, match="no backward"),
            tracker.step([0, 1, 2], padding_mask=mask),
            torch.no_grad(),
        ):
            model(input_ids=ids, attention_mask=mask)
        assert tracker.n_records == 0
        assert all(not layer._stack for layer in tracker.layers)
        raise KeyboardInterrupt
    assert n_hooks() == 0
    store = Store(tmp_path / "s.h5")
    assert store.status == "cancelled" and store.is_partial
    assert store.n_records == 0  # the no-grad step was refused, not committed as zero sketches


def _cov_run(model, layers, ids, mask, labels, token_mask, loss_scale):
    slots = [torch.zeros(ids.shape[0], layer.k_out, layer.k_in) for layer in layers]
    for layer in layers:  # fresh statistics per run
        layer.A = layer.S = layer.a_tokens = None
        layer.a_rows = 0
    with (
        Capture(model, layers) as cap,
        cap.batch(slots, token_mask=token_mask, loss_scale=loss_scale),
    ):
        causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels).mean().backward()
    return slots, cap.covariance_arrays()


def test_unpadded_mask_and_loss_scale_folding():
    """An all-ones mask takes the unmasked path (same A, S, count as no mask); the loss scale
    multiplies the sketches by s and S by s² and leaves A alone."""
    model = tiny_neox()
    layers = build_layers(model, TrackSettings(rank=0, k_in=4, k_out=5, scope=r"layers\.1\."))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (3, 10), generator=g)
    ones = torch.ones_like(ids)
    s1, c1 = _cov_run(model, layers, ids, ones, ids, None, 1.0)
    s2, c2 = _cov_run(model, layers, ids, ones, ids, ones, 1.0)
    s3, c3 = _cov_run(model, layers, ids, ones, ids, ones, 3.0)
    for li in range(len(layers)):
        np.testing.assert_array_equal(s1[li].numpy(), s2[li].numpy())
        np.testing.assert_allclose(c1[li].A, c2[li].A, rtol=1e-6)
        np.testing.assert_allclose(c1[li].S, c2[li].S, rtol=1e-6)
        assert c1[li].n_tokens == c2[li].n_tokens == 30
        np.testing.assert_allclose(
            s3[li].numpy(), 3 * s2[li].numpy(), rtol=1e-5, atol=1e-7 * float(s2[li].abs().max())
        )
        np.testing.assert_allclose(c3[li].A, c2[li].A, rtol=1e-6)
        np.testing.assert_allclose(c3[li].S, 9 * c2[li].S, rtol=1e-5)


class _Twice(torch.nn.Module):
    """One linear layer applied twice per forward (weight reuse, like a tied or looped block):
    on its own output (``d_in = d_out``), or ``side_by_side`` on the input and a flipped copy
    (``d_in → d_out``, e.g. a narrower input)."""

    def __init__(self, d_in: int = 6, d_out: int = 6, side_by_side: bool = False) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.side_by_side = side_by_side
        self.lin = torch.nn.Linear(d_in, d_out)
        self.head = torch.nn.Linear(d_out, 1)

    def forward(self, x):  # x (B, T, d_in) -> (B,) per-example loss
        if self.side_by_side:
            h = self.lin(x) + torch.tanh(self.lin(x.flip(1) * 0.5))
        else:
            h = self.lin(torch.tanh(self.lin(x)))
        return self.head(h).squeeze(-1).pow(2).mean(1)


def test_layer_used_twice_accumulates_both_uses():
    model = _Twice()
    settings = TrackSettings(rank=0, k_in=3, k_out=4, scope=r"^lin$")
    layers = build_layers(model, settings)
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(6))
    slots = [torch.full((4, 4, 3), float("nan"))]  # beta=0 must ignore what the slot held
    with Capture(model, layers, covariance=False) as cap, cap.batch(slots, loss_scale=4):
        model(x).mean().backward()
    ref = reference_sketches(model, layers, [lambda b=b: model(x[b : b + 1])[0] for b in range(4)])
    for b in range(4):
        assert_close(slots[0][b].numpy(), ref[b][0], f"example {b}")


def test_forward_without_backward_leaves_no_statistics():
    model = tiny_neox()
    layers = build_layers(model, TrackSettings(rank=0, k_in=4, k_out=4, scope=r"layers\.0\.mlp"))
    ids, mask, _, _ = causal_batch()
    slots = [torch.ones(3, layer.k_out, layer.k_in) for layer in layers]
    with Capture(model, layers) as cap, cap.batch(slots, token_mask=mask):
        model(input_ids=ids, attention_mask=mask)  # grad on, but no backward
    for layer, slot, cov in zip(layers, slots, cap.covariance_arrays(), strict=True):
        assert not layer._stack
        assert torch.all(slot == 0)  # the layer took no part in a backward: zero gradient
        assert np.all(cov.A == 0) and cov.n_tokens == 0


def test_bf16_autocast_gradients_are_projected_in_fp32():
    """Under autocast the output gradient is bf16 while P_out is fp32: the hook casts, and the
    sketches agree with the fp32 ones to bf16 round-off."""
    model = tiny_neox()
    layers = build_layers(model, TrackSettings(rank=0, k_in=4, k_out=4))
    ids, mask, labels, _ = causal_batch()

    def run(autocast: bool):
        slots = [torch.zeros(3, layer.k_out, layer.k_in) for layer in layers]
        with (
            Capture(model, layers, covariance=False) as cap,
            cap.batch(slots, token_mask=mask, loss_scale=3),
        ):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=ids, attention_mask=mask).logits
            causal_lm_losses(logits, labels).mean().backward()
        model.zero_grad()
        return slots

    ref, got = run(False), run(True)
    for layer, x, y in zip(layers, got, ref, strict=True):
        assert torch.all(torch.isfinite(x))
        assert float((x - y).norm() / y.norm()) < 0.05, layer.name


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_records_each_example_once(tmp_path, reentrant):
    """Activation checkpointing re-runs forwards inside backward: still one exact sketch per example."""
    model = tiny_neox()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()  # checkpointing is active in training mode (dropout is 0 in this config)
    store, _ = check_causal(tmp_path, model, TrackSettings(rank=0, k_in=4, k_out=6))
    _, mask, _, _ = causal_batch()
    assert store.covariance(0).n_tokens == int(mask.sum())  # A counted once, not per re-run


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("start", ["output", "narrow"])
def test_gradient_checkpointing_keeps_the_default_records(tmp_path, reentrant, start):
    """The default rank-1 records, from either side (``half_step_start``; the input side is
    summed in the forward, which checkpointing runs again inside the backward), are those of
    the same step without checkpointing."""

    def records(checkpointing: bool, path):
        model = tiny_neox()
        if checkpointing:
            kw = {"use_reentrant": reentrant}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
            model.train()
        settings = TrackSettings(factor_dtype="float32", half_step_start=start)
        store, _ = record_causal_step(path, model, settings)
        return [np.asarray(store.sketches(li)) for li in range(len(store.layers))]

    plain = records(False, tmp_path / "plain.h5")
    for got, want in zip(records(True, tmp_path / "ckpt.h5"), plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_narrow_start_under_bf16_autocast_matches_float32(tmp_path):
    """``half_step_start='narrow'`` sums the input in the forward hook, which a bf16 autocast
    forward runs under: the sums stay float32 (no dtype error in the backward), and the records
    agree with a float32 step's to bf16 round-off."""
    from traceprop_engine.capture.hooks import Capture

    ids, mask, labels, _ = causal_batch()

    def records(autocast: bool):
        model = tiny_neox()
        settings = TrackSettings(factor_dtype="float32", half_step_start="narrow")
        layers = build_layers(model, settings)
        assert any(x.input_start for x in layers)
        slots = [torch.zeros(3, x.k_out + x.k_in, 1) for x in layers]
        with Capture(model, layers, covariance=False) as cap, cap.batch(slots, mask, 3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=ids, attention_mask=mask).logits
            causal_lm_losses(logits.float(), labels).mean().backward()
        return [
            torch.bmm(x[:, : y.k_out], x[:, y.k_out :].transpose(1, 2))
            for x, y in zip(slots, layers, strict=True)
        ]

    for got, want in zip(records(True), records(False), strict=True):
        assert torch.isfinite(got).all()
        assert float((got - want).norm() / want.norm()) < 0.05


def test_backward_with_create_graph_records_the_same_sketches():
    """``backward(create_graph=True)`` (e.g. a gradient-penalty loss) runs the hooks with grad
    mode on: they detach, build no graph and record what a plain backward records."""
    model = tiny_neox()
    layers = build_layers(model, TrackSettings(factor_dtype="float32"))
    ids, mask, labels, _ = causal_batch()

    def run(create_graph: bool):
        slots = [torch.zeros(3, layer.k_out + layer.k_in, 1) for layer in layers]
        with Capture(model, layers, covariance=False) as cap, cap.batch(slots, loss_scale=3):
            logits = model(input_ids=ids, attention_mask=mask).logits
            causal_lm_losses(logits, labels).mean().backward(create_graph=create_graph)
        model.zero_grad(set_to_none=True)
        return slots

    for plain, graph in zip(run(False), run(True), strict=True):
        assert not graph.requires_grad
        torch.testing.assert_close(graph, plain, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip_continues_the_statistics():
    """Issue 28: the checkpoint goes through ``Capture.state_dict`` / ``load_state_dict``
    (nothing outside ``capture/`` touches its private state). A capture restored from the
    state after two batches, then given a third, has the statistics of one capture that saw
    all three (same kernels in the same order: tolerance only for the float64 read-out)."""
    model = tiny_neox()
    settings = TrackSettings(rank=0, k_in=4, k_out=5, covariance_stride=1)
    batches = [causal_batch(seed=i) for i in range(3)]

    def step(cap, layers, b):
        ids, mask, labels, _ = b
        slots = [torch.zeros(ids.shape[0], la.k_out, la.k_in) for la in layers]
        with cap.batch(slots, token_mask=mask, loss_scale=2):
            loss = causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
            loss.mean().backward()

    layers = build_layers(model, settings)
    with Capture(model, layers) as cap:
        for b in batches[:2]:
            step(cap, layers, b)
        state = cap.state_dict()
        step(cap, layers, batches[2])
        whole = cap.covariance_arrays()
    assert state["batches"] == 2 and len(state["covariance"]) == len(layers)
    layers2 = build_layers(model, settings)  # same seeds: the same projections
    with Capture(model, layers2) as cap2:
        cap2.load_state_dict(state)
        assert cap2.state_dict()["a_rows"] == state["a_rows"]
        step(cap2, layers2, batches[2])
        resumed = cap2.covariance_arrays()
    for w, r in zip(whole, resumed, strict=True):
        np.testing.assert_allclose(r.A, w.A, rtol=1e-6)
        np.testing.assert_allclose(r.S, w.S, rtol=1e-6, atol=1e-12 * float(np.abs(w.S).max()))
        assert r.n_tokens == w.n_tokens
