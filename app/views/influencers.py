"""Influencers: which training examples pushed the model toward (or away from) an output."""

from __future__ import annotations

import streamlit as st
from services import answers, config, exports, find, jobs, landing, queries, runs, text, warmup
from views import counterfactual as cf_sections
from views import example_details, find_panel, result_charts, second_opinion

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Influencers")
active = runs.ensure_active_run(cfg, st.session_state)
if active is None:
    st.warning("No run to query: launch one on the Launch page.")
    st.stop()

status = jobs.job_state(active).status
if status in ("starting", "running"):
    st.info(
        text.md_escape(active.name)
        + " is still training: query it when it has finished (see the Launch page)."
    )
    st.stop()
try:
    run = queries.query_overview(active)
    mtime = queries.manifest_mtime(active)
    evals = queries.cached_examples(str(active), mtime, "eval")
except TracepropError as e:
    st.error(text.md_escape(f"{active.name} cannot be queried: {e}"))
    st.stop()

st.caption(
    f"Run **{run.run_id}** · task {run.task} · {run.n_records} records · {run.n_layers} tracked layers"
)
for note in run.notes:
    st.warning(text.md_escape(note))
classification = run.task == "classification"
labels = sorted({x for x in queries.cached_examples(str(active), mtime)["label"].to_list() if x})

MODES = ["eval", "typed"]
mode = st.radio(
    "Query",
    MODES,
    horizontal=True,
    key="infl_mode",
    format_func={
        "eval": "An eval example",
        "typed": "Type a " + ("text" if classification else "prompt"),
    }.get,
)
eval_id = prompt = completion = label = None
if mode == "eval":
    if evals.is_empty():
        st.info("This run has no eval examples: type a query instead.")
    else:
        ids = evals["example_id"].to_list()
        texts = dict(zip(ids, evals["text"].to_list(), strict=True))
        eval_id = st.selectbox(
            "Eval example",
            ids,
            key="infl_eval",
            format_func=lambda i: f"#{i}: {text.one_line(texts[i])}",
        )
else:
    prompt = st.text_area(
        "Text" if classification else "Prompt",
        key="infl_prompt",
        height=80,
        placeholder="Q: Which colour does the planet Ethmor have?\nA:",
    )
    if classification:
        label = (
            st.selectbox("Label", labels, key="infl_label")
            if labels
            else st.text_input("Label", key="infl_label_text")
        )
    else:
        completion = st.text_input(
            "Completion (the output whose origin you want explained)", key="infl_completion"
        )
c1, c2 = st.columns(2)
top_k = c1.slider("Top k", 1, 200, 10, key="infl_topk")
pre = c2.selectbox(
    "Preconditioner",
    list(run.preconditioners),
    key="infl_pre",
    help=" ".join(f"{k}: {v}" for k, v in landing.PRECONDITIONERS.items())
    + " Score > 0: the example pushed the model toward this output (a proponent); < 0: away "
    "from it (an opponent).",
)

prior = None  # the run's default: a classification run adds its class prior
if classification:
    on = st.toggle(
        "Class prior",
        value=True,
        key="infl_prior",
        help="Add the classifier head's bias term the weight records leave out: "
        f"{run.class_prior:g} for an example of the queried label, "
        f"-{run.class_prior:g}/(C-1) for another label's (this run's default: "
        f"{queries.ADAPTER_CLASS_PRIOR:g} for a run that trained adapters, "
        f"{queries.DEFAULT_CLASS_PRIOR:g} otherwise; benchmarks/EVAL.md sections 1s-1v). "
        "Off: the records' gradient similarity alone.",
    )
    prior = None if on else 0.0
lm_bias = None  # the run's default: a free-text causal-LM run adds its LM-bias term
if run.lm_bias:
    on = st.toggle(
        "LM-bias term",
        value=True,
        key="infl_lm_bias",
        help=f"Add {run.lm_bias:g} x the cosine of the query's and each example's LM-head "
        "output-bias gradient (what the example teaches the next token's marginal, which the "
        "weight records leave out), from the records' first column; this run's default "
        f"({queries.DEFAULT_LM_BIAS:g} on a run trained on text; benchmarks/EVAL.md section 1ab). "
        "Off: the records' gradient similarity alone.",
    )
    lm_bias = None if on else 0.0

