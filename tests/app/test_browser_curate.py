"""The Curate page in a real browser (chromium via Playwright), on a copy of the sample run: the
Influencers query's top proponents → cleaned copy → background retrain → before/after proof.
Screenshots go to a temporary folder, or to $TRACEPROP_IMG_DIR when set (docs/img/curate-*.png)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
from test_browser import CHROMIUM, LAUNCH_ARGS, TIMEOUT_MS, _free_port, _nav, _need_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Q: Which colour does the planet Ethmor have?\nA:"


def _stop_jobs(runs: Path) -> None:
    """SIGTERM a curate job a failed test left running (its own process group)."""
    for p in runs.glob("*/launch.json"):
        pid = json.loads(p.read_text()).get("pid")
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGTERM)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _need_browser()
    tmp = tmp_path_factory.mktemp("browser-curate")
    samples = tmp / "samples"
    samples.mkdir()
    for name in ("facts", "facts-data"):
        shutil.copytree(REPO / "sample_runs" / name, samples / name)
    (tmp / "home").mkdir()
    port = _free_port()
    env = {
        **os.environ,
        "TRACEPROP_RUNS_ROOT": str(tmp / "runs"),
        "TRACEPROP_DATA_ROOT": str(tmp / "data"),
        "TRACEPROP_SAMPLE_RUNS": str(samples),
        "HOME": str(tmp / "home"),
        "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
    }
    cmd = [sys.executable, "-m", "streamlit", "run", str(REPO / "app" / "main.py"),
           "--server.headless", "true", "--server.address", "127.0.0.1",
           "--server.port", str(port), "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none"]  # fmt: skip
    log = open(tmp / "streamlit.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    "streamlit did not start:\n" + (tmp / "streamlit.log").read_text()[-3000:]
                )
            time.sleep(0.3)
        yield {"url": url, "run": samples / "facts", "runs": tmp / "runs", "tmp": tmp}
    finally:
        _stop_jobs(tmp / "runs")
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_curate_retrain_and_proof(server):
    from playwright.sync_api import expect, sync_playwright

    img = Path(os.environ.get("TRACEPROP_IMG_DIR") or server["tmp"] / "img")
    img.mkdir(parents=True, exist_ok=True)
    expect.set_options(timeout=TIMEOUT_MS)
    blocked: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        ctx = browser.new_context(viewport={"width": 1400, "height": 2200})

        def route(r):
            host = urlparse(r.request.url).hostname
            if r.request.url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost"):
                return r.continue_()
            blocked.append(r.request.url)
            return r.abort()

        ctx.route("**/*", route)
        page = ctx.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server["url"])
        expect(page.get_by_role("heading", name="Traceprop").first).to_be_visible()
        _nav(page, "Influencers")
        page.get_by_text("Type a prompt").click()
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        completion = page.get_by_label("Completion (the output whose origin you want explained)")
        completion.fill(" violet")
        completion.press("Enter")
        page.get_by_role("button", name="Find influencers").click()
        expect(page.get_by_role("heading", name="Per-token view")).to_be_visible()

        _nav(page, "Curate")
        page.get_by_role("button", name=re.compile("Add the Influencers query")).click()
        expect(page.get_by_text(re.compile(r"^Query 1: "))).to_be_visible()
        k = page.get_by_label("Top k per query (and of the ranking)")
        k.fill("3")
        k.press("Enter")
        expect(page.get_by_text("3 training example(s) will be removed")).to_be_visible()
        name = page.get_by_label("Name of the retrained run")
        name.fill("no-violet")
        name.press("Enter")
        page.screenshot(path=str(img / "curate-select.png"), full_page=True)
        page.get_by_role("button", name="Write the cleaned copy and retrain").click()
        expect(
            page.get_by_text(
                re.compile(
                    r"Writing the cleaned copy and starting|Retraining: step|comparing the two"
                )
            )
        ).to_be_visible()
        page.screenshot(path=str(img / "curate-running.png"), full_page=True)
        expect(page.get_by_text(re.compile(r"Retrained without 3 example"))).to_be_visible(
            timeout=300_000
        )
        expect(page.get_by_text("Answer after")).to_be_visible()
        # the page shows the proof's numbers; the manifest lists the 3 removed rows
        data = server["runs"] / "curated" / "no-violet"
        proof = json.loads((data / "proof.json").read_text())
        loss = page.get_by_test_id("stMetric").filter(has_text="Loss on the queried output")
        expect(loss).to_contain_text(f"{proof['queries'][0]['after']['loss']:.4f}")
        removed = json.loads((data / "curate.json").read_text())["removed"]
        assert len({(r["source"], r["row"]) for r in removed}) == 3
        page.get_by_role("heading", name="3 · Before and after").scroll_into_view_if_needed()
        page.screenshot(path=str(img / "curate-proof.png"), full_page=True)
        ctx.close()
        browser.close()
    assert not blocked, blocked
    assert (server["runs"] / "curated" / "no-violet" / "proof.json").is_file()
    assert not (server["run"].parent / "curated").exists()
