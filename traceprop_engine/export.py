"""Exports: influencer rows as CSV/JSON, audit trails, and verification of a run's inputs.

An audit trail records *what was asked of which model and what it answered*: the query, run
id, model fingerprint, data-manifest hash, time, software versions and every influencer with
its example id, source file, row, content sha256, score and rank. It does not prove that the
influencers *caused* the output (attribution scores are estimates; see docs/audit.md), nor that
the data files are the ones a reader has now — that is what ``verify`` checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import polars as pl

from . import constants as C
from .data import sha256_file
from .models import model_fingerprint
from .run import library_versions, read_manifest

EXPORT_COLUMNS = [
    "rank",
    "kind",
    "score",
    "example_id",
    "source",
    "row",
    "sha256",
    "text",
    "label",
    "layer_scores",
]


def rows_for_export(result) -> pl.DataFrame:
    """The full rows of a :class:`~traceprop_engine.query.QueryResult`, in a stable column order."""
    rows = result.rows
    cols = [c for c in EXPORT_COLUMNS if c in rows.columns] + [
        c for c in rows.columns if c not in EXPORT_COLUMNS
    ]
    return rows.select(cols)


CSV_FORMULA_CHARS = ("=", "+", "-", "@", "\t", "\r")
"""A text cell starting with one of these is read as a formula by spreadsheet programs (CSV
injection, e.g. ``=HYPERLINK(...)``)."""


def csv_safe(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with every text cell that starts with a formula character prefixed by ``'``.

    The OWASP rule against CSV injection: a spreadsheet shows the cell as text instead of
    evaluating it. Only text columns change (a negative score stays a number); use it for CSV
    only, JSON exports keep the exact values.
    """
    pattern = "^[" + "".join("\\" + c if c == "-" else c for c in CSV_FORMULA_CHARS) + "]"
    exprs = [
        pl.when(pl.col(c).str.contains(pattern))
        .then(pl.lit("'") + pl.col(c))
        .otherwise(pl.col(c))
        .alias(c)
        for c, dtype in df.schema.items()
        if dtype == pl.String
    ]
    return df.with_columns(exprs) if exprs else df


def csv_bytes(df: pl.DataFrame) -> bytes:
    """CSV bytes of ``df`` with formula-like cells neutralised (:func:`csv_safe`); every CSV
    the engine, the CLI and the app write goes through here."""
    return csv_safe(df).write_csv().encode()


def write_csv(df: pl.DataFrame, path: str | os.PathLike) -> None:
    """Write ``df`` as CSV to ``path`` (see :func:`csv_bytes`)."""
    Path(path).write_bytes(csv_bytes(df))


def rows_to_bytes(rows: pl.DataFrame, fmt: str) -> bytes:
    """CSV (formula-like cells neutralised) or JSON (exact; a list of row objects) of ``rows``."""
    if fmt == "csv":
        return csv_bytes(rows)
    if fmt == "json":
        return json.dumps(rows.to_dicts(), indent=2, ensure_ascii=False).encode()
    raise ValueError(f"format must be 'csv' or 'json', got {fmt!r}")


def write_rows(rows: pl.DataFrame, path: str | os.PathLike, fmt: str) -> None:
    Path(path).write_bytes(rows_to_bytes(rows, fmt))


def data_manifest_hash(manifest: dict) -> str:
    """One hash over the data section of a manifest (file names and their hashes)."""
    d = manifest.get("data", {})
    blob = json.dumps(
        {"files": d.get("files", {}), "eval_files": d.get("eval_files", {})}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def audit_trail(run, result) -> dict:
    """The audit record of one query (see the module docstring for what it does and does not prove)."""
    m = run.manifest
    rows = rows_for_export(result)
    return {
        "kind": "traceprop-audit-trail",
        "version": 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_id": run.run_id,
        "run_dir": str(Path(run.dir).resolve()),
        "run_status": m.get("status"),
        "model_fingerprint": m.get("model", {}).get("fingerprint"),
        "data_manifest_sha256": data_manifest_hash(m),
        "store_schema_version": C.SCHEMA_VERSION,
        "software": library_versions(),
        "query": result.query,
        "notes": result.notes,
        "sign_convention": result.sign_note,
        "influencers": [
            {
                k: r[k]
                for k in ("rank", "kind", "score", "example_id", "source", "row", "sha256")
                if k in r
            }
            for r in rows.iter_rows(named=True)
        ],
    }


def audit_rows(trail: dict) -> pl.DataFrame:
    """The trail's influencers as a table, each row stamped with run id, model and time (CSV form)."""
    base = {
        "run_id": trail["run_id"],
        "model_fingerprint": trail["model_fingerprint"],
        "data_manifest_sha256": trail["data_manifest_sha256"],
        "time": trail["time"],
        "query": json.dumps(trail["query"], ensure_ascii=False, default=str),
    }
    return (
        pl.DataFrame([{**base, **inf} for inf in trail["influencers"]])
        if trail["influencers"]
        else pl.DataFrame()
    )


def verify_run(run_dir: str | os.PathLike) -> dict:
    """Re-hash every data file and the saved model against the manifest.

    Returns:
        ``{"ok": bool, "files": [{"file", "status": ok|changed|missing, "expected", "actual"}], "model": {...}}``
    """
    run_dir = Path(run_dir)
    m = read_manifest(run_dir)
    d = m.get("data", {})
    out = []
    for root_key, files_key in (("root", "files"), ("eval_root", "eval_files")):
        root = Path(d.get(root_key, ""))
        rel = d.get(f"{root_key}_relative")
        if (
            not root.is_dir() and rel
        ):  # the run and its data moved together (e.g. the bundled sample)
            root = (run_dir / rel).resolve()
        for name, want in sorted(d.get(files_key, {}).items()):
            p = root / name
            if not p.exists():
                out.append({"file": str(p), "status": "missing", "expected": want, "actual": None})
                continue
            got = sha256_file(p)
            out.append(
                {
                    "file": str(p),
                    "status": "ok" if got == want else "changed",
                    "expected": want,
                    "actual": got,
                }
            )
    model = {"status": "absent"}
    want = m.get("model", {}).get("fingerprint")
    if want:
        md = run_dir / C.MODEL_DIR
        got = model_fingerprint(md) if md.exists() else None
        model = {
            "dir": str(md),
            "status": "ok" if got == want else ("missing" if got is None else "changed"),
            "expected": want,
            "actual": got,
        }
    ok = all(f["status"] == "ok" for f in out) and model["status"] in ("ok", "absent")
    return {"ok": ok, "run_id": m.get("run_id"), "files": out, "model": model}
