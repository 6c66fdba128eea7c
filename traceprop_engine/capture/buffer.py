"""Device-side sketch buffer: records accumulate where the model lives and cross to the host
in one large transfer per flush.

All layers share one flat device tensor, laid out layer-major so that every layer's region is a
contiguous ``(capacity, *record_shape)`` view and a step's rows ``[pos, pos+B)`` are contiguous
too: the hooks write into that slice in place (``baddbmm_`` / ``copy_``: no allocation, no
extra copy), and a flush is a single ``device -> host`` copy of the whole flat tensor. Host memory
stays bounded: the sink receives at most ``capacity`` records at a time, and
:class:`BackgroundSink` (the store writer's thread) holds at most ``max_pending`` such chunks.

Factored records stored as rank-r factors (``TrackSettings.rank > 0``): the hooks write each
step's full ``(B, k_out, k_in)`` sketches into a per-step *scratch* tensor instead, and
:meth:`SketchBuffer.commit` factorises the scratch of every layer of one shape in one batched
call (:func:`~traceprop_engine.capture.sketch.top_factors`, on the device) and keeps only ``U`` and
``V`` in the buffer, as a ``(k_out + k_in, r)`` record (``U`` rows first). Only factors cross
to the host, and the buffer holds ``r (k_out + k_in)`` numbers per record and layer.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import StoreError
from .sketch import top_factors

if TYPE_CHECKING:
    from ..store.writer import StoreWriter

FlushSink = Callable[[list[np.ndarray], dict[str, np.ndarray]], None]


@dataclass
class _Meta:
    example_index: list[np.ndarray] = field(default_factory=list)
    step: list[np.ndarray] = field(default_factory=list)
    epoch: list[np.ndarray] = field(default_factory=list)
    lr: list[np.ndarray] = field(default_factory=list)
    loss: list[np.ndarray] = field(default_factory=list)

    def take(self) -> dict[str, np.ndarray]:
        out = {
            "example_index": np.concatenate(self.example_index).astype(np.int64),
            "step": np.concatenate(self.step).astype(np.int64),
            "epoch": np.concatenate(self.epoch).astype(np.int32),
            "lr": np.concatenate(self.lr).astype(np.float32),
            "loss": np.concatenate([_host(x) for x in self.loss]).astype(np.float32),
        }
        self.__init__()
        return out


def _host(x: np.ndarray | torch.Tensor) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


class SketchBuffer:
    """A bounded device buffer of per-record sketches for several layers.

    Args:
        record_shapes: per layer, the shape of one record as the hooks write it (``(k_out, k_in)``
            or ``(k,)``).
        capacity: records held before a flush (grown once if a single batch is larger).
        device: where the buffer lives (the model's device).
        sink: called on flush with ``(per-layer arrays (n, *shape) float32, record metadata)``;
            a factored layer's array is ``(n, k_out + k_in, r)`` (``U`` rows, then ``V`` rows).
        ranks: per layer, ``r > 0`` to keep rank-``r`` factors of its ``(k_out, k_in)`` records
            (``r`` at most ``min(k_out, k_in)``), ``0`` to keep the records as written.
        before_flush: called first on every flush: whoever writes records into the slots
            later than :meth:`commit` (:meth:`Capture.write_deferred`) finishes them there.
    """

    def __init__(
        self,
        record_shapes: Sequence[tuple[int, ...]],
        capacity: int,
        device: torch.device | str,
        sink: FlushSink,
        ranks: Sequence[int] | None = None,
        before_flush: Callable[[], None] | None = None,
    ) -> None:
        self.record_shapes = [tuple(s) for s in record_shapes]
        self.ranks = [int(r) for r in ranks] if ranks is not None else [0] * len(record_shapes)
        if len(self.ranks) != len(self.record_shapes):
            raise ValueError("one rank per layer")
        self.stored_shapes = [
            (shape[0] + shape[1], r) if r else shape
            for shape, r in zip(self.record_shapes, self.ranks, strict=True)
        ]
        # layers factorised together: same (k_out, k_in, r)
        self._groups: dict[tuple[int, int, int], list[int]] = {}
        for i, (shape, r) in enumerate(zip(self.record_shapes, self.ranks, strict=True)):
            if r:
                self._groups.setdefault((shape[0], shape[1], r), []).append(i)
        self._scratch: dict[int, tuple[dict, list[torch.Tensor | None]]] = {}
        self._numels = [math.prod(s) for s in self.stored_shapes]
        self.device = torch.device(device)
        self.sink = sink
        self.before_flush = before_flush
        self.pos = 0
        self.n_flushed = 0
        self.n_transfers = 0
        self.flush_s = 0.0  # wall time spent in flush() on the calling (training) thread
        self._meta = _Meta()
        self._slot_cache: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self._flat = torch.zeros(
            capacity * sum(self._numels), dtype=torch.float32, device=self.device
        )
        self._views = []
        off = 0
        for numel, shape in zip(self._numels, self.stored_shapes, strict=True):
            self._views.append(self._flat[off : off + capacity * numel].view(capacity, *shape))
            off += capacity * numel
        self._slot_cache = {}

    def _scratch_for(self, batch: int) -> tuple[dict, list[torch.Tensor | None]]:
        """Per shape group one ``(n_layers, batch, k_out, k_in)`` tensor; per layer its slice."""
        hit = self._scratch.get(batch)
        if hit is None:
            if len(self._scratch) > 4:  # a few batch sizes recur (the last batch of an epoch)
                self._scratch.clear()
            tensors, slots = {}, [None] * len(self.record_shapes)
            for key, members in self._groups.items():
                t = torch.empty(len(members), batch, key[0], key[1], device=self.device)
                tensors[key] = t
                for j, i in enumerate(members):
                    slots[i] = t[j]  # (batch, k_out, k_in), contiguous
            hit = self._scratch[batch] = (tensors, slots)
        return hit

    @property
    def n_records(self) -> int:
        """Records committed so far (flushed or still on the device)."""
        return self.n_flushed + self.pos

    def reserve(self, batch: int) -> list[torch.Tensor]:
        """Make room for ``batch`` records; return each layer's ``(batch, *shape)`` slot view."""
        if self.pos + batch > self.capacity:
            self.flush()
            if batch > self.capacity:
                self._allocate(batch)
        key = (self.pos, batch)
        slots = self._slot_cache.get(key)
        if slots is None:  # the same few (pos, batch) windows recur every buffer cycle
            slots = self._slot_cache[key] = [v[self.pos : self.pos + batch] for v in self._views]
        if self._groups:  # factored layers: the hooks write the full sketch into scratch
            scratch = self._scratch_for(batch)[1]
            slots = [sc if sc is not None else sl for sc, sl in zip(scratch, slots, strict=True)]
        return slots

    def _factorise(self, batch: int) -> None:
        """Rank-r factors of the scratch sketches into the buffer rows ``[pos, pos + batch)``."""
        tensors = self._scratch_for(batch)[0]
        rows = slice(self.pos, self.pos + batch)
        for (k_out, k_in, r), members in self._groups.items():
            t = tensors[(k_out, k_in, r)]
            u, v = top_factors(t.view(-1, k_out, k_in), r)  # (G*B, k_out, r), (G*B, k_in, r)
            u = u.view(len(members), batch, k_out, r)
            v = v.view(len(members), batch, k_in, r)
            for j, i in enumerate(members):
                dst = self._views[i][rows]  # (B, k_out + k_in, r)
                dst[:, :k_out].copy_(u[j])
                dst[:, k_out:].copy_(v[j])

    def commit(
        self,
        example_index: np.ndarray,
        step: int,
        epoch: int,
        lr: float,
        loss: np.ndarray | torch.Tensor | None,
    ) -> None:
        """Accept the records just written into the slots returned by :meth:`reserve`.

        A ``loss`` tensor stays on its device until the flush (no synchronisation per step).
        """
        b = len(example_index)
        if self._groups:
            self._factorise(b)
        self._meta.example_index.append(np.asarray(example_index))
        self._meta.step.append(np.full(b, step))
        self._meta.epoch.append(np.full(b, epoch))
        self._meta.lr.append(np.full(b, lr, dtype=np.float32))
        if loss is None:
            loss = np.full(b, np.nan, dtype=np.float32)
        elif isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(b)
        else:
            loss = np.asarray(loss, np.float32)
        self._meta.loss.append(loss)
        self.pos += b

    def flush(self) -> None:
        """One device -> host transfer of everything committed, handed to the sink (the
        records still to be written first: ``before_flush``, not counted in ``flush_s``)."""
        if self.before_flush is not None:
            self.before_flush()
        if self.pos == 0:
            return
        t0 = time.perf_counter()
        try:
            self._flush()
        finally:
            self.flush_s += time.perf_counter() - t0

    def _flush(self) -> None:
        host = self._flat.cpu() if self._flat.device.type != "cpu" else self._flat
        self.n_transfers += 1
        arrays = []
        off = 0
        for numel, shape in zip(self._numels, self.stored_shapes, strict=True):
            region = host[off : off + self.pos * numel].view(self.pos, *shape)
            arrays.append(region.numpy().copy())  # the device buffer is reused after this
            off += self.capacity * numel
        meta = self._meta.take()
        n = self.pos
        self.pos = 0
        self.n_flushed += n
        self.sink(arrays, meta)


class BackgroundSink:
    """Hands flushed chunks to a writer thread so training does not wait on HDF5.

    At most ``max_pending`` chunks wait in the queue, which bounds host memory; an error in the
    writer thread is raised on the next :meth:`__call__` or on :meth:`close`. The thread looks
    ``writer.append`` up per chunk (the overhead bench swaps it for a timed one).
    """

    def __init__(self, writer: StoreWriter, max_pending: int = 2) -> None:
        self._writer = writer
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="traceprop-writer", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._writer.append(*item)
                except BaseException as e:  # surfaced to the training thread
                    self._error = e
            self._q.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreError(f"writing the store failed: {self._error}") from self._error

    def __call__(self, arrays, meta) -> None:
        self._raise_if_failed()
        self._q.put((arrays, meta))

    def drain(self) -> None:
        """Wait until every chunk handed over so far is written (a checkpoint's store is whole)."""
        self._q.join()
        self._raise_if_failed()

    def close(self) -> None:
        self._q.put(None)
        self._t.join()
        self._raise_if_failed()
