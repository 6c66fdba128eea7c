"""Find things among a query's influencers: filter by text and source, sort, page, and name
an export after the run and the query (plain polars, testable without Streamlit)."""

from __future__ import annotations

import math
import re

import polars as pl

SORTS = {
    "rank": (["kind", "rank"], [True, False]),  # proponents first, each by rank
    "score, highest first": (["score"], [True]),
    "score, lowest first": (["score"], [False]),
    "|score|, largest first": (["abs_score"], [True]),
    "source file": (["source", "row"], [False, False]),
}
"""The sort orders the Find panel offers: name -> (columns, descending per column)."""
PAGE_SIZES = (10, 25, 50, 100)


def filter_rows(
    rows: pl.DataFrame, text: str = "", sources=(), kinds=(), case: bool = False
) -> pl.DataFrame:
    """The rows whose ``text`` contains ``text`` (a literal, case-insensitive unless ``case``),
    whose ``source`` is one of ``sources`` and whose ``kind`` is one of ``kinds`` (an empty
    ``sources`` / ``kinds`` keeps every value)."""
    out = rows
    if text:
        needle = text if case else text.lower()
        hay = pl.col("text") if case else pl.col("text").str.to_lowercase()
        out = out.filter(hay.str.contains(needle, literal=True))
    if sources:
        out = out.filter(pl.col("source").is_in(list(sources)))
    if kinds:
        out = out.filter(pl.col("kind").is_in(list(kinds)))
    return out


def sort_rows(rows: pl.DataFrame, by: str = "rank") -> pl.DataFrame:
    """``rows`` in one of the :data:`SORTS` orders (ties keep their order).

    Raises:
        ValueError: an unknown sort.
    """
    if by not in SORTS:
        raise ValueError(f"sort must be one of {list(SORTS)}, got {by!r}")
    cols, desc = SORTS[by]
    df = rows.with_columns(pl.col("score").abs().alias("abs_score"))
    # 'rank' sorts kind descending: 'proponent' > 'opponent', so proponents come first
    return df.sort(cols, descending=desc, maintain_order=True).drop("abs_score")


def n_pages(n_rows: int, size: int) -> int:
    return max(1, math.ceil(n_rows / size))


def page_of(rows: pl.DataFrame, page: int, size: int) -> pl.DataFrame:
    """Rows ``(page-1)*size`` to ``page*size`` (pages from 1).

    Raises:
        ValueError: a page size < 1 or a page outside ``1..n_pages``.
    """
    if size < 1:
        raise ValueError(f"page size must be at least 1, got {size}")
    last = n_pages(rows.height, size)
    if not 1 <= page <= last:
        raise ValueError(f"page must be between 1 and {last}, got {page}")
    return rows.slice((page - 1) * size, size)


def _slug(s: str, limit: int = 40) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()
    return s[:limit].rstrip("-") or "query"


def query_slug(query: dict) -> str:
    """A file-name-safe name of a query: ``eval12`` for eval example 12, else its words."""
    if query.get("eval_example") is not None:
        return f"eval{int(query['eval_example'])}"
    words = " ".join(
        str(query.get(k) or "") for k in ("prompt", "completion", "label") if query.get(k)
    )
    return _slug(words) if words else "token-ids"


def export_name(query: dict, fmt: str, prefix: str = "influencers") -> str:
    """``<prefix>-<run>-<query>-<preconditioner>.<fmt>``, every part file-name safe."""
    parts = [prefix, _slug(str(query.get("run_id") or "run"), 60), query_slug(query)]
    if query.get("preconditioner"):
        parts.append(_slug(str(query["preconditioner"])))
    return "-".join(parts) + "." + fmt
