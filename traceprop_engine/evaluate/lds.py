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

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import constants as C
from ..errors import ConfigError, RunError
from ..settings import TrackSettings, TrainSettings

log = logging.getLogger(__name__)

EVAL_FILE = "eval.json"
SUBSETS_FILE = "subsets.json"
PROGRESS_FILE = "progress.json"
LOSSES_DIR = "losses"
LOSSES_FILE = "losses.npy"
RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
FIGURE_FILE = "figure.json"
BASE_MODEL_DIR = "base_model"
RUNS_DIR = "runs"
WORK_DIR = "work"
DENSE_RUN = "dense"
EXACT_RUN = "exact"
# k_in = k_out of the exact run: capture clamps k to each layer's width, and k equal to the width
# means no projection on that side, so the records are the exact per-example gradients
EXACT_K = 1 << 20
RUN_TRACK_FILE = "lds_track.json"  # in each run dir: the TrackSettings it was trained with
BM25_K1, BM25_B = 1.5, 0.75
# what the subset losses depend on: a resume must match these, anything else (k sweep, dense,
# exact, configs, scoring) may change on a resume and only adds or rescores tracked runs
# (retrain_seeds is not one: replicate r's loss file is the same whatever the count, so a resume
# with more replicates only trains the missing ones)
RESUME_KEYS = ("train", "n_subsets", "alpha", "seed")
RETRAIN_SEED_STRIDE = 7919  # replicate r of a subset trains with seed + r * stride
_CONFIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
PRECONDITIONERS = ("identity", "cosine", "kfac", "ekfac")
COMPACT_FAMILY = "factored-c"
COMPACT_PRECONDITIONERS = ("identity", "kfac", "ekfac")  # cosine needs the full vectors
# (k, preconditioner, c): compact-storage (LoRIF rank-c factor) methods scored from the k runs
COMPACT_METHODS: tuple[tuple[int, str, int], ...] = (
    (8, "kfac", 1),
    (8, "kfac", 2),
    (8, "kfac", 4),
    (8, "identity", 1),
    (16, "kfac", 1),
    (16, "kfac", 2),
    (16, "kfac", 4),
)

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class LdsSettings:
    """One LDS evaluation.

    Args:
        train: the training configuration of every run (data, eval data, model, hyperparameters,
            seed); its ``out`` is ignored and its ``track`` gives the scope of the factored runs.
        out: evaluation directory.
        n_subsets: ``m``, number of retrained subsets.
        alpha: fraction of the training set in each subset.
        seed: seed of the subset draw (subset ``j`` uses ``numpy.random.default_rng([seed, j])``).
        k_values: the k sweep (``k_in = k_out = k``), one tracked run per value.
        main_k: the k of the main table (added to the sweep if missing).
        dense: also train the dense-sketch run (last-block scope) and score it.
        dense_k: size of the dense sketch.
        workers: subset retrains run in parallel in this many processes (1 = in this process).
        bootstrap: bootstrap resamples for the interval.
        damping: preconditioner damping (``None``: the engine's default).
        compact: compact-storage methods, ``(k, preconditioner, c)``: the k run's sketches are
            compacted to rank-``c`` factors (``runs/k{k}/factors-c{c}.h5``, reused on a resume)
            and scored with :func:`traceprop_engine.attribution.factor_scores.factor_scores` (family
            ``factored-c``, method ``"{preconditioner} c={c}"``). Entries whose k is not in the
            sweep are skipped. Scoring only: not part of the settings a resume checks.
        exact: also train the exact run (``runs/exact``: ``k_in = k_out = EXACT_K``, clamped to
            every layer's width, i.e. unsketched per-example gradients) and score it with every
            preconditioner (family ``exact``, method ``"exact {preconditioner}"``): the ceiling
            of the same estimator.
        bm25: also score BM25 between each eval example's text and each training example's
            text (family ``baseline``, method ``bm25``): a floor that needs no model.
        configs: extra named tracking configurations, each a dict ``{"name": ..., **overrides}``
            whose overrides are :class:`~traceprop_engine.settings.TrackSettings` keyword
            arguments (scope and seed default to the evaluation's). Each is trained as its own
            tracked run ``runs/<name>`` and scored with every preconditioner (family
            ``config``, method ``"<name> <preconditioner>"``). See :func:`parse_config_spec`.
        retrain_seeds: ``r``, models retrained per subset (replicate ``i`` with training seed
            ``seed + i * RETRAIN_SEED_STRIDE``: another data order); the LDS target is the
            mean loss over the replicates. With ``r >= 2`` the results hold the split-half noise
            ceiling: the mean over eval examples of the Spearman correlation over subsets
            between the mean loss of the even and of the odd replicates (r = 2: replicate 0
            against replicate 1). A resume with a larger ``r``
            trains only the missing replicates.

        The k sweep, dense, exact, bm25 and configs are not part of the settings a resume checks
        (``RESUME_KEYS``): adding one to an existing evaluation reuses its subset losses.
    """

    train: TrainSettings
    out: str
    n_subsets: int = 32
    alpha: float = 0.5
    seed: int = 0
    k_values: tuple[int, ...] = (4, 8, 16, 32)
    main_k: int = 8
    dense: bool = True
    dense_k: int = 512
    workers: int = 1
    bootstrap: int = 2000
    damping: float | None = None
    compact: tuple[tuple[int, str, int], ...] = COMPACT_METHODS
    exact: bool = True
    bm25: bool = True
    configs: tuple[dict, ...] = ()
    retrain_seeds: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "k_values", tuple(sorted({int(k) for k in self.k_values} | {int(self.main_k)}))
        )
        problems = []
        try:
            compact = tuple((int(k), str(p), int(c)) for k, p, c in self.compact)
        except (TypeError, ValueError):
            compact = ()
            problems.append(f"compact={self.compact!r} ((k, preconditioner, c) triples)")
        object.__setattr__(self, "compact", compact)
        for k, p, c in compact:
            if p not in COMPACT_PRECONDITIONERS or c < 1 or k < 1:
                problems.append(
                    f"compact entry {(k, p, c)} (preconditioner one of {COMPACT_PRECONDITIONERS}, "
                    "k and c positive)"
                )
        if self.n_subsets < 2:
            problems.append(
                f"n_subsets={self.n_subsets} (need at least 2 subsets for a rank correlation)"
            )
        if not 0.0 < self.alpha < 1.0:
            problems.append(f"alpha={self.alpha} (a fraction strictly between 0 and 1)")
        if any(k < 1 for k in self.k_values):
            problems.append(f"k_values={self.k_values} (positive integers)")
        if not 1 <= self.workers <= 2:
            problems.append(f"workers={self.workers} (1 or 2: the machine has two cores)")
        if self.bootstrap < 100:
            problems.append(f"bootstrap={self.bootstrap} (at least 100 resamples)")
        if not isinstance(self.retrain_seeds, int) or self.retrain_seeds < 1:
            problems.append(f"retrain_seeds={self.retrain_seeds!r} (a positive integer)")
        object.__setattr__(self, "configs", tuple(dict(c) for c in self.configs))
        reserved = {f"k{k}" for k in self.k_values} | {DENSE_RUN, EXACT_RUN}
        seen: set[str] = set()
        for c in self.configs:
            name = str(c.get("name", ""))
            if not _CONFIG_NAME.match(name) or name in reserved or name in seen:
                problems.append(
                    f"config name {name!r} (letters, digits, '_.+-'; unique; not one of the "
                    f"other runs {sorted(reserved)})"
                )
            seen.add(name)
            check_track_overrides({k: v for k, v in c.items() if k != "name"}, name)
        if problems:
            raise ConfigError("invalid LDS settings: " + "; ".join(problems))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["train"] = self.train.to_dict()
        d["k_values"] = list(self.k_values)
        d.pop("workers")  # how fast, not what: a resume may use another worker count
        d.pop("bootstrap")
        d.pop("compact")  # scoring only: a resume may add compact methods without retraining
        d["configs"] = [dict(c) for c in self.configs]
        return d


