"""How fast the app feels: cold first page, first query, later queries (real browser).

    python benchmarks/app_speed.py --repeats 3 [--json out.json] [--screenshots docs/img]

``--screenshots DIR`` saves the first cold start's views to ``DIR`` (``docs/img`` refreshes the
docs' home, runs-story, influencers-answer and influencers-mismatch screenshots; the suite's
browser tests save theirs to a temporary folder unless run with ``--screenshots DIR`` too).

Each repeat starts a fresh `streamlit run app/main.py` (a cold process: nothing imported, no
run opened) on the bundled sample run and drives Debian's chromium through Playwright:

- ``server_s``: process start until ``/_stcore/health`` answers;
- ``first_page_s``: process start until the landing page is drawn in the browser (its
  sample-question button shown: what a user waits for after ``streamlit run``);
- ``page_after_server_s``: the same, less ``server_s`` (the app's own part);
- ``runs_page_s``: click on "Runs" until its loss curve is drawn;
- ``first_query_s``: click on "Ask the sample question" until the model's answer and the
  proponents are drawn (the background warm-up has had only the time the Runs page took);
- ``later_query_s``: median over ``--later`` clicks on "Find influencers" with an alternating
  completion, click until the new answer is drawn.

Prints the medians over repeats (seconds). The machine is shared: quote them with its load.

``--arms 'worker:TRACEPROP_QUERY_WORKER=1' 'in-process:TRACEPROP_QUERY_WORKER=0'`` measures
several environments interleaved: every repeat starts each arm once, in turn, and the medians
are printed per arm with each arm's ratio to the first. ``APP_SPEED_REPO=/path`` in an arm runs
that checkout's app instead (e.g. ``git worktree add /tmp/before HEAD~3``: before and after in
the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
COMPLETIONS = (" violet", " green")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, port: int, extra_env: dict | None = None) -> subprocess.Popen:
    """A fresh `streamlit run app/main.py` on ``port`` with its own runs root and HOME."""
    (tmp / "home").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TRACEPROP_RUNS_ROOT": str(tmp / "runs"),
        "TRACEPROP_DATA_ROOT": str(tmp / "data"),
        "TRACEPROP_SAMPLE_RUNS": str(REPO / "sample_runs"),
        "HOME": str(tmp / "home"),
        "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
        **(extra_env or {}),
    }
    env.pop("APP_SPEED_REPO", None)
    repo = Path((extra_env or {}).get("APP_SPEED_REPO") or REPO)  # another checkout's app
    cmd = [sys.executable, "-m", "streamlit", "run", str(repo / "app" / "main.py")]
    cmd += ["--server.headless", "true", "--server.address", "127.0.0.1"]
    cmd += ["--server.port", str(port), "--browser.gatherUsageStats", "false"]
    cmd += ["--server.fileWatcherType", "none"]
    log = open(tmp / "streamlit.log", "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(
        cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("streamlit exited")
        try:
            if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("streamlit did not answer /_stcore/health")


def _answer_shown(page, completion: str):
    """Wait until the 'Queried output' metric shows ``completion`` and the proponents are drawn."""
    metric = page.get_by_test_id("stMetric").filter(has_text="Queried output")
    metric.filter(has_text=completion.strip()).wait_for()
    page.get_by_text("Proponents (pushed toward this output)").first.wait_for()


def _local_only(url: str):
    """A route handler that lets the app's own requests through and blocks the rest (offline)."""

    def route(rt):
        ok = rt.request.url.startswith(("data:", "blob:", url))
        return rt.continue_() if ok else rt.abort()

    return route


