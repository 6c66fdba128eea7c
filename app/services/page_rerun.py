"""A whole-page rerun from a timer fragment that never undoes the user's click.

A fragment's ``st.rerun()`` reruns the page the fragment was drawn on. Streamlit folds the
reruns waiting for the script runner into one, and the newest one's page wins
(``ScriptRequests``), so a timer's rerun issued while the user's click on another page is
waiting took the user back (CI, stop 36: the sidebar's "job ended" rerun of the Launch page
undid a click on Runs). So a timer calls ``st.rerun()`` only when :func:`rerun_queued` says no
rerun is waiting: a waiting one redraws the page anyway (a page switch is a whole run), and the
caller keeps its trigger, so its next tick tries again if the waiting one was a fragment's.

It reads Streamlit's pending request (``ScriptRunContext.script_requests``, not a public API);
where that is not there (another Streamlit version), it says none is waiting (the rerun
happens, as before).
``tests/app/test_page_rerun.py`` checks it against the installed Streamlit's own classes.
"""

from __future__ import annotations

from streamlit.runtime.scriptrunner import get_script_run_ctx


def rerun_queued() -> bool:
    """Whether a rerun (a click, a page switch, a timer) waits for this session's script."""
    requests = getattr(get_script_run_ctx(), "script_requests", None)
    state = getattr(requests, "_state", None)
    return getattr(state, "name", None) == "RERUN"
