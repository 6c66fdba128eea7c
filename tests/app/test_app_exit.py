"""A process that ends while the app's warm-up runs exits cleanly (issue 27 item 3).

The warm-up thread (``app/services/warmup.py``) opens the run's store (h5py), its index (FAISS)
and, without a query worker, torch. A process exiting under it crashed (rc 139): HDF5's own exit
handler called back into a finalised interpreter for a converter h5py registered after its exit
hook had run. These tests exit during the warm-up and assert a clean exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"
CLEAN_EXIT_S = 30  # the warm-up's current step and the worker's stop, on a loaded machine

# AppTest from main.py (a session: the warm-up starts beside the first page), then exit at once.
# The app's folder goes on sys.path first, as `streamlit run` keeps it for the server's life (its
# bootstrap, or main.py under st.App). AppTest otherwise inserts it for each script run and removes
# it at the run's end: a removal at index 0 while the warm-up thread's import walks sys.path skips
# the next entry, and 1 CI run in many failed "No module named 'numpy'" (site-packages skipped).
EXIT_DURING_WARM_UP = textwrap.dedent(
    f"""
    import sys, threading
    sys.path.insert(0, {str(APP)!r})
    edits = []
    class Watched(list):
        def insert(self, i, x):
            edits.append(("insert", x)); super().insert(i, x)
        def remove(self, x):
            edits.append(("remove", x)); super().remove(x)
    sys.path = Watched(sys.path)
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file({str(APP / "main.py")!r}, default_timeout=120)
    at.run()
    assert not edits, ("a script run edited sys.path under the warm-up", edits)
    assert not at.exception, at.exception
    alive = [t.name for t in threading.enumerate() if t.name == "traceprop-warmup"]
    print("warm-up running at exit:", bool(alive), flush=True)
    """
)


def _env(tmp: Path, **extra: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TRACEPROP_RUNS_ROOT": str(tmp / "runs"),
        "TRACEPROP_DATA_ROOT": str(tmp / "data"),
        "TRACEPROP_SAMPLE_RUNS": str(REPO / "sample_runs"),
        "HOME": str(tmp),
        "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
        **extra,
    }
    env.pop("TRACEPROP_NO_WARMUP", None)
    return env


@pytest.mark.parametrize("worker", ["1", "1", "0"], ids=["worker-a", "worker-b", "no-worker"])
def test_exit_during_the_warm_up_is_clean(tmp_path, worker):
    """Before the fix, 3 of 3 such exits with the worker crashed (rc 139)."""
    out = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_WARM_UP],
        capture_output=True,
        text=True,
        env=_env(tmp_path, TRACEPROP_QUERY_WORKER=worker),
        timeout=300,
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    # the exit came while the warm-up ran (else this test would test nothing)
    assert "warm-up running at exit: True" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.browser
@pytest.mark.slow
def test_ctrl_c_during_the_warm_up_of_streamlit_run_exits_cleanly(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) right after a browser's
    first page is drawn, while the server's warm-up and the query worker's imports run."""
    from test_browser import CHROMIUM, LAUNCH_ARGS, _need_browser

    _need_browser()
    port = _free_port()
    log_path = tmp_path / "streamlit.log"
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP / "main.py"),
        "--server.headless",
        "true",
        "--server.address",
        "127.0.0.1",
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(tmp_path),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert workers, "the server's start starts the query worker"
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            page = browser.new_page()
            page.goto(url)
            page.get_by_role("heading", name="Traceprop").first.wait_for(timeout=60_000)
            os.killpg(proc.pid, signal.SIGINT)  # the session's warm-up has just started
            rc = proc.wait(timeout=CLEAN_EXIT_S)  # no hang
            browser.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text(errors="replace")
    # uvicorn (st.App) shuts the server down gracefully (the lifespan's exit: warmup.shutdown),
    # then re-raises the SIGINT: click's "Aborted!", exit status 1, as for any click program
    assert rc == 1 and text.rstrip().endswith("Aborted!"), (rc, text[-3000:])
    assert "Traceback" not in text and "Segmentation" not in text, text[-3000:]
    for pid in workers:  # the query worker ended with the server (no orphan)
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), pid


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return "zombie"