def measure_once(page, url: str, proc: subprocess.Popen, t_start: float, later: int,
                 shots: Path | None = None) -> dict:  # fmt: skip
    """One cold start: the timings of one fresh server (see the module docstring)."""
    wait_health(url, proc)
    out = {"server_s": time.monotonic() - t_start}
    page.goto(url)
    page.get_by_role("heading", name="Traceprop").first.wait_for()
    page.get_by_role("button", name="Ask the sample question").wait_for()  # the whole page
    out["first_page_s"] = time.monotonic() - t_start
    out["page_after_server_s"] = out["first_page_s"] - out["server_s"]
    if shots:  # the code box's monospace font loads on first use: an empty box otherwise
        page.evaluate("document.fonts.ready.then(() => true)")
        page.screenshot(path=str(shots / "home.png"), full_page=True)
    t = time.monotonic()
    page.get_by_test_id("stSidebarNav").get_by_text("Runs", exact=True).click()
    page.get_by_test_id("stPlotlyChart").first.wait_for()
    out["runs_page_s"] = time.monotonic() - t
    if shots:
        page.screenshot(path=str(shots / "runs-story.png"), full_page=True)
    page.get_by_test_id("stSidebarNav").get_by_text("Home", exact=True).click()
    t = time.monotonic()
    page.get_by_role("button", name="Ask the sample question").click()
    _answer_shown(page, COMPLETIONS[0])
    out["first_query_s"] = time.monotonic() - t
    times = []
    box = page.get_by_label("Completion (the output whose origin you want explained)")
    for i in range(later):
        c = COMPLETIONS[(i + 1) % 2]
        box.fill(c)
        t = time.monotonic()
        page.get_by_role("button", name="Find influencers").click()
        _answer_shown(page, c)
        times.append(time.monotonic() - t)
    out["later_query_s"] = statistics.median(times) if times else None
    out["later_query_all_s"] = times
    if shots:
        page.screenshot(path=str(shots / "influencers-answer.png"), full_page=True)
        box.fill(" green")  # an output the model does not give: the warning
        page.get_by_role("button", name="Find influencers").click()
        _answer_shown(page, " green")
        page.get_by_text("does not produce the queried output").wait_for()
        page.screenshot(path=str(shots / "influencers-mismatch.png"), full_page=True)
    return out


KEYS = (
    "server_s",
    "first_page_s",
    "page_after_server_s",
    "runs_page_s",
    "first_query_s",
    "later_query_s",
)


def measure(
    repeats: int = 3, later: int = 5, shots: Path | None = None, arms: dict | None = None
) -> dict:
    """Medians over ``repeats`` cold starts, and every repeat's timings; with ``arms`` (name ->
    extra environment) each repeat starts every arm once, in turn, and the result is per arm."""
    from playwright.sync_api import sync_playwright

    arms = arms or {"": {}}
    runs: dict[str, list] = {name: [] for name in arms}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        for r in range(repeats):
            for name, extra in arms.items():
                with tempfile.TemporaryDirectory() as d:
                    port = _free_port()
                    url = f"http://127.0.0.1:{port}"
                    ctx = browser.new_context(viewport={"width": 1400, "height": 2000})
                    ctx.route("**/*", _local_only(url))
                    page = ctx.new_page()
                    page.set_default_timeout(120_000)
                    t0 = time.monotonic()
                    proc = start_server(Path(d), port, extra)
                    try:
                        shot = shots if r == 0 and name == next(iter(arms)) else None
                        runs[name].append(measure_once(page, url, proc, t0, later, shot))
                    finally:
                        stop_server(proc)
                        ctx.close()
        browser.close()
    out = {
        name: {
            "env": arms[name],
            "medians": {k: statistics.median(x[k] for x in rs) for k in KEYS},
            "repeats": rs,
        }
        for name, rs in runs.items()
    }
    return out[""] if list(out) == [""] else {"arms": out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="cold starts")
    p.add_argument("--later", type=int, default=5, help="later queries per start")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--screenshots", help="folder for home/runs/influencers screenshots")
    p.add_argument(
        "--arms",
        nargs="+",
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="environments measured interleaved (every repeat starts each once, in turn)",
    )
    a = p.parse_args(argv)
    shots = Path(a.screenshots) if a.screenshots else None
    if shots:
        shots.mkdir(parents=True, exist_ok=True)
    arms = None
    if a.arms:
        arms = {}
        for spec in a.arms:
            name, _, env = spec.partition(":")
            arms[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    res = measure(a.repeats, a.later, shots, arms)
    if arms is None:
        for k, v in res["medians"].items():
            print(f"{k:>15}: {v:6.2f} s (median of {a.repeats})")
    else:
        base = next(iter(arms))
        for k in KEYS:
            cells = []
            for name, r in res["arms"].items():
                v, b = r["medians"][k], res["arms"][base]["medians"][k]
                cells.append(f"{name} {v:6.2f} s" + (f" ({v / b:.2f}x)" if name != base else ""))
            print(f"{k:>19}: " + " | ".join(cells) + f"  (medians of {a.repeats})")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
