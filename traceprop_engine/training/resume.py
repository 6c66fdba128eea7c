"""``traceprop train --resume RUN``: reopen a stopped run at its last checkpoint.

What may be resumed: a run that was killed (its run.json still says running but its process is
gone), failed or was cancelled, and has a checkpoint (:mod:`.checkpoint`). A single-process run
is resumed by one process; a DDP run by the same number of processes it was trained by, launched
the same way (``torchrun --nproc-per-node N -m traceprop_engine train --resume RUN``): every rank
restores the checkpoint (its own RNG and K-FAC state) and appends to its own store shard, cut to
the record count the checkpoint holds for that rank. Refused with a message: a completed run, a
run another process is training (the run directory's lock), a directory that holds no run, a run
without a checkpoint, another number of processes than the run's, a missing store shard or one
shorter than its checkpoint count, an FSDP run (not supported yet), data files that changed
since the run started.

The settings are the run's own (run.json's ``config``); the manifest keeps its run id and gains
a ``resumed`` entry per resume (when, from which step, how many records were kept).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import h5py

from .. import constants as C
from ..errors import ConfigError, RunError
from ..run import RunManifest
from ..run_record import RunRecord
from ..settings import TrackSettings, TrainSettings
from ..store.torn_tail import flushed_records
from . import checkpoint, distributed
from .prepare import Job
from .run_dir import lock_run_dir


def settings_from_config(config: dict, run_dir: Path) -> TrainSettings:
    """The :class:`TrainSettings` a run's manifest recorded (``out`` = where the run is now)."""
    if not isinstance(config, dict) or "data" not in config:
        raise RunError(f"{run_dir / C.MANIFEST_FILE} holds no training settings to resume with")
    names = set(TrainSettings.__dataclass_fields__)
    values = {k: v for k, v in config.items() if k in names}
    track = values.pop("track", None)
    if isinstance(track, dict):
        track = TrackSettings.from_dict(track)
    try:
        return TrainSettings(**{**values, "out": str(run_dir), "track": track})
    except (TypeError, ConfigError) as e:
        raise RunError(
            f"the settings in {run_dir / C.MANIFEST_FILE} cannot be used ({e})"
        ) from None


def resume_settings(run_dir: Path) -> TrainSettings:
    """The settings to resume ``run_dir`` with, read before any process group or lock exists;
    refuses a launch whose process count differs from the run's (and FSDP runs)."""
    path = run_dir / C.MANIFEST_FILE
    if not path.is_file():
        raise RunError(
            f"{run_dir} is not a Traceprop run (no {C.MANIFEST_FILE}); --resume takes the "
            "directory of a run made by 'traceprop train'"
        )
    try:
        manifest = RunManifest.load(run_dir, as_written=True)
    except RunError as e:
        raise RunError(f"{e}; the run cannot be resumed") from None
    settings = settings_from_config(manifest.raw.get("config"), run_dir)
    _check_world(run_dir, manifest, distributed.env_world_size())
    return settings


def _check_world(run_dir: Path, manifest: RunManifest, world: int) -> None:
    dist_info = manifest.distributed
    recorded = int(dist_info.get("world_size", 1))
    if recorded > 1 and dist_info.get("parallel") == "fsdp":
        raise RunError(
            f"{run_dir} was trained with --parallel fsdp: resuming FSDP runs is not supported yet "
            "(their model and optimizer states are sharded, so they write no checkpoint); "
            "train it again"
        )
    if recorded == world:
        return
    if recorded == 1:
        raise RunError(
            f"{run_dir} was trained by one process, this launch has {world} (torchrun): resume "
            "it with 'traceprop train --resume RUN', without torchrun"
        )
    raise RunError(
        f"{run_dir} was trained by {recorded} processes (DDP) and must be resumed by as many "
        f"(this launch has {world}): torchrun --nproc-per-node {recorded} -m traceprop_engine "
        "train --resume RUN"
    )


def open_resume(
    run_dir: Path, settings: TrainSettings, dist_ctx: distributed.DistContext | None = None
) -> Job:
    """Lock ``run_dir``, check that it can be resumed and return its :class:`Job` (holding the
    checkpoint); run.json says running again. The caller runs the job and releases the lock.

    Under DDP (``dist_ctx`` with several ranks, process group joined) rank 0 locks and checks
    (the checkpoint, every rank's store shard) and marks the run; the others get its verdict and
    manifest, so every rank raises the same error or goes on with the same run.json.
    """
    dist_ctx = dist_ctx or distributed.DistContext()
    lock_fd, manifest, error = None, None, None
    if dist_ctx.is_main:
        try:
            lock_fd = lock_run_dir(run_dir)
            record, ckpt = _check_resumable(run_dir, dist_ctx.world_size)
            record.resumed(ckpt.step, _kept(ckpt))
            _truncate_progress(run_dir, ckpt.step)
            record.save()
            manifest = record.as_dict()
        except BaseException as e:
            error = e
            if lock_fd is not None:
                os.close(lock_fd)
    if dist_ctx.enabled:
        import torch.distributed as dist

        box = [None if error is None else str(error), manifest]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            error = RunError(box[0])
        manifest = box[1]
    if error is not None:
        dist_ctx.close()
        raise error
    ckpt = checkpoint.load(run_dir)  # rank 0 checked it; nothing writes it until the first step
    if ckpt is None:  # removed between rank 0's check and here: not by Traceprop
        raise RunError(f"{run_dir}: the checkpoint disappeared while resuming")
    record = RunRecord(run_dir, manifest)
    job = Job(settings, run_dir, dist_ctx, record, lock_fd, checkpoint=ckpt)
    job.previous_data = record.manifest.raw.get("data")
    return job


