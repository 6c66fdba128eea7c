"""The Runs page's story of one run: its loss curve, configuration, bytes per example, the
measured quality of its tracking configuration, and the Launch form prefilled with its settings."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from traceprop_engine import constants as C
from traceprop_engine.run import RunManifest, read_progress

from .config import DATASETS_DIR, AppConfig, is_under

LOSS_SCHEMA = {"step": pl.Int64, "epoch": pl.Int64, "loss": pl.Float64}


def loss_curve(run_dir: str | os.PathLike) -> pl.DataFrame:
    """``step``, ``epoch``, ``loss`` of every training step logged in the run's progress.jsonl."""
    rows = [
        {"step": int(p["step"]), "epoch": int(p.get("epoch", 0)), "loss": float(p["loss"])}
        for p in read_progress(run_dir)
        if "step" in p and p.get("loss") is not None
    ]
    return pl.DataFrame(rows, schema=LOSS_SCHEMA) if rows else pl.DataFrame(schema=LOSS_SCHEMA)


def storage(run_dir: str | os.PathLike) -> dict:
    """Bytes of the run's store: on disk, and per recorded example (steady state, what a long
    run costs per record, not a short run's chunk padding:
    :func:`traceprop_engine.store.sizes.steady_state_bytes`)."""
    from traceprop_engine.store.sizes import run_store_bytes, steady_state_bytes

    m = RunManifest.load(run_dir)
    out = {"store_bytes": run_store_bytes(run_dir), "records": m.store.n_records}
    store = Path(run_dir) / C.STORE_FILE
    if store.exists():
        s = steady_state_bytes(store)
        out["bytes_per_example"] = s["bytes_per_example"]
        out["bytes_per_example_nominal"] = s["bytes_per_example_nominal"]
    return out


def configuration(run_dir: str | os.PathLike) -> dict:
    """The run's training configuration and tracking settings, flat (``track.*`` keys)."""
    m = RunManifest.load(run_dir)
    cfg = {k: v for k, v in m.config.items() if k != "track"}
    cfg.update({f"track.{k}": v for k, v in m.tracking.settings.items()})
    return cfg


def quality(run_dir: str | os.PathLike) -> tuple[str, dict | None]:
    """``(one line, measured)``: :func:`traceprop_engine.evaluate.pareto.describe` and
    :func:`~traceprop_engine.evaluate.pareto.assess` of the run's tracking configuration."""
    from traceprop_engine.evaluate.pareto import assess, describe

    track = RunManifest.load(run_dir).tracking.settings
    return describe(track or None), (assess(track) if track else None)


def bytes_note(sizes: dict, measured: dict | None, n_layers: int) -> str | None:
    """One line on why the page shows two bytes-per-example figures (this run's, and the
    benchmark model's for the same configuration), or None when there is only one."""
    ours = sizes.get("bytes_per_example")
    if not ours or measured is None:
        return None
    bench = float(measured["measured"].bytes_per_example)
    if abs(bench - ours) <= 0.02 * bench:
        return None
    return (
        f"Two byte counts: {ours:,.0f} bytes per example is this run's store ({n_layers} "
        f"tracked layers of its model); {bench:,.0f} is the same tracking configuration measured "
        "on the benchmark model. Bytes per example grow with the number of tracked layers."
    )


def relaunch_state(cfg: AppConfig, run_dir: str | os.PathLike) -> tuple[dict, list[str]]:
    """``(session-state values of the Launch form's widgets, notes)`` reproducing the run's
    settings; notes say what the form cannot take over (data outside the data root...)."""
    run_dir = Path(run_dir)
    m = RunManifest.load(run_dir)
    c, t = m.config, m.tracking.settings
    notes: list[str] = []
    st: dict = {
        "launch_task": c.get("task", m.task),
        "launch_lora": int(c.get("lora_rank", 0)),
        "launch_epochs": int(c.get("epochs", 2)),
        "launch_lr": float(c.get("lr", 3e-3)),
        "launch_batch": int(c.get("batch_size", 8)),
        "launch_maxlen": int(c.get("max_length", 64)),
        "launch_tiny_layers": int(c.get("tiny_layers", 2)),
        "launch_tiny_width": int(c.get("tiny_width", 64)),
        "launch_seed": int(c.get("seed", 0)),
        "launch_scope": str(t.get("scope", "all")),
        "launch_k_in": int(t.get("k_in", 16)),
        "launch_k_out": int(t.get("k_out", 16)),
        "launch_rank": int(t.get("rank", 0)),
        "launch_sketch": str(t.get("sketch", "factored")),
        "launch_cov": bool(t.get("covariance", True)),
        "launch_name": f"{run_dir.name}-again",
    }
    model = str(c.get("model", "tiny"))
    if model in ("tiny", "minilm"):
        st["launch_model"] = model
    else:
        mp = (run_dir / model).resolve()
        if is_under(mp, cfg.data_root):
            st["launch_model"], st["launch_model_dir"] = "dir", str(mp.relative_to(cfg.data_root))
        else:
            notes.append(f"the model {model} is not under the data root: choose it again")
    data = (run_dir / str(c.get("data", ""))).resolve()
    datasets = cfg.runs_root / DATASETS_DIR
    if is_under(data, datasets):
        st["launch_data_kind"] = data.relative_to(datasets).parts[0]
    elif is_under(data, cfg.sample_runs):
        st["launch_data_kind"] = "classification" if m.task == "classification" else "facts"
        notes.append("the sample run's data: the bundled generated set of the same kind")
    elif is_under(data, cfg.data_root):
        st["launch_data_kind"] = "path"
        st["launch_data_path"] = str(data.relative_to(cfg.data_root))
        ev = c.get("eval_data")
        if ev and is_under((run_dir / ev).resolve(), cfg.data_root):
            st["launch_eval_path"] = str((run_dir / ev).resolve().relative_to(cfg.data_root))
    else:
        notes.append(f"the data {data} is not under the data root: choose it again")
    return st, notes
