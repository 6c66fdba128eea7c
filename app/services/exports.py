"""The downloads of the Influencers and Audit pages, and verification of a run's inputs."""

from __future__ import annotations

import json
import os

import polars as pl

from .queries import open_cached

# The engine's export / audit / verify modules pull torch: imported inside the functions, so
# the app's first page starts without it.


def shown_rows(result) -> pl.DataFrame:
    """Exactly the rows shown and exported: the engine's export columns plus ``file:row``."""
    from traceprop_engine import attribution

    rows = attribution.rows_for_export(result)
    return rows.with_columns(
        (pl.col("source") + ":" + pl.col("row").cast(pl.Utf8)).alias("location")
    )


def export_bytes(result, fmt: str, rows: pl.DataFrame | None = None) -> bytes:
    """CSV or JSON bytes of the shown influencer rows (or of ``rows``, e.g. those found), with
    the query they answer recorded inside
    (:func:`~traceprop_engine.attribution.reports.export.export_with_query`)."""
    from traceprop_engine import attribution

    return attribution.export_with_query(
        shown_rows(result) if rows is None else rows, result.query, fmt
    )


def audit_bytes(run_dir: str | os.PathLike, result) -> tuple[bytes, bytes, dict]:
    """``(json bytes, csv bytes, trail)`` of the audit trail of one query on a run.

    Raises:
        TracepropError: the run cannot be opened.
    """
    from traceprop_engine import attribution

    run, _ = open_cached(run_dir)  # the trail reads the manifest only, not the store
    trail = attribution.audit_trail(run, result)
    js = json.dumps(trail, indent=2, ensure_ascii=False, default=str).encode()
    rows = attribution.audit_rows(trail)
    return js, attribution.csv_bytes(rows) if rows.height else b"", trail


def verify_inputs(run_dir: str | os.PathLike) -> dict:
    """Re-hash the run's data files, model and store against its manifest
    (:func:`traceprop_engine.verify.verify_run`: ``ok``, ``problems``, ``files``, ``model``...).

    Raises:
        RunError: no readable run.json.
    """
    from traceprop_engine.verify import verify_run

    return verify_run(run_dir)


def ranking_bytes(ranked: pl.DataFrame, desc: dict, by: str) -> bytes:
    """CSV of ranked examples (``rank_examples``) with the run, the ranking and the
    preconditioner in ``query_*`` columns."""
    from traceprop_engine import attribution

    return attribution.export_with_query(ranked, {**desc, "prompt": f"rank by {by}"}, "csv")
