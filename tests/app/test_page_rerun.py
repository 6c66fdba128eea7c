"""services.page_rerun reads the installed Streamlit's own pending-rerun state (not a public API:
this test is what says when an upgrade moves it)."""

from __future__ import annotations

from types import SimpleNamespace

from services import page_rerun
from streamlit.runtime.scriptrunner_utils.script_requests import RerunData, ScriptRequests


def _ctx(monkeypatch, requests) -> None:
    ctx = SimpleNamespace(script_requests=requests)
    monkeypatch.setattr(page_rerun, "get_script_run_ctx", lambda: ctx)


def test_a_waiting_click_is_seen(monkeypatch):
    requests = ScriptRequests()
    _ctx(monkeypatch, requests)
    assert not page_rerun.rerun_queued()  # nothing waits: the timer may rerun the page
    # the user's click on another page, queued while the timer's fragment runs
    assert requests.request_rerun(RerunData(page_script_hash="runs-page"))
    assert page_rerun.rerun_queued()
    # the script runner takes it (the run starts): nothing waits any more
    requests.on_scriptrunner_ready()
    assert not page_rerun.rerun_queued()


def test_outside_a_script_run_nothing_waits(monkeypatch):
    monkeypatch.setattr(page_rerun, "get_script_run_ctx", lambda: None)
    assert not page_rerun.rerun_queued()
