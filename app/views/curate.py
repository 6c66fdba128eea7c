"""Curate: remove the examples behind an output, retrain without them, and see what changed."""

from __future__ import annotations

import streamlit as st
from services import config, jobs, page_rerun, runs, text
from services import curate as cur

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Curate")
st.caption(
    "Pick the training examples behind an output (a query's top proponents or opponents, the "
    "top of a ranking, rows by hand), write a cleaned copy of the training data without them "
    "(same files and formats, with a manifest of every removed row and why), retrain with the "
    "run's own settings, and compare the two runs on the same queries and the eval set."
)
active = runs.ensure_active_run(cfg, st.session_state)
if active is None:
    st.warning("No run to curate: launch one on the Launch page.")
    st.stop()


def _show_proof(job: dict, proof: dict) -> None:
    st.success(
        f"Retrained without {proof['removed']} example(s): {text.md_escape(proof['after']['run'])}"
    )
    ev = proof["eval"]
    if ev["eval_loss_before"] is not None and ev["eval_loss_after"] is not None:
        c1, c2 = st.columns(2)
        c1.metric(
            "Eval loss (before → after)",
            f"{ev['eval_loss_after']:.4f}",
            f"{ev['eval_loss_after'] - ev['eval_loss_before']:+.4f} from {ev['eval_loss_before']:.4f}",
            delta_color="inverse",
        )
        c2.metric(
            "Training examples (before → after)",
            proof["after"]["n_train"],
            proof["after"]["n_train"] - proof["before"]["n_train"],
            delta_color="off",
        )
    for i, q in enumerate(proof["queries"], start=1):
        st.markdown(f"**Query {i}:** {text.md_escape(cur.query_label(q['query']))}")
        b, a = q["before"], q["after"]
        c1, c2, c3 = st.columns(3)
        c1.metric(
            "Loss on the queried output",
            f"{a['loss']:.4f}",
            f"{q['loss_change']:+.4f} from {b['loss']:.4f}",
            delta_color="inverse",
        )
        c2.metric("Answer before", text.one_line(b["answer"]) or "—")
        c3.metric("Answer after", text.one_line(a["answer"]) or "—")
        overlap, changes = cur.proof_tables(q)
        st.caption(
            "Top influencers before and after: removed rows are gone from the retrain; "
            "'moved up by' is the rank before minus the rank after"
        )
        st.dataframe(overlap, hide_index=True, key=f"cur_overlap_{i}")
        st.dataframe(changes, hide_index=True, width="stretch", key=f"cur_changes_{i}")
    with st.expander("Removed rows (the manifest)"):
        st.dataframe(cur.removed_rows(job), hide_index=True, width="stretch", key="cur_removed")
        st.caption(f"Cleaned copy: {text.md_escape(job['data'])}")


@st.fragment(run_every=1.0)
def _running(job: dict) -> None:
    s = cur.state(job)
    if s["status"] not in ("running", "comparing"):
        if not page_rerun.rerun_queued():  # a waiting rerun (a click) redraws the page itself
            st.rerun()
        return
    js = s["job"]
    if s["status"] == "comparing":
        st.progress(1.0, text="Retrained: comparing the two runs on the queries…")
        return
    if not js.total:  # no training step yet: the copy is being written, the model built
        st.progress(0.0, text="Writing the cleaned copy and starting the retrain…")
    else:
        st.progress(js.fraction, text=f"Retraining: step {js.step}/{js.total}")
    if st.button("Cancel", key="cur_cancel"):
        jobs.cancel_job(js.run_dir)


def _show_job(job: dict) -> None:
    s = cur.state(job)
    if s["status"] in ("running", "comparing"):
        _running(job)
    elif s["status"] == "completed":
        _show_proof(job, s["proof"])
    else:
        st.error(text.md_escape(f"The curate job {s['status']}: {s.get('error') or 'see the log'}"))
        if s.get("log"):
            st.code(s["log"][-3000:])


saved = st.session_state.get("infl_result")
current = saved["result"] if saved and saved["run"] == str(active) else None
# [(query dict, its result rows)] of the active run: another run's ids mean nothing here
by_run = st.session_state.setdefault("cur_queries", {})
queries = by_run.setdefault(str(active), [])

st.subheader("1 · What to remove")
c1, c2 = st.columns(2)
k = c1.number_input("Top k per query (and of the ranking)", 1, cur.MAX_K, 5, key="cur_k")
kind = c2.radio("Remove", ["proponents", "opponents"], horizontal=True, key="cur_kind")
if current is not None and not any(q[0] == current.query for q in queries):
    if st.button(
        f"Add the Influencers query: {text.one_line(cur.query_label(current.query))}",
        key="cur_add",
    ):
        queries.append((current.query, current.rows))
        st.rerun()
elif current is None and not queries:
    st.info("Ask a query on the Influencers page to add it here, or pick by ranking or by hand.")
for i, (q, _) in enumerate(queries, start=1):
    st.caption(f"Query {i}: {text.md_escape(cur.query_label(q))}")
if queries and st.button("Clear the queries", key="cur_clear"):
    queries.clear()
    st.rerun()
c1, c2 = st.columns(2)
by = c1.selectbox("And the top k of a ranking", ["none", "self-influence", "loss"], key="cur_by")
typed = c2.text_input("And rows by hand (ids or source:row)", key="cur_ids")
pre = (queries[0][0].get("preconditioner") if queries else None) or cur.CuratePlan.preconditioner
plan = cur.CuratePlan(
    queries=tuple(q for q, _ in queries),
    top_k=int(k),
    opponents=kind == "opponents",
    by=None if by == "none" else by,
    ids=cur.parse_ids(typed),
    preconditioner=pre,
    rows=tuple(r for _, r in queries),
)
try:
    picked = cur.preview(active, plan)
except TracepropError as e:
    picked = None
    st.info(text.md_escape(e))
if picked is not None:
    st.caption(f"{picked.height} training example(s) will be removed")
    st.dataframe(picked, hide_index=True, width="stretch", key="cur_preview")

st.subheader("2 · Clean copy and retrain")
name = st.text_input("Name of the retrained run", key="cur_name", placeholder="auto")
running = jobs.active_job(cfg)
if running is not None:
    st.info(text.md_escape(f"{running.run_dir.name} is training: one job at a time."))
if st.button(
    "Write the cleaned copy and retrain",
    type="primary",
    key="cur_go",
    disabled=picked is None or picked.is_empty() or running is not None,
):
    try:
        st.session_state["cur_job"] = cur.start(cfg, active, plan, name)
    except TracepropError as e:
        st.error(text.md_escape(e))
    else:
        st.rerun()

st.subheader("3 · Before and after")
earlier = cur.earlier(cfg)
job = st.session_state.get("cur_job")
if job is None and earlier:
    pick = st.selectbox(
        "Earlier curations",
        range(len(earlier)),
        format_func=lambda i: f"{earlier[i]['data']}",
        key="cur_earlier",
    )
    job = earlier[pick]
if job is None:
    st.caption("Nothing retrained yet.")
else:
    _show_job(job)
