"""The tracker: the public object that makes any training loop write a Traceprop store.

Example (your own loop)::

    from traceprop_engine import Tracker, TrackSettings
    from traceprop_engine.attribution import open_run

    with Tracker(model, "runs/mine/store.h5", TrackSettings(k_in=8, k_out=8)) as tracker:
        for epoch in range(n_epochs):
            for step, batch in enumerate(loader):
                with tracker.step(batch["example_index"], padding_mask=batch["attention_mask"],
                                  step=step, epoch=epoch, lr=sched.get_last_lr()[0]) as rec:
                    losses = per_example_loss(model(**inputs), batch)   # (B,)
                    losses.mean().backward()                            # L = mean of per-example losses
                    rec.losses = losses
                optimizer.step(); optimizer.zero_grad()
    tracker.finish(model)          # runs/mine is now a run: open_run, the CLI and the app open it
    run = open_run("runs/mine")

What a record is: one record per example per step, holding the sketch of that example's *raw*
per-example gradient ``∇ℓ_i`` on the tracked layers, stored with the step's learning rate; a
query weights each record by its ``lr`` (TracIn along the trajectory: ``lr × raw gradient``).
What the optimizer does with the gradient afterwards is not reflected: gradient clipping, Adam's
moment preconditioning, weight decay and momentum do not change the records.

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
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import constants as C
from ..errors import ConfigError, RunError
from ..run_record import make_run
from ..settings import TrackSettings
from ..store.writer import StoreWriter
from .buffer import BackgroundSink, SketchBuffer
from .free_text import TargetProbe, adapts, median_targets, rank_for, rank_from_first_step
from .hooks import Capture
from .layers import build_layers, model_origin, resolved_embedding, target_counts
from .optimizer_scale import (
    adam_row_scales,
    check_optimizer_aware,
    missing_optimizer,
    param_groups_of,
)
from .project import deferrable
from .step_checks import (
    check_losses,
    check_step_args,
    check_store_path,
    check_tokens_in_vocab,
    example_ids,
    few_statistics,
    padding_mask_of,
    warn_silent_embedding,
)

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """Filled by the caller inside :meth:`Tracker.step`: ``rec.losses`` = the ``(B,)`` per-example losses."""

    losses: torch.Tensor | np.ndarray | None = None


class Tracker:
    """Attach capture hooks to ``model`` and write every tracked step to an HDF5 store.

    Args:
        model: the model being trained (hooks go on its trainable linear layers in ``scope``).
        store_path: the ``store.h5`` to write.
        settings: what to record.
        manifest: JSON-serialisable run description kept in the store.
        background: write HDF5 chunks from a background thread.
        writer: append to this (reopened) store instead of creating ``store_path``.
        overwrite: replace a file already at ``store_path`` (without it, an existing file, such
            as the store of a finished run, is refused rather than wiped).
        optimizer: the optimizer (``settings.optimizer_aware``).
        targets: the training examples' target token ids (one array each: the token ids whose
            loss is taken, e.g. ``ids[loss_mask == 1]``). With ``settings.vocab_rows`` the LM
            head's output projection keeps the most frequent ones exact, which makes the head's
            scores nearly exact (benchmarks/EVAL.md §1g); without them the head's output side
            is a plain random projection. They also decide the records' rank
            (``settings.free_text_rank``: free text, a median of more than 16 targets an
            example, records at rank 16); without them the first step decides it
            (:mod:`.free_text`).

    A record is ``lr × raw per-example gradient`` (sketched): gradient clipping and the
    optimizer's own preconditioning (Adam's moments, momentum, weight decay) are not reflected.
    After training, :meth:`finish` makes the store's folder a run that ``open_run``, the CLI
    and the app accept.

    Raises:
        ConfigError: ``store_path`` is a directory, or a file already there without ``overwrite``.
    """

    def __init__(
        self,
        model: nn.Module,
        store_path: str | os.PathLike,
        settings: TrackSettings | None = None,
        manifest: dict | None = None,
        background: bool = True,
        writer: StoreWriter | None = None,
        overwrite: bool = False,
        optimizer=None,
        targets: Sequence[np.ndarray] | None = None,
    ) -> None:
        check_store_path(store_path, new=writer is None and not overwrite)
        self.model = model
        self.store_path = Path(store_path)
        # embedding='auto' decided here, once: a resumed store (writer) by what it records
        settings = resolved_embedding(
            settings or TrackSettings(), model, None if writer is None else writer.layer_kinds
        )
        # free_text_rank: the records' rank from the data (a resumed store keeps its own)
        self._probe_rank = writer is None and adapts(settings) and targets is None
        if writer is None and targets is not None:
            settings = rank_for(settings, median_targets(targets))
        self.settings = settings
        counts = None if targets is None else target_counts(targets)
        stored = None if writer is None else writer.layer_ranks  # a resumed store's form
        self.layers = build_layers(model, self.settings, counts, stored)
        self.capture = Capture(model, self.layers, covariance=self.settings.covariance)
        # ``writer``: an existing store reopened to append to (a resumed run)
        self.writer = writer or StoreWriter(
            store_path, self.layers, manifest or {}, sketch=self.settings.sketch.value
        )
        if writer is None:  # what was trained: AttributionRun.settings' weighting=auto reads it
            self.writer.set_attrs(**{C.MODEL_ORIGIN: model_origin(model)})
        self._sink = BackgroundSink(self.writer) if background else self.writer.append
        self.buffer = self._make_buffer()
        self.step_ms: list[float] = []
        self.flush_ms = 0.0
        self._closed = False
        self.status = C.STATUS_RUNNING
        self._in_step = False
        # inferred epoch (when step() is not given one): a repeated id starts the next
        self._epoch = 0
        self._seen: set[int] = set()
        self._embeddings = [x for x in self.layers if x.embedding]  # usually none
        self._embedding_warned = False
        self._max_id = -1  # the largest example id recorded (checked against the table)
        self._n_examples = self.writer.n_examples  # rows of the example table, once written
        self.optimizer = None
        if self.settings.optimizer_aware:
            check_optimizer_aware(self.layers, deferrable)
            self.capture.row_scales = self._optimizer_scales
            if optimizer is not None:
                self.attach_optimizer(optimizer)

    def _make_buffer(self) -> SketchBuffer:
        """The device buffer of the layers' records (made again when their rank changes)."""
        return SketchBuffer(
            [layer.record_shape for layer in self.layers],
            self.settings.buffer_records,
            next(self.model.parameters()).device,
            self._sink,
            # full-space factors are written by the hooks; sketch-space ones by the buffer
            ranks=[0 if layer.full_factor else layer.rank for layer in self.layers],
            # the default factors of a buffer's steps are projected together, before it flushes
            before_flush=self.capture.write_deferred,
        )

    def attach_optimizer(self, optimizer) -> None:
        """The optimizer whose second moments scale the records (``optimizer_aware``)."""
        self.optimizer = optimizer
        self._groups = param_groups_of(optimizer)

    def _optimizer_scales(self) -> dict:
        if self.optimizer is None:
            raise missing_optimizer()
        return adam_row_scales(self.layers, self.optimizer, self._groups)

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
        self.status = status
        self.capture.detach()
        try:
            t0 = time.perf_counter()
            self.buffer.flush()
            if isinstance(self._sink, BackgroundSink):
                self._sink.close()
            self.flush_ms += (time.perf_counter() - t0) * 1e3
            if self.settings.covariance:
                self.writer.write_covariance(self.capture.covariance_arrays())
                few = few_statistics(self.capture.batches, self.settings.covariance_stride)
                if few and status == C.STATUS_COMPLETED:
                    log.warning(few)
            self.writer.write_timings(
                self.step_ms, {"flush_ms": self.flush_ms, "n_transfers": self.buffer.n_transfers}
            )
        except BaseException:  # the last records or statistics are not in the store (disk full)
            self.status = status = C.STATUS_FAILED
            raise
        finally:
            self.writer.close(status)

    def sync(self) -> None:
        """Write every committed record to the store now (and wait for it): a checkpoint's
        record count is then durable."""
        self.buffer.flush()
        if isinstance(self._sink, BackgroundSink):
            self._sink.drain()

    # -- data -------------------------------------------------------------------------------
    def write_examples(
        self, table: dict, tokens: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray]
    ) -> None:
        """Store the example table (lineage + exact tokens); see :meth:`StoreWriter.write_examples`.

        Raises:
            ConfigError: the table's own problems (``StoreWriter.write_examples``), a token id
                outside the model's vocabulary, or fewer rows than the example ids recorded.
        """
        check_tokens_in_vocab(self.model, tokens)
        n = len(table.get(C.EX_SOURCE, ()))
        if self._max_id >= n:
            raise ConfigError(
                f"the example table has {n} rows, but example id {self._max_id} was recorded: "
                "give one row per training example (row i = example id i)"
            )
        self.writer.write_examples(table, tokens, loss_masks)
        self._n_examples = n

    # -- one micro-batch ----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(
        self,
        example_index: Sequence[int] | torch.Tensor | np.ndarray,
        *,
        padding_mask: torch.Tensor | None = None,
        loss_scale: float | None = None,
        step: int = 0,
        epoch: int | None = None,
        lr: float = 0.0,
        token_mask: torch.Tensor | None = None,
    ) -> Iterator[StepRecord]:
        """Record the forward + backward run inside the block as one record per example.

        The records are committed when the block exits normally; on an exception they are
        dropped (the store keeps only whole steps). Set ``rec.losses`` to the ``(B,)``
        per-example losses inside the block.

        Args:
            example_index: the ``(B,)`` example ids of the micro-batch, integers in
                ``[0, MAX_EXAMPLE_ID]`` (they index the example table).
            padding_mask: ``(B, T)`` 1 for real tokens, 0 for padding (the attention mask; not
                the loss mask): padding is kept out of the covariance.
            loss_scale: factor turning the batch loss's gradient into per-example gradients
                (default ``B``: the loss backpropagated is the mean of per-example losses).
            step: the optimizer step.
            epoch: the epoch. When omitted it is inferred by counting passes: a step holding an
                example id already recorded in the current epoch starts the next epoch (pass it
                explicitly when an epoch may repeat an example, e.g. sampling with replacement).
            lr: the learning rate of this step (a query weights the record by it).
            token_mask: deprecated alias of ``padding_mask``.

        Raises:
            ConfigError: example ids that are not integers in range, or not one per example of
                the batch the model sees; ``lr`` or ``loss_scale`` not a finite number >= 0
                (> 0); a ``padding_mask`` of another batch size; both ``padding_mask`` and
                ``token_mask``.
            RunError: a ``step()`` inside another; the block ran no backward through the tracked
                layers; ``rec.losses`` not set, not one loss per example, or not finite (a
                diverged step is not recorded).
        """
        padding_mask = padding_mask_of(padding_mask, token_mask)
        if self._in_step:
            raise RunError(
                "Tracker.step() was called inside another Tracker.step() block: record each "
                "micro-batch in its own block, one after the other"
            )
        idx = example_ids(example_index)
        check_step_args(b := len(idx), lr, padding_mask, loss_scale)
        top = int(idx.max())
        if self._n_examples is not None and top >= self._n_examples:
            raise ConfigError(
                f"example id {top} is not a row of the example table ({self._n_examples} rows): "
                "number the training examples 0..N-1 as in write_examples()"
            )
        slots = self.buffer.reserve(b)
        rec = StepRecord()
        t0 = time.perf_counter()
        self._in_step = True
        queued = False  # the block ran to its end: its records wait in the capture's queue
        if self._probe_rank:
            self.capture.probe = TargetProbe()
        try:
            with self.capture.batch(
                slots,
                token_mask=padding_mask,
                loss_scale=float(b if loss_scale is None else loss_scale),
                defer=True,
            ):
                yield rec
            queued = True
            if not any(layer._fired for layer in self.layers):
                raise RunError(
                    "no backward pass reached the tracked layers inside this Tracker.step() block: "
                    "call losses.mean().backward() inside the block (not after it, nor under "
                    "torch.no_grad())"
                )
            losses = check_losses(rec.losses, b, step, lr)
            self._embedding_warned = warn_silent_embedding(self._embeddings, self._embedding_warned)
            if self._probe_rank:
                self._probe_rank = False
                slots = rank_from_first_step(self, slots)
        except BaseException:
            if queued:  # not committed: its records must not be written into the buffer
                self.capture.drop_deferred_batch()
            raise
        finally:
            self._in_step = False
            self.capture.probe = None
        if epoch is None:
            epoch = self._infer_epoch(idx)
        self.buffer.commit(idx, step=step, epoch=epoch, lr=lr, loss=losses)
        self._max_id = max(self._max_id, top)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)

    def _infer_epoch(self, idx: np.ndarray) -> int:
        ids = set(idx.tolist())
        if not ids.isdisjoint(self._seen):
            self._epoch += 1
            self._seen = set()
        self._seen |= ids
        return self._epoch

    # -- the run ------------------------------------------------------------------------------
    def finish(
        self,
        model: nn.Module | None = None,
        tokenizer=None,
        *,
        task: str = "causal-lm",
        labels: Sequence[str] | None = None,
        max_length: int = 128,
        data: dict | None = None,
        config: dict | None = None,
    ) -> Path:
        """Close the tracker and make the store's folder a run: ``open_run``, the CLI and the app open it.

        Saves ``model`` (and ``tokenizer`` when given) to ``RUN/model`` and writes
        ``RUN/run.json``; ``RUN`` is the folder of the store, which must be named ``store.h5``.
        Without a tokenizer the run is queried by token ids (``run.query(input_ids=...)``).

        Args:
            model: the trained model (a Hugging Face ``PreTrainedModel``; default: the tracked one).
            tokenizer: its Hugging Face tokenizer, or ``None``.
            task: ``causal-lm`` or ``classification``.
            labels: class names in label-id order (classification).
            max_length: the truncation length of training (text queries are cut the same way).
            data: optional data section of the manifest.
            config: extra configuration to keep in the manifest.

        Returns:
            The run directory.

        Raises:
            ConfigError: the store is not named ``store.h5``; the model cannot be saved.
            RunError: nothing was recorded.
        """
        if not self._closed:
            self.close(C.STATUS_COMPLETED)
        if self.store_path.name != C.STORE_FILE:
            raise ConfigError(
                f"a run's store is named {C.STORE_FILE}, this one is {self.store_path.name}: build "
                f"the Tracker with store path RUN_DIR/{C.STORE_FILE}"
            )
        if self.n_records == 0:
            raise RunError(
                f"{self.store_path} holds no records: run at least one tracker.step() with a "
                "backward before finish()"
            )
        return make_run(
            self.store_path.parent,
            self.model if model is None else model,
            tokenizer,
            task=task,
            labels=labels,
            max_length=max_length,
            status=self.status,
            data=data,
            config={"trainer": "traceprop_engine.Tracker", **(config or {})},
            tracking=self.tracking_manifest(),
            timings={
                "n_steps": len(self.step_ms),
                "median_step_ms": float(np.median(self.step_ms)) if self.step_ms else None,
            },
            store={"file": C.STORE_FILE, "n_records": self.n_records},
        )

    def tracking_manifest(self) -> dict:
        """The run manifest's ``tracking`` section: the settings and every tracked layer."""
        return {
            **self.settings.to_dict(),
            "layers": [
                {
                    "name": t.name,
                    "kind": t.kind,
                    "d_in": t.d_in,
                    "d_out": t.d_out,
                    "k_in": t.k_in,
                    "k_out": t.k_out,
                    # exact target-token rows of an LM head's output projection (vocab_rows)
                    **({"vocab_rows": len(t.vocab_ids)} if t.vocab_ids is not None else {}),
                }
                for t in self.layers
            ],
        }

    @property
    def n_records(self) -> int:
        return self.buffer.n_records
