"""Home: what the app does, the sample question in one click, how to read a score."""

from __future__ import annotations

import streamlit as st
from services import config, landing, text

cfg = config.AppConfig.from_env()
st.title("Traceprop")
st.markdown(
    "**Which training examples made the model say this?** Traceprop records a compressed "
    "gradient of every training example *while the model trains*, and later ranks the "
    "training examples by how much each one pushed the model toward (or away from) any output "
    "you ask about, with the file and row each came from."
)
st.markdown(
    "1. **Runs**: the tracked training runs, their loss curves and storage cost.\n"
    "2. **Launch**: fine-tune a model on your own data with tracking on.\n"
    "3. **Influencers**: ask about an output; see its proponents and opponents.\n"
    "4. **Overhead**, **Quality**, **Audit**: what tracking cost, how good the rankings "
    "measured, and a verifiable trail of a query."
)

q = landing.sample_question(cfg)
if q is None:
    st.info("The bundled sample run is not here: launch a run on the Launch page.")
else:
    st.subheader("Try it")
    st.markdown(
        "The sample run is a small model trained on invented facts about invented planets, "
        "rivers and guilds (so nothing it knows came from pre-training). Ask it:"
    )
    st.code(q.prompt + q.completion, language=None)
    if st.button("Ask the sample question", type="primary", key="home_ask"):
        landing.ask_sample(st.session_state, q)
        st.switch_page("views/influencers.py")

st.subheader("How to read the results")
st.markdown(landing.SIGN_NOTE)
st.markdown(
    "\n".join(
        f"- **{text.md_escape(k)}**: {text.md_escape(v)}"
        for k, v in landing.PRECONDITIONERS.items()
    )
)
st.caption(
    "Beside the influencers you also see the model's own loss on the queried output and its own "
    "greedy answer: when the model does not give the queried output, the ranking explains a "
    "failure, and the examples that state the right answer can rank as opponents."
)
