"""The tracked retrain on a cleaned copy: the original run's settings (its ``run.json``), with
only the data swapped, from the same initial model.

What changes, and why nothing else does:

- ``data``: the cleaned copy (the file inside it when the run was trained on one file);
- ``eval_data``: the run's own eval data; when the run split its eval set off its data
  (``eval_fraction``), the cleaned copy's ``.heldout/`` rows, so the retrain holds out the
  same examples instead of drawing a new split from fewer rows;
- ``model``: for the tiny model, ``.base_model/`` of the cleaned copy (the run's initial model,
  rebuilt and checked by :mod:`~traceprop_engine.evaluate.counterfactual`: the tiny model's
  tokenizer is trained on the data, and fewer rows would train another vocabulary);
- ``out``: the new run. Tracking, seeds, epochs, learning rate, batch size … stay the run's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .. import constants as C
from ..errors import RunError
from ..run import RunManifest
from ..training.readers import SUPPORTED_SUFFIXES
from .clean_copy import BASE_MODEL_DIR, data_root, load_manifest, update_manifest


def _one_file(config_path: str | None, files: dict) -> str | None:
    """The file name when the run was trained (or evaluated) on one file, else None."""
    if config_path and Path(config_path).suffix.lower() in SUPPORTED_SUFFIXES and len(files) == 1:
        return next(iter(files))
    return None


def retrain_settings(
    data_dir: str | os.PathLike, out: str | os.PathLike, threads: int | None = None
):
    """The :class:`~traceprop_engine.settings.TrainSettings` of the retrain on ``data_dir``
    (``threads``: torch CPU threads, default the run's; how fast, not what is trained).

    Raises:
        RunError: the source run's settings cannot be read back.
        ConfigError: ``data_dir`` is not a cleaned copy.
    """
    from ..training.resume import settings_from_config

    data_dir = Path(data_dir).resolve()
    doc = load_manifest(data_dir)
    run_dir = Path(doc["source_run"]["path"])
    m = RunManifest.load(run_dir)
    s = settings_from_config(m.config, run_dir)
    one = _one_file(m.config.get("data"), m.data.files)
    data = data_dir / one if one else data_dir
    if doc.get("held_out"):
        held = data_dir / doc["held_out"]
        eval_data = str(held / one if one else held)
    elif m.data.eval_files:
        root = data_root(run_dir, m, "eval_root")
        ev = _one_file(m.config.get("eval_data"), m.data.eval_files)
        eval_data = str(root / ev if ev else root)
    else:
        eval_data = None
    from ..capture.layers import resolved_embedding
    from ..training.models import TINY

    model = s.model
    if (data_dir / BASE_MODEL_DIR).is_dir():
        model = str(data_dir / BASE_MODEL_DIR)
    elif s.model == TINY:  # a new tiny model would train its tokenizer on fewer rows
        raise RunError(
            f"{data_dir} has no {BASE_MODEL_DIR}/ (the run's initial tiny model): write the "
            "cleaned copy again with 'traceprop curate'"
        )
    if s.track is not None:  # the source's resolved embedding=auto, not a new decision on
        # the retrain's model (a tiny run's saved initialisation looks pretrained to auto)
        kinds = [layer.get("kind") for layer in m.tracking.layers]
        s = dataclasses.replace(s, track=resolved_embedding(s.track, None, kinds))
    return dataclasses.replace(
        s,
        data=str(data),
        eval_data=eval_data,
        out=str(Path(out).resolve()),
        model=model,
        threads=s.threads if threads is None else threads,
    )


def prepare_base_model(data_dir: str | os.PathLike, examples) -> None:
    """Write ``.base_model/`` into the cleaned copy when the run started from the tiny model.

    Args:
        examples: the source run's example table (its training rows rebuild the tokenizer).

    Raises:
        RunError: the rebuilt tokenizer differs from the run's.
    """
    from ..evaluate.counterfactual import _base_model
    from ..evaluate.lds_retrain import record
    from ..training.models import TINY
    from ..training.resume import settings_from_config

    data_dir = Path(data_dir)
    doc = load_manifest(data_dir)
    run_dir = Path(doc["source_run"]["path"])
    s = settings_from_config(RunManifest.load(run_dir).config, run_dir)
    if s.model != TINY:
        return
    train = examples.filter(examples["split"] == C.SPLIT_TRAIN).sort("example_id")
    rows = [record(r, s.task.value) for r in train.iter_rows(named=True)]
    _base_model(run_dir, s, rows, data_dir / BASE_MODEL_DIR)


def retrain(
    data_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    on_progress=None,
    stop=None,
    overwrite: bool = False,
    threads: int | None = None,
) -> Path:
    """Train the tracked retrain on ``data_dir`` into ``out``; recorded in ``curate.json``.

    Args:
        on_progress / stop: as for :func:`~traceprop_engine.training.loop.train`.

    Returns:
        The new run directory.

    Raises:
        RunError: the retrain did not complete (cancelled or failed).
    """
    from ..training.loop import train

    settings = retrain_settings(data_dir, out, threads)
    run = train(settings, overwrite=overwrite, on_progress=on_progress, stop=stop)
    status = RunManifest.load(run).status
    update_manifest(
        data_dir,
        retrain={"run": str(Path(run).resolve()), "status": status, "settings": settings.to_dict()},
    )
    if status != C.STATUS_COMPLETED:
        raise RunError(f"the retrain ended {status!r}; see {run}")
    return Path(run)
