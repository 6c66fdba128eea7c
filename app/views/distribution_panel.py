"""The Influencers page's distribution of one query's scores over every training example."""

from __future__ import annotations

import streamlit as st
from services import charts, distributions


def render(scores, key: str = "dist") -> None:
    """A histogram of the exact scores of every training example (``scores``: the query's
    ``example_id, source, row, score`` table, made with the query), proponents and opponents."""
    st.subheader("Score distribution (all training examples)")
    bins = st.slider("Bins", 5, 100, 40, key=f"{key}_bins")
    hist = distributions.score_histogram(scores["score"].to_numpy(), bins)
    n_pos = int((scores["score"] > 0).sum())
    n_neg = int((scores["score"] < 0).sum())
    st.caption(
        f"{scores.height} examples · {n_pos} with a positive score, {n_neg} with a negative one"
        f" · sum {scores['score'].sum():+.4g}"
    )
    st.plotly_chart(charts.score_histogram_figure(hist), key=f"{key}_hist")
