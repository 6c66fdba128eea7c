"""The epoch/step loop of ``traceprop train``: AdamW steps, each micro-batch inside the tracker.

Every step writes one line to progress.jsonl; a loss that is no longer finite stops the run
(it diverged); a stop request (SIGTERM, Ctrl-C, a caller, another rank) ends it at the next step
boundary.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import RunError
from ..run import now
from ..settings import TrainSettings
from . import checkpoint
from .losses import example_losses
from .models import collate, model_inputs
from .prepare import Job, Prepared, step_counts

if TYPE_CHECKING:
    from .loop import ProgressFn, StopFlag


def _optimizer(job: Job, prep: Prepared) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; an optimizer-aware tracker reads its moments."""
    settings = job.settings
    params = [p for p in prep.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    if job.tracker is not None and settings.track is not None and settings.track.optimizer_aware:
        job.tracker.attach_optimizer(opt)  # its second moments scale the records
    return opt


def _restore(job: Job, prep: Prepared, opt: torch.optim.Optimizer) -> int:
    """The step to start from: 0, or a resumed run's checkpoint step (its states restored)."""
    if job.checkpoint is None:
        return 0
    return checkpoint.restore(
        job.checkpoint, prep.model, opt, job.tracker, prep.device, job.dist.rank
    )


def train_steps(
    job: Job, prep: Prepared, stop: StopFlag, progress_file, on_progress: ProgressFn | None
) -> float:
    """The epoch/step loop; one progress.jsonl line per step. Returns the last loss read back.

    Stops at a step boundary when ``stop`` is set (on any rank) or after ``max_steps``; a loss
    that is not finite fails the run (it diverged). Writes run.json's ``timings``.
    """
    settings, dist_ctx, device = job.settings, job.dist, prep.device
    # DDP when WORLD_SIZE > 1, else the model itself; FSDP shards the model in place (the hooks'
    # Linear modules stay, their weights become DTensor shards between steps)
    forward = dist_ctx.wrap(prep.model, device)
    opt = _optimizer(job, prep)
    steps_per_epoch, total_steps = step_counts(job, prep.n_train)
    rng = np.random.default_rng(settings.seed)  # each epoch's order: drawn again on resume
    step_ms: list[float] = []
    # a resumed run: model, optimiser, capture and RNG states of its checkpoint, then on from there
    start = _restore(job, prep, opt)
    # FSDP's model and optimiser states are sharded: those runs write no checkpoint
    every = 0 if dist_ctx.fsdp else settings.checkpoint_every
    # one process: the checkpoint also holds the model as saved, so a killed run can be queried
    saved = None if dist_ctx.enabled else prep.loaded
    t_start = time.perf_counter()
    step = start
    halted = False  # the loop stopped on every rank together (a stop request)
    last_loss = float("nan")
    bar = _progress_bar(total_steps, disable=not dist_ctx.is_main, initial=start)
    try:
        for epoch in range(settings.epochs):
            order = rng.permutation(prep.n_train)
            for s in range(steps_per_epoch):
                if epoch * steps_per_epoch + s < start:
                    continue  # done before the checkpoint this run resumed from
                # one read of the flag, agreed by all ranks: a signal landing after it must not
                # stop this rank alone (it stops every rank at the next step)
                stopping = dist_ctx.any_true(stop.requested)
                if stopping and not stop.requested:
                    stop.requested, stop.reason = True, "another rank stopped"
                if stopping or step >= total_steps:
                    halted = True
                    break
                idx, global_b, batch = _batch(job, prep, order, s)
                lr = _lr_at(settings, step, total_steps)
                for g in opt.param_groups:
                    g["lr"] = lr
                t0 = time.perf_counter()
                losses = _backward(job, prep, forward, batch, idx, global_b, step, epoch, lr)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step_ms.append((time.perf_counter() - t0) * 1e3)
                step += 1
                if device.type == "cpu" or step % 10 == 0 or step >= total_steps:
                    # on an accelerator the loss is read back every 10 steps only, so
                    # the loop does not synchronise with the device on every step
                    last_loss = float(losses.detach().mean())
                    _check_finite(last_loss, step, lr)
                line = _progress_line(
                    job, (start, step, total_steps), epoch, last_loss, lr, t_start
                )
                progress_file.write(json.dumps(line) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.4f}", epoch=epoch)
                if on_progress is not None:
                    on_progress(line)
                if checkpoint.due(every, step, total_steps):
                    checkpoint.save(
                        job.run_dir, prep.model, opt, job.tracker, step, epoch, dist_ctx, saved
                    )
            # `halted`, not `stop.requested`: a request that reached one rank during an epoch's
            # last step must not end the loop there on that rank alone (the ranks would part)
            if halted or step >= total_steps:
                break
    finally:
        bar.close()
    if halted and checkpoint.due(every, step, total_steps, stopping=True) and step > start:
        # resume here (`halted` is the same on every rank: the save is a collective under DDP)
        checkpoint.save(job.run_dir, prep.model, opt, job.tracker, step, epoch, dist_ctx, saved)
    if step > start:
        _check_finite(float(losses.detach().mean()), step, lr)
    job.record.set_timings(
        n_steps=step,
        total_s=round(time.perf_counter() - t_start, 3),
        median_step_ms=float(np.median(step_ms)) if step_ms else None,
    )
    return last_loss


def _batch(job: Job, prep: Prepared, order: np.ndarray, s: int):
    """This rank's example indices of step ``s`` of an epoch, the global batch size (0 in one
    process) and the collated batch (a stand-in example when this rank has none)."""
    bs = job.settings.batch_size
    if job.dist.enabled:
        idx, global_b = job.dist.local_batch(order, s, bs)
    else:
        idx, global_b = order[s * bs : (s + 1) * bs], 0
    batch = collate(
        [prep.encoded[i] for i in (idx if len(idx) else order[:1])],
        prep.pad_id,
        prep.task,
        prep.device,
    )
    return idx, global_b, batch


def _lr_at(settings: TrainSettings, step: int, total_steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then linear decay to a floor of 10% of ``lr``."""
    if settings.warmup_steps and step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    return settings.lr * max(0.1, 1 - step / max(1, total_steps))


def _backward(job: Job, prep: Prepared, forward, batch, idx, global_b, step, epoch, lr):
    """Forward and backward of one micro-batch (recorded by the tracker); returns its losses."""
    dist_ctx, tracker, task = job.dist, job.tracker, prep.task
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
            idx, padding_mask=batch["attention_mask"], step=step, epoch=epoch, lr=lr
        ) as rec:
            losses = example_losses(prep.model(**model_inputs(batch)), batch, task)
            losses.mean().backward()
            rec.losses = losses
    else:
        losses = example_losses(prep.model(**model_inputs(batch)), batch, task)
        losses.mean().backward()
    return losses


def _progress_line(
    job: Job, steps: tuple[int, int, int], epoch: int, loss: float, lr: float, t_start: float
) -> dict:
    """One line of progress.jsonl (also what ``on_progress`` receives); ``steps``: the step this
    process started at (a resumed run's checkpoint), the current one and the total."""
    start, step, total_steps = steps
    elapsed = time.perf_counter() - t_start
    return {
        "step": step,
        "total": total_steps,
        "epoch": epoch,
        "loss": round(loss, 5),
        "lr": lr,
        "examples_per_s": round(
            (step - start) * job.settings.batch_size * job.dist.world_size / elapsed, 2
        ),
        "elapsed_s": round(elapsed, 2),
        "eta_s": round(elapsed / (step - start) * (total_steps - step), 1),
        "time": now(),
    }


def _check_finite(loss: float, step: int, lr: float) -> None:
    if not math.isfinite(loss):
        raise RunError(
            f"the training loss became {loss} at step {step} (learning rate {lr:g}): the run "
            "diverged and was stopped; lower --lr (or check the data) and train again"
        )


@torch.no_grad()
def eval_loss(model, encoded, pad_id, task, device, batch_size) -> float | None:
    if not encoded:
        return None
    total = 0.0
    for i in range(0, len(encoded), batch_size):
        batch = collate(encoded[i : i + batch_size], pad_id, task, device)
        total += float(example_losses(model(**model_inputs(batch)), batch, task).sum())
    return total / len(encoded)


def _progress_bar(total: int, disable: bool = False, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        leave=True,
        disable=disable,
    )
