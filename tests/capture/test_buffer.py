"""The device sketch buffer: slots write in place, flushes hand over whole records in order."""

from __future__ import annotations

import numpy as np
import torch

from traceprop_engine.capture.buffer import SketchBuffer


def _buffer(capacity: int, sink_calls: list) -> SketchBuffer:
    return SketchBuffer(
        [(2, 3), (4,)], capacity, "cpu", lambda arrays, meta: sink_calls.append((arrays, meta))
    )


def _fill(buf: SketchBuffer, start: int, b: int, loss=None) -> None:
    slots = buf.reserve(b)
    for li, slot in enumerate(slots):
        for j in range(b):
            slot[j].fill_(100 * li + start + j)
    buf.commit(np.arange(start, start + b), step=start, epoch=0, lr=0.5, loss=loss)


def test_records_flush_in_order_with_metadata():
    calls: list = []
    buf = _buffer(6, calls)
    _fill(buf, 0, 3, loss=torch.tensor([1.0, 2.0, 3.0]))
    _fill(buf, 3, 3)  # exactly full: no flush yet
    assert not calls and buf.n_records == 6
    _fill(buf, 6, 2)  # no room: the first six go out in one transfer
    assert len(calls) == 1 and buf.n_transfers == 1 and buf.pos == 2
    arrays, meta = calls[0]
    assert arrays[0].shape == (6, 2, 3) and arrays[1].shape == (6, 4)
    np.testing.assert_array_equal(arrays[0][:, 0, 0], np.arange(6))
    np.testing.assert_array_equal(arrays[1][:, 0], 100 + np.arange(6))
    np.testing.assert_array_equal(meta["example_index"], np.arange(6))
    np.testing.assert_array_equal(meta["step"], [0, 0, 0, 3, 3, 3])
    np.testing.assert_allclose(meta["loss"][:3], [1, 2, 3])
    assert np.all(np.isnan(meta["loss"][3:]))
    buf.flush()
    assert len(calls) == 2 and buf.n_records == 8 and buf.pos == 0
    np.testing.assert_array_equal(calls[1][0][0][:, 0, 0], [6, 7])
    assert buf.flush_s > 0
    buf.flush()  # nothing committed: no transfer
    assert len(calls) == 2


def test_flushed_arrays_are_copies_and_slots_are_reused():
    calls: list = []
    buf = _buffer(4, calls)
    first = buf.reserve(4)
    _fill(buf, 0, 4)
    buf.flush()
    again = buf.reserve(4)
    assert [s.data_ptr() for s in again] == [s.data_ptr() for s in first]  # same device memory
    again[0].fill_(-1)  # overwriting the device buffer does not touch what was handed over
    np.testing.assert_array_equal(calls[0][0][0][:, 0, 0], np.arange(4))


def test_batch_larger_than_capacity_grows_the_buffer():
    calls: list = []
    buf = _buffer(2, calls)
    _fill(buf, 0, 5)
    assert buf.capacity == 5
    buf.flush()
    np.testing.assert_array_equal(calls[-1][0][0][:, 0, 0], np.arange(5))
    np.testing.assert_array_equal(calls[-1][1]["example_index"], np.arange(5))
