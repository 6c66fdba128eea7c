"""A run directory from a recorded store: the model (and tokenizer) saved beside ``store.h5`` and a
``run.json`` that ``open_run``, the CLI and the app accept. Used by :meth:`Tracker.finish`, the
Hugging Face callback (``training/hf_trainer.py``) and FSDP's ``finish_sharded``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from .. import constants as C
from ..errors import ConfigError


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
    extra: dict | None = None,
    state_dict: dict | None = None,
    shards: Sequence[str] | None = None,
) -> Path:
    """Save ``model`` (+ tokenizer) to ``RUN/model`` and write ``RUN/run.json`` beside ``RUN/store.h5``.

    Shared by :meth:`Tracker.finish` and ``training.hf_trainer.finish_run``; ``extra``
    adds manifest sections (``tracking``, ``timings``, ``store``...). ``shards`` names the
    per-rank store files of a multi-process run (instead of ``store.h5``); ``state_dict`` is the
    full state dict to save for a model whose own parameters are sharded (FSDP).

    Raises:
        ConfigError: no ``store.h5`` in ``run_dir``; a model without ``save_pretrained``; bad task.
    """
    from ..run import library_versions, new_run_id, now, write_manifest
    from ..training.models import LoadedModel, count_parameters, quiet_hf, save_model

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
    manifest = {
        "run_id": new_run_id(),
        "status": status,
        "created": now(),
        "updated": now(),
        "config": {"task": task, "max_length": max_length, **(config or {})},
        "tracked": True,
        "versions": library_versions(),
        "data": data or {},
        "model": {
            "source": source,
            "task": task,
            "fingerprint": info["fingerprint"],
            "labels": loaded.labels,
            "saved": C.MODEL_DIR,
            "tokenizer": tokenizer is not None,
            "parameters": n_params,
            "trainable": n_trainable,
        },
        "store": {"file": C.STORE_FILE},
        **({"shards": list(shards)} if shards else {}),
        **(extra or {}),
    }
    write_manifest(run_dir, manifest)
    return run_dir
