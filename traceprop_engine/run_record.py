"""run.json's one writer: :class:`RunRecord` builds a run's manifest and makes every change to it.

Readers use :class:`~traceprop_engine.run.RunManifest` (typed, read-only). Everything that
writes ``run.json`` goes through a :class:`RunRecord`: the training loop (:meth:`new_training`,
then one typed method per fact as the run learns it, :meth:`finished` at the end), a resumed run
(:meth:`reopen` + :meth:`resumed`), :meth:`Tracker.finish` and the Hugging Face and FSDP
helpers (:func:`make_run` → :meth:`recorded`), the bundled sample's refit
(:meth:`relative_to`). Only :meth:`save` writes the file, atomically
(:func:`~traceprop_engine.run.write_manifest`); the updates change the record in memory, so the
caller decides when run.json is written (the loop writes it at the same points it always did).

The stored format is the one :class:`RunManifest` reads: each method writes the keys and values
the manifest always held (a key the run does not know is absent, not null).
"""

from __future__ import annotations

import copy
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import constants as C
from .errors import ConfigError
from .run import (
    RunManifest,
    library_versions,
    new_run_id,
    now,
    read_manifest,
    relative_paths,
    write_manifest,
)

if TYPE_CHECKING:
    from torch import nn

    from .settings import TrainSettings
    from .training.distributed import DistContext


