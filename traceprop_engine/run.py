"""The run directory: manifest (run.json), progress log, status, and listing runs.

::

    RUN/
      run.json         manifest: status, configuration, data files + hashes, model fingerprint,
                       library versions, timings, metrics (written atomically)
      progress.jsonl   one JSON line per step while training: step, total, loss, examples/s, ETA
      store.h5         the attribution store (docs/store-format.md)
      model/           the final model + tokenizer (save_pretrained), or the peft adapter
      index/           the FAISS index and preconditioner (traceprop index)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import constants as C
from .errors import RunError


def bundled_roots() -> list[Path]:
    """The folders of bundled sample runs: the repository's ``sample_runs/`` and, when set,
    ``$TRACEPROP_SAMPLE_RUNS`` (where the app lists them). Bundled runs are read-only for
    every command and page but the maintainer's refits (``traceprop sample``, ``index
    --rebuild``)."""
    roots = [C.REPO_ROOT / "sample_runs"]
    if os.environ.get("TRACEPROP_SAMPLE_RUNS"):
        roots.append(Path(os.environ["TRACEPROP_SAMPLE_RUNS"]))
    return [r.resolve() for r in roots]


def is_bundled(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` lies in one of the :func:`bundled_roots`."""
    p = Path(run_dir).resolve()
    return any(p == r or r in p.parents for r in bundled_roots())


# module -> its distribution on the package index (for versions read without importing)
_DISTRIBUTIONS = {
    "torch": "torch",
    "transformers": "transformers",
    "numpy": "numpy",
    "h5py": "h5py",
    "faiss": "faiss-cpu",
    "peft": "peft",
}


def _version(module: str) -> str | None:
    """The version of ``module``: its ``__version__`` when it is imported already, else its
    installed distribution's (no import: an audit trail written by the app, whose server never
    imports torch, costs no torch import), else by importing it; None when not installed."""
    mod = sys.modules.get(module)
    if mod is None:
        try:
            return importlib.metadata.version(_DISTRIBUTIONS[module])
        except importlib.metadata.PackageNotFoundError:  # e.g. a source build of torch
            try:
                mod = importlib.import_module(module)
            except ImportError:
                return None
    return str(getattr(mod, "__version__", "unknown"))


def library_versions() -> dict[str, str]:
    """The versions of the libraries a run's numbers depend on (recorded in run.json and in
    audit trails)."""
    from . import __version__

    out = {"traceprop": __version__, "python": platform.python_version()}
    for m in ("torch", "transformers", "numpy", "h5py", "faiss"):
        out[m] = _version(m) or "unknown"
    if (peft := _version("peft")) is not None:
        out["peft"] = peft
    return out


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """Atomic write: a reader never sees half a run.json. Called by
    :meth:`~traceprop_engine.run_record.RunRecord.save` only (run.json's one writer)."""
    tmp = run_dir / (C.MANIFEST_FILE + ".tmp")
    try:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        os.replace(tmp, run_dir / C.MANIFEST_FILE)
    except BaseException:  # e.g. the disk is full: no empty run.json.tmp is left behind
        tmp.unlink(missing_ok=True)
        raise


def relative_paths(obj, run_dir: Path, root: Path):
    """``obj`` (a manifest) with every absolute path string under ``root`` rewritten relative to
    ``run_dir``: for a run that travels with its data (the committed sample run), so that no
    path of the machine that made it is kept. Readers resolve data relative to the run first."""
    if isinstance(obj, dict):
        return {k: relative_paths(v, run_dir, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative_paths(v, run_dir, root) for v in obj]
    if isinstance(obj, str) and os.path.isabs(obj):
        p = Path(obj).resolve()
        if p == root or root in p.parents:
            return os.path.relpath(p, run_dir.resolve())
    return obj


def read_manifest(run_dir: str | os.PathLike, *, as_written: bool = False) -> dict:
    """The run's manifest; a run still marked 'running' whose process is gone reads as 'failed'
    (unless ``as_written``: what the file says, for the resume that tells killed from failed)."""
    run_dir = Path(run_dir)
    p = run_dir / C.MANIFEST_FILE
    if not p.exists():
        raise RunError(
            f"{run_dir} is not a Traceprop run (no {C.MANIFEST_FILE}); runs are made by 'traceprop train'"
        )
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{p} is not valid JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"cannot read {p} ({e})") from e
    if not isinstance(m, dict):
        raise RunError(
            f"{p} holds a JSON {type(m).__name__}, not a run manifest (an object); "
            "the file is damaged or not written by Traceprop"
        )
    if not as_written and process_gone(m):
        m["status"] = C.STATUS_FAILED
        m.setdefault("error", "the training process ended without updating its status (killed?)")
    return m


