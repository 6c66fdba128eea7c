"""The proof: the original run and its retrain on the cleaned copy, side by side, on the queries
that motivated the change (loss and answer before and after, how the rankings moved) and on the
eval set.

Rows of the retrain are matched to the original's by lineage: the cleaned copy left out some
rows, so a kept row's number in the copy is mapped back to its number in the source file
(:func:`source_row`) before :mod:`~traceprop_engine.attribution.reports.compare` matches
``source:row``. Saved as ``DATA_DIR/proof.json``.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from pathlib import Path

import polars as pl

from ..evaluate.lds_settings import atomic_write_text
from ..run import RunManifest
from .clean_copy import load_manifest

PROOF = "proof.json"


def dropped_rows(doc: dict) -> dict[str, list[int]]:
    """Per source file, the sorted rows the cleaned copy left out (removed or held out)."""
    out: dict[str, set[int]] = {}
    for r in doc["removed"]:
        out.setdefault(r["source"], set()).add(int(r["row"]))
    for name, info in doc["files"].items():
        out.setdefault(name, set()).update(info.get("held_out_rows") or [])
    return {k: sorted(v) for k, v in out.items()}


def source_row(new_row: int, dropped: list[int]) -> int:
    """The source file's row of row ``new_row`` of the cleaned copy (``dropped`` sorted)."""
    old = new_row
    # every dropped row at or before the answer shifts it by one; the answer moves as they count
    while True:
        shift = bisect.bisect_right(dropped, old)
        if new_row + shift == old:
            return old
        old = new_row + shift


def _in_source_rows(rows: pl.DataFrame, dropped: dict[str, list[int]]) -> pl.DataFrame:
    mapped = [
        source_row(int(r), dropped.get(s, [])) if s else int(r)
        for s, r in zip(rows["source"].to_list(), rows["row"].to_list(), strict=True)
    ]
    return rows.with_columns(pl.Series("row", mapped, dtype=rows["row"].dtype))


def _side(run, q: dict, top_k: int, settings) -> tuple[pl.DataFrame, dict]:
    from ..attribution import model_answer

    completion = q.get("completion") or None
    res = run.query(q["prompt"], completion, label=q.get("label"), top_k=top_k, settings=settings)
    ans = model_answer(run, q["prompt"], completion, label=q.get("label"))
    return res.rows, {
        "loss": ans.loss,
        "queried": ans.queried,
        "answer": ans.greedy,
        "matches": ans.matches,
    }


def _records(df: pl.DataFrame) -> list[dict]:
    return json.loads(df.write_json())


def prove(data_dir: str | os.PathLike, top_k: int = 10) -> dict:
    """Compare the source run of the cleaned copy ``data_dir`` with its retrain; saved to
    ``DATA_DIR/proof.json``.

    Raises:
        ConfigError: ``data_dir`` is not a cleaned copy, or it has no completed retrain.
    """
    from ..attribution import open_run, overlap, rank_changes
    from ..errors import ConfigError
    from ..settings import IndexSettings

    data_dir = Path(data_dir)
    doc = load_manifest(data_dir)
    rt = doc.get("retrain") or {}
    if rt.get("status") != "completed":
        raise ConfigError(
            f"{data_dir} has no completed retrain yet: run 'traceprop curate --retrain'"
        )
    before_dir, after_dir = Path(doc["source_run"]["path"]), Path(rt["run"])
    settings = IndexSettings(preconditioner=doc["selection"]["preconditioner"])
    dropped = dropped_rows(doc)
    removed_keys = {f"{r['source']}:{r['row']}" for r in doc["removed"]}
    before, after = open_run(before_dir), open_run(after_dir)
    queries = []
    try:
        for q in doc["queries"]:
            rows_a, ans_a = _side(before, q, top_k, settings)
            rows_b, ans_b = _side(after, q, top_k, settings)
            rows_b = _in_source_rows(rows_b, dropped)
            ch = rank_changes(rows_a, rows_b)
            key = pl.col("source") + ":" + pl.col("row").cast(pl.Utf8)
            ch = ch.with_columns(key.is_in(list(removed_keys)).alias("removed"))
            ch = ch.with_columns(
                pl.when(pl.col("removed"))
                .then(pl.lit("removed"))
                .otherwise(pl.col("status"))
                .alias("status")
            )
            queries.append(
                {
                    "query": {k: q.get(k) for k in ("prompt", "completion", "label")},
                    "before": ans_a,
                    "after": ans_b,
                    "loss_change": ans_b["loss"] - ans_a["loss"],
                    "overlap": _records(overlap(rows_a, rows_b, top_k)),
                    "changes": _records(ch.drop("removed")),
                }
            )
    finally:
        before.close()
        after.close()
    ma, mb = RunManifest.load(before_dir), RunManifest.load(after_dir)
    proof = {
        "before": {"run": str(before_dir), "run_id": ma.run_id, "n_train": ma.data.n_train},
        "after": {"run": str(after_dir), "run_id": mb.run_id, "n_train": mb.data.n_train},
        "removed": len(doc["removed"]),
        "top_k": top_k,
        "preconditioner": settings.preconditioner,
        "queries": queries,
        "eval": {
            "n_eval": [ma.data.n_eval, mb.data.n_eval],
            "eval_loss_before": ma.metrics.get("eval_loss"),
            "eval_loss_after": mb.metrics.get("eval_loss"),
        },
        "what": "loss = mean cross-entropy of the queried output on each run's final model; "
        "answer = the model's greedy output; rank_change = rank before - rank after (> 0: "
        "ranked higher after); status 'removed': the row is not in the cleaned copy",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_text(data_dir / PROOF, json.dumps(proof, indent=1, ensure_ascii=False))
    return proof


def load_proof(data_dir: str | os.PathLike) -> dict | None:
    p = Path(data_dir) / PROOF
    return json.loads(p.read_text()) if p.exists() else None
