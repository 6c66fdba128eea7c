"""Item 8 (fast enough to feel live), without a browser: what each page imports and does.

Wall-clock limits live in test_browser_speed.py (real browser, generous); here the causes of
slowness that a loaded machine cannot hide: the landing and Runs pages import no torch (1.5 s
on this CPU, and a Runs page waiting on the warm-up's torch import took 5 s), queries run torch
with the app's thread count, and a rerun does not read the shown examples' tokens again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import streamlit as st
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
MAIN = str(REPO / "app" / "navigation.py")  # the pages (main.py: the server, st.App)
SAMPLE = REPO / "sample_runs" / "facts"

# a fresh interpreter: the test process's own imports (torch from other tests) must not count
PAGES_SCRIPT = """
import json, sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120)
at.run()
out = {"home_exc": [str(e.value) for e in at.exception], "home_title": at.title[0].value}
out["home"] = sorted(m for m in ("torch", "transformers", "faiss") if m in sys.modules)
at.switch_page("views/runs.py")
at.run()
out["runs_exc"] = [str(e.value) for e in at.exception]
out["runs_charts"] = len(at.get("plotly_chart"))
out["runs_table"] = len(at.dataframe)
out["runs"] = sorted(m for m in ("torch", "transformers", "faiss") if m in sys.modules)
print(json.dumps(out))
"""


def test_landing_and_runs_pages_import_no_torch(app_env):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PAGES_SCRIPT, MAIN],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["home_exc"] == [] and res["runs_exc"] == [], res
    assert res["home_title"] == "Traceprop"
    assert res["runs_charts"] == 1 and res["runs_table"] >= 1  # the loss curve and the table drawn
    assert res["home"] == [], res
    assert res["runs"] == [], res  # the store's step times are read without torch


def test_queries_run_torch_with_the_app_thread_count(app_env, monkeypatch):
    import torch
    from services import queries

    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        queries.run_query(SAMPLE, eval_example=0, top_k=3)
        assert torch.get_num_threads() == 1  # the default: one intra-op thread
        monkeypatch.setenv("TRACEPROP_APP_THREADS", "2")
        queries.run_query(SAMPLE, eval_example=0, top_k=3)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("TRACEPROP_APP_THREADS", "many")
        assert queries.app_threads() == 1
    finally:
        torch.set_num_threads(prev)


def test_rerun_does_not_read_tokens_again(app_env, monkeypatch):
    from services import exports
    from views.example_details import expander_key

    from traceprop_engine import attribution
    from traceprop_engine.attribution import overview

    calls = []
    real = overview.example_tokens

    def counting(run, example_id):
        calls.append(example_id)
        return real(run, example_id)

    # the services call it through the front door, whose lazy name may already be bound (an
    # earlier test of this process read it, e.g. test_layout): patch both
    monkeypatch.setattr(overview, "example_tokens", counting)
    monkeypatch.setattr(attribution, "example_tokens", counting)
    st.cache_data.clear()  # token texts cached by an earlier test of this process
    at = AppTest.from_file(MAIN, default_timeout=300)
    at.run()
    at.switch_page("views/influencers.py").run()
    at.button(key="infl_go").click().run()
    assert not at.exception
    assert calls == []  # the examples' expanders are closed: no tokens read
    rows = exports.shown_rows(at.session_state["infl_result"]["result"])
    at.session_state[expander_key(next(rows.iter_rows(named=True)))] = True  # open the first
    at.run()
    first = len(calls)
    assert first == 1  # only the open example's tokens
    shown = [c.value for c in at.code]
    at.slider(key="infl_topk").set_value(10).run()  # a rerun that changes nothing shown
    assert not at.exception
    assert len(calls) == first  # the cached token texts
    assert [c.value for c in at.code] == shown
