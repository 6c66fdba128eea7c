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

# -- the active run's story: loss curve, configuration, bytes, measured quality, re-launch --------
st.header(f"The run {active.name}" if active is not None else "The run")
if active is not None and str(active) in paths:
    import plotly.graph_objects as go
    from services import run_story

    try:
        curve = run_story.loss_curve(active)
        sizes = run_story.storage(active)
        quality_line, measured = run_story.quality(active)
        settings = run_story.configuration(active)
        layers = settings.pop("track.layers", None) or []
        settings["track.layers"] = f"{len(layers)} tracked layers"
    except TracepropError as e:
        st.error(text.md_escape(f"{active.name}: {e}"))
    else:
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("Training steps", curve.height)
        c2.metric("Final training loss", f"{curve['loss'][-1]:.3f}" if curve.height else "—")
        c3.metric(
            "Bytes per example",
            f"{sizes['bytes_per_example']:,.0f}" if sizes.get("bytes_per_example") else "—",
            help="steady-state bytes one recorded training example takes in this run's store "
            "(its sketches and metadata; a short run's file also holds empty HDF5 chunk space). "
            "The measured line below is for the same configuration on the benchmark models.",
        )
        c4.metric("Store on disk", text.fmt_bytes(sizes["store_bytes"]))
        if curve.height:
            fig = go.Figure()
            fig.add_scatter(x=curve["step"].to_list(), y=curve["loss"].to_list(), mode="lines")
            fig.update_layout(
                xaxis_title="step", yaxis_title="training loss", height=300, margin={"t": 20}
            )
            st.plotly_chart(fig, key="runs_loss_curve")
        else:
            st.caption("No training steps logged (progress.jsonl is empty or missing).")
        st.markdown("**Measured quality of this tracking configuration**")
        st.caption(text.md_escape(quality_line))
        note = run_story.bytes_note(sizes, measured, len(layers))
        if note:
            st.caption(text.md_escape(note))
        if measured is not None and measured["dominated_by"]:
            st.warning(text.md_escape("Dominated by: " + ", ".join(measured["dominated_by"])))
        with st.expander("Configuration"):
            st.dataframe(
                {
                    "setting": list(settings),
                    "value": [str(v) for v in settings.values()],
                },
                hide_index=True,
                width="stretch",
            )
        if st.button("Re-launch with these settings", key="runs_relaunch"):
            values, notes = run_story.relaunch_state(cfg, active)
            st.session_state.update(values)
            st.session_state["launch_prefill_notes"] = notes
            st.switch_page("views/launch.py")
