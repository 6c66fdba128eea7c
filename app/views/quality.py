"""Attribution quality: LDS results of `traceprop eval lds` (UI only; data from services)."""

from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st
from services import config, runs

st.title("Attribution quality (LDS)")
st.caption(
    "Linear datamodeling score: retrain on random half-size subsets of the training data and check, "
    "per eval example, how well the summed influence of each subset predicts the retrained model's "
    "loss (Spearman; 1 = perfect ranking, 0 = none). Higher is better; bars show 95 % bootstrap intervals."
)
cfg = config.AppConfig.from_env()
results = runs.read_lds(cfg)
if not results:
    st.info(
        "No LDS results yet. Produce one with\n\n"
        "`traceprop eval lds --data DATA/train --eval-data DATA/eval --out runs/bench/lds`\n\n"
        "(the app reads folders with `figure.json` and `results.csv` under "
        f"`{cfg.runs_root / config.BENCH_DIR}` and `benchmarks/results`)."
    )
    st.stop()
names = [n for n, _, _ in results]
choice = st.selectbox("Evaluation", names, key="quality_eval")
_, fig, table = results[names.index(choice)]
st.plotly_chart(go.Figure(fig), key="quality_fig")
st.dataframe(table.drop([c for c in ("error",) if c in table.columns]), key="quality_table")
st.caption(
    "k is the sketch size per side (k_in = k_out); 'dense' rows use the last-block dense sketch. "
    "See benchmarks/EVAL.md for the protocol and the data set."
)
