"""Runs: every sample and user run; pick the active run; delete a user run."""

from __future__ import annotations

import streamlit as st
from services import config, runs, text

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Runs")
st.caption(text.md_escape(f"Sample runs from {cfg.sample_runs}, user runs from {cfg.runs_root}."))

table = runs.runs_table(cfg)
if table.is_empty():
    st.warning(
        "No runs found. Launch a tracked fine-tune on the Launch page, "
        "or point TRACEPROP_SAMPLE_RUNS at the bundled `sample_runs` folder."
    )
    st.stop()

active = runs.ensure_active_run(cfg, st.session_state)
paths = table["path"].to_list()
labels = {
    p: f"{n} · {k} · {s}"
    for p, n, k, s in zip(paths, table["run"], table["kind"], table["status"], strict=True)
}


def _set_active() -> None:
    st.session_state["runs_active"] = st.session_state["runs_pick"]


st.selectbox(
    "Active run",
    paths,
    index=paths.index(str(active)) if str(active) in paths else 0,
    format_func=labels.get,
    key="runs_pick",
    on_change=_set_active,
)
st.dataframe(table.drop("path"), hide_index=True, width="stretch")

for row in table.filter(table["status"].is_in(["failed", "unreadable"])).iter_rows(named=True):
    if row.get("error"):
        st.error(text.md_escape(f"{row['run']}: {row['error']}"))

user = table.filter(table["kind"] == "user")
with st.expander("Delete a user run"):
    if user.is_empty():
        st.caption("No user runs (the bundled sample run cannot be deleted).")
    else:
        victim = st.selectbox(
            "Run to delete",
            user["path"].to_list(),
            format_func=lambda p: labels.get(p, p),
            key="runs_delete_pick",
        )
        sure = st.checkbox(
            "Yes, delete this run and its store permanently", key=f"runs_delete_confirm_{victim}"
        )
        if st.button("Delete run", disabled=not sure, key="runs_delete_button"):
            try:
                runs.delete_run(cfg, victim)
            except TracepropError as e:
                st.error(text.md_escape(e))
            else:
                if st.session_state.get("runs_active") == victim:
                    st.session_state.pop("runs_active", None)
                st.success(text.md_escape(f"Deleted {victim}"))
                st.rerun()
