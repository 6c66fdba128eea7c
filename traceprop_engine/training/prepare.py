"""Building a training run: its first run.json, the data, the model and the tracker.

The steps :func:`~.loop.train` runs before the first optimiser step. Each records what it did
in the run's :class:`~traceprop_engine.run_record.RunRecord` (``data``, ``model``,
``tracking``), so run.json says what was trained on what even when the run fails later.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import constants as C
from ..capture.free_text import free_text_note
from ..capture.step_checks import short_run_stride
from ..capture.tracker import Tracker
from ..errors import ConfigError, RunError
from ..run_record import RunRecord
from ..settings import Task, TrackSettings, TrainSettings
from ..store.writer import StoreWriter
from . import distributed
from .checkpoint import Checkpoint
from .data import hash_files, load_examples, split_eval
from .examples import Example
from .models import apply_lora, build_model, count_parameters, encode_example

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What the steps of one :func:`~.loop.train` call share: settings, directory, ranks, run.json."""

    settings: TrainSettings
    run_dir: Path
    dist: distributed.DistContext
    record: RunRecord  # run.json
    lock_fd: int | None = None  # held by rank 0 for the whole run
    tracker: Tracker | None = None
    checkpoint: Checkpoint | None = None  # the checkpoint a resumed run continues from
    previous_data: dict | None = None  # a resumed run's recorded data files (checked again)

    def write_run_json(self) -> None:
        if self.dist.is_main:
            self.record.save()


@dataclass
class Prepared:
    """The model being trained and every example (train first, then eval) encoded for it."""

    task: str
    loaded: object  # models.LoadedModel: model + tokenizer + source
    model: torch.nn.Module
    device: torch.device
    examples: list[Example]
    n_train: int
    encoded: list
    pad_id: int


def _example_table(examples: list[Example], splits: list[str]) -> dict:
    return {
        C.EX_SOURCE: [e.source for e in examples],
        C.EX_ROW: [e.row for e in examples],
        C.EX_SHA256: [e.sha256 for e in examples],
        C.EX_SPLIT: splits,
        C.EX_TEXT: [e.text for e in examples],
        C.EX_PROMPT: [e.prompt for e in examples],
        C.EX_COMPLETION: [e.completion for e in examples],
        C.EX_LABEL: [e.label for e in examples],
    }


def load_data(job: Job) -> tuple[list[Example], list[Example], list[str] | None]:
    """Train and eval examples (and the class labels), recorded in run.json's ``data``."""
    settings = job.settings
    task = settings.task.value
    examples, data_root = load_examples(settings.data, task=task)
    if settings.eval_data:
        train_ex = examples
        eval_ex, eval_root = load_examples(settings.eval_data, task=task)
    else:
        train_ex, eval_ex = split_eval(examples, settings.eval_fraction, settings.seed)
        eval_root = data_root
    job.record.set_data(
        data_root,
        eval_root,
        files=hash_files(Path(data_root), sorted({e.source for e in train_ex})),
        eval_files=hash_files(Path(eval_root), sorted({e.source for e in eval_ex})),
        n_train=len(train_ex),
        n_eval=len(eval_ex),
    )
    labels = sorted({e.label for e in train_ex + eval_ex}) if task == "classification" else None
    if labels is not None and len(labels) < 2:
        raise ConfigError(f"classification needs at least two labels; the data has {labels}")
    return train_ex, eval_ex, labels


def prepare_model(
    job: Job,
    train_ex: list[Example],
    eval_ex: list[Example],
    labels: list[str] | None,
    device: torch.device,
) -> Prepared:
    """Build (and LoRA-wrap) the model on ``device`` and encode every example for it."""
    settings = job.settings
    task = settings.task.value
    loaded = build_model(
        settings.model,
        task,
        [e.full_text() for e in train_ex],
        labels=labels,
        seed=settings.seed,
        tiny_vocab=settings.tiny_vocab,
        tiny_width=settings.tiny_width,
        tiny_layers=settings.tiny_layers,
        max_length=settings.max_length,
    )
    if settings.lora_rank > 0:
        if job.dist.fsdp:
            raise ConfigError("--parallel fsdp with --lora-rank is not supported yet")
        apply_lora(loaded, settings.lora_rank, settings.lora_targets)
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    model = loaded.model.to(device)
    job.dist.check_same("the tokenizer", json.dumps(loaded.tokenizer.get_vocab(), sort_keys=True))
    model.train()
    label_ids = {lab: i for i, lab in enumerate(labels)} if labels else None
    all_ex = train_ex + eval_ex
    encoded = [
        encode_example(e, loaded.tokenizer, task, settings.max_length, label_ids) for e in all_ex
    ]
    n_trunc = sum(e.truncated for e in encoded)
    if n_trunc:
        note = (
            f"{n_trunc} of {len(encoded)} examples were longer than --max-length "
            f"{settings.max_length} tokens and were truncated"
        )
        log.warning("%s", note)
        job.record.add_note(note)
    total, trainable = count_parameters(model)
    job.record.set_model(
        source=loaded.source,
        task=task,
        parameters=total,
        trainable=trainable,
        lora_rank=settings.lora_rank,
        labels=labels,
    )
    pad_id = loaded.tokenizer.pad_token_id
    return Prepared(task, loaded, model, device, all_ex, len(train_ex), encoded, pad_id)


