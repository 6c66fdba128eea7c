"""The Curate page's data: which rows a selection removes, the background job that writes the
cleaned copy and retrains on it (``traceprop curate … --retrain``), and its proof.

The job is a ``traceprop curate`` process in its own process group, launched like a Launch job:
the retrained run's folder (``RUNS/<name>/``) holds ``launch.json`` and ``train.log`` from the
start, so the sidebar, the Runs page and Cancel see it as a training job; the cleaned copy goes
to ``RUNS/curated/<name>/`` (never beside a bundled sample run). The preview here uses the
Influencers result already on the page and the run's stored tables (no model in the server);
the job recomputes the same selection and records it in ``curate.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from traceprop_engine import constants as C
from traceprop_engine.curate import (
    MANIFEST,
    CurateQuery,
    Selection,
    load_manifest,
    load_proof,
)
from traceprop_engine.errors import ConfigError, TracepropError

from .config import AppConfig
from .jobs import (
    LAUNCH_FILE,
    JobError,
    active_job,
    check_run_name,
    job_slot,
    job_state,
    new_run_dir,
    process_alive,
    spawn_logged,
)
from .queries import cached_examples, manifest_mtime

CURATED_DIR = "curated"
STATUS_WORDS = {  # compare.rank_changes' statuses, as the page says them
    "both": "in both",
    "only a": "left the top",
    "only b": "entered the top",
    "flipped": "changed side",
    "removed": "removed",
}
MAX_K = 200


@dataclass(frozen=True)
class CuratePlan:
    """What the Curate form describes: queries (each a query dict of an Influencers result),
    the top k of each (proponents, or opponents), a ranking's top k, rows by hand."""

    queries: tuple[dict, ...] = ()
    top_k: int = 10
    opponents: bool = False
    by: str | None = None
    ids: tuple[str, ...] = ()
    preconditioner: str = C.DEFAULT_PRECONDITIONER  # identity on a run without statistics
    rows: tuple = field(default=(), compare=False)  # per query: its result rows (a DataFrame)

    def selection(self) -> Selection:
        """The engine's :class:`Selection` (raises ConfigError/QueryError when it is empty or bad)."""
        return Selection(
            queries=tuple(_curate_query(q) for q in self.queries),
            top_k=self.top_k if (self.queries or self.by) else 0,
            opponents=self.opponents,
            by=self.by,
            ids=self.ids,
            preconditioner=self.preconditioner,
        )


def _curate_query(q: dict) -> CurateQuery:
    if q.get("eval_example") is not None:
        return CurateQuery(eval_example=int(q["eval_example"]))
    return CurateQuery(q.get("prompt") or "", q.get("completion") or "", label=q.get("label"))


def parse_ids(typed: str) -> tuple[str, ...]:
    """Comma- or space-separated example ids or ``source:row``."""
    return tuple(t for t in typed.replace(",", " ").split() if t)


def query_label(q: dict) -> str:
    if q.get("eval_example") is not None:
        what = f"eval example #{q['eval_example']}"
    else:
        what = repr(q.get("prompt") or "")
    return f"{what} → {(q.get('label') or q.get('completion') or '')!r}"


def preview(run_dir: str | os.PathLike, plan: CuratePlan) -> pl.DataFrame:
    """``example_id, location, text, why`` of every row the plan removes (one row per example,
    its reasons joined), from the results on the page and the run's tables.

    Raises:
        ConfigError: a query's result holds fewer rows than k, or a bad hand-picked row.
    """
    plan.selection()  # the engine's checks first
    kind = "opponent" if plan.opponents else "proponent"
    why: dict[int, list[str]] = {}
    for i, rows in enumerate(plan.rows):
        part = rows.filter(pl.col("kind") == kind).sort("rank").head(plan.top_k)
        if int(plan.queries[i].get("top_k") or 0) < plan.top_k:
            raise ConfigError(
                f"query {i + 1} was asked for its top {plan.queries[i].get('top_k')}: ask it again "
                f"on the Influencers page with Top k ≥ {plan.top_k}, or lower k"
            )
        for r in part.iter_rows(named=True):
            why.setdefault(int(r["example_id"]), []).append(f"{kind} #{r['rank']} of query {i + 1}")
    ex = cached_examples(str(run_dir), manifest_mtime(run_dir))
    train = ex.filter(pl.col("split") == "train")
    if plan.by:
        from .distributions import cached_rank_by

        ranked = cached_rank_by(str(run_dir), manifest_mtime(run_dir), plan.by, plan.preconditioner)
        ranked = ranked.join(train.select("example_id"), on="example_id", how="semi")
        for r in ranked.head(plan.top_k).iter_rows(named=True):
            why.setdefault(int(r["example_id"]), []).append(f"{plan.by} #{r['rank']}")
    for token in plan.ids:
        if token.isdigit():
            hit = ex.filter(pl.col("example_id") == int(token))
        else:
            source, _, row = token.rpartition(":")
            ok = source and row.isdigit()
            hit = ex.filter((pl.col("source") == source) & (pl.col("row") == int(row or 0)))
            hit = hit if ok else hit.clear()
        if hit.is_empty() or hit["split"][0] != "train":
            raise ConfigError(f"{token!r} is no training example of this run (an id or source:row)")
        why.setdefault(int(hit["example_id"][0]), []).append("picked by hand")
    picked = train.filter(pl.col("example_id").is_in(list(why)))
    return picked.select(
        "example_id",
        (pl.col("source") + ":" + pl.col("row").cast(pl.Utf8)).alias("location"),
        "text",
        pl.col("example_id").replace_strict({k: "; ".join(v) for k, v in why.items()}).alias("why"),
    ).sort("example_id")


