"""Linear datamodeling score (LDS): does ``Σ_{i∈S} τ(test, i)`` predict the loss of a model
retrained on ``S``?

Protocol (Park et al., TRAK; the variant bergson and kronfluence report):

1. Train the tracked run(s) that are the attribution source on the whole training set.
2. Draw ``m`` random subsets ``S_j`` of ``round(α n)`` training examples (seed ``[seed, j]``),
   retrain a model on each with the *same* loop, untracked (``track=None``), and record the
   per-example loss (``constants.LOSS_DEFINITION``) of every eval example.
3. For every method and eval example ``e``: Spearman correlation over ``j`` between the predicted
   sum ``Σ_{i∈S_j} τ(e, i)`` and ``-loss_j(e)`` (a positive score is a proponent: including it
   should *lower* the loss). LDS = mean over eval examples, with a bootstrap 95 % interval
   that resamples eval examples.

Every model in the evaluation (tracked runs and subset retrains) starts from one saved
initialisation (``EVAL_DIR/base_model``): the tiny model's tokenizer is otherwise trained on
the run's own texts, so a subset would get a different vocabulary and the losses would not be
comparable. The data order follows the training loop's own seed policy
(``TrainSettings.seed`` for every run).

``EVAL_DIR`` layout (resumable: a killed evaluation continues where it stopped)::

    eval.json            settings of the evaluation (a resume with other settings is refused)
    base_model/          the shared initial model and tokenizer
    runs/k8, runs/k4...  tracked attribution runs (one per k), runs/dense (dense, last block),
                         runs/exact (k >= every width: unsketched per-example gradients),
                         runs/<name> (one per ``LdsSettings.configs`` entry); each holds
                         ``lds_track.json``, the TrackSettings it was trained with
    runs/k8/factors-c1.h5  rank-c factors of a run's sketches (compact storage, ``LdsSettings.compact``;
                         scoring only: added or rebuilt on a resume without any retraining)
    subsets.json         per subset: seed, member example ids, their sha256, a digest
    losses/subset_007.npy  eval losses of subset 7's model (written atomically, tmp + rename)
    progress.json        subsets done, seconds per subset
    losses.npy           (m, n_eval) once every subset is done
    results.json/.csv    LDS ± CI per method;  figure.json  plotly figure (``fig.to_json()``)
"""

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import constants as C
from ..errors import ConfigError, RunError
from ..run import RunManifest, is_completed
from ..settings import EmbeddingMode, TrackSettings, TrainSettings
from .lds_report import goal_checks, lds_scores, summarize, write_results
from .lds_retrain import record, retrain_subsets, subset_losses, write_subsets
from .lds_scoring import score_methods
from .lds_settings import (
    BASE_MODEL_DIR,
    DENSE_RUN,
    EVAL_FILE,
    EXACT_K,
    EXACT_RUN,
    LOSSES_FILE,
    RESUME_KEYS,
    RUN_TRACK_FILE,
    RUNS_DIR,
    LdsSettings,
    atomic_save_npy,
    atomic_write_text,
    check_out_dir,
)

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]


@dataclass
class LdsResult:
    """What :func:`run_lds` did and, once every subset is done, the table."""

    out: Path
    complete: bool
    retrained: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    noise_ceiling: dict | None = None
    base_model: dict | None = None
    goals: list[dict] = field(default_factory=list)  # the default against each bar (lds_report)


def base_model_record(base: str) -> dict:
    """Which model every run of the evaluation trained from: its directory (``minilm``
    resolved) and the sha256 of its weight files (``training.fingerprint``). Two evaluations
    with the same path but another hash (a base pretrained again, on another CPU) are not
    comparable row by row."""
    from ..training.fingerprint import model_fingerprint
    from ..training.models import resolve_model_path

    path = Path(resolve_model_path(base))
    return {"path": str(path), "sha256": model_fingerprint(path)}


_TRAIN_DEFAULTS = {
    k: v for k, v in TrainSettings(data="-", out="-").to_dict().items() if k not in ("data", "out")
}


def _as_recorded(track: dict) -> dict:
    """A run's recorded tracking settings with the fields added since filled in as it ran."""
    return json.loads(json.dumps(TrackSettings.from_dict(track).to_dict()))


