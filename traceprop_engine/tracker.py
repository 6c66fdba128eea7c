"""The tracker: the public object that makes any training loop write a Traceprop store.

Example (your own loop)::

    from traceprop_engine import Tracker, TrackSettings

    with Tracker(model, "runs/mine/store.h5", TrackSettings(k_in=8, k_out=8)) as tracker:
        for step, batch in enumerate(loader):
            with tracker.step(batch["example_index"], token_mask=batch["attention_mask"],
                              step=step, lr=sched.get_last_lr()[0]) as rec:
                losses = per_example_loss(model(**inputs), batch)   # (B,)
                losses.mean().backward()                            # L = mean of per-example losses
                rec.losses = losses
            optimizer.step(); optimizer.zero_grad()

``loss_scale`` defaults to the batch size, which is right when the loss you backpropagate is the
mean of per-example losses (Traceprop's loss definition, docs/store-format.md); pass another
factor if you reduce differently (e.g. ``B * accumulation_steps`` if you divide by the number
of accumulation steps).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import constants as C
from .buffer import SketchBuffer
from .capture import Capture, build_layers
from .settings import TrackSettings
from .store import BackgroundSink, StoreWriter

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """Filled by the caller inside :meth:`Tracker.step` (per-example losses are optional)."""

    losses: torch.Tensor | np.ndarray | None = None


class Tracker:
    """Attach capture hooks to ``model`` and write every tracked step to an HDF5 store.

    Args:
        model: the model being trained (hooks go on its trainable linear layers in ``scope``).
        store_path: the ``store.h5`` to write.
        settings: what to record.
        manifest: JSON-serialisable run description kept in the store.
        background: write HDF5 chunks from a background thread.
    """

    def __init__(
        self,
        model: nn.Module,
        store_path: str | os.PathLike,
        settings: TrackSettings | None = None,
        manifest: dict | None = None,
        background: bool = True,
    ) -> None:
        self.model = model
        self.settings = settings or TrackSettings()
        self.layers = build_layers(model, self.settings)
        self.capture = Capture(model, self.layers, covariance=self.settings.covariance)
        self.writer = StoreWriter(
            store_path, self.layers, manifest or {}, sketch=self.settings.sketch.value
        )
        self._sink = BackgroundSink(self.writer) if background else self.writer.append
        device = next(model.parameters()).device
        self.buffer = SketchBuffer(
            [layer.record_shape for layer in self.layers],
            self.settings.buffer_records,
            device,
            self._sink,
            ranks=[layer.rank for layer in self.layers],
        )
        self.step_ms: list[float] = []
        self.flush_ms = 0.0
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        self.capture.attach()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            status = C.STATUS_COMPLETED
        elif issubclass(exc_type, KeyboardInterrupt):
            status = C.STATUS_CANCELLED
        else:
            status = C.STATUS_FAILED
        self.close(status)

    def close(self, status: str = C.STATUS_COMPLETED) -> None:
        """Detach hooks, flush the buffer, write covariance and timings, set the status."""
        if self._closed:
            return
        self._closed = True
        self.capture.detach()
        try:
            t0 = time.perf_counter()
            self.buffer.flush()
            if isinstance(self._sink, BackgroundSink):
                self._sink.close()
            self.flush_ms += (time.perf_counter() - t0) * 1e3
            if self.settings.covariance:
                self.writer.write_covariance(self.capture.covariance_arrays())
            self.writer.write_timings(
                self.step_ms, {"flush_ms": self.flush_ms, "n_transfers": self.buffer.n_transfers}
            )
        finally:
            self.writer.close(status)

    # -- data -------------------------------------------------------------------------------
    def write_examples(
        self, table: dict, tokens: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray]
    ) -> None:
        """Store the example table (lineage + exact tokens); see :meth:`StoreWriter.write_examples`."""
        self.writer.write_examples(table, tokens, loss_masks)

    # -- one micro-batch ----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(
        self,
        example_index: Sequence[int] | torch.Tensor | np.ndarray,
        *,
        token_mask: torch.Tensor | None = None,
        loss_scale: float | None = None,
        step: int = 0,
        epoch: int = 0,
        lr: float = 0.0,
    ) -> Iterator[StepRecord]:
        """Record the forward + backward run inside the block as one record per example.

        The records are committed when the block exits normally; on an exception they are
        dropped (the store keeps only whole steps).
        """
        if isinstance(example_index, torch.Tensor):
            example_index = example_index.detach().cpu().numpy()
        idx = np.asarray(example_index, dtype=np.int64)
        b = len(idx)
        slots = self.buffer.reserve(b)
        rec = StepRecord()
        t0 = time.perf_counter()
        with self.capture.batch(
            slots, token_mask=token_mask, loss_scale=float(b if loss_scale is None else loss_scale)
        ):
            yield rec
        self.buffer.commit(idx, step=step, epoch=epoch, lr=lr, loss=rec.losses)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)

    @property
    def n_records(self) -> int:
        return self.buffer.n_records
