"""The fine-tune loop behind ``traceprop train``: data -> model -> tracked steps -> run directory.

A plain PyTorch loop (AdamW, linear decay) whose every micro-batch runs inside
:meth:`Tracker.step`, so the store holds one record per example per epoch. SIGTERM or Ctrl-C
stop the loop at the next step boundary: the records so far, the covariance and the model are
saved and the status says ``cancelled``. Any error marks the run ``failed`` (the store stays
readable) and is re-raised.

:func:`train` runs the named steps in order: open the run directory (:mod:`.run_dir`), write
``run.json``, load the data, build the model and start the tracker (:mod:`.prepare`), run the
epoch/step loop (:mod:`.steps`), save the model and metrics, and close the run (store, final
``run.json``, lock).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import constants as C
from ..errors import ConfigError, RunError, TracepropError
from ..run_record import RunRecord
from ..settings import TrainSettings
from . import checkpoint, distributed, fsdp
from .prepare import Job, Prepared, load_data, prepare_model, start_tracker
from .resume import check_same_data, open_resume, resume_settings
from .run_dir import disk_full, lock_run_dir, prepare_dir, save_model_atomically
from .steps import eval_loss, train_steps

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict], None]


@dataclass
class StopFlag:
    """Set by a signal handler (or a caller) to stop at the next step boundary."""

    requested: bool = False
    reason: str = ""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(
            f"device {name!r} is not a torch device (use auto, cpu, cuda, cuda:1...)"
        ) from e
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (device.index is not None and device.index >= n):
            raise ConfigError(
                f"--device {name}: this machine has {n} usable CUDA device(s) (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device auto or cpu"
            )
    return device


class _Signals:
    """SIGTERM / SIGINT -> stop flag (a second Ctrl-C interrupts at once). Main thread only."""

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.flag.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag.requested = True
        self.flag.reason = signal.Signals(signum).name
        log.warning("%s received: stopping after the current step", self.flag.reason)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(
    settings: TrainSettings,
    *,
    overwrite: bool = False,
    on_progress: ProgressFn | None = None,
    stop: StopFlag | None = None,
) -> Path:
    """Run a (tracked) fine-tune and write the run directory ``settings.out``.

    Returns:
        The run directory.

    Raises:
        DataError, ConfigError, RunError: bad input (the run is marked failed when it got that far).
    """
    run_dir = Path(settings.out)
    # WORLD_SIZE > 1 (torchrun): join the process group; rank 0 owns the run directory
    dist_ctx, dist_device = distributed.setup(resolve_device(settings.device), settings.parallel)
    lock_fd = _open_run_dir(run_dir, overwrite, dist_ctx)
    job = Job(
        settings, run_dir, dist_ctx, RunRecord.new_training(run_dir, settings, dist_ctx), lock_fd
    )
    return _run(job, dist_device, on_progress, stop)


def resume(
    run_dir: str | os.PathLike,
    *,
    on_progress: ProgressFn | None = None,
    stop: StopFlag | None = None,
) -> Path:
    """Continue a killed, failed or cancelled run from its last checkpoint (``train --resume``).

    The run's own settings (run.json) are used; its store keeps the checkpoint's records and
    gets the rest appended, so the finished run equals one that was never interrupted. A DDP run
    is resumed under torchrun with as many processes as it was trained by (every rank calls this).

    Raises:
        RunError: the run cannot be resumed (completed, in use, no checkpoint, another number
            of processes, a missing or short store shard, FSDP, its data changed).
    """
    run_dir = Path(run_dir)
    settings = resume_settings(run_dir)
    dist_ctx, device = distributed.setup(resolve_device(settings.device), settings.parallel)
    job = open_resume(run_dir, settings, dist_ctx)
    return _run(job, device, on_progress, stop)


# long: the run's lifecycle: every exit path marks run.json (cancelled, failed, disk full) once
def _run(job: Job, device: torch.device, on_progress: ProgressFn | None, stop: StopFlag | None):
    """Train ``job`` (a new or a resumed run) and close it; returns the run directory."""
    run_dir, dist_ctx = job.run_dir, job.dist
    stop = stop or StopFlag()
    try:
        job.write_run_json()
    except BaseException as e:
        if job.lock_fd is not None:
            os.close(job.lock_fd)
        if isinstance(e, OSError):
            raise RunError(f"cannot write {run_dir / C.MANIFEST_FILE} ({e})") from None
        raise
    progress_path = run_dir / C.PROGRESS_FILE
    status = C.STATUS_FAILED
    try:
        with (
            _Signals(stop),
            open(
                progress_path if dist_ctx.is_main else os.devnull, "a", buffering=1
            ) as progress_file,
        ):
            data = load_data(job)
            if job.checkpoint is not None:
                check_same_data(job)
            prep = prepare_model(job, *data, device)
            start_tracker(job, prep)
            job.write_run_json()
            last_loss = train_steps(job, prep, stop, progress_file, on_progress)
            status = C.STATUS_CANCELLED if stop.requested else C.STATUS_COMPLETED
            if stop.requested:
                job.record.cancelled(stop.reason)
            if job.tracker is not None:  # the last records on disk before the model is saved:
                job.tracker.sync()  # a full disk stops the run here, not after the save
            # a sharded (FSDP) model's forward and state dict are collectives: every rank joins
            if dist_ctx.is_main or dist_ctx.fsdp:
                _save_results(job, prep, last_loss)
    except KeyboardInterrupt:
        status = C.STATUS_CANCELLED
        job.record.cancelled("KeyboardInterrupt")
        raise
    except BaseException as e:
        status = C.STATUS_FAILED
        full = disk_full(e, run_dir)
        if full is not None:
            job.record.failed(f"disk full: {full}")
            raise _failure(run_dir, full) from None
        job.record.failed(f"{type(e).__name__}: {e}")
        if isinstance(e, OSError) and not isinstance(e, TracepropError):
            raise RunError(f"reading or writing the run {run_dir} failed: {e}") from e
        raise
    finally:
        _close_run(job, status)
    return run_dir


def _failure(run_dir: Path, full: BaseException) -> RunError:
    return RunError(
        f"the disk is full: writing {run_dir} failed ({full}); free some space (or choose "
        "an --out on another disk) and re-run; the run is marked failed"
    )


def _open_run_dir(run_dir: Path, overwrite: bool, dist_ctx: distributed.DistContext) -> int | None:
    """Rank 0 locks and clears the run directory; returns the lock's fd (None on other ranks)."""
    lock_fd = None
    try:
        if dist_ctx.is_main:
            # the lock comes before anything is written: a second train into the same --out
            # stops here and touches nothing
            lock_fd = lock_run_dir(run_dir)
            try:
                prepare_dir(run_dir, overwrite)
            except BaseException:
                os.close(lock_fd)
                raise
    finally:
        dist_ctx.barrier()  # the other ranks write their shards into the prepared directory
    return lock_fd


