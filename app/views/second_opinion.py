"""The Influencers page's second opinion: the same query asked of a second estimator, and the
examples both rank in their top k marked (triangulation: act on those first)."""

from __future__ import annotations

import polars as pl
import streamlit as st
from services import compare, text

from traceprop_engine.errors import TracepropError

OFF = "off"


def render(active, preconditioners, saved: dict, rows: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """``(rows with ``both`` and ``second_rank`` columns, the second estimator)``; the rows
    unchanged and ``OFF`` when no second opinion is asked for or possible."""
    res = saved["result"]
    first = res.query.get("preconditioner")
    best = compare.second_choice(preconditioners, first)
    if best is None:
        return rows, OFF
    others = [best, *(p for p in preconditioners if p not in (first, best))]
    choice = st.selectbox(
        "Second opinion",
        [OFF, *others],
        key="infl_second",
        format_func=lambda p: "off" if p == OFF else f"also ask {p} and mark where both agree",
        help=(
            "Triangulation: estimators of influence disagree, more so on hard queries. The same "
            "query is asked of a second estimator; examples both put in their top k are marked "
            "'both' — the ones worth acting on (removing, relabelling) first."
        ),
    )
    if choice == OFF:
        return rows, OFF
    cache = saved.setdefault("second", {})
    if choice not in cache:
        try:
            with st.spinner(f"Asking {choice} the same question…"):
                cache[choice] = compare.second_opinion(active, res, choice, saved["test_side"])
        except TracepropError as e:
            st.error(text.md_escape(f"second opinion from {choice}: {e}"))
            return rows, OFF
    marks, overlap = cache[choice]
    marks = marks.with_columns(pl.col("example_id").cast(rows.schema["example_id"]))
    rows = rows.join(marks, on=["kind", "example_id"], how="left").with_columns(
        pl.col("second_rank").is_not_null().alias("both")
    )
    parts = [
        f"{r['shared']} of the top {r['k']} {r['kind']}s"
        for r in overlap.iter_rows(named=True)
        if r["in_a"]
    ]
    st.caption(
        text.md_escape(
            f"{first} and {choice} agree on " + " and ".join(parts) + " (marked 'both'); "
            "the rest is ranked high by one estimator only."
        )
    )
    return rows, choice