def is_completed(run_dir: str | os.PathLike) -> bool:
    """``run_dir`` holds a run that finished (a readable run.json with status completed): what
    evaluations check before they reuse a run instead of training it again."""
    try:
        return RunManifest.load(run_dir).completed
    except RunError:
        return False


def process_gone(manifest: dict) -> bool:
    """True when ``manifest`` still says 'running' but its training process on this machine has
    ended: it was killed before it could write its final status, so the run failed.

    The one owner of this rule (the CLI's ``runs``, the app's job list and every reader of
    :func:`read_manifest` see the same answer). A run made on another host is taken at its word:
    its pid means nothing here.
    """
    pid = manifest.get("pid")
    return (
        manifest.get("status") == C.STATUS_RUNNING
        and bool(pid)
        and manifest.get("host") == platform.node()
        and not pid_alive(int(pid))
    )


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (a finished child nobody waited for) counts as ended."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap our own finished child
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child (another process launched it)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): kill(0) said it exists
        return True


def read_progress(run_dir: str | os.PathLike, last: int = 0) -> list[dict]:
    """Progress lines written so far (the last ``last`` lines when ``last > 0``)."""
    p = Path(run_dir) / C.PROGRESS_FILE
    if not p.exists():
        return []
    lines = p.read_text().splitlines()
    if last:
        lines = lines[-last:]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            continue
    return out


def list_runs(root: str | os.PathLike) -> list[Path]:
    """Run directories (with a run.json) directly under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if (p / C.MANIFEST_FILE).is_file()]
    return sorted(runs, key=lambda p: (p / C.MANIFEST_FILE).stat().st_mtime, reverse=True)


# -- the typed manifest ---------------------------------------------------------------------------
def _section(raw: dict, key: str) -> dict:
    """``raw[key]`` when it is an object, else ``{}``: older or hand-edited manifests may lack a
    section or hold something else there, and a reader must not fail on a section it skips."""
    v = raw.get(key)
    return v if isinstance(v, dict) else {}


def _pick(cls, section: dict):
    """An instance of the section dataclass ``cls`` from the keys of ``section`` it knows (the
    others stay in :attr:`RunManifest.raw`)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in section.items() if k in names and v is not None})


@dataclass(frozen=True)
class ModelInfo:
    """The manifest's ``model`` section: what was trained and, once saved, its fingerprint."""

    source: str | None = None
    task: str | None = None
    fingerprint: str | None = None  # absent until the model was saved (the run finished)
    saved: str | None = None  # the model folder, relative to the run
    labels: list | None = None
    tokenizer: bool | None = None  # False: saved without a tokenizer (show token ids)
    parameters: int | None = None
    trainable: int | None = None
    lora_rank: int | None = None


@dataclass(frozen=True)
class DataInfo:
    """The manifest's ``data`` section: where the data was and the sha256 of every file.

    ``root``/``eval_root`` are the paths recorded at training time; ``*_relative`` the same
    folders relative to the run (a run that moved with its data is checked beside itself).
    """

    root: str | None = None
    root_relative: str | None = None
    eval_root: str | None = None
    eval_root_relative: str | None = None
    files: dict = field(default_factory=dict)  # file name (relative to root) -> sha256
    eval_files: dict = field(default_factory=dict)
    n_train: int | None = None
    n_eval: int | None = None