def _check_resumable(run_dir: Path, world: int) -> tuple[RunRecord, checkpoint.Checkpoint]:
    """The run's record (as written: a killed run still says running) and its checkpoint."""
    try:
        record = RunRecord.reopen(run_dir)
    except RunError as e:
        raise RunError(f"{e}; the run cannot be resumed") from None
    manifest = record.manifest
    status = manifest.status
    if status == C.STATUS_COMPLETED:
        raise RunError(f"{run_dir} holds a completed run: there is nothing to resume")
    # on this host the lock we hold says no process trains it; another host's run may still be
    # alive (a lock on a network filesystem proves nothing there)
    host = manifest.host
    if status == C.STATUS_RUNNING and host and host != platform.node():
        raise RunError(
            f"{run_dir} says it is being trained on {host} (process {manifest.pid}); "
            "resume it there once that process has ended"
        )
    _check_world(run_dir, manifest, world)  # again, under the lock
    ckpt = checkpoint.load(run_dir)
    if ckpt is None:
        every = manifest.config.get("checkpoint_every")
        raise RunError(
            f"{run_dir} has no checkpoint to resume from (checkpoint_every={every}; it stopped "
            "before its first checkpoint, or checkpoints were off): train it again with "
            "--overwrite"
        )
    if ckpt.world_size != world:
        raise RunError(
            f"{ckpt.folder} was written by {ckpt.world_size} process(es), the run has {world}: "
            "it is not this run's checkpoint"
        )
    if manifest.tracked and manifest.config.get("track"):
        if world > 1:
            check_shards(run_dir, manifest, ckpt)
        else:
            store = run_dir / C.STORE_FILE
            if ckpt.n_records is None or not store.is_file():
                raise RunError(
                    f"{run_dir}: the checkpoint or {C.STORE_FILE} is missing the records"
                )
    return record, ckpt


def check_shards(run_dir: Path, manifest: RunManifest, ckpt: checkpoint.Checkpoint) -> None:
    """Every rank's store shard is there and holds at least the records its checkpoint counts."""
    ranks = ckpt.meta.get("ranks") or []
    shards = manifest.shards or [distributed.shard_file(r) for r in range(len(ranks))]
    if len(ranks) != len(shards):
        raise RunError(
            f"{run_dir}: the checkpoint has {len(ranks)} ranks, run.json lists {len(shards)} "
            "store shards; the run cannot be resumed"
        )
    for r, (name, mine) in enumerate(zip(shards, ranks, strict=True)):
        path = run_dir / name
        if path.is_symlink() or not path.is_file():
            raise RunError(
                f"{run_dir}: the store shard {name} of rank {r} is missing; every rank appends to "
                "its own shard, so the run cannot be resumed"
            )
        try:
            with h5py.File(path, "r", locking=False) as f:
                # what every record dataset holds (a kill mid-flush: store/torn_tail.py)
                have, why = flushed_records(f, int(f.attrs.get("n_records", 0)))
        except (OSError, ValueError, KeyError) as e:
            raise RunError(f"cannot read the store shard {path} ({e})") from None
        need = mine.get("n_records")
        if need is None or have < int(need):
            raise RunError(
                f"{path} holds {max(have, 0)} complete records"
                + (f" ({why})" if why else "")
                + f", the checkpoint counts {need} for rank {r}: the shard lost records the "
                "checkpoint relies on; the run cannot be resumed"
            )


def _kept(ckpt: checkpoint.Checkpoint) -> int | None:
    """The records the checkpoint keeps (summed over the shards of a DDP run)."""
    ranks = ckpt.meta.get("ranks")
    if ranks is None or any(r.get("n_records") is None for r in ranks):
        return ckpt.n_records
    return int(sum(int(r["n_records"]) for r in ranks))


def _truncate_progress(run_dir: Path, step: int) -> None:
    """Keep progress.jsonl's lines up to the checkpoint's step: the resumed steps follow them."""
    p = run_dir / C.PROGRESS_FILE
    if not p.is_file() or p.is_symlink():
        return
    keep = []
    for line in p.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a half-written last line of the killed run
    tmp = p.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, p)


def check_same_data(job: Job) -> None:
    """Refuse to resume on data files that changed since the run began (the records would mix
    two data sets)."""
    before, now_ = job.previous_data or {}, job.record.manifest.raw.get("data") or {}
    for key in ("files", "eval_files"):
        if before.get(key) is not None and before.get(key) != now_.get(key):
            changed = sorted(
                k
                for k in set(before[key]) | set(now_.get(key) or {})
                if before[key].get(k) != (now_.get(key) or {}).get(k)
            )
            job.record.restore_data(before)  # run.json keeps what the run was trained on
            raise RunError(
                f"the data changed since this run began ({', '.join(changed[:5])}): a resumed "
                "run must train on the same files; train a new run instead"
            )
