"""The Runs, Overview and Quality pages' data: run listings and summaries, bench and LDS results."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl

from traceprop_engine import constants as C
from traceprop_engine.errors import TracepropError
from traceprop_engine.run import RunManifest, list_runs, read_progress

from .config import AppConfig, PathError, is_sample, is_under
from .jobs import LAUNCH_FILE, JobError, job_state, launched_runs
from .text import fmt_bytes


def all_runs(cfg: AppConfig) -> list[Path]:
    """Sample runs first (the bundled ones are what a fresh checkout opens on), then user runs,
    then launched runs that never wrote a run.json (cancelled or failed while starting)."""
    return list_runs(cfg.sample_runs) + list_runs(cfg.runs_root) + launched_runs(cfg.runs_root)


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


# -- run summaries ---------------------------------------------------------------------------
def run_summary(cfg: AppConfig, run_dir: Path) -> dict:
    """One row of the Runs table (never raises: an unreadable run becomes a row saying so).

    No "overhead %" column: a run does not measure its own overhead (that needs an untracked
    twin), and a benchmark of another model is not this run's figure; the Overhead page shows
    the benchmarks as such.
    """
    kind = "sample" if is_sample(cfg, run_dir) else "user"
    if not (run_dir / C.MANIFEST_FILE).exists() and (run_dir / LAUNCH_FILE).exists():
        s = job_state(run_dir)  # launched, but its process never wrote a run.json
        return {"run": run_dir.name, "path": str(run_dir), "kind": kind, "status": s.status}
    try:
        m = RunManifest.load(run_dir)
    except TracepropError as e:
        return {
            "run": run_dir.name,
            "path": str(run_dir),
            "kind": kind,
            "status": "unreadable",
            "error": str(e),
        }
    tr = m.tracking
    store = run_dir / C.STORE_FILE
    median = median_step_ms(step_times(run_dir))
    return {
        "run": run_dir.name,
        "kind": kind,
        "status": m.status or "?",
        "model": f"{m.model.source or '?'} ({m.model.task or m.config.get('task', '?')})",
        "data": "/".join(Path(str(m.data.root or "?")).parts[-2:]),
        "examples": m.data.n_train,
        "tracked layers": len(tr.layers),
        "k": f"{tr.k_in or '?'}x{tr.k_out or '?'}"
        if tr.sketch == "factored"
        else f"dense {tr.dense_k}",
        "store": fmt_bytes(store.stat().st_size) if store.exists() else "—",
        "records": m.store.n_records,
        "median step ms": None if median is None else round(median, 2),
        "created": m.created,
        "path": str(run_dir),
        "error": m.error,
    }


def runs_table(cfg: AppConfig) -> pl.DataFrame:
    rows = [run_summary(cfg, p) for p in all_runs(cfg)]
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
    is_run = (p / C.MANIFEST_FILE).exists() or (p / LAUNCH_FILE).exists()
    if not is_under(p, cfg.runs_root) or p == cfg.runs_root or not is_run:
        raise PathError(f"{p} is not a run under {cfg.runs_root}")
    if job_state(p).running:
        raise JobError(f"{p.name} is still training: cancel it first")
    shutil.rmtree(p)


def median_step_ms(steps: pl.DataFrame) -> float | None:
    """THE median step time of a run, on the Runs page and the Overhead page alike: the median of
    :func:`step_times` (the per-step series the Overhead page plots)."""
    return float(steps["step_ms"].median()) if steps.height else None


def step_times(run_dir: Path) -> pl.DataFrame:
    """Per-step wall time (ms) of a run: from the store's timings, else from progress.jsonl."""
    from traceprop_engine.store.reader import Store

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