# -- extra tracking configurations ------------------------------------------------------------------
def track_fields() -> dict[str, object]:
    """``{field name: type}`` of :class:`TrackSettings`, read from the dataclass (not a copy)."""
    try:
        hints = typing.get_type_hints(TrackSettings)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: read the plain names
        simple = {"int": int, "float": float, "bool": bool, "str": str}
        hints = {
            f.name: simple.get(str(f.type).replace(" | None", ""), str)
            for f in dataclasses.fields(TrackSettings)
        }
    return {f.name: hints.get(f.name, str) for f in dataclasses.fields(TrackSettings)}


def check_track_overrides(overrides: dict, name: str = "config") -> TrackSettings:
    """The TrackSettings the overrides give; ConfigError on unknown keys or invalid values."""
    allowed = track_fields()
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ConfigError(
            f"tracking configuration {name!r}: unknown key(s) {unknown}; allowed keys: "
            f"{', '.join(allowed)}"
        )
    return TrackSettings(**overrides)


def _parse_value(key: str, text: str, typ) -> object:
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if args and type(None) in typing.get_args(typ):
        if text.lower() in ("none", "null"):
            return None
        typ = args[0]
    try:
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
    except ValueError:
        raise ConfigError(
            f"--config: {key}={text!r} is not a valid {getattr(typ, '__name__', typ)}"
        ) from None
    return text  # str, or an enum the settings parse themselves


