"""The Influencers page's charts: influence by source file and the score distribution, as two
tabs drawn lazily in a fragment.

Only the open tab's chart is made and sent (the by-source chart first); switching tabs or
changing the histogram's bins reruns this section alone, not the query page. Each plotly chart
costs the browser about 0.35 s of CPU per query on this machine (benchmarks/README.md, App
speed), so a query draws one instead of two.
"""

from __future__ import annotations

import streamlit as st
from services import charts
from views import distribution_panel

TABS = ("Influence by source file", "Score distribution")
KEY = "infl_charts"


@st.fragment
def render(by_source, scores) -> None:
    by_src, dist = st.tabs(list(TABS), key=KEY, on_change="rerun")
    if by_src.open:
        with by_src:
            st.subheader("Influence by source file (all training examples)")
            st.plotly_chart(charts.by_source_figure(by_source), key="infl_by_source")
    if dist.open:
        with dist:
            distribution_panel.render(scores, key="infl_dist")
