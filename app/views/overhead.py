"""Overhead: what tracking costs, from the run's own step timings and from bench results."""

from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st
from services import config, queries, runs

cfg = config.AppConfig.from_env()
st.title("Overhead")
active = runs.ensure_active_run(cfg, st.session_state)

st.subheader("Step time of the active run")
if active is None:
    st.info("No active run.")
else:
    steps = queries.cached_step_times(str(active), queries.manifest_mtime(active))
    if steps.is_empty():
        st.info(f"{active.name} recorded no step timings yet.")
    else:
        fig = go.Figure()
        fig.add_scatter(
            x=steps["step"].to_list(), y=steps["step_ms"].to_list(), mode="lines", name="step ms"
        )
        fig.update_layout(
            xaxis_title="step", yaxis_title="ms per step (tracked)", height=320, margin={"t": 20}
        )
        st.plotly_chart(fig, key="overhead_steps")
        st.caption(
            f"{steps.height} steps from the {steps['from'][0]}; "
            f"median {runs.median_step_ms(steps):.2f} ms (the Runs page's 'median step ms')"
        )

table = runs.runs_table(cfg)
if not table.is_empty() and "median step ms" in table.columns:
    t = table.filter(table["median step ms"].is_not_null())
    if not t.is_empty():
        st.subheader("Median step time across runs")
        fig = go.Figure(
            go.Bar(x=t["run"].to_list(), y=t["median step ms"].to_list(), marker_color="#457b9d")
        )
        fig.update_layout(
            yaxis_title="median ms per step", height=300, margin={"t": 20}, bargap=0.6
        )
        st.plotly_chart(fig, key="overhead_runs")

st.subheader("Tracked vs plain (overhead benchmark)")
bench = runs.read_bench(cfg)
if not bench:
    st.info(
        "No overhead benchmark results yet. Produce one with\n\n"
        "`traceprop bench overhead --json runs/bench/overhead.json`\n\n"
        f"(the app reads `{cfg.runs_root / config.BENCH_DIR}/*.json` and `benchmarks/results/*.json`)."
    )
    st.stop()
names = [n for n, _ in bench]
fig = go.Figure()
fig.add_bar(name="plain", x=names, y=[b["plain_step_ms"] for _, b in bench], marker_color="#8d99ae")
fig.add_bar(
    name="tracked", x=names, y=[b["tracked_step_ms"] for _, b in bench], marker_color="#e63946"
)
fig.update_layout(barmode="group", yaxis_title="median ms per step", height=320, margin={"t": 20})
st.plotly_chart(fig, key="overhead_bench_steps")
c1, c2 = st.columns(2)
fig = go.Figure()
fig.add_bar(
    name="logging", x=names, y=[b.get("logging_pct", 0) for _, b in bench], marker_color="#f4a261"
)
fig.add_bar(
    name="covariance",
    x=names,
    y=[b.get("covariance_pct", 0) for _, b in bench],
    marker_color="#2a9d8f",
)
fig.add_scatter(
    name="total",
    x=names,
    y=[b["overhead_pct"] for _, b in bench],
    mode="markers",
    marker={"size": 12, "color": "#264653"},
)
fig.update_layout(barmode="relative", yaxis_title="overhead %", height=320, margin={"t": 20})
c1.plotly_chart(fig, key="overhead_bench_pct")
fig = go.Figure(
    go.Bar(x=names, y=[b.get("bytes_per_example", 0) for _, b in bench], marker_color="#6d597a")
)
fig.update_layout(yaxis_title="store bytes per example", height=320, margin={"t": 20})
c2.plotly_chart(fig, key="overhead_bench_bytes")
st.dataframe(
    [
        {
            "file": n,
            **{
                k: b.get(k)
                for k in (
                    "overhead_pct",
                    "logging_pct",
                    "covariance_pct",
                    "cpu_overhead_pct",
                    "plain_step_ms",
                    "tracked_step_ms",
                    "bytes_per_example",
                    "repeats",
                )
            },
            **{f"config.{k}": v for k, v in (b.get("config") or {}).items()},
        }
        for n, b in bench
    ],
    hide_index=True,
)
