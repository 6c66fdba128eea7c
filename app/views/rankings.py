"""Rankings: every training example ranked without a query (``traceprop rank``): by
self-influence, gradient norm or last training loss, to find mislabelled or odd examples."""

from __future__ import annotations

import streamlit as st
from services import charts, config, distributions, exports, find, queries, runs, text

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Rankings")
active = runs.ensure_active_run(cfg, st.session_state)
if active is None:
    st.warning("No run to rank: launch one on the Launch page.")
    st.stop()
try:
    ov = queries.query_overview(active)
except TracepropError as e:
    st.error(text.md_escape(f"{active.name} cannot be ranked: {e}"))
    st.stop()
st.caption(
    f"Run **{ov.run_id}** · {ov.n_records} records · no query needed: these rank the training "
    "data itself (the detection rankings of `traceprop rank`)."
)

c1, c2 = st.columns(2)
by = c1.selectbox("Rank by", distributions.RANK_BY, key="rank_by")
pre = c2.selectbox(
    "Preconditioner",
    list(ov.preconditioners),
    key="rank_pre",
    disabled=by != "self-influence",
    help="self-influence is measured under this preconditioner",
)
st.info(distributions.RANK_HELP[by])
try:
    with st.spinner("Ranking every training example…"):
        ranked = distributions.cached_rank_by(str(active), queries.manifest_mtime(active), by, pre)
except TracepropError as e:
    st.error(text.md_escape(e))
    st.stop()
column = by.replace("-", "_")

st.plotly_chart(charts.ranking_figure(ranked, column), key="rank_chart")

c1, c2, c3, c4 = st.columns([2, 2, 1, 1])
needle = c1.text_input("Text contains", key="rank_text", help="case-insensitive")
sources = c2.multiselect("Source files", sorted(set(ranked["source"].to_list())), key="rank_src")
size = c3.selectbox("Rows per page", find.PAGE_SIZES, index=1, key="rank_size")
found = find.filter_rows(ranked, needle, sources)
last = find.n_pages(found.height, size)
page = min(int(c4.number_input(f"Page (of {last})", 1, last, 1, key="rank_page")), last)
part = find.page_of(found, page, size)
st.caption(f"{found.height} of {ranked.height} examples match · page {page} of {last}")
st.dataframe(
    part.select("rank", column, "text", "source", "row", "example_id"),
    hide_index=True,
    width="stretch",
    column_config={column: st.column_config.NumberColumn(format="%.4g")},
    key="rank_table",
)
desc = {"run_id": ov.run_id, "preconditioner": pre if by == "self-influence" else None}
st.download_button(
    "Export CSV",
    exports.ranking_bytes(found, desc, by),
    file_name=find.export_name({**desc, "prompt": by}, "csv", prefix="ranking"),
    mime="text/csv",
    on_click="ignore",
    key="rank_csv",
)