def parse_config_spec(spec: str) -> dict:
    """``"name:k_in=64,k_out=64"`` → ``{"name": "name", "k_in": 64, "k_out": 64}``.

    Values are parsed by the type of the :class:`TrackSettings` field of that name (int, float,
    bool, str, enums by value; ``none`` for an optional field). ``"name"`` alone (no overrides)
    is the default TrackSettings under that name.

    Raises:
        ConfigError: no name, an item without ``=``, an unknown key (the message lists the
            allowed keys) or a value of the wrong type.
    """
    name, _, body = spec.partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"--config {spec!r}: give a name first, e.g. 'k64:k_in=64,k_out=64'")
    fields = track_fields()
    out: dict = {"name": name}
    for item in (x.strip() for x in body.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"--config {spec!r}: {item!r} is not key=value")
        if key not in fields:
            raise ConfigError(
                f"--config {spec!r}: unknown key {key!r}; allowed keys: {', '.join(fields)}"
            )
        out[key] = _parse_value(key, value.strip(), fields[key])
    check_track_overrides({k: v for k, v in out.items() if k != "name"}, name)
    return out


# -- statistics -----------------------------------------------------------------------------------
def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman correlation of each row of ``x`` with the same row of ``y`` (ties: average ranks).

    Args:
        x, y: ``(n, m)`` arrays.

    Returns:
        ``(n,)`` correlations; ``nan`` where a row is constant (the correlation is undefined).
    """
    from scipy.stats import rankdata

    x, y = np.atleast_2d(x), np.atleast_2d(y)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have one shape, got {x.shape} and {y.shape}")
    rx = rankdata(x, axis=1)  # (n, m)
    ry = rankdata(y, axis=1)
    rx -= rx.mean(1, keepdims=True)
    ry -= ry.mean(1, keepdims=True)
    den = np.sqrt((rx * rx).sum(1) * (ry * ry).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(1) / np.where(den > 0, den, 1.0), np.nan)


def bootstrap_ci(
    values: np.ndarray, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (``nan`` entries dropped)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if len(v) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(1)  # (n_boot,)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return float(lo), float(hi)


def lds_scores(scores: np.ndarray, masks: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """Per-eval-example LDS correlations.

    Args:
        scores: ``(n_eval, n_train)`` attribution scores ``τ(e, i)`` (positive = proponent).
        masks: ``(m, n_train)`` boolean subset membership.
        losses: ``(m, n_eval)`` loss of eval example ``e`` under the model trained on subset ``j``.

    Returns:
        ``(n_eval,)`` Spearman correlations between ``Σ_{i∈S_j} τ(e, i)`` and ``-losses[j, e]``.
    """
    pred = masks.astype(np.float64) @ scores.T.astype(np.float64)  # (m, n_eval)
    return spearman_rows(pred.T, -losses.T.astype(np.float64))


def summarize(per_example: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict:
    lo, hi = bootstrap_ci(per_example, n_boot, seed=seed)
    valid = ~np.isnan(per_example)
    return {
        "lds": float(np.mean(per_example[valid])) if valid.any() else float("nan"),
        "ci_low": lo,
        "ci_high": hi,
        "n_eval": int(len(per_example)),
        "n_valid": int(valid.sum()),
    }


# -- subsets ----------------------------------------------------------------------------------------
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


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)


def _loss_path(eval_dir: Path, j: int, r: int = 0) -> Path:
    """Eval losses of subset ``j``'s model (replicate ``r > 0``: retrained with another seed)."""
    return eval_dir / LOSSES_DIR / (f"subset_{j:03d}.npy" if r == 0 else f"subset_{j:03d}_r{r}.npy")


