"""Issue 10, item 15 in a real browser: what only a browser shows (Enter in a form field, an
upload, the live sidebar and banner, a failed lazy import after a server restart).

Uses the server and page fixtures of test_browser.py (a fresh runs root per module)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_browser import _nav, page, server  # noqa: F401 - fixtures

from traceprop_engine.run import read_progress

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SMALL = (
    ("Max length (tokens)", "32"),
    ("Tiny model layers", "1"),
    ("Tiny model width", "32"),
)


def _open(page, server, name: str) -> None:  # noqa: F811
    page.goto(server["url"])
    page.get_by_role("heading", name="Traceprop").first.wait_for()  # the landing page
    _nav(page, name)


def _fill(page, values) -> None:  # noqa: F811 - page is the fixture
    for label, value in values:
        page.get_by_label(label, exact=True).fill(value)


def test_enter_in_a_launch_field_does_not_start_training(page, server):  # noqa: F811
    _open(page, server, "Launch")
    _fill(page, (*SMALL, ("Epochs", "1"), ("Run name (optional)", "enter-run")))
    for label in ("Run name (optional)", "Epochs", "Scope (all, last-block or a regex)"):
        page.get_by_label(label, exact=True).press("Enter")
    page.wait_for_timeout(3000)
    assert not page.get_by_text("Job enter-run").is_visible()
    assert not (server["runs"] / "enter-run").exists()


def test_uploaded_files_are_trained_on_and_said_so(page, server):  # noqa: F811
    from playwright.sync_api import expect

    rows = "".join(json.dumps({"text": f"upload row {i} says hello"}) + "\n" for i in range(24))
    _open(page, server, "Launch")
    expect(page.get_by_label("Bundled generated facts set (causal LM)")).to_be_checked()
    page.locator("input[type=file]").set_input_files(
        files=[{"name": "mine.jsonl", "mimeType": "application/json", "buffer": rows.encode()}]
    )
    _fill(page, (*SMALL, ("Epochs", "1"), ("Run name (optional)", "upload-run")))
    page.get_by_role("button", name="Start training").click()
    expect(
        page.get_by_text(re.compile(r"Training on the 1 uploaded file\(s\) \(mine\.jsonl\)"))
    ).to_be_visible()
    expect(page.get_by_text("Training finished")).to_be_visible(timeout=180_000)
    manifest = json.loads((server["runs"] / "upload-run" / "run.json").read_text())
    assert "/uploads/" in json.dumps(manifest["data"])
    assert manifest["data"]["n_train"] + manifest["data"].get("n_eval", 0) <= 24


def test_a_malformed_upload_is_refused_on_the_form_and_starts_no_job(page, server):  # noqa: F811
    """Issue 29 defect 8: the files are read before a job starts (it used to fail ~12 s in)."""
    from playwright.sync_api import expect

    rows = json.dumps({"text": "fine"}) + "\n" + '{"text": "broken' + "\n"
    _open(page, server, "Launch")
    page.locator("input[type=file]").set_input_files(
        files=[{"name": "bad.jsonl", "mimeType": "application/json", "buffer": rows.encode()}]
    )
    _fill(page, (*SMALL, ("Epochs", "1"), ("Run name (optional)", "bad-upload")))
    started = time.monotonic()
    page.get_by_role("button", name="Start training").click()
    expect(page.get_by_text(re.compile(r"bad\.jsonl:2:"))).to_be_visible(timeout=15_000)
    assert time.monotonic() - started < 15
    assert not (server["runs"] / "bad-upload").exists()
    assert not page.get_by_text("Job bad-upload").is_visible()
    assert not list((server["runs"] / "uploads").glob("*/bad.jsonl"))  # refused: not kept


def _first_step_pgid(run_dir: Path, timeout_s: float = 300) -> int:
    """The process group of the job training into ``run_dir``, once its first step is logged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        launch = run_dir / "launch.json"
        if read_progress(run_dir, last=1) and launch.exists():
            with contextlib.suppress(json.JSONDecodeError):  # being written: read it again
                return os.getpgid(json.loads(launch.read_text())["pid"])
        time.sleep(0.02)
    raise AssertionError(f"the job in {run_dir} logged no step within {timeout_s:.0f} s")


