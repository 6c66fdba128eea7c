"""The pages of every browser session of ``streamlit run app/main.py`` (opens on the bundled
sample run): page set-up, navigation, the sidebar, and the first query's warm-up."""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

APP_DIR = Path(__file__).resolve().parent
for p in (APP_DIR, APP_DIR.parent):  # `import services` and the engine, from any working directory
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from services import config, jobs, page_rerun, preload, runs, warmup  # noqa: E402

st.set_page_config(page_title="Traceprop", page_icon="↪", layout="wide")

cfg = config.AppConfig.from_env()
active = runs.ensure_active_run(cfg, st.session_state)

# icons from the symbol blocks a plain text font (DejaVu Sans) carries: emoji such as 🧭 or 🗂️
# were empty boxes on a system without an emoji font (tests/app/test_app_defects.py)
pages = [
    st.Page("views/home.py", title="Home", icon="▶", default=True),
    st.Page("views/runs.py", title="Runs", icon="☑"),
    st.Page("views/launch.py", title="Launch", icon="✈"),
    st.Page("views/influencers.py", title="Influencers", icon="➡"),
    st.Page("views/curate.py", title="Curate", icon="✂"),
    st.Page("views/compare.py", title="Compare", icon="⚖"),
    st.Page("views/rankings.py", title="Rankings", icon="↕"),
    st.Page("views/overhead.py", title="Overhead", icon="⚡"),
    st.Page("views/quality.py", title="Quality", icon="✔"),
    st.Page("views/audit.py", title="Audit", icon="✍"),
]
nav = st.navigation(pages)


def _job_status() -> None:
    job = jobs.active_job(cfg)
    if job is None:
        # the job just ended: redraw the page (its banners) without it; when the user's own
        # rerun (a click on another page) is waiting, that one redraws it (services/page_rerun)
        if st.session_state.get("sidebar_job") and not page_rerun.rerun_queued():
            del st.session_state["sidebar_job"]
            st.rerun()
        return
    st.session_state["sidebar_job"] = str(job.run_dir)
    st.info(f"Training {job.run_dir.name}: step {job.step}/{job.total or '?'}")


with st.sidebar:
    st.caption("Active run")
    if active is None:
        st.warning(
            "No runs yet: launch one, or set TRACEPROP_SAMPLE_RUNS to the bundled sample runs."
        )
    else:
        st.text(active.name + ("  (sample)" if config.is_sample(cfg, active) else ""))
    job = jobs.active_job(cfg)
    # live while a job runs; when it ends the whole page reruns, so no stale "step 9/20" or
    # "a training job is running" banner stays behind
    st.fragment(_job_status, run_every=2.0 if job is not None else None)()

    # "Failed to fetch dynamically imported module" after a server restart: reload the tab once
    # (a browser keeps a failed lazy import for the page's life), or say to (app/stale_assets.html)
    st.html(APP_DIR / "stale_assets.html", unsafe_allow_javascript=True)
    st.html(preload.script(), unsafe_allow_javascript=True)  # chart and table code, once

# the first query's server side starts now, beside the first page (services/warmup.py); the
# model itself has been loading in the query worker since the server started (main.py)
warmup.start(active)
nav.run()