def _record(row: dict, task: str) -> dict:
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
        status = json.loads((run_dir / C.MANIFEST_FILE).read_text())["status"]
        if status != C.STATUS_COMPLETED:
            raise RunError(f"the retrain of subset {job['subset']} ended {status!r}; see {run_dir}")
        losses = _eval_losses(run_dir / C.MODEL_DIR, job["encs"], settings.task.value)
        _atomic_save_npy(_loss_path(job["eval_dir"], job["subset"], r), losses)
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return {"subset": job["subset"], "seconds": round(time.perf_counter() - t0, 3)}


# -- the pipeline -----------------------------------------------------------------------------------
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


def _check_or_write_config(eval_dir: Path, s: LdsSettings, overwrite: bool) -> None:
    cfg_path = eval_dir / EVAL_FILE
    cfg = s.to_dict()

    def resume_part(d: dict) -> dict:
        d = {k: d.get(k) for k in RESUME_KEYS}
        d["train"] = {k: v for k, v in (d["train"] or {}).items() if k != "track"}
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
            _atomic_write_text(cfg_path, json.dumps(doc, indent=2))
    eval_dir.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        _atomic_write_text(
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
    from ..training.models import TINY, build_model, save_model

    if s.train.model != TINY:
        return (
            s.train.model
        )  # a local directory or 'minilm': tokenizer and weights are fixed already
    base = eval_dir / BASE_MODEL_DIR
    if (base / "traceprop_model.json").exists():
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
    save_model(loaded, tmp)
    os.replace(tmp, base)
    return str(base.resolve())


def _run_names(s: LdsSettings) -> dict[str, TrackSettings]:
    scope = s.train.track.scope if s.train.track is not None else "all"
    runs = {
        f"k{k}": TrackSettings(scope=scope, k_in=k, k_out=k, seed=s.train.seed) for k in s.k_values
    }
    if s.dense:
        runs[DENSE_RUN] = TrackSettings(
            scope="last-block", sketch="dense", dense_k=s.dense_k, seed=s.train.seed
        )
    if s.exact:
        runs[EXACT_RUN] = TrackSettings(scope=scope, k_in=EXACT_K, k_out=EXACT_K, seed=s.train.seed)
    for c in s.configs:
        overrides = {k: v for k, v in c.items() if k != "name"}
        runs[c["name"]] = TrackSettings(**{"scope": scope, "seed": s.train.seed, **overrides})
    return runs


def _ensure_run(name: str, track: TrackSettings, s: LdsSettings, base: str, eval_dir: Path) -> Path:
    from ..training.loop import train

    run_dir = eval_dir / RUNS_DIR / name
    man = run_dir / C.MANIFEST_FILE
    sidecar = run_dir / RUN_TRACK_FILE
    want = json.loads(json.dumps(track.to_dict()))
    if man.exists() and json.loads(man.read_text()).get("status") == C.STATUS_COMPLETED:
        if not sidecar.exists() or json.loads(sidecar.read_text()) == want:
            return run_dir  # (no sidecar: a run of an older evaluation, trusted as before)
        log.warning("%s was tracked with other settings; training it again", run_dir)
    log.info("training the tracked run %s", name)
    train(dataclasses.replace(s.train, model=base, out=str(run_dir), track=track), overwrite=True)
    status = json.loads(man.read_text())["status"]
    if status != C.STATUS_COMPLETED:
        raise RunError(
            f"the tracked run {run_dir} ended {status!r}; rerun to resume the evaluation"
        )
    _atomic_write_text(sidecar, json.dumps(want, indent=1))
    return run_dir


def _write_subsets(eval_dir: Path, s: LdsSettings, examples) -> list[np.ndarray]:
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
        _atomic_write_text(path, json.dumps(doc))
    return subsets


def _retrain_all(jobs: list[dict], workers: int, eval_dir: Path, progress: dict, on_done) -> None:
    def done(r: dict) -> None:
        progress["done"] = sorted(set(progress["done"]) | {r["subset"]})
        progress["seconds"][str(r["subset"])] = r["seconds"]
        progress["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        _atomic_write_text(eval_dir / PROGRESS_FILE, json.dumps(progress, indent=1))
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
        ConfigError: settings differ from the evaluation already in ``s.out``.
        RunError: a training run failed or was cancelled.
    """
    import torch

    torch.set_num_threads(1)
    eval_dir = Path(s.out)
    _check_or_write_config(eval_dir, s, overwrite)
    base = _base_model(s, eval_dir)
    runs = _run_names(s)
    main = f"k{s.main_k}"
    result = LdsResult(out=eval_dir, complete=False)
    t0 = time.perf_counter()
    main_dir = _ensure_run(main, runs[main], s, base, eval_dir)
    result.seconds["tracked_run_main"] = round(time.perf_counter() - t0, 2)

    from ..attribution.query import open_run

    run = open_run(main_dir)
    examples = run.examples()
    subsets = _write_subsets(eval_dir, s, examples)
    eval_ids = examples.filter(examples["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    if not eval_ids:
        raise ConfigError(
            "the evaluation needs eval examples: pass --eval-data or a positive --eval-fraction"
        )
    encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    rows = [
        _record(r, run.task)
        for r in examples.filter(examples["split"] == C.SPLIT_TRAIN).iter_rows(named=True)
    ]
    run.close()

    # -- subset retrains (resumable) ----------------------------------------------------------------
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

    t1 = time.perf_counter()
    _retrain_all(jobs, s.workers, eval_dir, prog, on_done)
    result.seconds["subset_retrains"] = round(time.perf_counter() - t1, 2)
    shutil.rmtree(eval_dir / WORK_DIR, ignore_errors=True)
    if any(missing(j) for j in range(s.n_subsets)):
        return result
    per_rep = np.stack(
        [[np.load(_loss_path(eval_dir, j, r)) for j in range(s.n_subsets)] for r in reps]
    )  # (r, m, n_eval)
    losses = per_rep.mean(0)  # (m, n_eval)
    if s.retrain_seeds >= 2:
        # split half: the mean loss of the even replicates against the odd ones (r = 2: 0 vs 1)
        split = spearman_rows(per_rep[0::2].mean(0).T, per_rep[1::2].mean(0).T)  # (n_eval,)
        result.noise_ceiling = {
            "split_half_spearman": float(np.nanmean(split)),
            "ci": list(bootstrap_ci(split, s.bootstrap, seed=s.seed)),
            "what": "mean over eval examples of Spearman over subsets between the mean loss of "
            "the even and of the odd replicates (retrains of each subset with other seeds)",
            "halves": [len(range(0, s.retrain_seeds, 2)), len(range(1, s.retrain_seeds, 2))],
        }
    _atomic_save_npy(eval_dir / LOSSES_FILE, losses)

    # -- the other tracked runs and the scores ----------------------------------------------------
    t2 = time.perf_counter()
    run_dirs = {name: _ensure_run(name, tr, s, base, eval_dir) for name, tr in runs.items()}
    result.seconds["tracked_runs_other"] = round(time.perf_counter() - t2, 2)
    n_train = len(rows)
    masks = np.zeros((s.n_subsets, n_train), bool)
    for j, m in enumerate(subsets):
        masks[j, m] = True
    t3 = time.perf_counter()
    table = []
    for method in _score_methods(s, run_dirs, eval_ids, n_train, progress):
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
    result.seconds["scoring"] = round(time.perf_counter() - t3, 2)
    result.rows = table
    result.complete = True
    _write_results(eval_dir, s, table, losses, result.seconds, result.noise_ceiling)
    return result


def _fix_dense_sign_dtype(run) -> None:
    # Store.dense_projection returns float64 signs under NumPy 2 (float32 / np.float64 scalar),
    # and index_add_ refuses to mix them with the float32 gradient; cast until the store does.
    for layer in run.tracked_layers():
        if layer.dense_sign is not None:
            layer.dense_sign = layer.dense_sign.float()


def _factor_file(store, rank: int, run_dir: Path) -> Path:
    """``run_dir/factors-c{rank}.h5``, built from the run's store unless a valid one is there."""
    from ..errors import IndexStaleError, StoreError
    from ..store.compact import FactorStore, compact_store, factor_file_name

    path = run_dir / factor_file_name(rank)
    if path.exists():
        try:
            with FactorStore(path) as fs:
                fs.check_source(store)
                if fs.n_records == store.n_records:
                    return path
        except (StoreError, IndexStaleError) as e:
            log.warning("%s cannot be reused (%s); rebuilding it", path, e)
    log.info("compacting %s to rank %d", run_dir.name, rank)
    return compact_store(store, rank, out=path)


def _compact_methods(
    s: LdsSettings,
    run_dir: Path,
    k: int,
    entries: Sequence[tuple[str, int]],
    eval_ids: list[int],
    n_train: int,
):
    """Compact-storage methods of one factored run: rank-c factor files scored by ``factor_scores``.

    The test side is the same as the full-sketch method's (the run's query sketches, the
    preconditioner of the run's persisted index for that kind), so at ``c = min(k_out, k_in)``
    the scores equal the full-sketch scores up to float32 storage round-off.
    """
    from ..attribution.factor_scores import factor_scores
    from ..attribution.query import open_run
    from ..settings import IndexSettings
    from ..store.compact import FactorStore

    run = open_run(run_dir)
    try:
        sketches = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]
        n_layers = len(sketches[0])
        tests = [np.concatenate([sk[li] for sk in sketches]) for li in range(n_layers)]
        for p, c in entries:
            row = {
                "method": f"{p} c={c}",
                "family": COMPACT_FAMILY,
                "k": k,
                "preconditioner": p,
                "c": c,
            }
            try:
                pre = None
                if p != "identity":
                    _, _, pre = run.index(IndexSettings(preconditioner=p, damping=s.damping))
                with FactorStore(_factor_file(run.store, c, run_dir)) as fs:
                    es = factor_scores(tests, fs, pre, dtype=np.float64, with_bound=False)
                    row["factor_bytes_per_record"] = fs.nbytes_per_record()
                    row["lossless"] = fs.lossless
                    row["relative_residual"] = [layer.relative_residual for layer in fs.layers]
            except Exception as e:  # noqa: BLE001 - a method that cannot be scored is reported, not fatal
                log.warning("%s/%s c=%d cannot be scored: %s", run_dir.name, p, c, e)
                yield {**row, "scores": None, "error": f"{type(e).__name__}: {e}"}
                continue
            scores = np.zeros((len(eval_ids), n_train), np.float64)
            scores[:, es.example_ids] = es.scores
            row["full_bytes_per_record"] = 4 * sum(
                int(np.prod(layer.record_shape)) for layer in run.store.layers
            )
            yield {**row, "scores": scores}
    finally:
        run.close()


def _score_methods(
    s: LdsSettings, run_dirs: dict[str, Path], eval_ids: list[int], n_train: int, progress
):
    """Yield ``{method, family, k, preconditioner, scores (n_eval, n_train)}`` for every method."""
    from ..attribution.query import open_run
    from ..settings import IndexSettings

    def attribution(run_dir: Path, family: str, k, precs: Sequence[str]):
        run = open_run(run_dir)
        _fix_dense_sign_dtype(run)
        sketches = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]
        for p in precs:
            ix = IndexSettings(
                preconditioner="identity" if p == "cosine" else p,
                cosine=p == "cosine",
                damping=s.damping,
            )
            try:
                _, ids, pre = run.index(ix)
            except Exception as e:  # noqa: BLE001 - a method that cannot be fitted is reported, not fatal
                log.warning("%s/%s cannot be scored: %s", run_dir.name, p, e)
                yield {
                    "method": f"{family} {p}" if family != "factored" else p,
                    "family": family,
                    "k": k,
                    "preconditioner": p,
                    "scores": None,
                    "error": f"{type(e).__name__}: {e}",
                }
                continue
            scores = np.zeros((len(eval_ids), n_train), np.float64)
            for r, sk in enumerate(sketches):
                scores[r, ids] = run.all_scores(sk, ix)
            yield {
                "method": f"{family} {p}" if family != "factored" else p,
                "family": family,
                "k": k,
                "preconditioner": p,
                "scores": scores,
            }
        run.close()

    main = run_dirs[f"k{s.main_k}"]
    config_names = {c["name"]: c for c in s.configs}
    for name, rd in run_dirs.items():
        if name == DENSE_RUN:
            yield from attribution(rd, "dense", s.dense_k, PRECONDITIONERS)
        elif name == EXACT_RUN:
            yield from attribution(rd, "exact", None, PRECONDITIONERS)
        elif name in config_names:
            c = config_names[name]
            k = c.get("k_in") if c.get("k_in") == c.get("k_out") else None
            for m in attribution(rd, "config", k, PRECONDITIONERS):
                m["method"] = f"{name} {m['preconditioner']}"
                m["config"] = name
                yield m
        else:
            k = int(name[1:])
            for m in attribution(rd, "factored", k, PRECONDITIONERS):
                m["family"] = "factored" if k == s.main_k else "k-sweep"
                yield m
            entries = [(p, c) for kk, p, c in s.compact if kk == k]
            if entries:
                yield from _compact_methods(s, rd, k, entries, eval_ids, n_train)
        if progress:
            progress("scoring", list(run_dirs).index(name) + 1, len(run_dirs))

    # baselines on the main run's final model
    run = open_run(main)
    train_encs = [run.encode(eval_example=i)[0] for i in range(n_train)]
    eval_encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    h_tr, h_ev = run.representations(train_encs), run.representations(eval_encs)
    h_tr = h_tr / np.maximum(np.linalg.norm(h_tr, axis=1, keepdims=True), 1e-30)
    h_ev = h_ev / np.maximum(np.linalg.norm(h_ev, axis=1, keepdims=True), 1e-30)
    yield {
        "method": "representation similarity",
        "family": "baseline",
        "k": None,
        "preconditioner": None,
        "scores": (h_ev @ h_tr.T).astype(np.float64),
    }
    gn = run.gradient_norms().sort("example_id")
    g = np.zeros(n_train)
    g[gn["example_id"].to_numpy()] = gn["gradient_norm"].to_numpy()
    yield {
        "method": "gradient norm (query-independent)",
        "family": "baseline",
        "k": s.main_k,
        "preconditioner": None,
        "scores": np.broadcast_to(g, (len(eval_ids), n_train)).copy(),
    }
    if s.bm25:
        ex = run.examples()
        texts = [_example_text(r) for r in ex.iter_rows(named=True)]
        yield {
            "method": "bm25",
            "family": "baseline",
            "k": None,
            "preconditioner": None,
            "scores": bm25_scores([texts[e] for e in eval_ids], texts[:n_train]),
        }
    run.close()
    yield {
        "method": "random",
        "family": "baseline",
        "k": None,
        "preconditioner": None,
        "scores": np.random.default_rng(s.seed).standard_normal((len(eval_ids), n_train)),
    }