def _save_results(job: Job, prep: Prepared, last_loss: float) -> None:
    """The metrics (last train loss, eval loss) and the model, saved atomically by rank 0. Under
    FSDP every rank calls this: the eval forward and the full-state gather are collectives."""
    loss = eval_loss(
        prep.model,
        prep.encoded[prep.n_train :],
        prep.pad_id,
        prep.task,
        prep.device,
        job.settings.batch_size,
    )
    full_state = fsdp.full_state_dict(prep.model) if job.dist.fsdp else None
    if not job.dist.is_main:
        return
    job.record.set_metrics(last_train_loss=last_loss, eval_loss=loss)
    prep.model.eval()
    info = save_model_atomically(prep.loaded, job.run_dir, full_state)
    job.record.set_model_saved(info["fingerprint"])


def _close_run(job: Job, status: str) -> None:
    """Close the store (every shard), write the final run.json and release the lock.

    Runs on every path out of :func:`train`; a failure here is logged, never raised over the
    error that ended the run.
    """
    record, dist_ctx, tracker = job.record, job.dist, job.tracker
    close_error = None  # raised at the end when nothing else ended the run
    if tracker is not None:
        try:
            tracker.writer.set_attrs(manifest=record.as_dict())
            tracker.close(status)
            record.set_store(dist_ctx.store_file, tracker.n_records)
        except Exception as e:  # never hide the original error behind a store error
            log.error("closing the store failed: %s", e)
            full = disk_full(e, job.run_dir)
            record.failed(
                f"disk full: {full}" if full else f"closing the store failed: {e}", replace=False
            )
            if status == C.STATUS_COMPLETED:
                close_error = (
                    _failure(job.run_dir, full)
                    if full
                    else RunError(
                        f"closing the store of {job.run_dir} failed ({e}); the run is marked failed"
                    )
                )
            record.set_store(dist_ctx.store_file, tracker.writer.n_records)
            status = C.STATUS_FAILED
    if dist_ctx.enabled and status != C.STATUS_FAILED:
        # every shard is closed before rank 0 marks the run finished (a failed rank is torn
        # down by the launcher, so no collective is attempted on that path)
        counts: list = [None] * dist_ctx.world_size
        import torch.distributed as tdist

        tdist.all_gather_object(counts, tracker.n_records if tracker is not None else 0)
        if tracker is not None:
            record.set_store_shards(dist_ctx.shard_files, counts)
    if status == C.STATUS_COMPLETED and dist_ctx.is_main:
        checkpoint.remove(job.run_dir)  # a completed run is not resumed
    record.finished(status)
    try:
        job.write_run_json()
    except OSError as e:  # e.g. the disk is still full: the original error matters more
        log.error("could not write %s: %s", job.run_dir / C.MANIFEST_FILE, e)
    if job.lock_fd is not None:
        os.close(job.lock_fd)  # releases the lock
    if dist_ctx.enabled and status != C.STATUS_FAILED:
        dist_ctx.barrier()  # no rank returns before run.json says how the run ended
    dist_ctx.close()
    if close_error is not None:
        raise close_error
