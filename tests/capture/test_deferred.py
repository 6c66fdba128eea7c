"""The default factors' projections deferred over steps (:class:`DeferredFactors` queued by the
Tracker, written before each buffer flush or when the scratch is full) store the same records as
the per-layer path that projects inside each hook, whatever the batch sizes (and so loss scales)
in one write, the flushes in between, and the steps that fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import causal_batch, tiny_neox

from traceprop_engine import RunError, Store, Tracker, TrackSettings
from traceprop_engine.capture import hooks, project
from traceprop_engine.training.losses import causal_lm_losses

SETTINGS = TrackSettings(k_in=4, k_out=5, factor_dtype="float32", covariance=False)
# the same float32 products, projected per layer and example instead of batched over layers
# and steps
ATOL_REL = 1e-5

# (example ids, what the step does): "ok", "raise" (the caller's code fails after the
# backward: the step is dropped) or "no-losses" (rec.losses not set: RunError, dropped)
STEPS = [
    ([0, 1, 2], "ok"),
    ([1, 2], "ok"),
    ([0, 1, 2], "raise"),
    ([2], "ok"),
    ([0, 2], "no-losses"),
    ([0, 1, 2], "ok"),
    ([0, 1], "ok"),
    ([1, 2], "ok"),
]


def _run(path, buffer_records: int, failures: bool) -> Store:
    model = tiny_neox()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids, mask, labels, _ = causal_batch()
    settings = TrackSettings(**{**SETTINGS.to_dict(), "buffer_records": buffer_records})
    with Tracker(model, path, settings, background=False) as tracker:
        for step, (rows, what) in enumerate(STEPS):
            if what != "ok" and not failures:
                continue
            b = torch.tensor(rows)
            try:
                with tracker.step(rows, padding_mask=mask[b], step=step) as rec:
                    losses = causal_lm_losses(
                        model(input_ids=ids[b], attention_mask=mask[b]).logits, labels[b]
                    )
                    losses.mean().backward()
                    if what != "no-losses":
                        rec.losses = losses
                    if what == "raise":
                        raise ZeroDivisionError
            except (ZeroDivisionError, RunError):
                assert what != "ok"
                model.zero_grad()
                continue
            opt.step()
            model.zero_grad()
    return Store(path)


@pytest.mark.parametrize("max_rows", [256, 4, 1])
@pytest.mark.parametrize("buffer_records", [2048, 5])
def test_deferred_records_equal_the_per_layer_path(tmp_path, monkeypatch, max_rows, buffer_records):
    """max_rows 256: every step waits for the flush; 4: the scratch fills first (a write at the
    start of a step); 1: one batch at a time. buffer_records 5: flushes between steps of
    different sizes. Steps that fail leave nothing, and the next steps reuse their rows."""
    monkeypatch.setattr(project, "DEFER_MAX_ROWS", max_rows)
    got = _run(tmp_path / "got.h5", buffer_records, failures=True)
    monkeypatch.setattr(hooks.DeferredFactors, "__bool__", lambda self: False)  # per-layer path
    ref = _run(tmp_path / "ref.h5", buffer_records, failures=False)
    with got, ref:
        assert got.n_records == ref.n_records == sum(len(r) for r, w in STEPS if w == "ok")
        for k in ("example_index", "step"):
            np.testing.assert_array_equal(got.records()[k], ref.records()[k])
        for li in range(len(ref.layers)):
            for a, b in zip(got.factors(li), ref.factors(li), strict=True):
                assert np.isfinite(a).all()
                np.testing.assert_allclose(a, b, rtol=0, atol=ATOL_REL * np.abs(b).max())


def test_records_wait_for_the_flush_and_are_there_after_it(tmp_path):
    """With the Tracker the records of the steps before a flush are still queued (the slots
    untouched) and written at the flush: the buffer never hands the sink an unwritten row."""
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    with Tracker(model, tmp_path / "s.h5", SETTINGS, background=False) as tracker:
        for step in range(2):
            with tracker.step([0, 1, 2], padding_mask=mask, step=step) as rec:
                rec.losses = causal_lm_losses(
                    model(input_ids=ids, attention_mask=mask).logits, labels
                )
                rec.losses.mean().backward()
        deferred = tracker.capture._deferred
        assert deferred.queued == 6
        with pytest.raises(RunError), tracker.step([0, 1, 2], padding_mask=mask, step=2):
            causal_lm_losses(
                model(input_ids=ids, attention_mask=mask).logits, labels
            ).mean().backward()
        assert deferred.queued == 6  # the failed step's batch left the queue
        rows = tracker.buffer._views[0][:6]
        assert torch.all(rows == 0)  # nothing written yet (the buffer starts zeroed)
        tracker.sync()
        assert deferred.queued == 0
    with Store(tmp_path / "s.h5") as store:
        u, v = store.factors(0)
        assert np.all(np.abs(u).sum((1, 2)) > 0) and np.all(np.abs(v).sum((1, 2)) > 0)


def test_capture_writes_deferred_batches_into_any_slots(monkeypatch):
    """``Capture.batch(defer=True)`` straight, as an own buffer would use it: two batches whose
    slots follow on in one tensor (one copy), one further on in the same tensor after a gap, one
    in a tensor of its own, all written by ``write_deferred``, equal what ``defer=False`` writes
    at each batch's end (the gap row untouched)."""
    from traceprop_engine.capture.layers import build_layers

    ids, mask, labels, _ = causal_batch()

    def record(defer: bool):
        model = tiny_neox()
        layers = build_layers(model, SETTINGS)
        shared = [torch.full((8, *layer.record_shape), float("nan")) for layer in layers]
        alone = [torch.full((3, *layer.record_shape), float("nan")) for layer in layers]
        windows = [
            ([0, 1], [s[0:2] for s in shared]),
            ([2, 0, 1], [s[2:5] for s in shared]),  # follows on: one copy with the first
            ([1, 2], [s[6:8] for s in shared]),  # row 5 left out
            ([0, 1, 2], alone),
        ]
        with hooks.Capture(model, layers, covariance=False) as cap:
            for rows, slots in windows:
                b = torch.tensor(rows)
                with cap.batch(slots, loss_scale=len(rows), defer=defer):
                    causal_lm_losses(
                        model(input_ids=ids[b], attention_mask=mask[b]).logits, labels[b]
                    ).mean().backward()
                model.zero_grad()
            if defer:
                assert all(torch.isnan(s).all() for s in shared + alone)  # nothing written yet
                cap.write_deferred()
        return [torch.cat([s, a]) for s, a in zip(shared, alone, strict=True)]

    for got, want in zip(record(True), record(False), strict=True):
        assert torch.isnan(want[5]).all() and torch.isfinite(want[[0, 1, 2, 3, 4, 6, 7]]).all()
        scale = float(want.nan_to_num().abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * scale, equal_nan=True)
