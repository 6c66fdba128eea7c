"""The per-token view and the counterfactual check in a real browser (chromium via Playwright),
on a copy of the sample run; its screenshots are the docs' (``doc_shots``: a temporary folder, or
``pytest --screenshots docs/img``)."""

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


def _stop_checks(run_dir: Path) -> None:
    """SIGTERM a counterfactual check a failed test left running (its own process group)."""
    results = run_dir.parents[1] / "runs" / "bundled-run-results"  # where a bundled run's go
    for p in results.glob("*/counterfactual/*.progress.json"):
        st = json.loads(p.read_text())
        if st.get("status") == "running" and st.get("pid"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(st["pid"]), signal.SIGTERM)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _need_browser()
    tmp = tmp_path_factory.mktemp("browser-cf")
    samples = tmp / "samples"
    samples.mkdir()
    for name in ("facts", "facts-data"):
        shutil.copytree(REPO / "sample_runs" / name, samples / name)
    shutil.rmtree(samples / "facts" / "counterfactual", ignore_errors=True)
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
        yield {"url": url, "run": samples / "facts"}
    finally:
        _stop_checks(samples / "facts")
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_per_token_view_and_counterfactual_check(server, doc_shots):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    blocked: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        ctx = browser.new_context(viewport={"width": 1400, "height": 1100})

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
        expect(page.get_by_role("heading", name="Traceprop").first).to_be_visible()  # landing page
        _nav(page, "Influencers")
        page.get_by_text("Type a prompt").click()
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        completion = page.get_by_label("Completion (the output whose origin you want explained)")
        completion.fill(" violet")
        completion.press("Enter")
        page.get_by_role("button", name="Find influencers").click()

        # per-token view of the top proponent: highlighted spans, the sum stated below
        section = page.get_by_role("heading", name="Per-token view")
        expect(section).to_be_visible()
        toks = page.locator("span.tp-tok")
        expect(toks.first).to_be_visible()
        assert toks.count() > 5
        expect(
            page.get_by_text(re.compile(r"Sum over tokens: .* = [+-][\d.]+, its"))
        ).to_be_visible()
        section.scroll_into_view_if_needed()
        page.screenshot(path=str(doc_shots / "per-token.png"))

        # the counterfactual check: one seed keeps it short; progress, then the result
        cf = page.get_by_role("heading", name="Counterfactual check")
        cf.scroll_into_view_if_needed()
        page.get_by_label("Proponents to remove (k)", exact=True).fill("5")
        page.get_by_label("Proponents to remove (k)", exact=True).press("Enter")
        page.get_by_label("Seeds", exact=True).fill("1")
        page.get_by_label("Seeds", exact=True).press("Enter")
        go = page.get_by_role(
            "button", name=re.compile(r"Run the counterfactual check \(3 retrains")
        )
        go.click()
        expect(page.get_by_text(re.compile(r"running: \d+/(\d+|\?)"))).to_be_visible()
        expect(page.get_by_role("button", name="Cancel")).to_be_visible()
        cf.scroll_into_view_if_needed()
        page.screenshot(path=str(doc_shots / "counterfactual-running.png"))
        expect(page.get_by_text(re.compile(r"Removing the top proponents"))).to_be_visible(
            timeout=300_000
        )
        expect(page.get_by_role("button", name=re.compile("Run the check again"))).to_be_visible()
        page.get_by_role("heading", name="Counterfactual check").scroll_into_view_if_needed()
        page.screenshot(path=str(doc_shots / "counterfactual-result.png"))
        # a bundled run stays read-only: the result lies beside the user's runs (issue 27 item 6)
        assert not (server["run"] / "counterfactual").exists()
        runs_root = server["run"].parents[1] / "runs"
        assert list(runs_root.glob("bundled-run-results/*/counterfactual/*.json"))

        # a revisit (a new page load) shows the saved result
        page.reload()
        _nav(page, "Influencers")
        page.get_by_text("Type a prompt").click()
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        completion = page.get_by_label("Completion (the output whose origin you want explained)")
        completion.fill(" violet")
        completion.press("Enter")
        page.get_by_role("button", name="Find influencers").click()
        page.get_by_label("Proponents to remove (k)", exact=True).fill("5")
        page.get_by_label("Proponents to remove (k)", exact=True).press("Enter")
        page.get_by_label("Seeds", exact=True).fill("1")
        page.get_by_label("Seeds", exact=True).press("Enter")
        expect(page.get_by_role("button", name=re.compile("Run the check again"))).to_be_visible()
        # the saved result, without retraining (no "running" line on the revisit)
        expect(page.get_by_text(re.compile(r"Removing the top proponents"))).to_be_visible()
        expect(
            page.get_by_text(re.compile(r"Query loss of the run's model [\d.]+"))
        ).to_be_visible()
        expect(page.get_by_text(re.compile(r"running: \d+/(\d+|\?)"))).to_have_count(0)
        ctx.close()
        browser.close()
    assert not blocked, blocked
