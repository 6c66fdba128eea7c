"""Subset retraining of an LDS evaluation: draw the subsets, retrain a model on each, keep its losses.

Each subset's model is trained with the same loop as the tracked runs, untracked, from the
shared initial model; its eval losses are written atomically to ``losses/subset_NNN.npy`` and
the model is deleted, so a killed evaluation resumes with the subsets still missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import constants as C
from ..errors import RunError
from ..run import RunManifest
from .lds_report import bootstrap_ci, spearman_rows
from .lds_settings import (
    LOSSES_DIR,
    PROGRESS_FILE,
    RETRAIN_SEED_STRIDE,
    SUBSETS_FILE,
    WORK_DIR,
    LdsSettings,
    atomic_save_npy,
    atomic_write_text,
)

log = logging.getLogger(__name__)


def draw_subsets(n_train: int, n_subsets: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Sorted member indices of each subset; subset ``j`` from ``default_rng([seed, j])``."""
    size = max(1, round(alpha * n_train))
    return [
        np.sort(np.random.default_rng([seed, j]).choice(n_train, size=size, replace=False))
        for j in range(n_subsets)
    ]


def _subset_digest(members: Sequence[int], sha256: Sequence[str]) -> str:
    h = hashlib.sha256()
    for i, s in zip(members, sha256, strict=True):
        h.update(f"{int(i)}:{s}\n".encode())
    return h.hexdigest()


def _loss_path(eval_dir: Path, j: int, r: int = 0) -> Path:
    """Eval losses of subset ``j``'s model (replicate ``r > 0``: retrained with another seed)."""
    return eval_dir / LOSSES_DIR / (f"subset_{j:03d}.npy" if r == 0 else f"subset_{j:03d}_r{r}.npy")


def record(row: dict, task: str) -> dict:
    """The raw record of an example as a one-line JSON object the data loader reads back."""
    if task == "classification":
        return {"text": row["text"], "label": row["label"]}
    if row.get("completion"):
        return {"prompt": row.get("prompt") or "", "completion": row["completion"]}
    return {"text": row["text"]}


# -- the worker (module level: it runs in a spawned process) ----------------------------------------
def _eval_losses(model_dir: Path, encs: list, task: str, batch_size: int = 16) -> np.ndarray:
    import torch

    from ..training.losses import example_losses
    from ..training.models import collate, load_saved_model, model_inputs

    loaded = load_saved_model(model_dir, "cpu")
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    out = []
    with torch.no_grad():
        for i in range(0, len(encs), batch_size):
            batch = collate(encs[i : i + batch_size], pad, task, "cpu")
            out.append(
                example_losses(loaded.model(**model_inputs(batch)), batch, task).double().numpy()
            )
    return np.concatenate(out)