def _example_text(row: dict) -> str:
    if row.get("completion"):
        return (row.get("prompt") or "") + row["completion"]
    return row.get("text") or ""


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def bm25_scores(
    queries: Sequence[str], docs: Sequence[str], k1: float = BM25_K1, b: float = BM25_B
) -> np.ndarray:
    """Okapi BM25 of every document for every query (``(n_queries, n_docs)``).

    Words are lower-cased ``\\w+`` runs; ``idf = log(1 + (N - df + 0.5) / (df + 0.5))`` (never
    negative); a query word counts once per occurrence in the query.
    """
    from collections import Counter

    tfs = [Counter(_words(d)) for d in docs]
    lens = np.array([sum(t.values()) for t in tfs], np.float64)
    avg = max(float(lens.mean()), 1e-12) if len(lens) else 1.0
    df = Counter(w for t in tfs for w in t)
    n = len(docs)
    norm = k1 * (1 - b + b * lens / avg)  # (n_docs,)
    out = np.zeros((len(queries), n), np.float64)
    for qi, q in enumerate(queries):
        for w in _words(q):
            if w not in df:
                continue
            idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
            tf = np.array([t.get(w, 0) for t in tfs], np.float64)
            out[qi] += idf * tf * (k1 + 1) / (tf + norm)
    return out


