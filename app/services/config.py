"""Where the app reads and writes, and the path safety of everything a user types or uploads."""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from traceprop_engine.errors import TracepropError

REPO = Path(__file__).resolve().parents[2]
DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet", ".txt")
UPLOADS_DIR = "uploads"
DATASETS_DIR = "datasets"
BENCH_DIR = "bench"
BUNDLED_RESULTS_DIR = "bundled-run-results"
"""Under the runs root: what the app computes for a run it must not write (a bundled sample run,
a read-only run), one folder per run (``services.counterfactual.results_dir``)."""
MAX_UPLOAD_BYTES = 200 * 1024 * 1024


class PathError(TracepropError, ValueError):
    """A typed or uploaded path would leave its allowed root, or does not exist."""


# -- configuration ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AppConfig:
    """Where the app reads and writes; from environment variables with repo-relative defaults."""

    runs_root: Path
    sample_runs: Path
    data_root: Path

    @classmethod
    def from_env(cls) -> AppConfig:
        runs = Path(os.environ.get("TRACEPROP_RUNS_ROOT") or REPO / "runs").expanduser().resolve()
        runs.mkdir(parents=True, exist_ok=True)
        data = Path(os.environ.get("TRACEPROP_DATA_ROOT") or REPO / "data").expanduser().resolve()
        data.mkdir(parents=True, exist_ok=True)  # the Launch page's paths are relative to it
        return cls(
            runs_root=runs,
            sample_runs=Path(os.environ.get("TRACEPROP_SAMPLE_RUNS") or REPO / "sample_runs")
            .expanduser()
            .resolve(),
            data_root=data,
        )

    @property
    def bench_dirs(self) -> list[Path]:
        """Folders with ``bench overhead`` JSON: TRACEPROP_BENCH_DIRS (os.pathsep-separated), or
        the runs root's ``bench/`` then the repository's ``benchmarks/results``."""
        env = os.environ.get("TRACEPROP_BENCH_DIRS")
        if env:
            return [Path(p).expanduser().resolve() for p in env.split(os.pathsep) if p]
        return [self.runs_root / BENCH_DIR, REPO / "benchmarks" / "results"]


def is_sample(cfg: AppConfig, run_dir: str | os.PathLike) -> bool:
    return is_under(Path(run_dir).resolve(), cfg.sample_runs)


# -- path safety -----------------------------------------------------------------------------
def is_under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def safe_path(root: str | os.PathLike, typed: str, *, must_exist: bool = True) -> Path:
    """Resolve ``typed`` (relative to ``root``, or absolute) and refuse anything outside ``root``.

    Symlinks are resolved before the check, so a link inside the root that points outside is
    refused like a ``..`` path.

    Raises:
        PathError: empty, outside the root, or missing (when ``must_exist``).
    """
    root = Path(root).resolve()
    typed = (typed or "").strip()
    if not typed:
        raise PathError(f"type a path under {root}")
    if "\x00" in typed:
        raise PathError("the path contains a NUL character")
    p = Path(typed).expanduser()
    p = (p if p.is_absolute() else root / p).resolve()
    if not is_under(p, root):
        raise PathError(
            f"{typed!r} is outside the allowed data root {root}; put the data under it (or set TRACEPROP_DATA_ROOT)"
        )
    if must_exist and not p.exists():
        raise PathError(f"{p} does not exist")
    return p


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def sanitize_name(name: str, *, default: str = "file") -> str:
    """A file name with no directories, no leading dots and only ``[A-Za-z0-9._-]``."""
    base = (name or "").replace("\\", "/").split("/")[-1]
    base = _UNSAFE.sub("_", base).strip("._-")
    base = re.sub(r"\.{2,}", ".", base)
    return base[:120] or default


def save_uploads(cfg: AppConfig, files: list[tuple[str, bytes]]) -> Path:
    """Write uploaded ``(name, content)`` pairs into a fresh folder under ``runs_root/uploads``.

    Raises:
        PathError: no files, an unsupported extension, an empty or oversized file.
    """
    if not files:
        raise PathError("upload at least one data file (.jsonl, .json, .csv, .parquet or .txt)")
    names: list[tuple[str, bytes]] = []
    for name, data in files:
        clean = sanitize_name(name)
        if not clean.lower().endswith(DATA_EXTENSIONS):
            raise PathError(
                f"{name!r}: unsupported file type; use one of {', '.join(DATA_EXTENSIONS)}"
            )
        if not data:
            raise PathError(f"{name!r} is empty")
        if len(data) > MAX_UPLOAD_BYTES:
            raise PathError(f"{name!r} is larger than {MAX_UPLOAD_BYTES // 2**20} MiB")
        names.append((clean, data))
    root = cfg.runs_root / UPLOADS_DIR
    out = root / (time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex())
    out.mkdir(parents=True)
    for clean, data in names:
        target = (out / clean).resolve()
        assert is_under(target, out.resolve())  # sanitize_name leaves no separators
        target.write_bytes(data)
    return out


def discard_uploads(cfg: AppConfig, folder: Path) -> None:
    """Remove a folder :func:`save_uploads` made (its files were refused); nothing else."""
    root = (cfg.runs_root / UPLOADS_DIR).resolve()
    folder = Path(folder).resolve()
    if folder.parent == root and folder.is_dir():
        shutil.rmtree(folder, ignore_errors=True)


def sample_dataset(cfg: AppConfig, kind: str) -> tuple[Path, Path]:
    """The generated facts or classification set under ``runs_root/datasets`` (made once)."""
    from traceprop_engine.samples import data as sd

    out = cfg.runs_root / DATASETS_DIR / kind
    if kind == "facts":
        if not (out / sd.EVAL_FILE).exists():
            sd.generate_sample_data(out)
        return out / sd.TRAIN_DIR, out / sd.EVAL_FILE
    if kind == "classification":
        if not (out / sd.CLASSIFICATION_EVAL_FILE).exists():
            sd.generate_classification_data(out)
        return out / sd.CLASSIFICATION_TRAIN_FILE, out / sd.CLASSIFICATION_EVAL_FILE
    raise ValueError(f"unknown sample dataset {kind!r}; use 'facts' or 'classification'")
