"""Audit: an audit-trail export of one query, and verification of the run's inputs."""

from __future__ import annotations

import streamlit as st
from services import config, exports, queries, runs, text

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Audit")
active = runs.ensure_active_run(cfg, st.session_state)
if active is None:
    st.warning("No run to audit.")
    st.stop()
st.caption(text.md_escape(f"Run {active.name}"))

st.subheader("Verify the run's inputs")
st.caption(
    "Re-hashes every data file and the saved model against the hashes recorded when the run was trained."
)
if st.button("Verify", key="audit_verify"):
    try:
        v = exports.verify_inputs(active)
    except TracepropError as e:
        st.error(text.md_escape(e))
    else:
        if v["ok"]:
            st.success(f"All {len(v['files'])} data files and the model match the manifest.")
        else:
            for p in v.get("problems", []):
                st.error(text.md_escape(p))
            bad = [f for f in v["files"] if f["status"] != "ok"]
            for f in bad:
                st.error(text.md_escape(f"{f['status']}: {f['file']}"))
            if v["model"]["status"] not in ("ok", "absent"):
                st.error(text.md_escape(f"model {v['model']['status']}: {v['model'].get('dir')}"))
        st.dataframe(v["files"], hide_index=True, width="stretch")
        st.caption(f"model: {v['model']['status']}")

st.subheader("Audit trail of a query")
st.caption(
    "Records what was asked of which model and what it answered; it does not prove causation "
    "(scores are estimates) nor that today's data files are the trained ones (that is what Verify checks)."
)
saved = st.session_state.get("infl_result")
use_last = False
if saved and saved["run"] == str(active):
    use_last = st.checkbox("Use the last Influencers query", value=True, key="audit_use_last")
res = saved["result"] if use_last else None
if res is None:
    try:
        evals = queries.cached_examples(str(active), queries.manifest_mtime(active), "eval")
    except TracepropError as e:
        st.error(text.md_escape(e))
        st.stop()
    if evals.is_empty():
        st.info("Run a query on the Influencers page first (this run has no eval examples).")
        st.stop()
    ids = evals["example_id"].to_list()
    texts = dict(zip(ids, evals["text"].to_list(), strict=True))
    eid = st.selectbox(
        "Eval example", ids, format_func=lambda i: f"#{i}: {texts[i][:100]!r}", key="audit_eval"
    )
    if st.button("Run the query for the audit trail", key="audit_query"):
        try:
            with st.spinner("Querying…"):
                res, _ = queries.run_query(active, eval_example=eid, top_k=10)
        except TracepropError as e:
            st.error(text.md_escape(e))
            st.stop()
        st.session_state["audit_result"] = {"run": str(active), "result": res}
    a = st.session_state.get("audit_result")
    res = a["result"] if a and a["run"] == str(active) else None
if res is None:
    st.stop()

try:
    js, csv, trail = exports.audit_bytes(active, res)
except TracepropError as e:
    st.error(text.md_escape(e))
    st.stop()
st.write(
    f"{len(trail['influencers'])} influencers · model {str(trail['model_fingerprint'])[:16]}… · "
    f"data manifest {trail['data_manifest_sha256'][:16]}…"
)
c1, c2 = st.columns(2)
c1.download_button(
    "Audit trail (JSON)",
    js,
    file_name=f"audit-{trail['run_id']}.json",
    mime="application/json",
    on_click="ignore",
    key="audit_json",
)
c2.download_button(
    "Audit trail (CSV)",
    csv,
    file_name=f"audit-{trail['run_id']}.csv",
    mime="text/csv",
    on_click="ignore",
    key="audit_csv",
)
with st.expander("Trail"):
    st.json(trail, expanded=False)
