"""The thin service layer between the Streamlit pages and the engine.

Pages hold layout and widgets only; every value they show comes from a function here, and
every function here is plain Python (testable without Streamlit) except the few ``cached_*``
wrappers at the bottom, which add ``st.cache_resource`` / ``st.cache_data`` around them.

State lives on disk (run.json, progress.jsonl, launch.json), never in module globals, so a
closed browser tab neither kills nor orphans a training job and every user sees the same runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import streamlit as st

from traceprop_engine import constants as C
from traceprop_engine.attribution import export
from traceprop_engine.errors import TracepropError
from traceprop_engine.run import list_runs, pid_alive, read_manifest, read_progress
from traceprop_engine.settings import TrackSettings

REPO = Path(__file__).resolve().parent.parent
DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet", ".txt")
LAUNCH_FILE = "launch.json"  # written by the app next to run.json: pid + command of a launched job
UPLOADS_DIR = "uploads"
DATASETS_DIR = "datasets"
BENCH_DIR = "bench"
MAX_UPLOAD_BYTES = 200 * 1024 * 1024


class PathError(TracepropError, ValueError):
    """A typed or uploaded path would leave its allowed root, or does not exist."""


class JobError(TracepropError, RuntimeError):
    """A training job cannot be started or cancelled."""


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
        return cls(
            runs_root=runs,
            sample_runs=Path(os.environ.get("TRACEPROP_SAMPLE_RUNS") or REPO / "sample_runs")
            .expanduser()
            .resolve(),
            data_root=Path(os.environ.get("TRACEPROP_DATA_ROOT") or REPO / "data")
            .expanduser()
            .resolve(),
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
    return _is_under(Path(run_dir).resolve(), cfg.sample_runs)


def all_runs(cfg: AppConfig) -> list[Path]:
    """Sample runs first (the bundled ones are what a fresh checkout opens on), then user runs."""
    return list_runs(cfg.sample_runs) + list_runs(cfg.runs_root)


# -- path safety -----------------------------------------------------------------------------
def _is_under(path: Path, root: Path) -> bool:
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
    if not _is_under(p, root):
        raise PathError(
            f"{typed!r} is outside the allowed data root {root}; put the data under it (or set TRACEPROP_DATA_ROOT)"
        )
    if must_exist and not p.exists():
        raise PathError(f"{p} does not exist")
    return p


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def one_line(text: str, limit: int = 120) -> str:
    """A text as one readable line for a dropdown: line breaks shown as ' ⏎ ', cut at
    ``limit`` characters with an ellipsis (no Python repr quotes or escapes)."""
    flat = " ⏎ ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


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
        assert _is_under(target, out.resolve())  # sanitize_name leaves no separators
        target.write_bytes(data)
    return out


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


# -- run summaries ---------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run_summary(cfg: AppConfig, run_dir: Path, bench: list[dict] | None = None) -> dict:
    """One row of the Runs table (never raises: an unreadable run becomes a row saying so)."""
    try:
        m = read_manifest(run_dir)
    except TracepropError as e:
        return {
            "run": run_dir.name,
            "path": str(run_dir),
            "kind": "sample" if is_sample(cfg, run_dir) else "user",
            "status": "unreadable",
            "error": str(e),
        }
    tr = m.get("tracking", {}) or {}
    model = m.get("model", {}) or {}
    data = m.get("data", {}) or {}
    timings = m.get("timings", {}) or {}
    store = run_dir / C.STORE_FILE
    overhead = None
    for b in bench or []:
        bc = b.get("config", {})
        if all(bc.get(k) == tr.get(k) for k in ("k_in", "k_out", "sketch")):
            overhead = b.get("overhead_pct")  # the user's own bench folder comes first
            break
    return {
        "run": run_dir.name,
        "kind": "sample" if is_sample(cfg, run_dir) else "user",
        "status": m.get("status", "?"),
        "model": f"{model.get('source', '?')} ({model.get('task') or m.get('config', {}).get('task', '?')})",
        "data": "/".join(Path(str(data.get("root", "?"))).parts[-2:]),
        "examples": data.get("n_train"),
        "tracked layers": len(tr.get("layers", []) or []),
        "k": f"{tr.get('k_in', '?')}x{tr.get('k_out', '?')}"
        if tr.get("sketch", "factored") == "factored"
        else f"dense {tr.get('dense_k')}",
        "store": _fmt_bytes(store.stat().st_size) if store.exists() else "—",
        "records": (m.get("store") or {}).get("n_records"),
        "median step ms": round(timings["median_step_ms"], 2)
        if timings.get("median_step_ms")
        else None,
        "overhead %": None if overhead is None else round(float(overhead), 2),
        "created": m.get("created", ""),
        "path": str(run_dir),
        "error": m.get("error") or "",
    }


def runs_table(cfg: AppConfig) -> pl.DataFrame:
    bench = [b for _, b in read_bench(cfg)]
    rows = [run_summary(cfg, p, bench) for p in all_runs(cfg)]
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def delete_run(cfg: AppConfig, run_dir: str | os.PathLike) -> None:
    """Delete a user run directory.

    Raises:
        PathError: a sample run, or a path outside the runs root.
        JobError: the run is still training.
    """
    p = Path(run_dir).resolve()
    if is_sample(cfg, p):
        raise PathError("the bundled sample run cannot be deleted")
    if not _is_under(p, cfg.runs_root) or p == cfg.runs_root or not (p / C.MANIFEST_FILE).exists():
        raise PathError(f"{p} is not a run under {cfg.runs_root}")
    if job_state(p).running:
        raise JobError(f"{p.name} is still training: cancel it first")
    shutil.rmtree(p)


# -- bench results ---------------------------------------------------------------------------
def read_bench(cfg: AppConfig) -> list[tuple[str, dict]]:
    """``(file name, result)`` of every overhead-bench JSON found; unreadable files are skipped."""
    out = []
    for d in cfg.bench_dirs:
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.json")):
            try:
                b = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(b, dict) and "overhead_pct" in b and "plain_step_ms" in b:
                out.append((p.name, b))
    return out


def read_lds(cfg: AppConfig) -> list[tuple[str, dict, pl.DataFrame]]:
    """``(folder name, plotly figure dict, results table)`` of every ``traceprop eval lds`` output
    (a folder with ``figure.json`` and ``results.csv``) directly under the bench folders."""
    out = []
    for d in cfg.bench_dirs:
        if not d.is_dir():
            continue
        for sub in sorted(p for p in d.iterdir() if p.is_dir()):
            fig_p, csv_p = sub / "figure.json", sub / "results.csv"
            if not (fig_p.exists() and csv_p.exists()):
                continue
            try:
                fig = json.loads(fig_p.read_text())
                table = pl.read_csv(csv_p)
            except (OSError, json.JSONDecodeError, pl.exceptions.PolarsError):
                continue
            if "lds" in table.columns and isinstance(fig, dict) and "data" in fig:
                out.append((sub.name, fig, table))
    return out


def measured_configurations() -> pl.DataFrame:
    """The measured quality, overhead and bytes of the tracking configurations (empty when the
    table is absent), with the Pareto front marked: what the Launch page shows before a run."""
    from traceprop_engine.errors import ConfigError
    from traceprop_engine.evaluate.pareto import front, load_measured

    try:
        sets, rows = load_measured()
    except ConfigError:
        return pl.DataFrame()
    on_front = {r.name for r in front(rows)}
    return pl.DataFrame(
        [
            {
                "configuration": r.name + (" (default)" if r.default else ""),
                **{f"LDS {d}": round(r.lds[d], 3) for d in sets},
                "mean LDS": round(r.lds_mean, 3),
                "overhead %": round(r.overhead_pct, 1),
                "bytes / example": int(r.bytes_per_example),
                "on the front": r.name in on_front,
            }
            for r in sorted(rows, key=lambda r: -r.lds_mean)
        ]
    )


def assess_configuration(spec: LaunchSpec) -> str:
    """One sentence on the measured quality of a Launch configuration (or that it was not
    measured), saying when another measured configuration dominates it."""
    from traceprop_engine.evaluate.pareto import assess

    track = {**TrackSettings().to_dict(), "k_in": spec.k_in, "k_out": spec.k_out}
    track["rank"] = spec.rank
    hit = assess(track)
    if hit is None:
        return (
            f"k_in={spec.k_in}, k_out={spec.k_out}, rank={spec.rank}: not measured "
            "(benchmarks/EVAL.md lists the measured configurations)"
        )
    m = hit["measured"]
    text = (
        f"{m.name}: mean LDS {m.lds_mean:.2f}, overhead {m.overhead_pct:+.1f} %, "
        f"{m.bytes_per_example:.0f} bytes per example (measured, benchmarks/EVAL.md)"
    )
    if hit["dominated_by"]:
        text += ". Dominated by: " + ", ".join(hit["dominated_by"])
    return text


def step_times(run_dir: Path) -> pl.DataFrame:
    """Per-step wall time (ms) of a run: from the store's timings, else from progress.jsonl."""
    from traceprop_engine.store.hdf5 import Store

    store = run_dir / C.STORE_FILE
    if store.exists():
        try:
            with Store(store) as s:
                ms = s.timings().get("step_ms")
            if ms is not None and len(ms):
                return pl.DataFrame(
                    {
                        "step": range(1, len(ms) + 1),
                        "step_ms": [float(x) for x in ms],
                        "from": "store",
                    }
                )
        except (TracepropError, OSError, KeyError):
            pass
    prog = read_progress(run_dir)
    rows, prev = [], 0.0
    for p in prog:
        el = float(p.get("elapsed_s", 0.0))
        rows.append({"step": int(p["step"]), "step_ms": (el - prev) * 1e3, "from": "progress"})
        prev = el
    return (
        pl.DataFrame(rows)
        if rows
        else pl.DataFrame(schema={"step": pl.Int64, "step_ms": pl.Float64, "from": pl.Utf8})
    )


