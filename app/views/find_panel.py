"""The Influencers page's Find panel: search the rows by text, filter by source and kind, sort
and page through them; the page's rows are returned for the example details below."""

from __future__ import annotations

import polars as pl
import streamlit as st
from services import find


def render(rows: pl.DataFrame, key: str = "find") -> tuple[pl.DataFrame, pl.DataFrame]:
    """Draw the panel; return ``(found rows in their sort order, the rows of this page)``."""
    st.subheader("Find")
    c1, c2, c3 = st.columns([2, 2, 1])
    needle = c1.text_input(
        "Text contains", key=f"{key}_text", placeholder="e.g. Ethmor", help="case-insensitive"
    )
    sources = c2.multiselect(
        "Source files", sorted(set(rows["source"].to_list())), key=f"{key}_sources"
    )
    kinds = c3.multiselect("Kind", ["proponent", "opponent"], key=f"{key}_kinds")
    c1, c2, c3 = st.columns([2, 1, 1])
    order = c1.selectbox("Sort by", list(find.SORTS), key=f"{key}_sort")
    size = c2.selectbox("Rows per page", find.PAGE_SIZES, index=1, key=f"{key}_size")
    found = find.sort_rows(find.filter_rows(rows, needle, sources, kinds), order)
    last = find.n_pages(found.height, size)
    page = int(c3.number_input(f"Page (of {last})", 1, last, 1, key=f"{key}_page"))
    page = min(page, last)  # the filter shrank the pages since the number was set
    part = find.page_of(found, page, size)
    first = (page - 1) * size + 1 if found.height else 0
    st.caption(
        f"{found.height} of {rows.height} rows match · showing {first}–"
        f"{(page - 1) * size + part.height} (page {page} of {last})"
    )
    if part.is_empty():
        st.info("No influencer matches these filters.")
    else:
        st.dataframe(
            part.select("kind", "rank", "score", "text", "location"),
            hide_index=True,
            width="stretch",
            column_config={
                "score": st.column_config.NumberColumn(format="%.4g"),
                "location": st.column_config.TextColumn("source file:row"),
            },
            key=f"{key}_table",
        )
    return found, part
