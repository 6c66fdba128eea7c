"""Plotly figures of the app's distributions, built from engine tables (plain Python: the
tests read the numbers back from the figure)."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl

PRO, OPP, TOTAL = "#2a9d8f", "#e76f51", "#264653"


def score_histogram_figure(hist: pl.DataFrame) -> go.Figure:
    """Bars of :func:`~traceprop_engine.attribution.reports.distributions.score_histogram`:
    proponents and opponents in their colours on shared bins."""
    fig = go.Figure()
    width = (hist["right"] - hist["left"]).to_list()
    for name, color in (("proponents", PRO), ("opponents", OPP)):
        fig.add_bar(
            name=name,
            x=hist["center"].to_list(),
            y=hist[name].to_list(),
            width=width,
            marker_color=color,
        )
    fig.update_layout(
        barmode="stack",
        bargap=0,
        xaxis_title="score (> 0 proponent, < 0 opponent)",
        yaxis_title="training examples",
        height=320,
        margin={"t": 20},
    )
    return fig


def by_source_figure(by_source: pl.DataFrame) -> go.Figure:
    """Positive and negative influence per source file (stacked) and the total (markers)."""
    fig = go.Figure()
    src = by_source["source"].to_list()
    fig.add_bar(name="positive", x=src, y=by_source["positive"].to_list(), marker_color=PRO)
    fig.add_bar(name="negative", x=src, y=by_source["negative"].to_list(), marker_color=OPP)
    fig.add_scatter(
        name="total",
        x=src,
        y=by_source["total"].to_list(),
        mode="markers",
        marker={"size": 12, "color": TOTAL},
    )
    fig.update_layout(
        barmode="relative", yaxis_title="summed influence", height=380, margin={"t": 20}
    )
    return fig


def ranking_figure(ranked: pl.DataFrame, column: str) -> go.Figure:
    """``column`` against rank, one marker trace per source file (``rank_examples`` output)."""
    fig = go.Figure()
    for (src,), part in ranked.group_by("source", maintain_order=True):
        fig.add_scatter(
            name=str(src) or "(no source)",
            x=part["rank"].to_list(),
            y=part[column].to_list(),
            mode="markers",
            text=[f"{src}:{r}" for r in part["row"].to_list()],
            hovertemplate="rank %{x}<br>%{y:.4g}<br>%{text}<extra></extra>",
        )
    fig.update_layout(
        xaxis_title="rank", yaxis_title=column.replace("_", " "), height=360, margin={"t": 20}
    )
    return fig


def rank_scatter_figure(changes: pl.DataFrame, label_a: str, label_b: str) -> go.Figure:
    """Rank in A against rank in B of the examples of the same kind in both answers."""
    fig = go.Figure()
    both = changes.filter(pl.col("status") == "both")
    for kind, color in (("proponent", PRO), ("opponent", OPP)):
        part = both.filter(pl.col("kind_a") == kind)
        fig.add_scatter(
            name=kind + "s",
            x=part["rank_a"].to_list(),
            y=part["rank_b"].to_list(),
            mode="markers",
            marker={"size": 10, "color": color},
            text=[f"{s}:{r}" for s, r in zip(part["source"], part["row"], strict=True)],
            hovertemplate="%{text}<br>A #%{x} → B #%{y}<extra></extra>",
        )
    top = int(max(both["rank_a"].max() or 1, both["rank_b"].max() or 1))
    fig.add_scatter(
        name="same rank",
        x=[1, top],
        y=[1, top],
        mode="lines",
        line={"dash": "dot", "color": "#999"},
    )
    fig.update_layout(
        xaxis_title=f"rank in A ({label_a})",
        yaxis_title=f"rank in B ({label_b})",
        height=360,
        margin={"t": 20},
    )
    return fig