# -- training jobs ---------------------------------------------------------------------------
_TRACK_DEFAULTS = TrackSettings()


@dataclass(frozen=True)
class LaunchSpec:
    """A tracked fine-tune, as the Launch form describes it."""

    data: Path
    eval_data: Path | None = None
    model: str = "tiny"
    task: str = "causal-lm"
    lora_rank: int = 0
    epochs: int = 1
    lr: float = 3e-3
    batch_size: int = 8
    max_length: int = 64
    scope: str = "all"
    k_in: int = _TRACK_DEFAULTS.k_in
    k_out: int = _TRACK_DEFAULTS.k_out
    rank: int = _TRACK_DEFAULTS.rank
    sketch: str = "factored"
    covariance: bool = True
    seed: int = 0
    tiny_layers: int = 2
    tiny_width: int = 64
    extra: tuple[str, ...] = field(default_factory=tuple)

    def errors(self) -> list[str]:
        """Every problem with the spec, each a sentence saying how to fix it (empty: valid)."""
        e = []
        if not Path(self.data).exists():
            e.append(f"the training data {self.data} does not exist")
        if self.eval_data is not None and not Path(self.eval_data).exists():
            e.append(f"the eval data {self.eval_data} does not exist")
        if self.task not in ("causal-lm", "classification"):
            e.append("task must be 'causal-lm' or 'classification'")
        if self.model == "minilm" and self.task != "classification":
            e.append(
                "the minilm encoder only trains the classification task: pick task 'classification'"
            )
        if self.model == "tiny" and self.task == "classification":
            e.append(
                "the tiny model is a causal LM: use minilm (or a local classifier directory) for classification"
            )
        for name, v, lo in (
            ("epochs", self.epochs, 1),
            ("batch size", self.batch_size, 1),
            ("max length", self.max_length, 8),
            ("k in", self.k_in, 1),
            ("k out", self.k_out, 1),
            ("factor rank", self.rank, 0),
            ("LoRA rank", self.lora_rank, 0),
            ("tiny layers", self.tiny_layers, 1),
            ("tiny width", self.tiny_width, 8),
        ):
            if int(v) < lo:
                e.append(f"{name} must be at least {lo} (got {v})")
        if not 0 < float(self.lr) <= 1:
            e.append(f"learning rate must be in (0, 1] (got {self.lr})")
        if self.sketch not in ("factored", "dense"):
            e.append("sketch must be 'factored' or 'dense'")
        if self.scope != "all" and self.scope != "last-block":
            try:
                re.compile(self.scope)
            except re.error as ex:
                e.append(f"scope {self.scope!r} is not 'all', 'last-block' or a valid regex ({ex})")
        return e

    def command(self, run_dir: Path) -> list[str]:
        from traceprop_engine.cli.train import train_argv

        tiny = self.model == "tiny"
        flags = {
            "data": self.data,
            "out": run_dir,
            "model": self.model,
            "task": self.task,
            "epochs": self.epochs,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "lora_rank": self.lora_rank,
            "scope": self.scope,
            "k_in": self.k_in,
            "k_out": self.k_out,
            "rank": self.rank,
            "sketch": self.sketch,
            "seed": self.seed,
            "eval_data": self.eval_data,
            "no_covariance": not self.covariance,
            "tiny_layers": self.tiny_layers if tiny else None,
            "tiny_width": self.tiny_width if tiny else None,
        }
        return train_argv(flags) + list(self.extra)