@dataclass(frozen=True)
class TrackingInfo:
    """The manifest's ``tracking`` section (``Tracker.tracking_manifest``): the capture
    settings and every tracked layer. ``settings`` keeps the whole section as written."""

    k_in: int | None = None
    k_out: int | None = None
    sketch: str = "factored"
    dense_k: int | None = None
    rank: int | None = None
    layers: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Timings:
    """The manifest's ``timings`` section, written when the training loop ends."""

    n_steps: int | None = None
    total_s: float | None = None
    median_step_ms: float | None = None


@dataclass(frozen=True)
class StoreInfo:
    """The manifest's ``store`` section: the store file (or DDP shards) and its record count."""

    file: str | None = None
    shards: list = field(default_factory=list)
    n_records: int | None = None
    n_records_per_shard: list | None = None


@dataclass(frozen=True)
class RunManifest:
    """run.json, typed: what every reader of a run uses instead of ``.get()`` chains.

    Built by :meth:`load` (through :func:`read_manifest`, so a run whose process died reads as
    failed) or :meth:`from_dict`. Tolerant of older manifests: a missing or malformed section
    reads as empty. :attr:`raw` keeps the whole dict (``traceprop info --json``, sections no
    reader types). Written only through :class:`~traceprop_engine.run_record.RunRecord`.
    """

    raw: dict = field(repr=False, compare=False)
    run_id: str | None
    status: str | None
    created: str = ""
    updated: str = ""
    pid: int | None = None
    host: str | None = None
    error: str = ""  # why a failed run failed ("" when none is recorded)
    cancel_reason: str | None = None
    tracked: bool = True  # False: trained with --no-track (no store)
    config: dict = field(default_factory=dict)  # TrainSettings.to_dict(), or the Tracker's config
    model: ModelInfo = field(default_factory=ModelInfo)
    data: DataInfo = field(default_factory=DataInfo)
    tracking: TrackingInfo = field(default_factory=TrackingInfo)
    timings: Timings = field(default_factory=Timings)
    store: StoreInfo = field(default_factory=StoreInfo)
    shards: list = field(default_factory=list)  # DDP runs: one store file per rank
    distributed: dict = field(default_factory=dict)  # world_size, backend (parallel: fsdp)
    resumed: list = field(default_factory=list)  # one entry per train --resume
    notes: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: str | os.PathLike, *, as_written: bool = False) -> RunManifest:
        """The manifest of ``run_dir`` (``as_written``: see :func:`read_manifest`).

        Raises:
            RunError: no run.json, or not a readable JSON object.
        """
        return cls.from_dict(read_manifest(run_dir, as_written=as_written))

    @classmethod
    def from_dict(cls, raw: dict) -> RunManifest:
        tracking = _section(raw, "tracking")
        return cls(
            raw=raw,
            run_id=raw.get("run_id"),
            status=raw.get("status"),
            created=str(raw.get("created") or ""),
            updated=str(raw.get("updated") or ""),
            pid=raw.get("pid"),
            host=raw.get("host"),
            error=str(raw.get("error") or ""),
            cancel_reason=raw.get("cancel_reason"),
            tracked=bool(raw.get("tracked", True)),
            config=_section(raw, "config"),
            model=_pick(ModelInfo, _section(raw, "model")),
            data=_pick(DataInfo, _section(raw, "data")),
            tracking=_pick(TrackingInfo, {**tracking, "settings": tracking}),
            timings=_pick(Timings, _section(raw, "timings")),
            store=_pick(StoreInfo, _section(raw, "store")),
            shards=list(raw.get("shards") or []),
            distributed=_section(raw, "distributed"),
            resumed=list(raw.get("resumed") or []),
            notes=list(raw.get("notes") or []),
            metrics=_section(raw, "metrics"),
            versions=_section(raw, "versions"),
        )

    @property
    def task(self) -> str:
        """The trained task: from the configuration, else the model section, else causal-lm
        (the only task before classification existed)."""
        return str(self.config.get("task") or self.model.task or "causal-lm")

    @property
    def completed(self) -> bool:
        return self.status == C.STATUS_COMPLETED
