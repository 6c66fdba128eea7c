"""Hugging Face ``Trainer`` integration: a normal ``Trainer.train()`` writes a Traceprop store.

A ``TrainerCallback`` alone cannot do it: callbacks see neither the micro-batch (so neither the
example ids nor the padding mask) nor the per-example losses, and no callback fires between a
micro-batch's arrival and its forward pass. So the integration is three small pieces:

- :class:`TracepropCollator` wraps any data collator and carries the ``example_index`` of every
  feature through the batch (the model's forward never sees it);
- :class:`TracepropTrainer` (a ``Trainer`` subclass) wraps every micro-batch's
  ``training_step`` in :meth:`Tracker.step` and computes the loss as Traceprop defines it
  (mean of per-example losses, ``constants.LOSS_DEFINITION``);
- :class:`TracepropCallback` (added by the trainer) follows the epoch and closes the tracker
  when training ends.

Example::

    from traceprop_engine import Tracker, TrackSettings
    from traceprop_engine.training.hf_trainer import TracepropCollator, TracepropTrainer

    with Tracker(model, "runs/hf/store.h5", TrackSettings(k_in=8, k_out=8)) as tracker:
        tracker.write_examples(table, tokens, loss_masks)          # lineage (optional)
        trainer = TracepropTrainer(
            model=model, args=args, train_dataset=ds,              # rows carry "example_index"
            data_collator=TracepropCollator(pad_id=tok.pad_token_id),
            tracker=tracker,
        )
        trainer.train()

Loss scaling: ``Trainer.training_step`` divides the loss of each micro-batch by
``current_gradient_accumulation_steps`` (we set ``loss_is_scaled_for_ga = False`` so it always
does, whatever the model's forward signature), so the hooks see ``∂(mean_i ℓ_i / G)/∂y`` and the
loss scale is ``B · G`` (``B`` the micro-batch size). Under accelerate's DDP the capture hooks
see the *local* output gradient (DDP averages parameter gradients, not activation gradients),
so the same scale holds on every rank; each rank then needs its own store file (see
:func:`rank_store_path`). Mixed precision: the Trainer's autocast runs the forward hooks in the
autocast dtype; sketches and covariance are accumulated in fp32 by the capture.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..capture.tracker import Tracker
from ..errors import ConfigError
from ..run_record import make_run
from .losses import example_losses
from .models import Encoded, collate

log = logging.getLogger(__name__)

EXAMPLE_INDEX = "example_index"
LOSS_MASK = "loss_mask"

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - transformers is a dependency
    raise ImportError(
        "traceprop_engine.training.hf_trainer needs transformers: pip install transformers"
    ) from e


def rank_store_path(store_path: str | os.PathLike, rank: int, world_size: int) -> Path:
    """``store.h5`` in one process; ``store.rank{r}.h5`` beside it when ``world_size > 1``."""
    p = Path(store_path)
    return p if world_size <= 1 else p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def encoded_dataset(encoded: Sequence[Encoded], indices: Sequence[int] | None = None) -> list[dict]:
    """Rows ``{"example_index", "input_ids", "loss_mask", "label"}`` for :class:`TracepropCollator`.

    Args:
        encoded: every example, as :func:`traceprop_engine.training.models.encode_example` made them.
        indices: the example indices to train on (default: all), in dataset order.
    """
    idx = range(len(encoded)) if indices is None else indices
    return [
        {
            EXAMPLE_INDEX: int(i),
            "input_ids": encoded[i].ids,
            LOSS_MASK: encoded[i].loss_mask,
            "label": encoded[i].label,
        }
        for i in idx
    ]


class TracepropCollator:
    """A data collator that keeps each feature's ``example_index`` as a ``(B,)`` long tensor.

    Args:
        base: the collator to wrap (called on the features without ``example_index``). ``None``
            uses Traceprop's own right-padding collate for rows from :func:`encoded_dataset`.
        pad_id: the pad token id (for the default collate).
        task: ``"causal-lm"`` or ``"classification"`` (for the default collate).

    Raises:
        ConfigError: a feature has no ``example_index``.
    """

    def __init__(
        self,
        base: Callable[[list[dict]], dict] | None = None,
        *,
        pad_id: int = 0,
        task: str = "causal-lm",
    ) -> None:
        self.base = base
        self.pad_id = pad_id
        self.task = task

    def __call__(self, features: list[dict]) -> dict:
        try:
            idx = [int(f[EXAMPLE_INDEX]) for f in features]
        except KeyError:
            raise ConfigError(
                f"a training row has no {EXAMPLE_INDEX!r} column: give every row its example index "
                "(see encoded_dataset), and keep it through the dataset's map/filter steps"
            ) from None
        rest = [{k: v for k, v in f.items() if k != EXAMPLE_INDEX} for f in features]
        if self.base is None:
            batch = collate(
                [Encoded(r["input_ids"], r[LOSS_MASK], int(r.get("label", -1))) for r in rest],
                self.pad_id,
                self.task,
                "cpu",
            )
        else:
            batch = dict(self.base(rest))
        batch[EXAMPLE_INDEX] = torch.tensor(idx, dtype=torch.long)
        return batch


class TracepropCallback(TrainerCallback):
    """Follows the epoch for the records and closes the tracker when training ends.

    Args:
        tracker: the tracker the trainer records into.
        close_on_end: close the tracker (status ``completed``) in ``on_train_end``.
    """

    def __init__(self, tracker: Tracker, close_on_end: bool = True) -> None:
        self.tracker = tracker
        self.close_on_end = close_on_end
        self.epoch = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.tracker.capture.attach()  # idempotent: a `with Tracker(...)` already attached it

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch = int(round(state.epoch or 0.0))

    def on_train_end(self, args, state, control, **kwargs):
        if self.close_on_end:
            self.tracker.close()


class TracepropTrainer(Trainer):
    """A ``Trainer`` whose every training micro-batch is recorded by ``tracker``.

    Args:
        *args, **kwargs: as for ``transformers.Trainer``; the ``data_collator`` must keep the
            ``example_index`` column (wrap yours in :class:`TracepropCollator`).
        tracker: a :class:`~traceprop_engine.Tracker` built on the same ``model``.
        task: ``"causal-lm"`` or ``"classification"`` (selects the per-example loss).
        close_tracker_on_end: close the tracker when ``train()`` returns normally.

    Raises:
        ConfigError: ``tracker`` missing, or several GPUs in one process (``DataParallel``).
    """

    # compute_loss returns the mean of per-example losses, not a num_items_in_batch-normalised
    # sum: the Trainer must always divide it by the accumulation steps (see the module docstring)
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args,
        tracker: Tracker | None = None,
        task: str = "causal-lm",
        close_tracker_on_end: bool = True,
        **kwargs,
    ) -> None:
        if tracker is None:
            raise ConfigError("TracepropTrainer needs tracker=Tracker(model, store_path, settings)")
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            raise ConfigError(
                f"TracepropTrainer does not support DataParallel over {self.args.n_gpu} GPUs in one process; "
                "launch with torchrun (one process per GPU, one store per rank) or set CUDA_VISIBLE_DEVICES"
            )
        if task not in ("causal-lm", "classification"):
            raise ConfigError(f"task must be one of 'causal-lm', 'classification', got {task!r}")
        self.tracker = tracker
        self.traceprop_task = task
        self._traceprop_cb = TracepropCallback(tracker, close_on_end=close_tracker_on_end)
        self.add_callback(self._traceprop_cb)
        self._last_losses: torch.Tensor | None = None

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        # kept by remove_unused_columns: the ids, and the loss mask the default collate needs
        for col in (EXAMPLE_INDEX, LOSS_MASK):
            if col not in self._signature_columns:
                self._signature_columns.append(col)

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = dict(inputs)
        if EXAMPLE_INDEX not in inputs:
            raise ConfigError(
                f"the training batch has no {EXAMPLE_INDEX!r}: wrap the data collator in TracepropCollator"
            )
        idx = inputs.pop(EXAMPLE_INDEX)
        accum = int(
            getattr(
                self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps
            )
        )
        scale = len(idx) * accum  # hooks see ∂(mean_i ℓ_i / accum)/∂y
        with self.tracker.step(
            idx,
            padding_mask=inputs.get("attention_mask"),
            loss_scale=scale,
            step=self.state.global_step,
            epoch=self._traceprop_cb.epoch,
            lr=float(self._get_learning_rate()),
        ) as rec:
            self._last_losses = None
            loss = super().training_step(model, inputs, num_items_in_batch)
            rec.losses = self._last_losses
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {k: v for k, v in inputs.items() if k != EXAMPLE_INDEX}
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        losses = example_losses(outputs, {"labels": labels}, self.traceprop_task)  # (B,) fp32
        if model.training:
            self._last_losses = losses.detach()
        loss = losses.mean()
        return (loss, outputs) if return_outputs else loss


def finish_run(
    run_dir: str | os.PathLike,
    model: torch.nn.Module,
    tokenizer,
    *,
    task: str = "causal-lm",
    labels: Sequence[str] | None = None,
    max_length: int = 128,
    status: str = "completed",
    data: dict | None = None,
    config: dict | None = None,
) -> Path:
    """Make a Trainer-tracked store a complete run directory that ``traceprop query``/the app open.

    Saves ``model`` (+ tokenizer, or the peft adapter) to ``RUN/model`` and writes ``RUN/run.json``;
    the tracker must have written ``RUN/store.h5`` (close it first).

    Args:
        run_dir: the folder holding ``store.h5``.
        model, tokenizer: the trained model and its tokenizer.
        task: ``causal-lm`` or ``classification``.
        labels: class names in label-id order (classification).
        max_length: the truncation length used for training (queries are cut the same way).
        status: the run status to record.
        data: optional data section (``root``, ``files`` {relative path: sha256}, ``n_train``, ``n_eval``).
        config: extra configuration to keep in the manifest.
    """
    return make_run(
        run_dir,
        model,
        tokenizer,
        task=task,
        labels=labels,
        max_length=max_length,
        status=status,
        data=data,
        config={"trainer": "transformers.Trainer", **(config or {})},
    )
