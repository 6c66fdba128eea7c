"""Checkpoints of ``traceprop train`` runs, from which ``traceprop train --resume RUN`` continues.

Every ``TrainSettings.checkpoint_every`` steps and when a run is stopped (SIGTERM, Ctrl-C),
the loop writes ``RUN/checkpoint/``:

``state.pt``
    the model's and the optimiser's state dicts, torch's RNG states (CPU and CUDA) and the
    capture's running K-FAC sums (``A``, ``S``, token counts) per tracked layer; loaded with
    ``torch.load(weights_only=True)`` (tensors and plain containers only, no pickled code).
``model/``
    (one process) the model saved as a run's ``model/`` is, its fingerprint in
    ``checkpoint.json`` (``model_fingerprint``): a run killed before its final save is queried
    on it.
``checkpoint.json``
    the step and epoch reached, the store's record count and per-layer stored norms at that
    step, numpy's and Python's global RNG states, the capture's batch counter and the
    tracker's step timings.

Before the checkpoint is written the tracker's buffer is flushed and the writer thread drained,
so the store holds exactly ``n_records`` complete records on disk. The folder is written as
``RUN/.checkpoint.tmp`` and renamed into place (the previous one moves to
``RUN/.checkpoint.old`` for the moment of the swap): a killed process (SIGKILL, the OOM killer)
at any point leaves one whole checkpoint. Like the store, it is not fsync'ed: a power loss may
lose what the operating system had not yet written. The data order needs no state: it is the seeded permutation of each epoch, drawn
again on resume. A completed run's checkpoint is removed.

Under DDP (torchrun, ``--parallel ddp``) the checkpoint is one folder written by all ranks
together after the same step: rank 0 creates ``.checkpoint.tmp``; every rank flushes its store
shard and writes ``rank{r}.pt`` (its RNG states and K-FAC sums); rank 0 writes ``state.pt``
(model and optimiser: DDP keeps them equal on every rank); the ranks' JSON parts (record count of
their shard, norms, RNG states) are gathered and, once every rank has written its files, rank 0
writes ``checkpoint.json`` (with ``world_size`` and ``ranks``: one entry per rank) and renames
the folder into place; a barrier then lets every rank go on. A kill at any point leaves the
previous whole checkpoint. FSDP runs (sharded model and optimiser states) write none.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import RunError
from ..run import now

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_TMP = ".checkpoint.tmp"
CHECKPOINT_OLD = ".checkpoint.old"
STATE_FILE = "state.pt"
META_FILE = "checkpoint.json"
MODEL_SUBDIR = "model"  # the model as saved (loadable for queries of a run that stopped)
FORMAT = 1


@dataclass
class Checkpoint:
    """A checkpoint read back: its ``checkpoint.json`` and the folder holding ``state.pt``."""

    folder: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def n_records(self) -> int | None:
        n = self.meta.get("n_records")
        return None if n is None else int(n)

    @property
    def world_size(self) -> int:
        return int(self.meta.get("world_size", 1))

    def rank_meta(self, rank: int) -> dict:
        """``checkpoint.json`` as seen by ``rank``: its own record count, norms, RNG states."""
        ranks = self.meta.get("ranks")
        return self.meta if ranks is None else {**self.meta, **ranks[rank]}

    def state(self, device: torch.device, name: str = STATE_FILE) -> dict:
        try:
            return torch.load(self.folder / name, map_location=device, weights_only=True)
        except Exception as e:  # a damaged, missing or foreign file: say which
            raise RunError(f"cannot read the checkpoint {self.folder / name} ({e})") from None

    def rank_state(self, rank: int, device: torch.device, state: dict) -> dict:
        """The RNG and K-FAC state of ``rank``: ``state`` (state.pt) itself in one process."""
        if "ranks" not in self.meta:
            return state
        return self.state(device, rank_state_file(rank))


def due(every: int, step: int, total_steps: int, stopping: bool = False) -> bool:
    """Whether a checkpoint is written after ``step``: every ``every`` steps and when the run is
    stopping early (never after the last step: the run ends)."""
    return bool(every) and step < total_steps and (step % every == 0 or stopping)


def save(
    run_dir: Path, model, opt, tracker, step: int, epoch: int, dist_ctx=None, loaded=None
) -> None:
    """Write ``RUN/checkpoint`` for the state after ``step`` (atomically, see the module doc).

    ``loaded`` (the run's ``LoadedModel``; one process only): also save the model as a run's
    ``model/`` is saved, into ``checkpoint/model/`` with its fingerprint in ``checkpoint.json``,
    so that a run killed before its final save can still be queried.

    Under DDP (``dist_ctx`` with several ranks) a collective: every rank calls it after the same
    step; see the module doc for who writes what.
    """
    own_meta: dict = {
        "n_records": None,
        "numpy_rng": _numpy_state(),
        "python_rng": _python_state(),
    }
    own_state: dict = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        own_state["cuda_rng"] = torch.cuda.get_rng_state_all()
    if tracker is not None:
        tracker.sync()  # every committed record on disk: n_records below is durable
        own_meta["n_records"] = tracker.writer.n_records
        own_meta["sq_norm"] = tracker.writer.sq_norms
        own_meta["step_ms"] = [round(x, 4) for x in tracker.step_ms]
        own_meta["capture"], own_state["covariance"] = _capture_state(tracker.capture)
    tmp, final, old = run_dir / CHECKPOINT_TMP, run_dir / CHECKPOINT_DIR, run_dir / CHECKPOINT_OLD
    for p in (tmp, final, old):
        if p.is_symlink():
            raise RunError(f"{p} is a symbolic link; Traceprop does not write through links")
    head = {"format": FORMAT, "step": step, "epoch": epoch, "time": now()}
    model_state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if dist_ctx is None or not dist_ctx.enabled:
        shutil.rmtree(tmp, ignore_errors=True)
        state = {**model_state, **own_state}
        _ensure_room(run_dir, [state, model_state["model"] if loaded is not None else None])
        try:
            tmp.mkdir()
            _save_state(state, tmp / STATE_FILE)
            if loaded is not None:
                from .models import save_model

                info = save_model(loaded, tmp / MODEL_SUBDIR)
                own_meta["model_fingerprint"] = info["fingerprint"]
            _publish(tmp, final, old, {**head, **own_meta})
        except BaseException:  # a failed checkpoint takes no space: the run can still close
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return
    import torch.distributed as dist

    if dist_ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist_ctx.barrier()  # the folder exists before any rank writes into it
    _save_state(own_state, tmp / rank_state_file(dist_ctx.rank))
    if dist_ctx.is_main:  # DDP keeps the model and optimiser states equal on every rank
        _save_state(model_state, tmp / STATE_FILE)
    metas: list = [None] * dist_ctx.world_size
    dist.all_gather_object(metas, own_meta)  # returns once every rank wrote its file
    if dist_ctx.is_main:
        head.update(world_size=dist_ctx.world_size, parallel=dist_ctx.parallel)
        _publish(tmp, final, old, {**head, **metas[0], "ranks": metas})
    dist_ctx.barrier()  # no rank goes on before the whole checkpoint is in place


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _ensure_room(run_dir: Path, state: dict) -> None:
    """Refuse (ENOSPC) a checkpoint that would not fit beside the store's reserve: a full disk
    mid-checkpoint would leave no room to close the store and write run.json."""
    from ..store.space import METADATA_BYTES, ensure_room

    ensure_room(run_dir / CHECKPOINT_TMP, _tensor_bytes(state) + METADATA_BYTES, "a checkpoint")


def _save_state(state: dict, path: Path) -> None:
    """``torch.save``, its failures as ``OSError``: torch's zip writer reports a full disk as a
    RuntimeError ("iostream error", "unexpected pos", "file write failed")."""
    from ..store.space import RESERVE_BYTES, room

    try:
        torch.save(state, path)
    except RuntimeError as e:
        free, code = room(path)  # measured before the partial file is removed
        what = f"writing the checkpoint {path} failed ({e})"
        if free < RESERVE_BYTES:
            raise OSError(code, f"{os.strerror(code)}: {what}; {free} bytes are left") from e
        raise OSError(what) from e


def rank_state_file(rank: int) -> str:
    """A DDP checkpoint's file of one rank's own state (RNG, K-FAC sums)."""
    return f"rank{rank}.pt"


def _publish(tmp: Path, final: Path, old: Path, meta: dict) -> None:
    """Write ``checkpoint.json`` last into ``tmp`` and swap ``tmp`` into place."""
    (tmp / META_FILE).write_text(json.dumps(meta))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load(run_dir: Path) -> Checkpoint | None:
    """The run's last whole checkpoint, or None when it has none."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_OLD):  # .old: killed during the swap
        folder = run_dir / name
        if folder.is_symlink() or not (folder / META_FILE).is_file():
            continue
        if not (folder / STATE_FILE).is_file():
            continue
        try:
            meta = json.loads((folder / META_FILE).read_text())
        except (OSError, ValueError) as e:
            raise RunError(f"cannot read the checkpoint {folder / META_FILE} ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or "step" not in meta:
            raise RunError(
                f"{folder / META_FILE} is not a checkpoint this version of Traceprop can resume"
            )
        return Checkpoint(folder, meta)
    return None


def remove(run_dir: Path) -> None:
    """Delete the run's checkpoints (a completed run cannot be resumed)."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_OLD, CHECKPOINT_TMP):
        p = run_dir / name
        if p.is_symlink():
            continue  # never follow a link; leave it for the user
        shutil.rmtree(p, ignore_errors=True)


def restore(ckpt: Checkpoint, model, opt, tracker, device: torch.device, rank: int = 0) -> int:
    """Load the model, optimiser, capture and RNG states of ``ckpt`` (those of ``rank`` under
    DDP); returns its step.

    Called right before the first resumed step (after the model, optimiser and tracker exist),
    so the RNG streams continue exactly where the checkpoint left them.
    """
    state = ckpt.state(device)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    mine, meta = ckpt.rank_state(rank, device, state), ckpt.rank_meta(rank)
    if tracker is not None:
        _restore_capture(tracker, meta, mine.get("covariance"))
    torch.set_rng_state(mine["torch_rng"].cpu())
    if "cuda_rng" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in mine["cuda_rng"]])
    np.random.set_state(_numpy_from(meta["numpy_rng"]))
    random.setstate(_python_from(meta["python_rng"]))
    return ckpt.step


# -- the capture's running state (Capture.state_dict, split into JSON and tensors) ----------------
def _capture_state(capture) -> tuple[dict, list]:
    """JSON part (batch counter, host token counts) and tensors (``A``, ``S``, token sums)."""
    state = capture.state_dict()
    return {"batches": state["batches"], "a_rows": state["a_rows"]}, state["covariance"]


def _restore_capture(tracker, meta: dict, tensors: list | None) -> None:
    tracker.capture.load_state_dict({**(meta.get("capture") or {}), "covariance": tensors})
    tracker.step_ms[:] = list(meta.get("step_ms", []))


# -- RNG states as JSON -------------------------------------------------------------------------------
def _numpy_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _numpy_from(s: list) -> tuple:
    return (s[0], np.asarray(s[1], dtype=np.uint32), s[2], s[3], s[4])


def _python_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _python_from(s: list) -> tuple:
    return (s[0], tuple(s[1]), s[2])
