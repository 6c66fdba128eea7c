"""Settings of an LDS evaluation (:class:`LdsSettings`), its ``--config`` specs and its files.

The names of the files in an evaluation directory (``EVAL_DIR``, described in :mod:`.lds`) and
the atomic writes every step uses to keep that directory resumable live here too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..settings import TrackSettings, TrainSettings

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
PRECONDITIONERS = ("identity", "cosine", "kfac", "ekfac", "kfac-cos", "ekfac-cos")
"""Scored per tracked run: ``cosine`` is identity with cosine scores (the default index until stop 39; now ``kfac-cos``), ``-cos``
the same preconditioner with cosine scores (what the app's indexes use), the rest dot products."""
DEFAULT_METHOD = "default"
"""The main run's row under ``IndexSettings()`` as the run resolves it (``auto``: its
preconditioner, and a classification run's class prior); the rows of :data:`PRECONDITIONERS`
score the records alone (``class_prior=0``)."""
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
            and scored with :func:`traceprop_engine.attribution.score.factor_scores.factor_scores`
            (family ``factored-c``, method ``"{preconditioner} c={c}"``). Entries whose k is not in
            the sweep are skipped. Scoring only: not part of the settings a resume checks.
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
        levers: also score the main run's records with other record weightings and per-layer
            normalisation (family ``lever``, :mod:`.lds_levers`).
        final_grad: also score exact per-example gradients of every trainable parameter on
            the main run's final model, dot and cosine (family ``final-model``), post-hoc.

        The k sweep, dense, exact, bm25, configs, levers and final_grad are not part of the settings a resume checks
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
    levers: bool = True
    final_grad: bool = True

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
        if self.damping is not None and not (
            isinstance(self.damping, (int, float))
            and not isinstance(self.damping, bool)
            and math.isfinite(self.damping)
            and self.damping >= 0
        ):
            problems.append(f"damping={self.damping!r} (a finite number >= 0, or None)")
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
    bool, str, enums by value; ``none`` for an optional field). ``"name:"`` (no overrides) is
    the default TrackSettings under that name; a spec without ``:`` is refused (a typo).

    Raises:
        ConfigError: no name, no ``:``, an item without ``=``, an unknown key (the message lists the
            allowed keys) or a value of the wrong type.
    """
    name, colon, body = spec.partition(":")
    name = name.strip()
    if not colon:
        raise ConfigError(
            f"--config {spec!r}: write NAME:KEY=VALUE,... (e.g. 'k64:k_in=64,k_out=64'), or "
            f"'{name}:' for the default tracking settings under that name"
        )
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


# -- writing the evaluation directory -----------------------------------------------------------
def check_out_dir(out: Path) -> None:
    """ConfigError when an evaluation's output folder is a file (or a link to nothing)."""
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"--out {out} is a symbolic link to nothing; remove it or pick another")
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out} is a file, not a directory; pass a new or existing folder instead"
        )


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename: a killed evaluation leaves no half file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    """``np.save`` through a temporary file and a rename (see :func:`atomic_write_text`)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)