def test_banner_and_sidebar_clear_when_the_job_ends(page, server, artifacts):  # noqa: F811
    from playwright.sync_api import expect

    _open(page, server, "Launch")
    _fill(page, (*SMALL, ("Epochs", "3"), ("Run name (optional)", "live-run")))
    page.get_by_role("button", name="Start training").click()
    # the job is held still (SIGSTOP) from its first step until the page runs below are done,
    # then let go: they always happen while it trains, and it ends right after, whatever the
    # machine's load (a job long enough to outlast them took 8 minutes on a loaded machine)
    pgid = _first_step_pgid(server["runs"] / "live-run")
    os.killpg(pgid, signal.SIGSTOP)
    try:
        expect(page.get_by_text(re.compile(r"running: step \d+/\d+"))).to_be_visible()
        _nav(page, "Runs")  # a full page run while it trains: the sidebar shows it
        _nav(page, "Launch")
        sidebar = page.get_by_test_id("stSidebar")
        expect(sidebar.get_by_text(re.compile(r"Training live-run: step \d+/\d+"))).to_be_visible()
        expect(page.get_by_text("A training job is running")).to_be_visible()
        page.screenshot(path=str(artifacts / "launch-live-sidebar.png"), full_page=True)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    expect(page.get_by_text("Training finished")).to_be_visible(timeout=300_000)
    # no reload, no click: both go within a few seconds of the end
    expect(sidebar.get_by_text(re.compile(r"Training live-run"))).to_have_count(0, timeout=15_000)
    expect(page.get_by_text("A training job is running")).to_have_count(0, timeout=15_000)
    # a healthy tab never shows the stale-code hint (app/stale_assets.html)
    expect(page.locator("#traceprop-stale-hint")).to_have_count(0)
    page.screenshot(path=str(artifacts / "launch-done-cleared.png"), full_page=True)


def test_a_failed_lazy_import_reloads_the_tab(page, server):  # noqa: F811
    """The server unreachable at the moment a page first needs a lazily loaded chunk (as during
    a restart): the browser keeps that failure and shows "Failed to fetch dynamically imported
    module" until the tab reloads. Each chunk first requested after the first page load fails
    once here; the app's watcher reloads the tab and the page renders."""
    from playwright.sync_api import expect

    # the landing page's background preload (services/preload.py) would load the chart's code
    # before the failure starts: mark it done so that the Overhead page's chart needs its chunk
    page.add_init_script("window.__tracepropPreload = true")
    page.goto(server["url"])
    page.get_by_role("heading", name="Traceprop").first.wait_for()  # the landing page
    page.wait_for_timeout(1500)
    expect(page.locator("#traceprop-stale-hint")).to_have_count(0)
    seen = {r for r in page.evaluate("performance.getEntriesByType('resource').map(e => e.name)")}
    failed: list[str] = []

    def flaky(route):
        url = route.request.url
        if url in seen or url in failed:
            return route.continue_()
        failed.append(url)
        return route.abort("connectionrefused")

    page.route(re.compile(r".*/static/js/.*\.js$"), flaky)
    try:
        _nav(page, "Overhead")
        expect(page.get_by_test_id("stPlotlyChart").first).to_be_visible(timeout=30_000)
        page.wait_for_timeout(2000)
        assert failed, "no lazily loaded chunk was requested"
        assert "Failed to fetch dynamically imported module" not in page.inner_text("body")
        # it was a reload (not the hint): the chart's chunk loaded on the second try
        assert any("PlotlyChart" in u for u in failed), failed
        expect(page.locator("#traceprop-stale-hint")).to_have_count(0)
    finally:
        page.unroute(re.compile(r".*/static/js/.*\.js$"))
