"""``traceprop train --resume RUN``: reopen a stopped run at its last checkpoint.

What may be resumed: a run that was killed (its run.json still says running but its process is
gone), failed or was cancelled, that has a checkpoint (:mod:`.checkpoint`) and was trained by a
single process. Refused with a message: a completed run, a run another process is training (the
run directory's lock), a directory that holds no run, a run without a checkpoint, a DDP/FSDP run
(not supported yet), data files that changed since the run started.

The settings are the run's own (run.json's ``config``); the manifest keeps its run id and gains
a ``resumed`` entry per resume (when, from which step, how many records were kept).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .. import constants as C
from ..errors import ConfigError, RunError
from ..run import library_versions, now
from ..settings import TrackSettings, TrainSettings
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
        known = set(TrackSettings.__dataclass_fields__)
        track = TrackSettings(**{k: v for k, v in track.items() if k in known})
    try:
        return TrainSettings(**{**values, "out": str(run_dir), "track": track})
    except (TypeError, ConfigError) as e:
        raise RunError(
            f"the settings in {run_dir / C.MANIFEST_FILE} cannot be used ({e})"
        ) from None


def open_resume(run_dir: Path) -> Job:
    """Lock ``run_dir``, check that it can be resumed and return its :class:`Job` (holding the
    checkpoint); run.json says running again. The caller runs the job and releases the lock."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "--resume is single-process only: resuming under torchrun (DDP, FSDP) is not "
            "supported yet"
        )
    if not (run_dir / C.MANIFEST_FILE).is_file():
        raise RunError(
            f"{run_dir} is not a Traceprop run (no {C.MANIFEST_FILE}); --resume takes the "
            "directory of a run made by 'traceprop train'"
        )
    lock_fd = lock_run_dir(run_dir)
    try:
        manifest, ckpt = _check_resumable(run_dir)
        settings = settings_from_config(manifest.get("config"), run_dir)
        job = Job(settings, run_dir, distributed.DistContext(), manifest, lock_fd, checkpoint=ckpt)
        job.previous_data = manifest.get("data")
        _mark_resumed(job, ckpt)
        _truncate_progress(run_dir, ckpt.step)
        job.write_run_json()
    except BaseException:
        os.close(lock_fd)
        raise
    return job


def _check_resumable(run_dir: Path) -> tuple[dict, checkpoint.Checkpoint]:
    path = run_dir / C.MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"cannot read {path} ({e}); the run cannot be resumed") from None
    if not isinstance(manifest, dict):
        raise RunError(f"{path} is not a run manifest; the run cannot be resumed")
    status = manifest.get("status")
    if status == C.STATUS_COMPLETED:
        raise RunError(f"{run_dir} holds a completed run: there is nothing to resume")
    # on this host the lock we hold says no process trains it; another host's run may still be
    # alive (a lock on a network filesystem proves nothing there)
    host = manifest.get("host")
    if status == C.STATUS_RUNNING and host and host != platform.node():
        raise RunError(
            f"{run_dir} says it is being trained on {host} (process {manifest.get('pid')}); "
            "resume it there once that process has ended"
        )
    if manifest.get("distributed"):
        raise RunError(
            f"{run_dir} was trained by several processes (torchrun); resuming DDP/FSDP runs "
            "is not supported yet: train it again"
        )
    ckpt = checkpoint.load(run_dir)
    if ckpt is None:
        every = (manifest.get("config") or {}).get("checkpoint_every")
        raise RunError(
            f"{run_dir} has no checkpoint to resume from (checkpoint_every={every}; it stopped "
            "before its first checkpoint, or checkpoints were off): train it again with "
            "--overwrite"
        )
    if manifest.get("tracked", True) and (manifest.get("config") or {}).get("track"):
        store = run_dir / C.STORE_FILE
        if ckpt.n_records is None or not store.is_file():
            raise RunError(f"{run_dir}: the checkpoint or {C.STORE_FILE} is missing the records")
    return manifest, ckpt


def _mark_resumed(job: Job, ckpt: checkpoint.Checkpoint) -> None:
    m = job.manifest
    m.setdefault("resumed", []).append(
        {
            "time": now(),
            "from_step": ckpt.step,
            "n_records_kept": ckpt.n_records,
            # a run still marked running here was killed (its process is gone)
            "previous_status": "killed" if m.get("status") == C.STATUS_RUNNING else m.get("status"),
            "previous_error": m.get("error") or m.get("cancel_reason"),
        }
    )
    for key in ("error", "cancel_reason", "metrics", "timings"):
        m.pop(key, None)
    m["model"] = {
        k: v for k, v in (m.get("model") or {}).items() if k not in ("fingerprint", "saved")
    }
    m.update(
        status=C.STATUS_RUNNING,
        updated=now(),
        pid=os.getpid(),
        host=platform.node(),
        versions=library_versions(),
    )


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
    before, now_ = job.previous_data or {}, job.manifest.get("data") or {}
    for key in ("files", "eval_files"):
        if before.get(key) is not None and before.get(key) != now_.get(key):
            changed = sorted(
                k
                for k in set(before[key]) | set(now_.get(key) or {})
                if before[key].get(k) != (now_.get(key) or {}).get(k)
            )
            job.manifest["data"] = before  # run.json keeps what the run was trained on
            raise RunError(
                f"the data changed since this run began ({', '.join(changed[:5])}): a resumed "
                "run must train on the same files; train a new run instead"
            )