class RunRecord:
    """The manifest of the run in ``run_dir``, owned: built here, changed through its methods,
    written by :meth:`save`. :attr:`manifest` is the typed view of what it holds now."""

    def __init__(self, run_dir: str | os.PathLike, manifest: dict) -> None:
        self.run_dir = Path(run_dir)
        self._m = copy.deepcopy(manifest)

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def new_training(
        cls, run_dir: str | os.PathLike, settings: TrainSettings, dist_ctx: DistContext
    ) -> RunRecord:
        """The first run.json of a ``traceprop train`` run: status running, the settings, this
        process, the library versions (and, under torchrun, the ranks and their store shards)."""
        m = {
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
            dist = {"world_size": dist_ctx.world_size, "backend": dist_ctx.backend}
            if dist_ctx.fsdp:
                dist["parallel"] = "fsdp"
            m["distributed"] = dist
            if settings.track is not None:
                m["shards"] = dist_ctx.shard_files
        return cls(run_dir, m)

    @classmethod
    def recorded(
        cls,
        run_dir: str | os.PathLike,
        *,
        status: str,
        config: dict,
        data: dict,
        model: dict,
        tracking: dict | None = None,
        timings: dict | None = None,
        store: dict | None = None,
        shards: Sequence[str] | None = None,
        distributed: dict | None = None,
    ) -> RunRecord:
        """The manifest of a run recorded by the caller's own loop (:func:`make_run`): the
        sections given, the store ``store.h5`` unless ``store`` says otherwise."""
        m = {
            "run_id": new_run_id(),
            "status": status,
            "created": now(),
            "updated": now(),
            "config": config,
            "tracked": True,
            "versions": library_versions(),
            "data": data,
            "model": model,
            "store": store if store is not None else {"file": C.STORE_FILE},
        }
        optional = {"shards": list(shards) if shards else None, "tracking": tracking}
        optional.update(timings=timings, distributed=distributed)
        m.update({k: v for k, v in optional.items() if v is not None})
        return cls(run_dir, m)

    @classmethod
    def reopen(cls, run_dir: str | os.PathLike) -> RunRecord:
        """The record of an existing run, as written (a run still marked running stays so:
        :meth:`resumed` tells a killed run from a failed one).

        Raises:
            RunError: no run.json, or not a readable JSON object.
        """
        return cls(run_dir, read_manifest(run_dir, as_written=True))

    # -- reading ------------------------------------------------------------------------------
    @property
    def manifest(self) -> RunManifest:
        """What the record holds now, typed (a copy: changing it changes nothing here)."""
        return RunManifest.from_dict(self.as_dict())

    def as_dict(self) -> dict:
        """A copy of the manifest as it would be written (the store keeps one in its attributes;
        DDP ranks receive one)."""
        return copy.deepcopy(self._m)

    # -- what a training run learns, in order ---------------------------------------------------
    def set_data(
        self,
        root: str | os.PathLike,
        eval_root: str | os.PathLike,
        files: dict,
        eval_files: dict,
        n_train: int,
        n_eval: int,
    ) -> None:
        """The ``data`` section: both roots (absolute, and relative to the run), the sha256 of
        every file, the example counts."""
        root, eval_root = Path(root).resolve(), Path(eval_root).resolve()
        run = self.run_dir.resolve()
        self._m["data"] = {
            "root": str(root),
            "root_relative": os.path.relpath(root, run),
            "eval_root_relative": os.path.relpath(eval_root, run),
            "files": files,
            "eval_root": str(eval_root),
            "eval_files": eval_files,
            "n_train": n_train,
            "n_eval": n_eval,
        }

    def restore_data(self, data: dict) -> None:
        """Put back a ``data`` section as it was recorded (a resume refused on changed data:
        run.json keeps what the run was trained on)."""
        self._m["data"] = copy.deepcopy(data)

    def set_model(
        self,
        *,
        source: str,
        task: str,
        parameters: int,
        trainable: int,
        lora_rank: int,
        labels: list | None,
    ) -> None:
        """The ``model`` section of the model being trained (its fingerprint comes once saved)."""
        self._m["model"] = {
            "source": source,
            "task": task,
            "parameters": parameters,
            "trainable": trainable,
            "lora_rank": lora_rank,
            "labels": labels,
        }

    def add_note(self, note: str) -> None:
        self._m.setdefault("notes", []).append(note)

    def set_tracking(self, tracking: dict) -> None:
        """The ``tracking`` section (``Tracker.tracking_manifest()``)."""
        self._m["tracking"] = copy.deepcopy(tracking)

    def set_timings(
        self, n_steps: int, median_step_ms: float | None, total_s: float | None = None
    ) -> None:
        """The ``timings`` section (``total_s`` only when measured)."""
        t: dict = {"n_steps": n_steps}
        if total_s is not None:
            t["total_s"] = total_s
        t["median_step_ms"] = median_step_ms
        self._m["timings"] = t

    def set_metrics(self, last_train_loss: float, eval_loss: float) -> None:
        self._m["metrics"] = {"last_train_loss": last_train_loss, "eval_loss": eval_loss}

    def set_model_saved(self, fingerprint: str) -> None:
        """The model was saved to ``RUN/model`` with this fingerprint."""
        model = self._m.setdefault("model", {})
        model["fingerprint"] = fingerprint
        model["saved"] = C.MODEL_DIR

    def set_store(self, file: str, n_records: int | None = None) -> None:
        """The ``store`` section of a one-file store."""
        self._m["store"] = {"file": file, **({} if n_records is None else {"n_records": n_records})}

    def set_store_shards(self, shards: Sequence[str], n_records_per_shard: Sequence[int]) -> None:
        """The ``store`` section of a store written as one shard per rank."""
        counts = [int(n) for n in n_records_per_shard]
        self._m["store"] = {
            "file": None,
            "shards": list(shards),
            "n_records": int(sum(counts)),
            "n_records_per_shard": list(n_records_per_shard),
        }

    # -- how it ends ----------------------------------------------------------------------------
    def cancelled(self, reason: str) -> None:
        """Why the run was stopped (a signal's name, ``KeyboardInterrupt``, a caller's reason)."""
        self._m["cancel_reason"] = reason

    def failed(self, error: str, *, replace: bool = True) -> None:
        """Why the run failed; ``replace=False`` keeps an error already recorded (the first
        error is the one that ended the run)."""
        if replace or "error" not in self._m:
            self._m["error"] = error

    def finished(self, status: str) -> None:
        """The final status; the process no longer owns the run."""
        self._m.update(status=status, updated=now(), pid=None)

    def resumed(self, from_step: int, n_records_kept: int | None) -> None:
        """A resume from the checkpoint at ``from_step``: a ``resumed`` entry (when, from where,
        how the run had ended), the outcome of the last attempt forgotten, running again here."""
        m = self._m
        m.setdefault("resumed", []).append(
            {
                "time": now(),
                "from_step": from_step,
                "n_records_kept": n_records_kept,
                # a run still marked running here was killed (its process is gone)
                "previous_status": (
                    "killed" if m.get("status") == C.STATUS_RUNNING else m.get("status")
                ),
                "previous_error": m.get("error") or m.get("cancel_reason"),
            }
        )
        for key in ("error", "cancel_reason", "metrics", "timings"):
            m.pop(key, None)
        model = m.get("model") or {}
        m["model"] = {k: v for k, v in model.items() if k not in ("fingerprint", "saved")}
        m.update(
            status=C.STATUS_RUNNING,
            updated=now(),
            pid=os.getpid(),
            host=platform.node(),
            versions=library_versions(),
        )

    def relative_to(self, root: str | os.PathLike) -> None:
        """Every absolute path under ``root`` rewritten relative to the run (a run that travels
        with its data: the bundled sample)."""
        self._m = relative_paths(self._m, self.run_dir, Path(root).resolve())

    # -- writing ------------------------------------------------------------------------------
    def save(self) -> None:
        """Write run.json (atomically: a reader never sees half of it)."""
        write_manifest(self.run_dir, self._m)


def make_run(
    run_dir: str | os.PathLike,
    model: nn.Module,
    tokenizer=None,
    *,
    task: str = "causal-lm",
    labels: Sequence[str] | None = None,
    max_length: int = 128,
    status: str = C.STATUS_COMPLETED,
    data: dict | None = None,
    config: dict | None = None,
    tracking: dict | None = None,
    timings: dict | None = None,
    store: dict | None = None,
    distributed: dict | None = None,
    state_dict: dict | None = None,
    shards: Sequence[str] | None = None,
) -> Path:
    """Save ``model`` (+ tokenizer) to ``RUN/model`` and write ``RUN/run.json`` beside the store.

    Behind :meth:`Tracker.finish`, ``training.hf_trainer.finish_run`` and
    ``training.fsdp.finish_sharded``; ``tracking``, ``timings``, ``store``, ``distributed`` are
    the manifest sections the caller knows (see :meth:`RunRecord.recorded`). ``shards`` names the
    per-rank store files of a multi-process run (instead of ``store.h5``); ``state_dict`` is the
    full state dict to save for a model whose own parameters are sharded (FSDP).

    Raises:
        ConfigError: no ``store.h5`` in ``run_dir``; a model without ``save_pretrained``; bad task.
    """
    # the model's saving lives with training (torch, transformers, peft): imported when used
    from .training.models import LoadedModel, count_parameters, quiet_hf, save_model

    run_dir = Path(run_dir)
    missing = [s for s in (shards or [C.STORE_FILE]) if not (run_dir / s).exists()]
    if missing:
        raise ConfigError(
            f"{run_dir} has no {missing[0]}: build the Tracker with store path {run_dir}/{C.STORE_FILE}"
            + (" (rank_store_path for each rank)" if shards else "")
        )
    if task not in ("causal-lm", "classification"):
        raise ConfigError(f"task must be one of 'causal-lm', 'classification', got {task!r}")
    if not hasattr(model, "save_pretrained"):
        raise ConfigError(
            f"a run needs a Hugging Face model (save_pretrained/from_pretrained) to reload for "
            f"queries; got a {type(model).__name__}: build it with transformers (e.g. "
            "GPTNeoXForCausalLM(config))"
        )
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or "custom"
    loaded = LoadedModel(
        model,
        tokenizer,
        task,
        source,
        labels=list(labels) if labels else None,
        base_source=source if hasattr(model, "peft_config") else None,
    )
    n_params, n_trainable = count_parameters(model)
    model.eval()
    with quiet_hf():
        info = save_model(loaded, run_dir / C.MODEL_DIR, state_dict=state_dict)
    record = RunRecord.recorded(
        run_dir,
        status=status,
        config={"task": task, "max_length": max_length, **(config or {})},
        data=data or {},
        model={
            "source": source,
            "task": task,
            "fingerprint": info["fingerprint"],
            "labels": loaded.labels,
            "saved": C.MODEL_DIR,
            "tokenizer": tokenizer is not None,
            "parameters": n_params,
            "trainable": n_trainable,
        },
        tracking=tracking,
        timings=timings,
        store=store,
        shards=shards,
        distributed=distributed,
    )
    record.save()
    return run_dir