def _finite(obj):
    """NaN -> None, so the JSON is standard (an undefined LDS reads as null)."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _write_results(
    eval_dir: Path,
    s: LdsSettings,
    table: list[dict],
    losses: np.ndarray,
    seconds: dict,
    noise_ceiling: dict | None = None,
) -> None:
    import csv

    doc = {
        "what": "LDS: mean over eval examples of Spearman(sum of scores over subset, -loss of the model retrained on it); "
        "95% percentile bootstrap interval over eval examples",
        "settings": s.to_dict(),
        "compact": [list(m) for m in s.compact],
        "n_subsets": s.n_subsets,
        "alpha": s.alpha,
        "n_eval": int(losses.shape[1]),
        "loss_mean_over_subsets": float(losses.mean()),
        "seconds": seconds,
        "retrain_seeds": s.retrain_seeds,
        "noise_ceiling": noise_ceiling,
        "rows": table,
    }
    _atomic_write_text(eval_dir / RESULTS_JSON, json.dumps(_finite(doc), indent=1))
    cols = [
        "method",
        "family",
        "k",
        "preconditioner",
        "c",
        "lds",
        "ci_low",
        "ci_high",
        "n_eval",
        "n_valid",
        "error",
        "config",  # last: readers of the columns before it keep working
    ]
    tmp = eval_dir / (RESULTS_CSV + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    os.replace(tmp, eval_dir / RESULTS_CSV)
    _atomic_write_text(eval_dir / FIGURE_FILE, lds_figure(table).to_json())


def _bar_label(row: dict) -> str:
    """The bar's x label; rows of a family scored at several k (compact storage) name their k."""
    if row.get("family") in ("factored", "k-sweep", "dense", "baseline", "exact", "config"):
        return row["method"]
    return f"{row['method']} (k={row['k']})" if row.get("k") is not None else row["method"]


