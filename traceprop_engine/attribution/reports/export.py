"""Exports: influencer rows as CSV or JSON, with spreadsheet formulas neutralised.

Audit trails are in :mod:`traceprop_engine.attribution.reports.audit`, verification of a run's
inputs in :mod:`traceprop_engine.verify`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl

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


QUERY_FIELDS = (
    "run_id",
    "prompt",
    "completion",
    "eval_example",
    "label",
    "preconditioner",
    "weighting",
    "statistics",
    "top_k",
    "query_loss",
)
"""What of a query's description every exported row carries (as ``query_<field>`` in a CSV)."""


def rows_with_query(rows: pl.DataFrame, query: dict) -> pl.DataFrame:
    """``rows`` with one ``query_<field>`` column per :data:`QUERY_FIELDS` entry (the same value
    on every row), so a CSV on its own still says which run and query it answers."""
    cols = []
    for f in QUERY_FIELDS:
        v = query.get(f)
        cols.append(pl.lit(None if v is None else str(v), dtype=pl.Utf8).alias(f"query_{f}"))
    return rows.with_columns(cols)


def export_with_query(rows: pl.DataFrame, query: dict, fmt: str) -> bytes:
    """CSV (``rows`` plus the ``query_*`` columns of :func:`rows_with_query`) or JSON (an object
    ``{"query": query, "rows": [...]}``) of influencer rows and the query they answer."""
    if fmt == "csv":
        return csv_bytes(rows_with_query(rows, query))
    if fmt == "json":
        doc = {"query": query, "rows": rows.to_dicts()}
        return json.dumps(doc, indent=2, ensure_ascii=False, default=str).encode()
    raise ValueError(f"format must be 'csv' or 'json', got {fmt!r}")
