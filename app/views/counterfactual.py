"""Sections of the Influencers page: the per-token view of one influencer and the counterfactual
check of the query (retrain without its top-k proponents vs k random examples).

Not a page of its own: ``influencers.py`` calls :func:`render_tokens` and
:func:`render_counterfactual` under a result.
"""

from __future__ import annotations

import json

import plotly.graph_objects as go
import streamlit as st
from services import counterfactual as cf
from services import text

from traceprop_engine.errors import TracepropError


def render_tokens(active, res, rows) -> None:
    """Per-token view: which tokens of a selected influencer carry its score."""
    st.subheader("Per-token view")
    if rows.is_empty():
        return
    labels = {
        int(
            r["example_id"]
        ): f"{r['kind']} #{r['rank']} · {r['score']:+.4g} · {text.one_line(r['text'])}"
        for r in rows.iter_rows(named=True)
    }
    eid = st.selectbox("Influencer", list(labels), key="tok_pick", format_func=lambda i: labels[i])
    # the whole query (prompt, completion, preconditioner, cosine, ...): a view computed for
    # another completion or preconditioner is never shown for this one
    key = (str(active), json.dumps(res.query, sort_keys=True, default=str), int(eid))
    cache = st.session_state.setdefault("tok_cache", {})
    if key not in cache:
        try:
            with st.spinner("Recomputing this example's gradient, token by token…"):
                cache[key] = cf.token_view(active, res, int(eid))
        except TracepropError as e:
            st.warning(text.md_escape(e))
            return
    pieces, tc = cache[key]
    st.caption(
        "Each target token's share of the example's score: its loss gradient on the final model "
        "against the query's (same preconditioner"
        + (", cosine" if tc.cosine else "")
        + "). Green pushed toward the queried output, red away; grey tokens have no loss. "
        "Hover a token for its value."
    )
    # every piece is HTML-escaped by highlighted_html: no data is rendered as markup
    st.markdown(cf.highlighted_html(pieces, tc.contributions, tc.loss_mask), unsafe_allow_html=True)
    st.caption(text.md_escape(cf.score_line(pieces, tc)))
    top = sorted(
        ((float(v), pieces[i]) for i, v in enumerate(tc.contributions) if tc.loss_mask[i]),
        key=lambda x: -abs(x[0]),
    )[:8]
    st.dataframe(
        {"token": [repr(p) for _, p in top], "contribution": [v for v, _ in top]},
        hide_index=True,
        key="tok_table",
    )


@st.fragment(run_every=1.0)
def _running(active: str, spec) -> None:
    s = cf.state(active, spec)
    if s["status"] != "running":
        st.rerun()  # finished, cancelled or failed: show it in the page
    frac = s["done"] / s["total"] if s.get("total") else 0.0
    st.progress(
        frac, text=text.md_escape(f"running: {s['done']}/{s['total'] or '?'} · {s['message']}")
    )
    if st.button("Cancel", key="cf_cancel"):
        cf.cancel(active, spec)
        st.info("Cancel requested: the check stops at the next training step.")


def _show_result(doc: dict) -> None:
    rows = cf.summary_rows(doc)
    n = len(doc["seeds"])
    st.dataframe(
        rows,
        hide_index=True,
        key="cf_table",
        column_config={
            "loss change (mean)": st.column_config.NumberColumn(format="%+.4f"),
            "std": st.column_config.NumberColumn(format="%.4f"),
            "sem": st.column_config.NumberColumn(format="%.4f"),
        },
    )
    fig = go.Figure()
    fig.add_bar(
        x=[r["removed"] for r in rows],
        y=[r["loss change (mean)"] for r in rows],
        error_y={"type": "data", "array": [r["std"] or 0.0 for r in rows], "visible": n > 1},
        marker_color=["#2a9d8f", "#8d99ae"],
    )
    fig.update_layout(
        yaxis_title="change of the query's loss", height=300, margin={"t": 20}, showlegend=False
    )
    st.plotly_chart(fig, key="cf_chart")
    diff = doc["change"]["top_k_minus_random"]
    full = sum(doc["losses"]["full"]) / n
    verdict = (
        "Removing the top proponents raised the query's loss more than removing random examples: "
        "the ranking points at examples the output depends on."
        if diff > 0 and doc["change"]["top_k"]["mean"] > 0
        else "Removing the top proponents did not raise the query's loss more than random "
        "removal: do not trust this ranking for this query."
    )
    (st.success if diff > 0 else st.warning)(verdict)
    st.caption(
        f"Query loss of the run's model {doc['original_loss']:.4f}; retrained on all "
        f"{doc['n_train']} examples {full:.4f} (mean of {n} seeds). Change = retrained without "
        f"the removed examples minus retrained on all, same recipe and seed; ± std over seeds "
        f"(none with one seed). "
        f"Computed {text.md_escape(doc['created'])} in {doc['seconds']:.0f} s."
    )


def render_counterfactual(active, res) -> None:
    """The counterfactual check of the result's query: start, progress, cancel, saved result."""
    st.subheader("Counterfactual check")
    st.caption(
        "Retrain the model without the query's top-k proponents and, as a control, without k "
        "random examples (same recipe and seeds), and compare the change of the query's loss."
    )
    q = res.query
    if not (q.get("prompt") or q.get("completion")) or q.get("label"):
        st.info("The counterfactual check needs a prompt/completion query of a causal-LM run.")
        return
    try:
        k_default, k_most = cf.k_range(active)
    except TracepropError as e:
        st.warning(text.md_escape(f"Counterfactual check unavailable: {e}"))
        return
    if k_most < 1:
        st.info("This run has too few training examples for the counterfactual check.")
        return
    c1, c2 = st.columns(2)
    # no bounds on the fields: a browser keeps an out-of-range value to itself (a red field,
    # the old estimate on the button); checked here instead, with the range said
    k = c1.number_input(
        "Proponents to remove (k)",
        value=k_default,
        step=1,
        key="cf_k",
        help=f"1 to {k_most}: the top-k proponents of this query, and as many random examples.",
    )
    seeds = c2.number_input(
        "Seeds", value=3, step=1, key="cf_seeds", help="1 to 5 retrains per arm"
    )
    bad = []
    if not 1 <= k <= k_most:
        bad.append(
            f"k must be 1 to {k_most} for this run (half its training examples, at most {cf.MAX_K})"
        )
    if not 1 <= seeds <= 5:
        bad.append("seeds must be 1 to 5")
    if bad:
        st.warning("; ".join(bad).capitalize() + ".")
        return
    try:
        spec = cf.spec_for(q, int(k), int(seeds), str(q.get("preconditioner")))
        est = cf.plan(active, spec)
    except TracepropError as e:
        st.warning(text.md_escape(f"Counterfactual check unavailable: {e}"))
        return
    s = cf.state(active, spec)
    if s["status"] == "running":
        _running(str(active), spec)
        return
    doc = cf.result(active, spec) if s["status"] == "completed" else None
    if doc is not None:
        _show_result(doc)
    elif s["status"] in ("cancelled", "failed"):
        msg = f"The last check {s['status']}" + (f": {s['error']}" if s.get("error") else "")
        (st.warning if s["status"] == "cancelled" else st.error)(text.md_escape(msg))
    label = "Run the check again" if doc is not None else "Run the counterfactual check"
    if st.button(
        f"{label} ({est['retrains']} retrains, about {est['estimated_s']:.0f} s)", key="cf_go"
    ):
        try:
            cf.start(active, spec)
        except TracepropError as e:
            st.error(text.md_escape(e))
            return
        st.rerun()
