"""The fine-tune loop behind ``traceprop train``: data -> model -> tracked steps -> run directory.

A plain PyTorch loop (AdamW, linear decay) whose every micro-batch runs inside
:meth:`Tracker.step`, so the store holds one record per example per epoch. SIGTERM or Ctrl-C
stop the loop at the next step boundary: the records so far, the covariance and the model are
saved and the status says ``cancelled``. Any error marks the run ``failed`` (the store stays
readable) and is re-raised.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import platform
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import constants as C
from ..capture.tracker import Tracker
from ..errors import ConfigError, RunError, TracepropError
from ..run import library_versions, new_run_id, now, read_manifest, write_manifest
from ..settings import TrainSettings
from . import distributed, fsdp
from .data import Example, hash_files, load_examples, split_eval
from .losses import example_losses
from .models import (
    apply_lora,
    build_model,
    collate,
    count_parameters,
    encode_example,
    model_inputs,
    save_model,
)

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


LOCK_FILE = ".traceprop.lock"  # flock'ed by the training process for the whole run
_MODEL_TMP = ".model.tmp"  # the final model is saved here, then renamed to model/
# what a run directory holds (a folder with any of these looks like a run)
_RUN_ENTRIES = (
    C.MANIFEST_FILE,
    C.STORE_FILE,
    C.PROGRESS_FILE,
    C.MODEL_DIR,
    C.INDEX_DIR,
    C.MANIFEST_FILE + ".tmp",
    C.STORE_FILE + ".tmp",
    _MODEL_TMP,
)


def _lock_run_dir(run_dir: Path) -> int:
    """Create ``run_dir`` and take its exclusive lock (held until the returned fd is closed)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--out {run_dir} is a file, not a directory; choose a directory path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted as the lock file is refused, not written through
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise RunError(
            f"cannot create the run directory {run_dir} ({e.strerror or e}); choose an --out "
            "you can write to"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RunError(
            f"{run_dir} is in use by another 'traceprop train' (it holds {LOCK_FILE}); wait for "
            "it to finish or choose another --out"
        ) from None
    return fd


def _prepare_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that looks like a run unless ``overwrite``; then empty it of run files.

    Never deletes or writes through a symbolic link (a link among the run's files is refused).
    Called with the run directory's lock held.
    """
    shards = sorted(run_dir.glob(distributed.shard_file(0).replace("0", "*")))
    found = [
        run_dir / n for n in _RUN_ENTRIES if (run_dir / n).exists() or (run_dir / n).is_symlink()
    ] + shards
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found)
        raise RunError(
            f"{run_dir} already holds a run (or what is left of one: {names}); choose another "
            "--out or pass --overwrite"
        )
    links = [p for p in found if p.is_symlink()]
    if links:
        raise RunError(
            f"{links[0]} is a symbolic link: Traceprop never deletes or writes through a link "
            "in a run directory; remove it yourself or choose another --out"
        )
    try:
        status = read_manifest(run_dir).get("status")
    except RunError:
        status = None  # no or unreadable run.json: nothing says it is running
    if status == C.STATUS_RUNNING:
        raise RunError(f"{run_dir} holds a run that is still running; cancel it first")
    try:
        for p in found:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    except OSError as e:
        raise RunError(f"cannot clear the old run in {run_dir} ({e}); remove it yourself") from None


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
    lock_fd = None
    try:
        if dist_ctx.is_main:
            # the lock comes before anything is written: a second train into the same --out
            # stops here and touches nothing
            lock_fd = _lock_run_dir(run_dir)
            try:
                _prepare_dir(run_dir, overwrite)
            except BaseException:
                os.close(lock_fd)
                raise
    finally:
        dist_ctx.barrier()  # the other ranks write their shards into the prepared directory
    stop = stop or StopFlag()
    manifest = {
        "run_id": new_run_id(),
        "status": C.STATUS_RUNNING,
        "created": now(),
        "updated": now(),
        "pid": os.getpid(),
        "host": platform.node(),
        "config": settings.to_dict(),
        "tracked": settings.track is not None,
        "versions": library_versions(),
        "loss_definition": C.LOSS_DEFINITION,
    }
    if dist_ctx.enabled:
        manifest["distributed"] = {"world_size": dist_ctx.world_size, "backend": dist_ctx.backend}
        if dist_ctx.fsdp:
            manifest["distributed"]["parallel"] = "fsdp"
        if settings.track is not None:
            manifest["shards"] = dist_ctx.shard_files

    def write_run_json() -> None:
        if dist_ctx.is_main:
            write_manifest(run_dir, manifest)

    try:
        write_run_json()
    except BaseException as e:
        if lock_fd is not None:
            os.close(lock_fd)
        if isinstance(e, OSError):
            raise RunError(f"cannot write {run_dir / C.MANIFEST_FILE} ({e})") from None
        raise
    progress_path = run_dir / C.PROGRESS_FILE
    tracker: Tracker | None = None
    status = C.STATUS_FAILED
    loaded = None
    try:
        with (
            _Signals(stop),
            open(
                progress_path if dist_ctx.is_main else os.devnull, "a", buffering=1
            ) as progress_file,
        ):
            # -- data -----------------------------------------------------------------------
            task = settings.task.value
            examples, data_root = load_examples(settings.data, task=task)
            if settings.eval_data:
                train_ex = examples
                eval_ex, eval_root = load_examples(settings.eval_data, task=task)
            else:
                train_ex, eval_ex = split_eval(examples, settings.eval_fraction, settings.seed)
                eval_root = data_root
            eval_root = Path(eval_root)
            manifest["data"] = {
                "root": str(Path(data_root).resolve()),
                "root_relative": os.path.relpath(Path(data_root).resolve(), run_dir.resolve()),
                "eval_root_relative": os.path.relpath(eval_root.resolve(), run_dir.resolve()),
                "files": hash_files(Path(data_root), sorted({e.source for e in train_ex})),
                "eval_root": str(Path(eval_root).resolve()),
                "eval_files": hash_files(Path(eval_root), sorted({e.source for e in eval_ex})),
                "n_train": len(train_ex),
                "n_eval": len(eval_ex),
            }
            labels = (
                sorted({e.label for e in train_ex + eval_ex}) if task == "classification" else None
            )
            if labels is not None and len(labels) < 2:
                raise ConfigError(
                    f"classification needs at least two labels; the data has {labels}"
                )
            # -- model ----------------------------------------------------------------------
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
                if dist_ctx.fsdp:
                    raise ConfigError("--parallel fsdp with --lora-rank is not supported yet")
                apply_lora(loaded, settings.lora_rank, settings.lora_targets)
            if settings.threads > 0:
                torch.set_num_threads(settings.threads)
            device = dist_device
            model = loaded.model.to(device)
            dist_ctx.check_same(
                "the tokenizer", json.dumps(loaded.tokenizer.get_vocab(), sort_keys=True)
            )
            model.train()
            label_ids = {lab: i for i, lab in enumerate(labels)} if labels else None
            all_ex = train_ex + eval_ex
            encoded = [
                encode_example(e, loaded.tokenizer, task, settings.max_length, label_ids)
                for e in all_ex
            ]
            n_trunc = sum(e.truncated for e in encoded)
            if n_trunc:
                note = (
                    f"{n_trunc} of {len(encoded)} examples were longer than --max-length "
                    f"{settings.max_length} tokens and were truncated"
                )
                log.warning("%s", note)
                manifest.setdefault("notes", []).append(note)
            total, trainable = count_parameters(model)
            manifest["model"] = {
                "source": loaded.source,
                "task": task,
                "parameters": total,
                "trainable": trainable,
                "lora_rank": settings.lora_rank,
                "labels": labels,
            }
            # -- tracker --------------------------------------------------------------------
            if settings.track is not None:
                # hooks on the underlying module (not the DDP wrapper): the same layer names
                tracker = Tracker(
                    model, run_dir / dist_ctx.store_file, settings.track, manifest=manifest
                )
                if dist_ctx.is_main:  # the example table lives in shard 0 only
                    tracker.write_examples(
                        _example_table(
                            all_ex, [C.SPLIT_TRAIN] * len(train_ex) + [C.SPLIT_EVAL] * len(eval_ex)
                        ),
                        [e.ids for e in encoded],
                        [e.loss_mask for e in encoded],
                    )
                tracker.capture.attach()
                manifest["tracking"] = tracker.tracking_manifest()
            write_run_json()
            # DDP when WORLD_SIZE > 1, else the model itself; FSDP shards `model` in place (the
            # hooks' Linear modules stay, their weights become DTensor shards between steps)
            forward = dist_ctx.wrap(model, device)
            # -- loop -----------------------------------------------------------------------
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
            n_train = len(train_ex)
            steps_per_epoch = (
                dist_ctx.steps_per_epoch(n_train, settings.batch_size)
                if dist_ctx.enabled
                else math.ceil(n_train / settings.batch_size)
            )
            total_steps = steps_per_epoch * settings.epochs
            if settings.max_steps:
                total_steps = min(total_steps, settings.max_steps)

            def lr_at(step: int) -> float:
                if settings.warmup_steps and step < settings.warmup_steps:
                    return settings.lr * (step + 1) / settings.warmup_steps
                return settings.lr * max(0.1, 1 - step / max(1, total_steps))

            rng = np.random.default_rng(settings.seed)
            pad_id = loaded.tokenizer.pad_token_id
            step_ms: list[float] = []
            t_start = time.perf_counter()
            step = 0
            last_loss = float("nan")
            bar = _progress_bar(total_steps, disable=not dist_ctx.is_main)
            try:
                for epoch in range(settings.epochs):
                    order = rng.permutation(n_train)
                    for s in range(steps_per_epoch):
                        if dist_ctx.any_true(stop.requested) and not stop.requested:
                            stop.requested, stop.reason = True, "another rank stopped"
                        if stop.requested or step >= total_steps:
                            break
                        if dist_ctx.enabled:
                            idx, global_b = dist_ctx.local_batch(order, s, settings.batch_size)
                        else:
                            idx = order[s * settings.batch_size : (s + 1) * settings.batch_size]
                        batch = collate(
                            [encoded[i] for i in (idx if len(idx) else order[:1])],
                            pad_id,
                            task,
                            device,
                        )
                        lr = lr_at(step)
                        for g in opt.param_groups:
                            g["lr"] = lr
                        t0 = time.perf_counter()
                        if dist_ctx.enabled and not len(idx):
                            # no example left for this rank in the last global batch: a zero-weight
                            # step on a stand-in keeps DDP's collectives in step (nothing recorded)
                            losses = example_losses(forward(**model_inputs(batch)), batch, task)
                            (losses.sum() * 0.0).backward()
                        elif dist_ctx.enabled:
                            # DDP averages over ranks: Σ_local ℓ_i · W / B_global averages to the
                            # global mean; the hooks see the local gradient, so scale B_global / W
                            w = dist_ctx.world_size / global_b
                            with contextlib.ExitStack() as cm:
                                rec = (
                                    cm.enter_context(
                                        tracker.step(
                                            idx,
                                            padding_mask=batch["attention_mask"],
                                            loss_scale=1.0 / w,
                                            step=step,
                                            epoch=epoch,
                                            lr=lr,
                                        )
                                    )
                                    if tracker is not None
                                    else None
                                )
                                losses = example_losses(forward(**model_inputs(batch)), batch, task)
                                (losses.sum() * w).backward()
                                if rec is not None:
                                    rec.losses = losses
                        elif tracker is not None:
                            with tracker.step(
                                idx,
                                padding_mask=batch["attention_mask"],
                                step=step,
                                epoch=epoch,
                                lr=lr,
                            ) as rec:
                                losses = example_losses(model(**model_inputs(batch)), batch, task)
                                losses.mean().backward()
                                rec.losses = losses
                        else:
                            losses = example_losses(model(**model_inputs(batch)), batch, task)
                            losses.mean().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        step_ms.append((time.perf_counter() - t0) * 1e3)
                        step += 1
                        if device.type == "cpu" or step % 10 == 0 or step >= total_steps:
                            # on an accelerator the loss is read back every 10 steps only, so
                            # the loop does not synchronise with the device on every step
                            last_loss = float(losses.detach().mean())
                            _check_finite(last_loss, step, lr)
                        elapsed = time.perf_counter() - t_start
                        line = {
                            "step": step,
                            "total": total_steps,
                            "epoch": epoch,
                            "loss": round(last_loss, 5),
                            "lr": lr,
                            "examples_per_s": round(
                                step * settings.batch_size * dist_ctx.world_size / elapsed, 2
                            ),
                            "elapsed_s": round(elapsed, 2),
                            "eta_s": round(elapsed / step * (total_steps - step), 1),
                            "time": now(),
                        }
                        progress_file.write(json.dumps(line) + "\n")
                        bar.update(1)
                        bar.set_postfix(loss=f"{last_loss:.4f}", epoch=epoch)
                        if on_progress is not None:
                            on_progress(line)
                    if stop.requested or step >= total_steps:
                        break
            finally:
                bar.close()
            if step:
                _check_finite(float(losses.detach().mean()), step, lr)
            status = C.STATUS_CANCELLED if stop.requested else C.STATUS_COMPLETED
            manifest["timings"] = {
                "n_steps": step,
                "total_s": round(time.perf_counter() - t_start, 3),
                "median_step_ms": float(np.median(step_ms)) if step_ms else None,
            }
            if stop.requested:
                manifest["cancel_reason"] = stop.reason
            # a sharded model's forward and state dict are collectives: every rank takes part
            eval_loss = (
                _eval_loss(model, encoded[n_train:], pad_id, task, device, settings.batch_size)
                if dist_ctx.is_main or dist_ctx.fsdp
                else None
            )
            full_state = fsdp.full_state_dict(model) if dist_ctx.fsdp else None
            if dist_ctx.is_main:
                manifest["metrics"] = {"last_train_loss": last_loss, "eval_loss": eval_loss}
                model.eval()
                info = _save_model_atomically(loaded, run_dir, full_state)
                manifest["model"]["fingerprint"] = info["fingerprint"]
                manifest["model"]["saved"] = C.MODEL_DIR
    except KeyboardInterrupt:
        status = C.STATUS_CANCELLED
        manifest["cancel_reason"] = "KeyboardInterrupt"
        raise
    except BaseException as e:
        status = C.STATUS_FAILED
        full = _disk_full(e)
        if full is not None:
            manifest["error"] = f"disk full: {full}"
            raise RunError(
                f"the disk is full: writing {run_dir} failed ({full}); free some space (or choose "
                "an --out on another disk) and re-run; the run is marked failed"
            ) from None
        manifest["error"] = f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and not isinstance(e, TracepropError):
            raise RunError(f"reading or writing the run {run_dir} failed: {e}") from e
        raise
    finally:
        if tracker is not None:
            try:
                tracker.writer.set_attrs(manifest=manifest)
                tracker.close(status)
                manifest["store"] = {"file": dist_ctx.store_file, "n_records": tracker.n_records}
            except Exception as e:  # never hide the original error behind a store error
                log.error("closing the store failed: %s", e)
                manifest.setdefault("error", f"closing the store failed: {e}")
                status = C.STATUS_FAILED
        if dist_ctx.enabled and status != C.STATUS_FAILED:
            # every shard is closed before rank 0 marks the run finished (a failed rank is torn
            # down by the launcher, so no collective is attempted on that path)
            counts: list = [None] * dist_ctx.world_size
            import torch.distributed as tdist

            tdist.all_gather_object(counts, tracker.n_records if tracker is not None else 0)
            if tracker is not None:
                manifest["store"] = {
                    "file": None,
                    "shards": dist_ctx.shard_files,
                    "n_records": int(sum(counts)),
                    "n_records_per_shard": counts,
                }
        manifest["status"] = status
        manifest["updated"] = now()
        manifest["pid"] = None
        try:
            write_run_json()
        except OSError as e:  # e.g. the disk is still full: the original error matters more
            log.error("could not write %s: %s", run_dir / C.MANIFEST_FILE, e)
        if lock_fd is not None:
            os.close(lock_fd)  # releases the lock
        if dist_ctx.enabled and status != C.STATUS_FAILED:
            dist_ctx.barrier()  # no rank returns before run.json says how the run ended
        dist_ctx.close()
    return run_dir


def _check_finite(loss: float, step: int, lr: float) -> None:
    if not math.isfinite(loss):
        raise RunError(
            f"the training loss became {loss} at step {step} (learning rate {lr:g}): the run "
            "diverged and was stopped; lower --lr (or check the data) and train again"
        )


def _disk_full(e: BaseException) -> OSError | None:
    """The ENOSPC error in ``e`` or its causes (the store writer wraps it), else None."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _save_model_atomically(loaded, run_dir: Path, state_dict: dict | None = None) -> dict:
    """Save to RUN/.model.tmp, then rename to RUN/model: an interrupted save leaves no model/."""
    tmp, final = run_dir / _MODEL_TMP, run_dir / C.MODEL_DIR
    for p in (tmp, final):
        if p.is_symlink():
            raise RunError(f"{p} is a symbolic link; Traceprop does not write through links")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = save_model(loaded, tmp, state_dict=state_dict)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


@torch.no_grad()
def _eval_loss(model, encoded, pad_id, task, device, batch_size) -> float | None:
    if not encoded:
        return None
    total = 0.0
    for i in range(0, len(encoded), batch_size):
        batch = collate(encoded[i : i + batch_size], pad_id, task, device)
        total += float(example_losses(model(**model_inputs(batch)), batch, task).sum())
    return total / len(encoded)


def _progress_bar(total: int, disable: bool = False):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc="train", unit="step", dynamic_ncols=True, leave=True, disable=disable
    )