def _retrain_subset(job: dict) -> dict:
    """Retrain on one subset (untracked), record the eval losses atomically, drop the model."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("TQDM_DISABLE", "1")
    from ..training.loop import train

    t0 = time.perf_counter()
    work: Path = job["work"]
    shutil.rmtree(work, ignore_errors=True)  # a half-finished retrain from a killed evaluation
    work.mkdir(parents=True)
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in job["rows"]))
    settings = dataclasses.replace(
        job["train"],
        data=str(data),
        eval_data=None,
        eval_fraction=0.0,
        out=str(work / "run"),
        track=None,
    )
    for r in job.get("replicates", (0,)):  # replicate r: same subset, training seed + r·STRIDE
        rs = dataclasses.replace(
            settings, seed=settings.seed + RETRAIN_SEED_STRIDE * r, out=str(work / f"run{r}")
        )
        run_dir = train(rs, overwrite=True)
        status = RunManifest.load(run_dir).status
        if status != C.STATUS_COMPLETED:
            raise RunError(f"the retrain of subset {job['subset']} ended {status!r}; see {run_dir}")
        losses = _eval_losses(run_dir / C.MODEL_DIR, job["encs"], settings.task.value)
        atomic_save_npy(_loss_path(job["eval_dir"], job["subset"], r), losses)
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return {"subset": job["subset"], "seconds": round(time.perf_counter() - t0, 3)}


def write_subsets(eval_dir: Path, s: LdsSettings, examples) -> list[np.ndarray]:
    train_rows = examples.filter(examples["split"] == C.SPLIT_TRAIN)
    ids = train_rows["example_id"].to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise RunError(
            "the run's training examples are not examples 0..n_train-1; the store layout changed"
        )
    sha = train_rows["sha256"].to_list()
    subsets = draw_subsets(len(ids), s.n_subsets, s.alpha, s.seed)
    doc = {
        "n_train": len(ids),
        "alpha": s.alpha,
        "seed": s.seed,
        "subsets": [
            {
                "subset": j,
                "seed": [s.seed, j],
                "members": [int(i) for i in m],
                "sha256": [sha[i] for i in m],
                "digest": _subset_digest(m, [sha[i] for i in m]),
            }
            for j, m in enumerate(subsets)
        ],
    }
    path = eval_dir / SUBSETS_FILE
    if path.exists():
        old = json.loads(path.read_text())
        if old != doc:
            raise RunError(
                f"{path} does not match the subsets these settings draw (the data changed?); start over with --overwrite"
            )
    else:
        atomic_write_text(path, json.dumps(doc))
    return subsets


def _retrain_all(jobs: list[dict], workers: int, eval_dir: Path, progress: dict, on_done) -> None:
    def done(r: dict) -> None:
        progress["done"] = sorted(set(progress["done"]) | {r["subset"]})
        progress["seconds"][str(r["subset"])] = r["seconds"]
        progress["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        atomic_write_text(eval_dir / PROGRESS_FILE, json.dumps(progress, indent=1))
        on_done(r)

    if workers == 1 or len(jobs) < 2:
        for job in jobs:
            done(_retrain_subset(job))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a forked child would inherit this process's torch thread pools and locks
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        futures = [ex.submit(_retrain_subset, job) for job in jobs]
        for f in as_completed(futures):
            done(f.result())


def retrain_subsets(
    s: LdsSettings,
    eval_dir: Path,
    base: str,
    rows: list[dict],
    encs: list,
    subsets: list[np.ndarray],
    result,
    max_new_subsets: int | None,
    progress,
) -> bool:
    """Retrain the subsets (and replicates) whose losses are missing; True once none is.

    At most ``max_new_subsets`` subsets are retrained in this call; ``result`` (the
    :class:`~.lds.LdsResult`) gets the subsets skipped (already done) and retrained.
    """
    (eval_dir / LOSSES_DIR).mkdir(exist_ok=True)
    prog_path = eval_dir / PROGRESS_FILE
    prog = (
        json.loads(prog_path.read_text())
        if prog_path.exists()
        else {"n_subsets": s.n_subsets, "done": [], "seconds": {}}
    )
    reps = range(s.retrain_seeds)

    def missing(j: int) -> list[int]:
        return [r for r in reps if not _loss_path(eval_dir, j, r).exists()]

    todo = [j for j in range(s.n_subsets) if missing(j)]
    result.skipped = [j for j in range(s.n_subsets) if j not in todo]
    if max_new_subsets is not None:
        todo = todo[:max_new_subsets]
    retrain = dataclasses.replace(s.train, model=base)
    jobs = [
        {
            "subset": j,
            "train": retrain,
            "rows": [rows[i] for i in subsets[j]],
            "encs": encs,
            "work": eval_dir / WORK_DIR / f"subset_{j:03d}",
            "eval_dir": eval_dir,
            "replicates": missing(j),
        }
        for j in todo
    ]
    n_done = len(result.skipped)

    def on_done(r):
        nonlocal n_done
        n_done += 1
        result.retrained.append(r["subset"])
        log.info(
            "subset %d retrained in %.1fs (%d/%d)", r["subset"], r["seconds"], n_done, s.n_subsets
        )
        if progress:
            progress("subsets", n_done, s.n_subsets)

    _retrain_all(jobs, s.workers, eval_dir, prog, on_done)
    shutil.rmtree(eval_dir / WORK_DIR, ignore_errors=True)
    return not any(missing(j) for j in range(s.n_subsets))


def subset_losses(s: LdsSettings, eval_dir: Path) -> tuple[np.ndarray, dict | None]:
    """``(m, n_eval)`` mean eval loss over the replicates, and the split-half noise ceiling.

    The ceiling (``r >= 2`` replicates only, else None) is the mean over eval examples of the
    Spearman correlation over subsets between the mean loss of the even and the odd replicates,
    ``ρ``. From it, ``attainable_lds`` estimates the highest LDS any attribution can reach
    against the noisy target, the mean loss of all the replicates: by the Spearman–Brown
    formula that mean has reliability ``2ρ / (1 + ρ)``, and a score that predicted the
    noiseless effect exactly would correlate with it by the square root of that (per eval
    example, ``ρ`` below 0 read as 0, then the mean). An estimate, not a bound: Spearman, not
    Pearson, and the halves are few.
    """
    reps = range(s.retrain_seeds)
    per_rep = np.stack(
        [[np.load(_loss_path(eval_dir, j, r)) for j in range(s.n_subsets)] for r in reps]
    )  # (r, m, n_eval)
    losses = per_rep.mean(0)  # (m, n_eval)
    if s.retrain_seeds < 2:
        return losses, None
    # split half: the mean loss of the even replicates against the odd ones (r = 2: 0 vs 1)
    split = spearman_rows(per_rep[0::2].mean(0).T, per_rep[1::2].mean(0).T)  # (n_eval,)
    rho = np.clip(split, 0.0, None)
    attainable = np.sqrt(2 * rho / (1 + rho))  # NaN where the split is NaN
    return losses, {
        "split_half_spearman": float(np.nanmean(split)),
        "ci": list(bootstrap_ci(split, s.bootstrap, seed=s.seed)),
        "attainable_lds": float(np.nanmean(attainable)),
        "what": "mean over eval examples of Spearman over subsets between the mean loss of "
        "the even and of the odd replicates (retrains of each subset with other seeds)",
        "halves": [len(range(0, s.retrain_seeds, 2)), len(range(1, s.retrain_seeds, 2))],
    }
