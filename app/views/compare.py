"""Compare: one query answered two ways (two preconditioners, or two runs) side by side, with
the overlap of the two rankings and how each example's rank changed."""

from __future__ import annotations

import streamlit as st
from services import charts, compare, config, queries, runs, text

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Compare")
st.caption(
    "Ask one question of two preconditioners on a run, or of two runs, and see how far the "
    "answers agree: the overlap of the top k (Jaccard = shared / union, overlap@k = shared / k) "
    "and each example's rank in both."
)
active = runs.ensure_active_run(cfg, st.session_state)
if active is None:
    st.warning("No run to compare: launch one on the Launch page.")
    st.stop()
completed = [p for p in runs.all_runs(cfg) if runs.run_summary(cfg, p).get("status") == "completed"]
paths = [str(p) for p in completed] or [str(active)]
start = paths.index(str(active)) if str(active) in paths else 0


def _side(col, name: str, default_pre: int):
    col.markdown(f"**{name}**")
    run_dir = col.selectbox(
        "Run", paths, index=start, key=f"cmp_run_{name}", format_func=lambda p: p.rsplit("/", 1)[-1]
    )
    try:
        ov = queries.query_overview(run_dir)
    except TracepropError as e:
        col.error(text.md_escape(f"cannot be queried: {e}"))
        st.stop()
    pres = list(ov.preconditioners)
    pre = col.selectbox(
        "Preconditioner", pres, index=min(default_pre, len(pres) - 1), key=f"cmp_pre_{name}"
    )
    return run_dir, pre, ov


c1, c2 = st.columns(2)
run_a, pre_a, ov_a = _side(c1, "A", 0)
run_b, pre_b, _ = _side(c2, "B", 1)
same_run = run_a == run_b

mtime = queries.manifest_mtime(run_a)
evals = queries.cached_examples(run_a, mtime, "eval")
classification = ov_a.task == "classification"
mode = st.radio(
    "Query",
    ["eval", "typed"],
    horizontal=True,
    key="cmp_mode",
    format_func={"eval": "An eval example of run A", "typed": "Type a query"}.get,
)
query: dict = {}
if mode == "eval" and not evals.is_empty():
    ids = evals["example_id"].to_list()
    texts = dict(zip(ids, evals["text"].to_list(), strict=True))
    ev = st.selectbox(
        "Eval example",
        ids,
        key="cmp_eval",
        format_func=lambda i: f"#{i}: {text.one_line(texts[i])}",
    )
    query = {"eval_example": int(ev)}
else:
    if mode == "eval":
        st.info("Run A has no eval examples: type a query instead.")
    prompt = st.text_area("Text" if classification else "Prompt", key="cmp_prompt", height=80)
    second = st.text_input("Label" if classification else "Completion", key="cmp_second")
    # an empty completion is the engine's to refuse (it is not a whole-text query)
    query = (
        {"prompt": prompt, "label": second or None}
        if classification
        else {"prompt": prompt, "completion": second}
    )
top_k = st.slider("Top k", 1, 100, 10, key="cmp_topk")

if st.button("Compare", type="primary", key="cmp_go"):
    try:
        q = query
        if "eval_example" in q and not same_run:
            q = compare.query_text(run_a, q["eval_example"])  # the same text, asked of run B
        with st.spinner("Asking both sides…"):
            result = compare.compare_sides((run_a, pre_a), (run_b, pre_b), q, top_k)
    except (TracepropError, ValueError) as e:
        st.session_state.pop("cmp_result", None)
        st.error(text.md_escape(e))
    else:
        st.session_state["cmp_result"] = result

result = st.session_state.get("cmp_result")
if result is None:
    st.stop()
la = f"{result.a.query['run_id']} · {result.a.query['preconditioner']}"
lb = f"{result.b.query['run_id']} · {result.b.query['preconditioner']}"
st.caption(text.md_escape(f"A = {la}   ·   B = {lb}"))
for note in dict.fromkeys(result.a.notes + result.b.notes):
    st.warning(text.md_escape(note))

st.subheader("Overlap of the top k")
st.dataframe(
    result.overlap,
    hide_index=True,
    width="stretch",
    column_config={
        "jaccard": st.column_config.NumberColumn(format="%.3f"),
        "overlap_at_k": st.column_config.NumberColumn("overlap@k", format="%.3f"),
    },
    key="cmp_overlap",
)
for kind in ("proponent", "opponent"):
    st.subheader(kind.capitalize() + "s side by side")
    cols = st.columns(2)
    for col, res, label in ((cols[0], result.a, la), (cols[1], result.b, lb)):
        part = res.rows.filter(res.rows["kind"] == kind)
        col.caption(text.md_escape(label))
        col.dataframe(
            part.select("rank", "score", "text", "source", "row"),
            hide_index=True,
            width="stretch",
            column_config={"score": st.column_config.NumberColumn(format="%.4g")},
            key=f"cmp_{kind}_{'a' if res is result.a else 'b'}",
        )

st.subheader("Rank changes")
st.caption(
    "rank change = rank in A − rank in B (> 0: ranked higher by B); 'flipped': a proponent on "
    "one side and an opponent on the other; 'only a' / 'only b': outside the other's top k."
)
st.plotly_chart(charts.rank_scatter_figure(result.changes, la, lb), key="cmp_scatter")
st.dataframe(
    result.changes,
    hide_index=True,
    width="stretch",
    column_config={
        "score_a": st.column_config.NumberColumn(format="%.4g"),
        "score_b": st.column_config.NumberColumn(format="%.4g"),
    },
    key="cmp_changes",
)
