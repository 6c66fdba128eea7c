"""The Influencers page's "Examples on this page": one expander per shown row, drawn lazily.

Each expander's contents (text, tokens, lineage, per-layer scores: 7 elements) are made only
while it is open, and the section is a fragment, so opening one reruns this section alone. Drawn
eagerly, the closed expanders of a 20-row page were 160 of a query's 240 page elements and about
40 % of the browser's work per query (benchmarks/README.md, App speed).
"""

from __future__ import annotations

import json

import streamlit as st
from services import queries, text


def expander_key(row: dict) -> str:
    """The session-state key of ``row``'s expander (True while it is open)."""
    return f"infl_ex_{row['kind']}_{row['example_id']}"


@st.fragment
def render(active, page_rows) -> None:
    st.subheader("Examples on this page")
    for r in page_rows.iter_rows(named=True):
        box = st.expander(
            f"{r['kind']} #{r['rank']} · {r['score']:+.4g} · {text.md_escape(r['location'])}",
            key=expander_key(r),
            on_change="rerun",
        )
        if box.open:
            with box:
                _details(active, r)


def _details(active, r: dict) -> None:
    st.text(r["text"])
    st.caption("Tokens (trained-on tokens in ⟦brackets⟧)")
    st.code(queries.example_tokens_text(active, int(r["example_id"])), language=None)
    st.caption("Lineage")
    lineage = {k: r[k] for k in ("example_id", "source", "row", "sha256")}
    st.code(json.dumps(lineage, indent=1), language=None)
    st.caption("Per-layer partial scores")
    # a plain table: 2 × top-k interactive grids made every query's page slow to draw
    st.table(queries.layer_scores_table(r["layer_scores"]))