def start_tracker(job: Job, prep: Prepared) -> None:
    """Open the store, write the example table and attach the hooks (when the run is tracked)."""
    settings, dist_ctx = job.settings, job.dist
    if settings.track is None:
        return
    path = job.run_dir / dist_ctx.store_file
    ckpt, writer = job.checkpoint, None
    if ckpt is not None:  # resumed: append to the store (this rank's shard), from the
        # checkpoint's record count
        mine = ckpt.rank_meta(dist_ctx.rank)
        writer = StoreWriter.reopen(path, int(mine["n_records"]), mine["sq_norm"])
    targets = training_targets(prep) if prep.task == Task.CAUSAL_LM.value else None
    if targets is not None and dist_ctx.is_main:
        free_text_note(settings.track, targets)
    # hooks on the underlying module (not the DDP wrapper): the same layer names
    tracker = Tracker(
        prep.model,
        path,
        short_run_track(settings.track, step_counts(job, prep.n_train)[1]),
        manifest=job.record.as_dict(),
        writer=writer,
        targets=targets,
    )
    job.tracker = tracker
    if ckpt is not None:
        tracker.buffer.n_flushed = writer.n_records  # the records already in the store
        _check_projections(tracker)
    elif dist_ctx.is_main:  # the example table lives in shard 0 only
        n_eval = len(prep.examples) - prep.n_train
        tracker.write_examples(
            _example_table(prep.examples, [C.SPLIT_TRAIN] * prep.n_train + [C.SPLIT_EVAL] * n_eval),
            [e.ids for e in prep.encoded],
            [e.loss_mask for e in prep.encoded],
        )
    tracker.capture.attach()
    job.record.set_tracking(tracker.tracking_manifest())


MIN_COVARIANCE_BATCHES = C.MIN_COVARIANCE_BATCHES  # why: constants.py


def step_counts(job: Job, n_train: int) -> tuple[int, int]:
    """Steps per epoch and in all (``max_steps`` caps the total)."""
    settings, dist_ctx = job.settings, job.dist
    steps_per_epoch = (
        dist_ctx.steps_per_epoch(n_train, settings.batch_size)
        if dist_ctx.enabled
        else math.ceil(n_train / settings.batch_size)
    )
    total_steps = steps_per_epoch * settings.epochs
    if settings.max_steps:
        total_steps = min(total_steps, settings.max_steps)
    return steps_per_epoch, total_steps


def short_run_track(track: TrackSettings, total_steps: int) -> TrackSettings:
    """``track`` with ``covariance_stride`` lowered so that a run of ``total_steps`` batches takes
    K-FAC statistics from at least :data:`MIN_COVARIANCE_BATCHES` of
    them (never raised; the same on a resume, since the length is). The manifest's ``tracking``
    section records the stride used, its ``config`` the one asked for."""
    stride = min(track.covariance_stride, short_run_stride(total_steps))
    if stride == track.covariance_stride or not track.covariance:
        return track
    log.info(
        "K-FAC statistics from one batch in %d instead of one in %d: the run has %d steps, "
        "and at least %d of them give statistics",
        stride,
        track.covariance_stride,
        total_steps,
        MIN_COVARIANCE_BATCHES,
    )
    return dataclasses.replace(track, covariance_stride=stride)


def training_targets(prep: Prepared) -> list:
    """Each training example's target token ids (its loss-masked ids): the same on every rank
    and on a resume, so the LM head's vocabulary rows are rebuilt identically."""
    return [e.ids[e.loss_mask.astype(bool)] for e in prep.encoded[: prep.n_train]]


def _check_projections(tracker: Tracker) -> None:
    """A resumed run's rebuilt projections must be the ones its store recorded with."""
    import numpy as np

    f = tracker.writer._f
    for i, layer in enumerate(tracker.layers):
        g = f[f"{C.G_LAYERS}/{i:03d}"]
        for name, p in ((C.L_P_IN, layer.P_in), (C.L_P_OUT, layer.P_out)):
            if p is not None and (name not in g or not np.array_equal(g[name][()], p.numpy())):
                raise RunError(
                    f"layer {layer.name}: the store's {name} differs from the rebuilt projection; "
                    "this run cannot be resumed exactly"
                )