@dataclass(frozen=True)
class JobState:
    """What a launched (or listed) run is doing, read from disk."""

    run_dir: Path
    status: str  # starting | running | completed | failed | cancelled | missing
    pid: int | None = None
    step: int = 0
    total: int = 0
    loss: float | None = None
    eta_s: float | None = None
    examples_per_s: float | None = None
    error: str = ""
    log_tail: str = ""

    @property
    def running(self) -> bool:
        return self.status in ("starting", C.STATUS_RUNNING)

    @property
    def fraction(self) -> float:
        return min(self.step / self.total, 1.0) if self.total else 0.0


def process_alive(pid: int | None) -> bool:
    """True while ``pid`` runs (see :func:`traceprop_engine.run.pid_alive`)."""
    return bool(pid) and pid_alive(int(pid))


def log_tail(run_dir: Path, n: int = 40) -> str:
    p = Path(run_dir) / C.LOG_FILE
    if not p.exists():
        return ""
    lines = p.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(line for line in lines[-n:] if line.strip())


def job_state(run_dir: str | os.PathLike) -> JobState:
    """The state of a run from its files (launch.json, run.json, progress.jsonl, train.log)."""
    run_dir = Path(run_dir)
    launch = {}
    if (run_dir / LAUNCH_FILE).exists():
        try:
            launch = json.loads((run_dir / LAUNCH_FILE).read_text())
        except json.JSONDecodeError:
            launch = {}
    pid = launch.get("pid")
    alive = process_alive(pid)
    status, error = "missing", ""
    if (run_dir / C.MANIFEST_FILE).exists():
        try:
            m = read_manifest(run_dir)
            status, error = m.get("status", "failed"), m.get("error") or ""
            pid = m.get("pid") or pid
            if status == C.STATUS_RUNNING and pid and not alive and not process_alive(pid):
                status, error = (
                    C.STATUS_FAILED,
                    error or "the training process ended without updating its status",
                )
        except TracepropError as e:
            status, error = C.STATUS_FAILED, str(e)
    elif launch:
        status = "starting" if alive else C.STATUS_FAILED
        if not alive:
            error = "the training process exited before it created the run (see the log)"
    prog = read_progress(run_dir, last=1)
    last = prog[-1] if prog else {}
    tail = log_tail(run_dir) if status in (C.STATUS_FAILED, C.STATUS_CANCELLED) else ""
    return JobState(
        run_dir=run_dir,
        status=status,
        pid=pid,
        step=int(last.get("step", 0)),
        total=int(last.get("total", 0)),
        loss=last.get("loss"),
        eta_s=last.get("eta_s"),
        examples_per_s=last.get("examples_per_s"),
        error=error,
        log_tail=tail,
    )