def _with_earlier_configs(eval_dir: Path, s: LdsSettings) -> LdsSettings:
    """``s`` with the ``--config`` runs an earlier call on ``eval_dir`` added and this one does
    not name (their runs are kept and stay in the table; a name given again takes the new
    overrides). ``s`` itself for a new folder."""
    cfg_path = eval_dir / EVAL_FILE
    if not cfg_path.exists():
        return s
    try:
        old = json.loads(cfg_path.read_text())["settings"].get("configs") or []
    except (OSError, ValueError, KeyError, AttributeError):
        return s  # an unreadable file: _check_or_write_config says so
    names = {c["name"] for c in s.configs}
    kept = [dict(c) for c in old if isinstance(c, dict) and c.get("name") not in names]
    if not kept:
        return s
    log.info("keeping the config runs of earlier calls: %s", ", ".join(c["name"] for c in kept))
    return dataclasses.replace(s, configs=(*s.configs, *kept))


def _check_or_write_config(eval_dir: Path, s: LdsSettings, overwrite: bool) -> None:
    cfg_path = eval_dir / EVAL_FILE
    cfg = s.to_dict()

    def resume_part(d: dict) -> dict:
        d = {k: d.get(k) for k in RESUME_KEYS}
        # a training field added since the evaluation was made counts as its default
        train = {**_TRAIN_DEFAULTS, **(d["train"] or {})}
        d["train"] = {k: v for k, v in train.items() if k != "track"}
        return json.loads(json.dumps(d))

    if cfg_path.exists():
        old = json.loads(cfg_path.read_text())["settings"]
        if resume_part(old) != resume_part(cfg):
            if not overwrite:
                diff = [k for k in RESUME_KEYS if resume_part(old)[k] != resume_part(cfg)[k]]
                raise ConfigError(
                    f"{eval_dir} holds an LDS evaluation with other settings ({', '.join(diff)} "
                    "differ: the subset losses depend on them); pass overwrite (--overwrite) "
                    "to start over, or choose another --out"
                )
            shutil.rmtree(eval_dir)
        elif old != json.loads(json.dumps(cfg)):
            log.info(
                "resuming %s with other runs or scoring settings; the subset losses are reused",
                eval_dir,
            )
            doc = json.loads(cfg_path.read_text())
            doc["settings"] = cfg
            atomic_write_text(cfg_path, json.dumps(doc, indent=2))
    eval_dir.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        atomic_write_text(
            cfg_path,
            json.dumps(
                {
                    "settings": cfg,
                    "loss_definition": C.LOSS_DEFINITION,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                },
                indent=2,
            ),
        )


