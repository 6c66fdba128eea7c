"""The Tracker on its own: hooks attached for its lifetime, one record per example per whole
step holding what the step was given, the run ``finish`` makes, and clear errors on misuse."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from helpers import causal_batch, record_causal_step, tiny_neox

from traceprop_engine import ConfigError, RunError, Store, Tracker, TrackSettings
from traceprop_engine import constants as C
from traceprop_engine.capture.layers import build_layers
from traceprop_engine.training.losses import causal_lm_losses

SETTINGS = TrackSettings(k_in=4, k_out=4, rank=0)
# the same float32 sums in another order (a batch of 3 vs 1 + 2 examples, sum vs mean)
RTOL = 1e-4
ATOL_REL = 1e-5
# the same float32 products through a GEMM of another shape: the batched projection of the
# deferred factors (capture/project.py) multiplies every row queued since the last flush at
# once, so another buffer size gives it another M, and BLAS may block (and round) differently
# for it (MKL on Intel Xeon: max relative difference 2.2e-7, a couple of ulps); relative to each
# layer's largest entry, as rows near zero lose their relative precision in the sums
FP32_GEMM_RTOL = 1e-5
FP32_GEMM_ATOL_REL = 1e-6


def _n_hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def _losses(model, ids, mask, labels):
    return causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels)


# -- lifetime -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc, status",
    [
        (None, C.STATUS_COMPLETED),
        (ValueError, C.STATUS_FAILED),
        (KeyboardInterrupt, C.STATUS_CANCELLED),
    ],
)
def test_hooks_live_inside_the_with_block_and_the_exit_sets_the_status(tmp_path, exc, status):
    model = tiny_neox()
    tracker = Tracker(model, tmp_path / "store.h5", SETTINGS, background=False)
    n_layers = len(build_layers(model, SETTINGS))
    assert _n_hooks(model) == 0 and not tracker.capture.attached  # nothing before __enter__
    ids, mask, labels, _ = causal_batch()
    try:
        with tracker:
            assert _n_hooks(model) == n_layers  # one forward hook per tracked layer
            with tracker.step([0, 1, 2], padding_mask=mask) as rec:
                rec.losses = _losses(model, ids, mask, labels)
                rec.losses.mean().backward()
            if exc is not None:
                raise exc
    except (ValueError, KeyboardInterrupt):
        pass
    assert _n_hooks(model) == 0 and tracker.status == status
    tracker.close(C.STATUS_FAILED)  # a second close changes nothing
    with Store(tmp_path / "store.h5") as store:
        assert store.status == status and store.n_records == 3  # the whole step was kept


def test_records_hold_what_each_step_was_given(tmp_path):
    """example ids, step, epoch, lr and the per-example losses, in commit order."""
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    given = [([7, 3], 0, 0, 1e-3), ([5], 1, 0, 5e-4), ([3, 7], 2, 1, 2.5e-4)]
    want_loss = []
    with Tracker(model, tmp_path / "store.h5", SETTINGS, background=False) as tracker:
        for i, (idx, step, epoch, lr) in enumerate(given):
            rows = slice(i % 2, i % 2 + len(idx))
            with tracker.step(idx, padding_mask=mask[rows], step=step, epoch=epoch, lr=lr) as rec:
                rec.losses = _losses(model, ids[rows], mask[rows], labels[rows])
                rec.losses.mean().backward()
            want_loss += rec.losses.detach().tolist()
            model.zero_grad()
    with Store(tmp_path / "store.h5") as store:
        r = store.records()
        assert r[C.REC_EXAMPLE].tolist() == [7, 3, 5, 3, 7]
        assert r[C.REC_STEP].tolist() == [0, 0, 1, 2, 2]
        assert r[C.REC_EPOCH].tolist() == [0, 0, 0, 1, 1]
        np.testing.assert_allclose(r[C.REC_LR], [1e-3, 1e-3, 5e-4, 2.5e-4, 2.5e-4], rtol=1e-7)
        np.testing.assert_allclose(r[C.REC_LOSS], want_loss, rtol=1e-6)
        assert len(store.timings()["step_ms"]) == 3  # one timing per step


def test_loss_scale_turns_any_reduction_into_per_example_gradients(tmp_path):
    """The default scale is B (the loss is the mean); a summed loss with loss_scale=1 records
    the same per-example sketches."""
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    got = {}
    for how in ("mean", "sum"):
        with Tracker(model, tmp_path / f"{how}.h5", SETTINGS, background=False) as tracker:
            scale = None if how == "mean" else 1.0
            with tracker.step([0, 1, 2], padding_mask=mask, loss_scale=scale) as rec:
                rec.losses = _losses(model, ids, mask, labels)
                getattr(rec.losses, how)().backward()
            model.zero_grad()
        with Store(tmp_path / f"{how}.h5") as store:
            got[how] = [store.sketches(li) for li in range(len(store.layers))]
    for a, b in zip(got["mean"], got["sum"], strict=True):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL_REL * np.abs(a).max())


def test_a_step_that_raises_is_dropped_and_the_next_one_recorded(tmp_path):
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    with Tracker(model, tmp_path / "store.h5", SETTINGS, background=False) as tracker:
        with pytest.raises(ZeroDivisionError), tracker.step([0, 1, 2], padding_mask=mask) as rec:
            rec.losses = _losses(model, ids, mask, labels)
            rec.losses.mean().backward()
            1 / 0  # noqa: B018  (the caller's code fails after the backward)
        assert tracker.n_records == 0
        model.zero_grad()
        with tracker.step([0, 1, 2], padding_mask=mask) as rec:
            rec.losses = _losses(model, ids, mask, labels)
            rec.losses.mean().backward()
    ref, _ = record_causal_step(tmp_path / "ref.h5", tiny_neox(), SETTINGS)
    with Store(tmp_path / "store.h5") as store:
        assert store.n_records == 3
        for li in range(len(store.layers)):  # the failed step left nothing in the slots
            want = ref.sketches(li)
            np.testing.assert_allclose(
                store.sketches(li), want, rtol=RTOL, atol=ATOL_REL * np.abs(want).max()
            )
    ref.close()


# a transfer whenever the next step does not fit; a step larger than the buffer grows it once
TRANSFERS = {2048: 1, 6: 2, 2: 3}


@pytest.mark.parametrize("background, buffer_records", [(True, 2048), (False, 6), (True, 2)])
def test_the_writer_thread_and_small_buffers_write_the_same_store(
    tmp_path, background, buffer_records
):
    """Records pass through the device buffer (transfers of ``buffer_records``) and, by default,
    a writer thread: neither changes what is stored.

    The reference writes on the calling thread through the default buffer. The writer thread
    only moves finished chunks, so with the default buffer the store is bit-identical; a smaller
    buffer flushes earlier, and the deferred projection then runs over fewer rows at a time:
    the same products, to float32 round-off (``FP32_GEMM_RTOL``)."""
    ids, mask, labels, _ = causal_batch()

    def record(path, background, **kw):
        model = tiny_neox()
        s = TrackSettings(k_in=4, k_out=4, **kw)
        with Tracker(model, path, s, background=background) as tracker:
            for step in range(3):
                with tracker.step([0, 1, 2], padding_mask=mask, step=step) as rec:
                    rec.losses = _losses(model, ids, mask, labels)
                    rec.losses.mean().backward()
                model.zero_grad()
        return Store(path)

    with (
        record(tmp_path / "ref.h5", background=False) as ref,
        record(tmp_path / "got.h5", background, buffer_records=buffer_records) as got,
    ):
        assert got.n_records == ref.n_records == 9
        same_gemms = buffer_records == TrackSettings().buffer_records
        for li in range(len(ref.layers)):
            for a, b in zip(got.factors(li), ref.factors(li), strict=True):
                if same_gemms:  # the same kernels in the same order: exactly
                    np.testing.assert_array_equal(a, b)
                else:
                    atol = FP32_GEMM_ATOL_REL * np.abs(b).max()
                    np.testing.assert_allclose(a, b, rtol=FP32_GEMM_RTOL, atol=atol)
        # ids, steps, lr as given, losses from the same forward: exactly
        for k, v in ref.records().items():
            np.testing.assert_array_equal(got.records()[k], v)
        assert got.timings()["n_transfers"] == TRANSFERS[buffer_records]


# -- finish --------------------------------------------------------------------------------------
def test_finish_writes_the_tracking_section_of_the_run(tmp_path):
    model = tiny_neox()
    settings = TrackSettings(k_in=4, k_out=6, scope="last-block")
    ids, mask, labels, _ = causal_batch()
    with (
        Tracker(model, tmp_path / C.STORE_FILE, settings, background=False) as tracker,
        tracker.step([0, 1, 2], padding_mask=mask) as rec,
    ):
        rec.losses = _losses(model, ids, mask, labels)
        rec.losses.mean().backward()
    assert tracker.finish() == tmp_path
    m = json.loads((tmp_path / C.MANIFEST_FILE).read_text())
    tracking = dict(m["tracking"])
    layers = tracking.pop("layers")
    # the settings read back as they were, with embedding='auto' as the Tracker decided it
    assert TrackSettings(**tracking) == dataclasses.replace(settings, embedding="off")
    want = build_layers(model, settings)
    assert [(x["name"], x["d_in"], x["d_out"], x["k_in"], x["k_out"]) for x in layers] == [
        (t.name, t.d_in, t.d_out, t.k_in, t.k_out) for t in want
    ]
    assert m["store"]["n_records"] == 3 and m["timings"]["n_steps"] == 1
    assert m["status"] == C.STATUS_COMPLETED


def test_store_not_named_store_h5_and_empty_tracker_cannot_finish(tmp_path):
    model = tiny_neox()
    with Tracker(model, tmp_path / "s.h5", SETTINGS) as tracker:
        pass
    with pytest.raises(ConfigError, match="store.h5"):
        tracker.finish(model)
    (tmp_path / "r").mkdir()
    with Tracker(model, tmp_path / "r" / "store.h5", SETTINGS) as tracker:
        pass
    with pytest.raises(RunError, match="no records"):
        tracker.finish(model)
    assert not (tmp_path / "r" / C.MANIFEST_FILE).exists()


# -- step arguments ----------------------------------------------------------------------------
def test_padding_mask_name_and_deprecated_token_mask(tmp_path):
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    with Tracker(model, tmp_path / "store.h5", SETTINGS) as tracker:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with tracker.step([0, 1, 2], padding_mask=mask) as rec:
                rec.losses = _losses(model, ids, mask, labels)
                rec.losses.mean().backward()
        with (
            pytest.warns(DeprecationWarning, match="padding_mask"),
            tracker.step([0, 1, 2], token_mask=mask) as rec,
        ):
            rec.losses = _losses(model, ids, mask, labels)
            rec.losses.mean().backward()
        with (
            pytest.raises(ConfigError, match="both"),
            tracker.step([0, 1, 2], token_mask=mask, padding_mask=mask),
        ):
            pass
    assert tracker.n_records == 6


def test_epoch_is_inferred_by_counting_passes_when_omitted(tmp_path):
    model = tiny_neox()
    ids, mask, labels, _ = causal_batch()
    order = [[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]]  # epochs 0, 0, 1, 1, 2
    with Tracker(model, tmp_path / "store.h5", SETTINGS) as tracker:
        for step, idx in enumerate(order):
            with tracker.step(idx, step=step, padding_mask=mask[:2]) as rec:
                rec.losses = _losses(model, ids[:2], mask[:2], labels[:2])
                rec.losses.mean().backward()
    with Store(tmp_path / "store.h5") as st:
        assert st.records()[C.REC_EPOCH].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


# -- misuse (issue 10, item 14) ------------------------------------------------------------------
@pytest.fixture()
def tracker(tmp_path):
    model = tiny_neox()
    with Tracker(model, tmp_path / "store.h5", SETTINGS, background=False) as tr:
        tr.trained_model = model
        yield tr


def _batch(model):
    ids, mask, labels, _ = causal_batch()
    return _losses(model, ids[:2], mask[:2], labels[:2])


def test_forgetting_rec_losses_raises_and_records_nothing(tracker):
    model = tracker.trained_model
    with pytest.raises(RunError, match="rec.losses was not set"), tracker.step([0, 1]):
        _batch(model).mean().backward()
    with pytest.raises(RunError, match="one loss per"), tracker.step([0, 1]) as rec:
        losses = _batch(model)
        losses.mean().backward()
        rec.losses = losses.mean()
    assert tracker.n_records == 0


def test_a_step_without_backward_raises(tracker):
    model = tracker.trained_model
    with pytest.raises(RunError, match="no backward"), tracker.step([0, 1]) as rec:
        rec.losses = _batch(model).detach()
    with (
        pytest.raises(RunError, match="no backward"),
        tracker.step([0, 1]) as rec,
        torch.no_grad(),
    ):
        rec.losses = _batch(model)
    assert tracker.n_records == 0
    with tracker.step([0, 1]) as rec:  # the tracker still works after the error
        rec.losses = _batch(model)
        rec.losses.mean().backward()
    assert tracker.n_records == 2


def test_nested_steps_raise(tracker):
    model = tracker.trained_model
    with (
        pytest.raises(RunError, match="inside another"),
        tracker.step([0, 1]),
        tracker.step([2, 3]),
    ):
        pass
    assert tracker.n_records == 0
    with tracker.step([0, 1]) as rec:
        rec.losses = _batch(model)
        rec.losses.mean().backward()
    assert tracker.n_records == 2


@pytest.mark.parametrize(
    "ids, match",
    [
        ([0.0, 1.0], "integers"),
        (np.array([0.5, 1.0]), "integers"),
        ([-1, 0], "-1"),
        ([0, 2**40], str(2**40)),
        (torch.tensor([0, 2**40]), str(2**40)),
        ([], "non-empty"),
        ([[0, 1]], "1-D"),
    ],
)
def test_bad_example_ids_raise_at_the_call(tracker, ids, match):
    with pytest.raises(ConfigError, match=match), tracker.step(ids):
        pass
    assert tracker.n_records == 0


def test_a_directory_as_store_path_raises_and_leaves_no_file(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        Tracker(tiny_neox(), d, SETTINGS)
    assert list(tmp_path.rglob("*")) == [d]


def test_a_second_tracker_on_an_existing_store_is_refused_unless_told_to_overwrite(tmp_path):
    """Issue 27, round 2 "silently wrong" item 1: a new Tracker used to wipe a finished store."""
    model = tiny_neox()
    path = tmp_path / C.STORE_FILE
    record_causal_step(path, model, SETTINGS)[0].close()
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="already exists.*overwrite=True"):
        Tracker(model, path, SETTINGS, background=False)
    assert path.read_bytes() == before  # nothing written
    with Store(path) as st:
        assert st.n_records == 3 and st.status == C.STATUS_COMPLETED
    with Tracker(model, path, SETTINGS, background=False, overwrite=True):
        pass  # asked for: the old store is replaced by a new, empty one
    with Store(path) as st:
        assert st.n_records == 0


# -- issue 27 (round 2): values that would make every record silently wrong ------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lr": float("nan")}, r"lr=\.\.\.\) must be .* finite number >= 0, got nan"),
        ({"lr": -1.0}, r"got -1\.0"),  # would swap proponents and opponents
        ({"lr": float("inf")}, "got inf"),
        ({"lr": "0.1"}, "got '0.1'"),
        ({"loss_scale": 0.0}, r"loss_scale=\.\.\.\) must be a finite number > 0"),
        ({"padding_mask": torch.ones(3, 5)}, r"2 example ids but a padding_mask of shape \(3, 5\)"),
    ],
    ids=["lr-nan", "lr-negative", "lr-inf", "lr-a-string", "loss-scale-0", "mask-of-3"],
)
def test_a_bad_lr_loss_scale_or_mask_raises_at_the_call(tracker, kw, match):
    with pytest.raises(ConfigError, match=match), tracker.step([0, 1], **kw):
        pytest.fail("the block must not run")  # refused before the block, nothing recorded
    assert tracker.n_records == 0


def test_a_nan_loss_is_refused_and_the_tracker_goes_on(tracker):
    model = tracker.trained_model
    with (
        pytest.raises(RunError, match=r"loss became nan at step 4 \(learning rate 0.001\)"),
        tracker.step([0, 1], step=4, lr=1e-3) as rec,
    ):
        losses = _batch(model)
        losses.mean().backward()
        rec.losses = losses * float("nan")
    assert tracker.n_records == 0
    with tracker.step([0, 1], lr=1e-3) as rec:  # the tracker still works after the error
        rec.losses = _batch(model)
        rec.losses.mean().backward()
    assert tracker.n_records == 2


def test_fewer_example_ids_than_the_batch_raise_in_the_forward(tracker):
    """2 ids for a batch of 3 used to fail at the end of the step with an internal
    RuntimeError about the factor scratch; the first tracked layer now names the mismatch."""
    model = tracker.trained_model
    ids, mask, labels, _ = causal_batch()
    with (
        pytest.raises(ConfigError, match="sees a batch of 3 examples, but the step was given 2"),
        tracker.step([0, 1]) as rec,
    ):
        rec.losses = _losses(model, ids, mask, labels)
    assert tracker.n_records == 0
    with tracker.step([0, 1, 2], padding_mask=mask) as rec:
        rec.losses = _losses(model, ids, mask, labels)
        rec.losses.mean().backward()
    assert tracker.n_records == 3


def _table(n, vocab_top=5, length=4):
    table = {C.EX_SOURCE: ["a.jsonl"] * n, C.EX_ROW: list(range(1, n + 1)), C.EX_TEXT: ["x"] * n}
    tokens = [np.arange(length, dtype=np.int32) % vocab_top for _ in range(n)]
    masks = [np.ones(length, np.uint8) for _ in range(n)]
    return table, tokens, masks


_TABLE_CASES = (
    "short-column",
    "fewer-tokens",
    "mask-length",
    "mask-2",
    "negative-token",
    "outside-vocab",
)


def _edit(n, what):
    table, tokens, masks = _table(n)
    if what == "short-column":
        table[C.EX_ROW] = table[C.EX_ROW][:-1]
    elif what == "fewer-tokens":
        tokens = tokens[:-1]
    elif what == "mask-length":
        masks[1] = np.ones(3, np.uint8)
    elif what == "mask-2":
        masks[2][1] = 2
    elif what == "negative-token":
        tokens[1] = np.array([0, -3, 1, 1], np.int32)
    elif what == "outside-vocab":
        from helpers import VOCAB

        tokens[2] = np.array([0, VOCAB, 1, 1], np.int32)
    return table, tokens, masks


@pytest.mark.parametrize(
    "what, match",
    [
        ("short-column", r"column 'row' has 2 rows, 'source' has 3"),
        ("fewer-tokens", "3 rows but 2 token arrays and 3 loss masks"),
        ("mask-length", r"example 1: tokens of shape \(4,\) and a loss mask of shape \(3,\)"),
        ("mask-2", "example 2: a loss mask holds only 0 .* and 1 .*, got 2"),
        ("negative-token", r"example 1: token id -3 is not in \[0, 2\^31\)"),
        ("outside-vocab", "example 2: token id 97 is outside the model's vocabulary of 97"),
    ],
    ids=list(_TABLE_CASES),
)
def test_a_bad_example_table_raises_at_write_examples(tracker, what, match):
    """Each of these used to be stored and to fail at query time (polars OutOfBoundsError, a
    numpy broadcast error, an IndexError in the embedding)."""
    with pytest.raises(ConfigError, match=match):
        tracker.write_examples(*_edit(3, what))
    assert tracker.writer.n_examples is None  # nothing written
    tracker.write_examples(*_table(3))  # a good table is still accepted
    assert tracker.writer.n_examples == 3


def test_a_table_shorter_than_the_recorded_ids_raises_either_way(tracker):
    model = tracker.trained_model
    ids, mask, labels, _ = causal_batch()
    with tracker.step([0, 1, 5], padding_mask=mask) as rec:
        rec.losses = _losses(model, ids, mask, labels)
        rec.losses.mean().backward()
    with pytest.raises(ConfigError, match="has 3 rows, but example id 5 was recorded"):
        tracker.write_examples(*_table(3))
    tracker.write_examples(*_table(6))
    with (
        pytest.raises(ConfigError, match=r"example id 6 is not a row of the example table \(6"),
        tracker.step([0, 6]),
    ):
        pass
    assert tracker.n_records == 3