def lds_figure(table: list[dict]):
    """Plotly figure: LDS ± CI per method (main table) and the k sweep per preconditioner."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("LDS by method (95% CI)", "k sweep (k_in = k_out)")
    )
    table = [r for r in table if r["lds"] is not None and not np.isnan(r["lds"])]
    main = [r for r in table if r.get("family") != "k-sweep"]
    fig.add_trace(
        go.Bar(
            x=[_bar_label(r) for r in main],
            y=[r["lds"] for r in main],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [r["ci_high"] - r["lds"] for r in main],
                "arrayminus": [r["lds"] - r["ci_low"] for r in main],
            },
            name="LDS",
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    sweep = [r for r in table if r.get("family") in ("factored", "k-sweep")]
    for p in PRECONDITIONERS:
        pts = sorted((r for r in sweep if r["preconditioner"] == p), key=lambda r: r["k"])
        if pts:
            fig.add_trace(
                go.Scatter(
                    x=[r["k"] for r in pts],
                    y=[r["lds"] for r in pts],
                    mode="lines+markers",
                    name=p,
                    error_y={
                        "type": "data",
                        "symmetric": False,
                        "array": [r["ci_high"] - r["lds"] for r in pts],
                        "arrayminus": [r["lds"] - r["ci_low"] for r in pts],
                    },
                ),
                row=1,
                col=2,
            )
    ks = sorted({r["k"] for r in sweep})
    refs = [
        r
        for r in table
        if r.get("family") == "exact" and r["preconditioner"] in ("identity", "kfac")
    ]
    refs += [r for r in table if r["method"] == "bm25"]
    for r in refs if ks else []:
        fig.add_trace(
            go.Scatter(
                x=[ks[0], ks[-1]],
                y=[r["lds"], r["lds"]],
                mode="lines",
                line={"dash": "dash"},
                name=r["method"],
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(
        type="log", title_text="k", tickvals=ks, ticktext=[str(k) for k in ks], row=1, col=2
    )
    fig.update_yaxes(title_text="LDS (Spearman)", row=1, col=1)
    fig.update_layout(title="Linear datamodeling score", height=420)
    return fig