def _base_model(s: LdsSettings, eval_dir: Path) -> str:
    """The shared initial model directory (built once for the tiny model)."""
    from ..training.models import TINY, UNTRAINED_KEY, build_model, save_model

    if s.train.model != TINY:
        return (
            s.train.model
        )  # a local directory or 'minilm': tokenizer and weights are fixed already
    base = eval_dir / BASE_MODEL_DIR
    info_path = base / "traceprop_model.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if not info.get(UNTRAINED_KEY):
            # saved before the key existed (stop 49): every run trained from it counted as a
            # fine-tune of a pretrained model (model_origin), not as the model from scratch it is
            info[UNTRAINED_KEY] = True
            atomic_write_text(info_path, json.dumps(info, indent=2))
        return str(base.resolve())
    from ..training.data import load_examples, split_eval

    t = s.train
    examples, _ = load_examples(t.data, task=t.task.value)
    train_ex = examples if t.eval_data else split_eval(examples, t.eval_fraction, t.seed)[0]
    loaded = build_model(
        TINY,
        t.task.value,
        [e.full_text() for e in train_ex],
        seed=t.seed,
        tiny_vocab=t.tiny_vocab,
        tiny_width=t.tiny_width,
        tiny_layers=t.tiny_layers,
        max_length=t.max_length,
    )
    tmp = eval_dir / (BASE_MODEL_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(loaded, tmp, untrained=True)
    os.replace(tmp, base)
    return str(base.resolve())


def _run_names(s: LdsSettings) -> dict[str, TrackSettings]:
    from ..training.models import TINY

    scope = s.train.track.scope if s.train.track is not None else "all"
    # The tiny model's shared initialisation is loaded from base_model/, which ``auto`` would
    # take for saved (pretrained) weights; it is the from-scratch model `traceprop train` builds
    # from a config, where ``auto`` records no embedding. A --config entry may still set it.
    emb = EmbeddingMode.OFF if s.train.model == TINY else EmbeddingMode.AUTO
    runs = {
        f"k{k}": TrackSettings(scope=scope, k_in=k, k_out=k, seed=s.train.seed, embedding=emb)
        for k in s.k_values
    }
    if s.dense:
        runs[DENSE_RUN] = TrackSettings(
            scope="last-block", sketch="dense", dense_k=s.dense_k, seed=s.train.seed
        )
    if s.exact:
        runs[EXACT_RUN] = TrackSettings(
            scope=scope, k_in=EXACT_K, k_out=EXACT_K, seed=s.train.seed, embedding=emb
        )
    for c in s.configs:
        overrides = {k: v for k, v in c.items() if k != "name"}
        runs[c["name"]] = TrackSettings(
            **{"scope": scope, "seed": s.train.seed, "embedding": emb, **overrides}
        )
    return runs


def _trained_as_pretrained(run_dir: Path, base: str) -> bool:
    """Whether a run trained from an untrained initialisation (``base``: the tiny model's
    ``base_model``) recorded ``model_origin`` pretrained-full, as every such run did before the
    initialisation was marked (stop 49): ``auto`` would score it as a pretrained fine-tune."""
    from ..store.sharded import open_run_store
    from ..training.models import is_untrained

    if not is_untrained(base):
        return False
    with open_run_store(run_dir) as store:
        return store.model_origin == C.ORIGIN_PRETRAINED_FULL


def _ensure_run(name: str, track: TrackSettings, s: LdsSettings, base: str, eval_dir: Path) -> Path:
    from ..training.loop import train

    run_dir = eval_dir / RUNS_DIR / name
    sidecar = run_dir / RUN_TRACK_FILE
    want = json.loads(json.dumps(track.to_dict()))
    if is_completed(run_dir):
        # a tracking field added since that run was made counts as what it recorded then
        # (TrackSettings.from_dict: RECORDED_BEFORE_KEYS, else the field's default)
        if _trained_as_pretrained(run_dir, base):
            log.warning(
                "%s was trained from this evaluation's untrained initialisation but recorded "
                "as a fine-tune of a pretrained model (before stop 49); training it again",
                run_dir,
            )
        elif not sidecar.exists() or _as_recorded(json.loads(sidecar.read_text())) == want:
            return run_dir  # (no sidecar: a run of an older evaluation, trusted as before)
        else:
            log.warning("%s was tracked with other settings; training it again", run_dir)
    log.info("training the tracked run %s", name)
    train(dataclasses.replace(s.train, model=base, out=str(run_dir), track=track), overwrite=True)
    status = RunManifest.load(run_dir).status
    if status != C.STATUS_COMPLETED:
        raise RunError(
            f"the tracked run {run_dir} ended {status!r}; rerun to resume the evaluation"
        )
    atomic_write_text(sidecar, json.dumps(want, indent=1))
    return run_dir


def run_lds(
    s: LdsSettings,
    *,
    overwrite: bool = False,
    max_new_subsets: int | None = None,
    progress: ProgressFn | None = None,
) -> LdsResult:
    """Run (or resume) an LDS evaluation and write its results into ``s.out``.

    Args:
        s: the evaluation settings.
        overwrite: start over when ``s.out`` holds an evaluation with other settings.
        max_new_subsets: retrain at most this many subsets in this call, then return
            (``complete=False``); a later call resumes.
        progress: ``progress(stage, done, total)`` callback.

    Returns:
        An :class:`LdsResult`; ``rows`` holds the table once every subset is done.

    Raises:
        ConfigError: settings differ from the evaluation already in ``s.out``, ``s.out`` is a
            file, or ``max_new_subsets`` is negative.
        RunError: a training run failed or was cancelled.
    """
    import torch

    if max_new_subsets is not None and (
        isinstance(max_new_subsets, bool)
        or not isinstance(max_new_subsets, int)
        or max_new_subsets < 0
    ):
        raise ConfigError(
            f"max_new_subsets must be an integer >= 0 (or None: all), got {max_new_subsets!r}"
        )
    torch.set_num_threads(1)
    eval_dir = Path(s.out)
    check_out_dir(eval_dir)
    if not overwrite:
        s = _with_earlier_configs(eval_dir, s)
    _check_or_write_config(eval_dir, s, overwrite)
    base = _base_model(s, eval_dir)
    runs = _run_names(s)
    main = f"k{s.main_k}"
    result = LdsResult(out=eval_dir, complete=False)
    t0 = time.perf_counter()
    main_dir = _ensure_run(main, runs[main], s, base, eval_dir)
    result.seconds["tracked_run_main"] = round(time.perf_counter() - t0, 2)
    subsets, eval_ids, encs, rows = _read_main_run(main_dir, eval_dir, s)

    # -- subset retrains (resumable) ----------------------------------------------------------------
    t1 = time.perf_counter()
    done = retrain_subsets(
        s, eval_dir, base, rows, encs, subsets, result, max_new_subsets, progress
    )
    result.seconds["subset_retrains"] = round(time.perf_counter() - t1, 2)
    if not done:
        return result
    losses, result.noise_ceiling = subset_losses(s, eval_dir)
    atomic_save_npy(eval_dir / LOSSES_FILE, losses)

    # -- the other tracked runs and the scores ----------------------------------------------------
    t2 = time.perf_counter()
    run_dirs = {name: _ensure_run(name, tr, s, base, eval_dir) for name, tr in runs.items()}
    result.seconds["tracked_runs_other"] = round(time.perf_counter() - t2, 2)
    t3 = time.perf_counter()
    table = _lds_table(s, run_dirs, subsets, eval_ids, len(rows), losses, progress)
    result.seconds["scoring"] = round(time.perf_counter() - t3, 2)
    result.rows = table
    result.goals = goal_checks(table, s.main_k, s.bootstrap, s.seed)
    result.base_model = base_model_record(base)  # hashed once the table is done, not per resume
    result.complete = True
    write_results(
        eval_dir,
        s,
        table,
        losses,
        result.seconds,
        result.noise_ceiling,
        result.base_model,
        result.goals,
    )
    return result


def _read_main_run(main_dir: Path, eval_dir: Path, s: LdsSettings):
    """From the main tracked run: the subsets (written to subsets.json), the eval example ids,
    their encodings and the raw training records the subset retrains read."""
    from ..attribution import open_run

    run = open_run(main_dir)
    examples = run.examples()
    subsets = write_subsets(eval_dir, s, examples)
    eval_ids = examples.filter(examples["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    if not eval_ids:
        raise ConfigError(
            "the evaluation needs eval examples: pass --eval-data or a positive --eval-fraction"
        )
    encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    rows = [
        record(r, run.task)
        for r in examples.filter(examples["split"] == C.SPLIT_TRAIN).iter_rows(named=True)
    ]
    run.close()
    return subsets, eval_ids, encs, rows


def _lds_table(
    s: LdsSettings,
    run_dirs: dict[str, Path],
    subsets: list[np.ndarray],
    eval_ids: list[int],
    n_train: int,
    losses: np.ndarray,
    progress: ProgressFn | None,
) -> list[dict]:
    """One row per method: its LDS, bootstrap interval and per-example correlations."""
    masks = np.zeros((s.n_subsets, n_train), bool)
    for j, m in enumerate(subsets):
        masks[j, m] = True
    table = []
    for method in score_methods(s, run_dirs, eval_ids, n_train, progress):
        scores = method.pop("scores")
        if scores is None:  # the engine could not fit this method; keep the row and the reason
            table.append(
                {
                    **method,
                    "lds": float("nan"),
                    "ci_low": float("nan"),
                    "ci_high": float("nan"),
                    "n_eval": len(eval_ids),
                    "n_valid": 0,
                    "per_example": [],
                }
            )
            continue
        per = lds_scores(scores, masks, losses)
        table.append(
            {
                **method,
                **summarize(per, s.bootstrap, seed=s.seed),
                "per_example": [None if np.isnan(v) else float(v) for v in per],
            }
        )
    return table