def command(run_dir: Path, plan: CuratePlan, data_dir: Path, out: Path) -> list[str]:
    """The ``traceprop curate … --retrain`` argv of the plan."""
    argv = [sys.executable, "-m", "traceprop_engine", "curate", str(Path(run_dir).resolve())]
    for q in plan.queries:
        if q.get("eval_example") is not None:
            argv += ["--eval-example", str(int(q["eval_example"]))]
        elif q.get("label"):
            argv += ["--prompt", q.get("prompt") or "", "--label", q["label"]]
        else:
            argv += ["--prompt", q.get("prompt") or "", "--completion", q.get("completion") or ""]
    if plan.queries or plan.by:
        argv += ["--remove-top-k", str(plan.top_k)]
    if plan.opponents:
        argv.append("--opponents")
    if plan.by:
        argv += ["--by", plan.by]
    if plan.ids:
        argv += ["--remove-ids", ",".join(plan.ids)]
    argv += ["--preconditioner", plan.preconditioner, "--out", str(data_dir)]
    argv += ["--retrain", "--retrain-out", str(out), "--threads", "1"]
    return argv + ["--compare-top-k", str(max(10, plan.top_k))]


def start(cfg: AppConfig, run_dir: str | os.PathLike, plan: CuratePlan, name: str = "") -> dict:
    """Start the curate job: ``{"run": RUNS/<name>, "data": RUNS/curated/<name>}``.

    Raises:
        JobError: another job is running, or a bad name.
        ConfigError, QueryError: an empty or bad selection (checked before anything starts).
    """
    plan.selection()
    check_run_name(name)
    with job_slot(cfg):
        running = active_job(cfg)
        if running is not None:
            raise JobError(f"a training job is already running ({running.run_dir.name})")
        out = new_run_dir(cfg, name or time.strftime("curated-%Y%m%d-%H%M%S"))
        data_dir = cfg.runs_root / CURATED_DIR / out.name
        if data_dir.exists():
            raise JobError(f"{data_dir} exists already: pick another name")
        out.mkdir(parents=True)
        cmd = command(Path(run_dir), plan, data_dir, out)
        proc = spawn_logged(cmd, out / "train.log", {"TQDM_MININTERVAL": "1"})
        launch = {"pid": proc.pid, "command": cmd, "started": time.time(), "curate": str(data_dir)}
        (out / LAUNCH_FILE).write_text(json.dumps(launch, indent=2))
    return {"run": str(out), "data": str(data_dir)}


def state(job: dict) -> dict:
    """``status``: running (training), comparing (trained, the proof being computed),
    completed (proof saved), failed, cancelled; with the training job's state and the log."""
    js = job_state(job["run"])
    proof = load_proof(job["data"]) if Path(job["data"], MANIFEST).exists() else None
    if proof is not None:
        return {"status": "completed", "job": js, "proof": proof}
    if js.running:
        return {"status": "running", "job": js}
    alive = process_alive(js.pid) or process_alive(_launch_pid(job["run"]))
    if js.status == "completed" and alive:
        return {"status": "comparing", "job": js}
    status = js.status if js.status in ("failed", "cancelled") else "failed"
    tail = js.log_tail or _log_tail(job["run"])
    return {"status": status, "job": js, "error": js.error or _last_error(tail), "log": tail}


def _launch_pid(run: str) -> int | None:
    try:
        return json.loads(Path(run, LAUNCH_FILE).read_text()).get("pid")
    except (OSError, json.JSONDecodeError):
        return None


def _log_tail(run: str, n: int = 30) -> str:
    p = Path(run, "train.log")
    lines = p.read_text(errors="replace").replace("\r", "\n").splitlines() if p.exists() else []
    return "\n".join(line for line in lines[-n:] if line.strip())


def _last_error(tail: str) -> str:
    errs = [line for line in tail.splitlines() if line.startswith("error:")]
    return errs[-1].removeprefix("error:").strip() if errs else ""


def earlier(cfg: AppConfig) -> list[dict]:
    """Earlier curate jobs of this runs root (newest first) as ``{"run", "data", "source"}``."""
    root = cfg.runs_root / CURATED_DIR
    out = []
    for d in sorted(root.glob("*/" + MANIFEST), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            doc = load_manifest(d.parent)
        except TracepropError:
            continue
        run = (doc.get("retrain") or {}).get("run") or str(cfg.runs_root / d.parent.name)
        out.append({"run": run, "data": str(d.parent), "source": doc["source_run"]["path"]})
    return out


def removed_rows(job: dict) -> list[dict]:
    """The manifest's removed rows: location, why, sha256."""
    doc = load_manifest(job["data"])
    return [
        {"location": f"{r['source']}:{r['row']}", "why": r["why"], "sha256": r["sha256"]}
        for r in doc["removed"]
    ]


def proof_tables(q: dict) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``(overlap, changes)`` of one query of a proof, for display."""
    ch = pl.DataFrame(q["changes"], infer_schema_length=None)
    if not ch.is_empty():
        ch = ch.select(
            (pl.col("source") + ":" + pl.col("row").cast(pl.Utf8)).alias("location"),
            "text",
            pl.col("kind_a").alias("before"),
            pl.col("rank_a").alias("rank before"),
            pl.col("kind_b").alias("after"),
            pl.col("rank_b").alias("rank after"),
            pl.col("rank_change").alias("moved up by"),
            pl.col("status").replace(STATUS_WORDS).alias("status"),
        )
    ov = pl.DataFrame(q["overlap"])
    if not ov.is_empty():
        ov = ov.select(
            "kind",
            pl.col("k").alias("top k"),
            pl.col("shared").alias("in both top lists"),
            pl.col("overlap_at_k").alias("overlap@k"),
        )
    return ov, ch