clicked = st.button("Find influencers", type="primary", key="infl_go")
if clicked or st.session_state.pop("infl_autorun", False):  # the landing page's sample question
    warmup.page_query_started()
    try:
        with st.spinner("Scoring every training example…"):
            res, by_source, scores, ts = queries.run_query_and_scores(
                active,
                prompt=prompt,
                completion=completion,
                eval_example=eval_id,
                label=label,
                top_k=top_k,
                preconditioner=pre,
                class_prior=prior,
                lm_bias=lm_bias,
            )
    except TracepropError as e:
        st.session_state.pop("infl_result", None)
        st.error(text.md_escape(e))
    else:
        try:
            ans = answers.model_answer(
                active, prompt=prompt, completion=completion, eval_example=eval_id, label=label
            )
        except TracepropError:
            ans = None
        st.session_state["infl_result"] = {
            "run": str(active),
            "result": res,
            "by_source": by_source,
            "scores": scores,
            "answer": ans,
            "test_side": ts,  # the second opinion ranks the same model half again
        }

saved = st.session_state.get("infl_result")
if not saved or saved["run"] != str(active):
    st.stop()
res, by_source = saved["result"], saved["by_source"]
rows = exports.shown_rows(res)

st.info("Sign convention — " + res.sign_note)
for note in res.notes:  # the run's own notes are shown above, once
    if note not in run.notes:
        st.warning(text.md_escape(note))
q = res.query
prior_shown = f" · class prior {q['class_prior']:g}" if q.get("class_prior") else ""
prior_shown += f" · LM bias {q['lm_bias']:g}" if q.get("lm_bias") else ""
st.caption(
    f"Query loss {q.get('query_loss', float('nan')):.4f} · preconditioner {q.get('preconditioner')}"
    f"{prior_shown} · {q.get('n_vectors')} examples searched · {res.elapsed_ms:.0f} ms"
)
ans = saved.get("answer")
if ans is not None:
    a1, a2, a3 = st.columns(3)
    a1.metric("Model's loss on the queried output", f"{ans.loss:.4f}")
    a2.metric("Queried output", text.one_line(ans.queried) or "—")
    a3.metric("Model's own greedy answer", text.one_line(ans.greedy) or "—")
    if (warn := answers.answer_warning(ans)) is not None:
        st.warning(text.md_escape(warn))

rows, second = second_opinion.render(active, run.preconditioners, saved, rows)
cols = (
    ["rank", "score", "text", "location", "label"]
    if classification
    else ["rank", "score", "text", "location"]
)
if second != second_opinion.OFF:
    cols += ["both", "second_rank"]
for kind, title in (
    ("proponent", "Proponents (pushed toward this output)"),
    ("opponent", "Opponents (pushed away)"),
):
    part = rows.filter(rows["kind"] == kind)
    st.subheader(title)
    if part.is_empty():
        st.caption("none")
        continue
    st.dataframe(
        part.select(cols),
        hide_index=True,
        width="stretch",
        column_config={
            "score": st.column_config.NumberColumn(format="%.4g"),
            "location": st.column_config.TextColumn("source file:row"),
            "both": st.column_config.CheckboxColumn("both", help="in both estimators' top k"),
            "second_rank": st.column_config.NumberColumn(
                f"rank under {second}", help=f"its rank in {second}'s top k (None: not in it)"
            ),
        },
    )

found, page_rows = find_panel.render(rows, key="infl_find")
example_details.render(active, page_rows)

cf_sections.render_tokens(active, res, rows)
cf_sections.render_counterfactual(active, res)

result_charts.render(by_source, saved["scores"])

c1, c2 = st.columns(2)
c1.download_button(
    "Export CSV",
    exports.export_bytes(res, "csv", found),
    file_name=find.export_name(q, "csv"),
    mime="text/csv",
    on_click="ignore",
    key="infl_csv",
)
c2.download_button(
    "Export JSON",
    exports.export_bytes(res, "json", found),
    file_name=find.export_name(q, "json"),
    mime="application/json",
    on_click="ignore",
    key="infl_json",
)
