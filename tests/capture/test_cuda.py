"""The device-side paths on a CUDA device, against the same computation on the CPU: capture
hooks (fp32, a bf16 model, bf16 autocast) with the records kept on the device until the
buffer's transfer, and the training loop (``traceprop train --device cuda``).

Marked ``cuda``: deselected by default, run with ``python -m pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers import causal_batch, fast_settings, tiny_neox

from traceprop_engine import Store, Tracker, TrackSettings
from traceprop_engine.training.loop import train
from traceprop_engine.training.losses import causal_lm_losses

pytestmark = pytest.mark.cuda

# fp32 on two devices: the same products summed in another order (no TF32: torch's default)
FP32_REL = 1e-4
# a bf16 forward/backward (8 significant bits per number through two blocks) against fp32
BF16_REL = 0.05

SKETCH = TrackSettings(k_in=4, k_out=6, rank=0)  # per-token projection, the layer's dtype
FULL = TrackSettings(k_in=4, k_out=6, rank=1, factor_dtype="float32")  # fp32 power iteration
# the input embedding too: gathered columns of P_in on the device
EMBED = TrackSettings(k_in=4, k_out=6, rank=1, factor_dtype="float32", embedding="on")


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _record(path, device, settings, precision: str, n_steps: int = 2):
    """Record ``n_steps`` steps of :func:`causal_batch` on ``device``; returns the store and the
    tracker (closed). ``precision``: fp32, bf16 (the model's weights) or autocast (bf16)."""
    model = tiny_neox().to(device)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    ids, mask, labels, _ = (t.to(device) if torch.is_tensor(t) else t for t in causal_batch())
    auto = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "autocast"
        else contextlib.nullcontext()
    )
    with Tracker(model, path, settings, background=False) as tracker:
        for step in range(n_steps):
            with tracker.step([0, 1, 2], padding_mask=mask, step=step) as rec:
                with auto:
                    logits = model(input_ids=ids, attention_mask=mask).logits
                rec.losses = causal_lm_losses(logits.float(), labels)
                rec.losses.mean().backward()
            model.zero_grad()
            if step == 0:  # still on the device: nothing has crossed to the host yet
                assert tracker.buffer.n_transfers == 0 and tracker.n_records == 3
                assert tracker.buffer._flat.device.type == device.type
    return Store(path), tracker


@pytest.mark.parametrize(
    "settings", [SKETCH, FULL, EMBED], ids=["sketch-space", "full-space", "embedding"]
)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_capture_on_cuda_matches_the_cpu(tmp_path, cuda_device, settings, precision):
    tol = FP32_REL if precision == "fp32" else BF16_REL
    with (
        _record(tmp_path / "cpu.h5", torch.device("cpu"), settings, "fp32")[0] as ref,
        _record(tmp_path / "cuda.h5", cuda_device, settings, precision)[0] as got,
    ):
        assert got.n_records == ref.n_records == 6
        np.testing.assert_array_equal(
            got.records()["example_index"], ref.records()["example_index"]
        )
        np.testing.assert_allclose(got.records()["loss"], ref.records()["loss"], rtol=tol)
        for li, layer in enumerate(ref.layers):
            assert got.layers[li].name == layer.name
            g, r = got.sketches(li), ref.sketches(li)
            assert np.all(np.isfinite(g)), layer.name
            assert _rel(g, r) < tol, (layer.name, _rel(g, r))
            cg, cr = got.covariance(li), ref.covariance(li)
            assert cg.n_tokens == cr.n_tokens
            for k in ("A", "S"):
                assert _rel(getattr(cg, k), getattr(cr, k)) < tol, (layer.name, k)


def test_records_stay_on_the_device_until_the_buffer_transfers(tmp_path, cuda_device):
    """Sketches and losses are written into the device buffer; the host sees them in one
    transfer per full buffer (here: at close)."""
    sunk = []
    model = tiny_neox().to(cuda_device)
    ids, mask, labels, _ = (t.to(cuda_device) if torch.is_tensor(t) else t for t in causal_batch())
    with Tracker(model, tmp_path / "s.h5", FULL, background=False) as tracker:
        sink = tracker.buffer.sink
        tracker.buffer.sink = lambda arrays, meta: (sunk.append(len(arrays[0])), sink(arrays, meta))
        for step in range(4):
            with tracker.step([0, 1, 2], padding_mask=mask, step=step) as rec:
                rec.losses = causal_lm_losses(
                    model(input_ids=ids, attention_mask=mask).logits, labels
                )
                rec.losses.mean().backward()
            model.zero_grad()
        assert sunk == [] and tracker.buffer.n_transfers == 0
        assert tracker.buffer._flat.device.type == cuda_device.type
    assert sunk == [12] and tracker.buffer.n_transfers == 1
    with Store(tmp_path / "s.h5") as store:
        assert store.n_records == 12 and store.timings()["n_transfers"] == 1


def test_training_on_cuda_records_what_the_cpu_records(tmp_path, cuda_device, facts):
    """The loop's device path: batches, hooks and buffer on the GPU. With lr = 0 every step
    sees the initial model, so each record must equal the CPU run's to fp32 round-off; the
    loss is read back every 10 steps there (not every step), the records keep every loss."""
    runs = {}
    for name, device in (("cpu", "cpu"), ("gpu", str(cuda_device))):
        track = TrackSettings(k_in=4, k_out=4, factor_dtype="float32")
        s = fast_settings(facts, tmp_path / name, lr=0.0, device=device, track=track)
        runs[name] = Store(train(s) / "store.h5")
    cpu, gpu = runs["cpu"], runs["gpu"]
    try:
        assert gpu.status == cpu.status == "completed"
        assert gpu.n_records == cpu.n_records > 10
        for k in ("example_index", "step", "epoch", "lr"):
            np.testing.assert_array_equal(gpu.records()[k], cpu.records()[k])
        np.testing.assert_allclose(gpu.records()["loss"], cpu.records()["loss"], rtol=FP32_REL)
        for li in range(len(cpu.layers)):
            assert _rel(gpu.sketches(li), cpu.sketches(li)) < FP32_REL, cpu.layers[li].name
    finally:
        cpu.close()
        gpu.close()


def test_per_token_view_on_a_cuda_query_device(cuda_device):
    """The per-token view recomputes sketches with the capture hooks on the query's device:
    its slots live there too, and the contributions equal the CPU's."""
    from pathlib import Path

    from traceprop_engine.attribution import open_run, token_contributions

    sample = Path(__file__).resolve().parents[2] / "sample_runs" / "facts"
    prompt = "Q: Is Ethmor a planet, an inventor, a river or a guild?\nA:"
    got = {}
    for device in ("cpu", str(cuda_device)):
        run = open_run(sample, device=device)
        try:
            res = run.query(prompt, " a planet", top_k=1)
            eid = int(res.proponents["example_id"][0])
            got[device] = token_contributions(run, res.sketches, eid).contributions
        finally:
            run.close()
    cpu, gpu = got["cpu"], got[str(cuda_device)]
    assert _rel(gpu, cpu) < 1e-3