def active_job(cfg: AppConfig) -> JobState | None:
    """The user run that is training now (one job at a time), or None."""
    root = cfg.runs_root
    candidates = [
        p
        for p in root.iterdir()
        if p.is_dir() and ((p / LAUNCH_FILE).exists() or (p / C.MANIFEST_FILE).exists())
    ]
    for p in sorted(candidates, key=lambda q: q.stat().st_mtime, reverse=True):
        s = job_state(p)
        if s.running:
            return s
    return None


def new_run_dir(cfg: AppConfig, name: str = "") -> Path:
    base = sanitize_name(name, default="") if name else ""
    base = base or time.strftime("run-%Y%m%d-%H%M%S")
    p = cfg.runs_root / base
    i = 2
    while p.exists():
        p = cfg.runs_root / f"{base}-{i}"
        i += 1
    return p


def start_job(cfg: AppConfig, spec: LaunchSpec, name: str = "") -> JobState:
    """Start ``traceprop train`` in its own process group, logging to RUN/train.log.

    Raises:
        JobError: another job is running, or the spec is invalid.
    """
    running = active_job(cfg)
    if running is not None:
        raise JobError(
            f"a training job is already running ({running.run_dir.name}); wait for it or cancel it first"
        )
    errs = spec.errors()
    if errs:
        raise JobError("; ".join(errs))
    run_dir = new_run_dir(cfg, name)
    run_dir.mkdir(parents=True)
    cmd = spec.command(run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_MININTERVAL": "1"}
    with open(run_dir / C.LOG_FILE, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    (run_dir / LAUNCH_FILE).write_text(
        json.dumps({"pid": proc.pid, "command": cmd, "started": time.time()}, indent=2)
    )
    return job_state(run_dir)


def cancel_job(run_dir: str | os.PathLike) -> bool:
    """SIGTERM the job's process group (training stops at the next step, status 'cancelled').

    Returns:
        True if a signal was sent, False if the job was not running.
    """
    s = job_state(run_dir)
    if not s.running or not s.pid:
        return False
    try:
        os.killpg(os.getpgid(s.pid), signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def wait_job(run_dir: str | os.PathLike, timeout_s: float = 120.0, poll_s: float = 0.2) -> JobState:
    """Poll until the job is no longer running (or the timeout passes)."""
    end = time.monotonic() + timeout_s
    s = job_state(run_dir)
    while s.running and time.monotonic() < end:
        time.sleep(poll_s)
        s = job_state(run_dir)
    return s


# -- queries and exports ---------------------------------------------------------------------
def shown_rows(result) -> pl.DataFrame:
    """Exactly the rows shown and exported: the engine's export columns plus ``file:row``."""
    rows = export.rows_for_export(result)
    return rows.with_columns(
        (pl.col("source") + ":" + pl.col("row").cast(pl.Utf8)).alias("location")
    )


def export_bytes(result, fmt: str) -> bytes:
    """CSV or JSON bytes of the shown influencer rows."""
    return export.rows_to_bytes(shown_rows(result), fmt)


def audit_bytes(run, result) -> tuple[bytes, bytes, dict]:
    """``(json bytes, csv bytes, trail)`` of the audit trail of one query."""
    trail = export.audit_trail(run, result)
    js = json.dumps(trail, indent=2, ensure_ascii=False, default=str).encode()
    rows = export.audit_rows(trail)
    return js, export.csv_bytes(rows) if rows.height else b"", trail


def layer_scores_table(layer_scores: str) -> pl.DataFrame:
    d = json.loads(layer_scores or "{}")
    return pl.DataFrame({"layer": list(d), "score": [float(v) for v in d.values()]})


def decode_tokens(run_dir: Path, ids, loss_mask) -> str:
    """Tokens as text, the trained-on (loss) tokens in ⟦brackets⟧; ids when no tokenizer loads."""
    tok = cached_tokenizer(str(run_dir))
    out = []
    for t, m in zip(ids.tolist(), loss_mask.tolist(), strict=True):
        piece = tok.decode([t]) if tok is not None else str(t)
        out.append(f"⟦{piece}⟧" if m else piece)
    return ("" if tok is not None else "ids: ") + (
        "".join(out) if tok is not None else " ".join(out)
    )


# -- cached engine handles (Streamlit) -------------------------------------------------------
def manifest_mtime(run_dir: str | os.PathLike) -> float:
    p = Path(run_dir) / C.MANIFEST_FILE
    return p.stat().st_mtime if p.exists() else 0.0


@st.cache_resource(max_entries=8, show_spinner="Opening the run…")
def _open_run(run_dir: str, mtime: float):
    from traceprop_engine.attribution.query import open_run

    return open_run(run_dir), threading.Lock()


def open_cached(run_dir: str | os.PathLike):
    """``(AttributionRun, lock)`` cached per run path + manifest mtime; the lock serialises queries."""
    return _open_run(str(Path(run_dir).resolve()), manifest_mtime(run_dir))


@st.cache_resource(max_entries=8, show_spinner=False)
def cached_tokenizer(run_dir: str):
    try:
        from transformers import AutoTokenizer

        info = Path(run_dir) / C.MODEL_DIR / "traceprop_model.json"
        if info.exists() and json.loads(info.read_text()).get("tokenizer") is False:
            return None  # a run finished without a tokenizer: show token ids
        return AutoTokenizer.from_pretrained(str(Path(run_dir) / C.MODEL_DIR))
    except (OSError, ValueError):
        return None


@st.cache_data(max_entries=16, show_spinner=False)
def cached_examples(run_dir: str, mtime: float, split: str | None = None) -> pl.DataFrame:
    run, _ = open_cached(run_dir)
    ex = run.examples()
    return ex if split is None else ex.filter(pl.col("split") == split)


@st.cache_data(max_entries=16, show_spinner=False)
def cached_step_times(run_dir: str, mtime: float) -> pl.DataFrame:
    return step_times(Path(run_dir))


def run_query(
    run_dir: str | os.PathLike,
    *,
    prompt=None,
    completion=None,
    eval_example=None,
    label=None,
    top_k: int = 10,
    preconditioner: str = C.DEFAULT_PRECONDITIONER,
):
    """``(QueryResult, influence by source)`` of one query on a cached run (serialised per run)."""
    from traceprop_engine.attribution.query import IndexSettings

    run, lock = open_cached(run_dir)
    s = IndexSettings(preconditioner=preconditioner)
    with lock:
        res = run.query(
            prompt, completion, eval_example=eval_example, label=label, top_k=top_k, settings=s
        )
        by_source = run.influence_by_source(res, s)
    return res, by_source


def ensure_active_run(cfg: AppConfig, state) -> Path | None:
    """The active run kept in ``state['runs_active']``; defaults to the first sample run."""
    runs = all_runs(cfg)
    cur = state.get("runs_active")
    if cur and any(str(p) == cur for p in runs):
        return Path(cur)
    if not runs:
        state.pop("runs_active", None)
        return None
    state["runs_active"] = str(runs[0])
    return runs[0]


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>#~|$])")


def md_escape(text: object) -> str:
    """Text from data or the file system made safe for Streamlit's markdown-rendering elements."""
    return _MD_SPECIAL.sub(r"\\\1", str(text))
