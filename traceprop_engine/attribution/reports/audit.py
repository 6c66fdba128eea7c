"""Audit trails: what was asked of which model and what it answered.

An audit trail records the query, run id, model fingerprint, data-manifest hash, time, software
versions and every influencer with its example id, source file, row, content sha256, score and
rank. It does not prove that the influencers *caused* the output (attribution scores are
estimates; see docs/audit.md), nor that the data files are the ones a reader has now — that is
what :func:`traceprop_engine.verify.verify_run` checks.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import polars as pl

from ... import constants as C
from ...run import RunManifest, library_versions
from .export import rows_for_export


def data_manifest_hash(manifest: RunManifest) -> str:
    """One hash over the data section of a manifest (file names and their hashes)."""
    blob = json.dumps(
        {"files": manifest.data.files, "eval_files": manifest.data.eval_files}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def audit_trail(run, result) -> dict:
    """The audit record of one query (see the module docstring for what it does and does not prove).

    ``model_fingerprint`` is that of the model the query was answered on (checked against the
    run's record when it was loaded); ``recorded_model_fingerprint`` is what ``run.json`` holds.
    """
    m = run.manifest
    rows = rows_for_export(result)
    loaded = getattr(result, "model_fingerprint", None)
    if loaded is None:  # a result ranked from a test side computed without the run's model
        from ...training.fingerprint import cached_model_fingerprint

        model_dir = Path(run.dir) / C.MODEL_DIR
        loaded = cached_model_fingerprint(model_dir)[0] if model_dir.is_dir() else None
    return {
        "kind": "traceprop-audit-trail",
        "version": 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_id": run.run_id,
        "run_dir": str(Path(run.dir).resolve()),
        "run_status": m.status,
        "model_fingerprint": loaded,
        "recorded_model_fingerprint": m.model.fingerprint,
        "data_manifest_sha256": data_manifest_hash(m),
        "store_schema_version": run.store.schema_version,  # the store's, not the library's
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
