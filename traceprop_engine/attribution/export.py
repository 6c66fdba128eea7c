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

from .. import constants as C
from ..run import library_versions, read_manifest
from ..training.data import sha256_file
from ..training.models import model_fingerprint

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
    """The full rows of a :class:`~traceprop_engine.attribution.query.QueryResult`, in a stable column order."""
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


def _data_root(run_dir: Path, d: dict, root_key: str) -> Path:
    """Where a run's data files are now: relative to the run first (the run and its data moved
    together, as in the bundled sample), then the absolute path recorded at training time."""
    rel, recorded = d.get(f"{root_key}_relative"), d.get(root_key)
    candidates = ([run_dir / rel] if rel else []) + ([Path(recorded)] if recorded else [])
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    return (candidates[0] if candidates else run_dir).resolve()


def verify_run(run_dir: str | os.PathLike) -> dict:
    """Re-hash every data file, the saved model and the store's content against the manifest.

    Data and model paths are resolved relative to the run directory (so a moved run checks the
    files beside it, not those of the machine that made it). ``ok`` is true only when the run
    completed, records data files and a saved model, every recorded file is there and matches,
    and the store's content digest matches (a store written before digests existed is reported
    ``unchecked``). ``problems`` says, in words, what else made ``ok`` false (beyond the per-file and model
    statuses).

    Returns:
        ``{"ok": bool, "run_id", "status", "problems": [str], "roots": {...},
        "files": [{"file", "status": ok|changed|missing, "expected", "actual"}],
        "model": {...}, "store": {...}}``

    Raises:
        RunError: no readable run.json.
    """
    from ..errors import StoreError
    from ..store.sharded import open_run_store

    run_dir = Path(run_dir)
    m = read_manifest(run_dir)
    problems: list[str] = []
    status = m.get("status")
    if status != C.STATUS_COMPLETED:
        problems.append(
            f"the run's status is {status!r}, not 'completed': verify cannot vouch for a run "
            "that did not finish" + (f" ({m['error']})" if m.get("error") else "")
        )
    d = m.get("data") if isinstance(m.get("data"), dict) else {}
    if not d.get("files"):
        problems.append("run.json records no training data files, so there is nothing to check")
    out = []
    roots = {}
    for root_key, files_key in (("root", "files"), ("eval_root", "eval_files")):
        files = d.get(files_key) or {}
        if not files:
            continue
        root = roots[root_key] = _data_root(run_dir, d, root_key)
        for name, want in sorted(files.items()):
            p = root / name
            if not p.is_file():
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
    mo = m.get("model") if isinstance(m.get("model"), dict) else {}
    want = mo.get("fingerprint")
    md = run_dir / C.MODEL_DIR
    if not want:
        model = {"dir": str(md), "status": "absent", "expected": None, "actual": None}
        problems.append("run.json records no saved model (the run never reached the save step)")
    else:
        got = model_fingerprint(md) if md.is_dir() else None
        model = {
            "dir": str(md),
            "status": "ok" if got == want else ("missing" if got is None else "changed"),
            "expected": want,
            "actual": got,
        }
    store = {"status": "absent"}
    if m.get("tracked", True) or (run_dir / C.STORE_FILE).exists():
        try:
            with open_run_store(run_dir, m) as st:
                parts = getattr(st, "shards", [st])
                checks = [{"file": str(sh.path), **sh.verify_content()} for sh in parts]
                worst = next((c for c in checks if c["status"] != "ok"), checks[0])
                store = {"status": worst["status"], "store_status": st.status, "files": checks}
                if st.status != C.STATUS_COMPLETED:
                    problems.append(f"the store's status is {st.status!r}, not 'completed'")
        except StoreError as e:
            store = {"status": "unreadable", "detail": str(e)}
        if store["status"] not in ("ok", "unchecked"):
            detail = store.get("detail") or next(
                (
                    c.get("detail") or c["file"]
                    for c in store.get("files", [])
                    if c["status"] != "ok"
                ),
                "",
            )
            problems.append(f"the store is {store['status']}: {detail}".rstrip(": "))
    # per-file and model mismatches are in "files" / "model"; "problems" says the rest
    ok = not problems and model["status"] == "ok" and all(f["status"] == "ok" for f in out)
    return {
        "ok": ok,
        "run_id": m.get("run_id"),
        "status": status,
        "problems": problems,
        "roots": {k: str(v) for k, v in roots.items()},
        "files": out,
        "model": model,
        "store": store,
    }
