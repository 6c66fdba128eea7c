"""A real browser (Debian chromium via Playwright) against `streamlit run app/main.py`.

See /work/shared/TESTING-UI.md. Screenshots go to temporary folders (the ``artifacts`` and
``doc_shots`` fixtures; ``pytest --screenshots docs/img`` refreshes the docs' ones).
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 30_000
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


def _need_browser():
    missing = [
        w
        for w, ok in (("chromium", Path(CHROMIUM).exists()), ("playwright", _has_playwright()))
        if not ok
    ]
    if missing:
        # a skipped browser test is not a pass: scripts/setup.sh installs both (as root);
        # deselect them explicitly with -m "not browser" when a machine cannot have a browser
        pytest.fail(
            f"browser tests need {' and '.join(missing)} (run scripts/setup.sh as root, or "
            "apt-get install chromium; pip install playwright), or deselect them with -m 'not browser'"
        )


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _need_browser()
    tmp = tmp_path_factory.mktemp("browser")
    port = _free_port()
    env = {
        **os.environ,
        "TRACEPROP_RUNS_ROOT": str(tmp / "runs"),
        "TRACEPROP_DATA_ROOT": str(tmp / "data"),
        "TRACEPROP_SAMPLE_RUNS": str(REPO / "sample_runs"),
        "HOME": str(tmp / "home"),
        "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
    }
    (tmp / "home").mkdir()
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(REPO / "app" / "main.py"),
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
    log = open(tmp / "streamlit.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
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
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    "streamlit did not start:\n" + (tmp / "streamlit.log").read_text()[-3000:]
                )
            time.sleep(0.3)
        yield {"url": url, "runs": tmp / "runs", "pid": proc.pid}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    blocked: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        ctx = browser.new_context(viewport={"width": 1500, "height": 2600}, accept_downloads=True)

        def route(r):
            host = urlparse(r.request.url).hostname
            if r.request.url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost"):
                return r.continue_()
            blocked.append(r.request.url)
            return r.abort()

        ctx.route("**/*", route)
        pg = ctx.new_page()
        pg.set_default_timeout(TIMEOUT_MS)
        pg.blocked = blocked
        yield pg
        ctx.close()
        browser.close()


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's shared library mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the parent's pid follows the state
            out.append(int(stat.parent.name))
    return out


def _nav(page, name: str) -> None:
    page.get_by_test_id("stSidebarNav").get_by_text(name, exact=True).click()
    page.get_by_role("heading", name=name).first.wait_for()


def test_sample_run_is_active(page, server, artifacts):
    from playwright.sync_api import expect

    page.goto(server["url"])
    expect(page.get_by_role("heading", name="Traceprop").first).to_be_visible()  # the landing page
    # the landing page (no chart) has the chart and table code loaded for the next pages
    page.wait_for_function(
        "() => ['PlotlyChart.', 'DataFrame.'].every(n => performance.getEntriesByType('resource')"
        ".some(e => e.name.includes('/static/js/' + n)))"
    )
    _nav(page, "Runs")
    expect(page.get_by_test_id("stSidebar")).to_contain_text("facts")
    expect(page.get_by_label("Active run")).to_have_value("facts · sample · completed")
    expect(page.get_by_test_id("stDataFrame").first).to_be_visible()
    expect(page.get_by_text("Delete a user run")).to_be_visible()
    page.screenshot(path=str(artifacts / "runs.png"), full_page=True)


def test_typed_prompt_influencers_and_csv(page, server, artifacts):
    from playwright.sync_api import expect

    _nav(page, "Influencers")
    page.get_by_text("Type a prompt").click()
    page.get_by_label("Prompt", exact=True).fill("Q: Which colour does the planet Ethmor have?\nA:")
    page.get_by_label("Completion (the output whose origin you want explained)").fill(" violet")
    page.get_by_label("Completion (the output whose origin you want explained)").press("Enter")
    page.get_by_role("button", name="Find influencers").click()
    expect(page.get_by_text("Proponents (pushed toward this output)")).to_be_visible()
    expect(page.get_by_text("Sign convention")).to_be_visible()
    expect(page.get_by_test_id("stPlotlyChart").first).to_be_visible()  # by source
    page.screenshot(path=str(artifacts / "influencers.png"), full_page=True)
    page.get_by_text("proponent #1 ·").click()
    expect(
        page.get_by_test_id("stExpander").first.get_by_text("Per-layer partial scores")
    ).to_be_visible()
    page.get_by_test_id("stExpander").first.screenshot(
        path=str(artifacts / "influencers-example.png")
    )
    page.get_by_test_id("stPlotlyChart").first.screenshot(
        path=str(artifacts / "influencers-by-source.png")
    )
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export CSV").click()
    rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
    assert len(rows) == 20  # top 10 proponents + top 10 opponents
    assert {r["kind"] for r in rows} == {"proponent", "opponent"}
    # ground truth of the generated sample: the two training rows that state Ethmor's colour
    top2 = {
        (r["source"], int(r["row"]))
        for r in rows
        if r["kind"] == "proponent" and int(r["rank"]) <= 2
    }
    assert top2 == {("planets.jsonl", 2), ("planets.jsonl", 3)}
    for r in rows:
        assert r["source"].endswith(".jsonl") and int(r["row"]) >= 1
        assert r["location"] == f"{r['source']}:{r['row']}"
        assert len(r["sha256"]) == 64
    assert not page.blocked, page.blocked
    # the model's half of every query ran in the query worker: torch is loaded there, never in
    # the server process (issue 13 item 8; app/services/model_worker.py)
    assert not _maps_torch(server["pid"])
    workers = [p for p in _children(server["pid"]) if _maps_torch(p)]
    assert len(workers) == 1, _children(server["pid"])


def test_launch_tiny_finetune_and_see_it_in_runs(page, server, artifacts, doc_shots):
    from playwright.sync_api import expect

    _nav(page, "Launch")
    # the measured configurations, the default first (benchmarks/results/pareto.json)
    page.get_by_text("Measured quality, overhead and bytes of tracking configurations").click()
    expect(page.get_by_test_id("stExpander").get_by_test_id("stDataFrame")).to_be_visible()
    page.screenshot(path=str(doc_shots / "launch-quality.png"), full_page=True)
    # long enough (≈ 240 steps, several seconds) that the live progress is seen before the end
    for label, value in (
        ("Epochs", "12"),
        ("Max length (tokens)", "32"),
        ("Tiny model layers", "1"),
        ("Tiny model width", "32"),
        ("Run name (optional)", "browser-run"),
    ):
        page.get_by_label(label, exact=True).fill(value)
    page.get_by_role("button", name="Start training").click()
    expect(page.get_by_text("Job browser-run")).to_be_visible()
    # the chosen (default) tracking configuration's measured quality, not dominated
    expect(page.get_by_text(re.compile(r"shared k, orthogonal: mean LDS 0\.7\d"))).to_be_visible()
    expect(page.get_by_text("Dominated by")).to_have_count(0)
    expect(page.get_by_text(re.compile(r"running: step \d+/\d+, loss [\d.]+, ETA"))).to_be_visible()
    expect(page.get_by_role("button", name="Cancel")).to_be_visible()
    page.screenshot(path=str(artifacts / "launch-running.png"), full_page=True)
    expect(page.get_by_text("Training finished")).to_be_visible(timeout=180_000)
    page.screenshot(path=str(artifacts / "launch-done.png"), full_page=True)
    assert (server["runs"] / "browser-run" / "store.h5").exists()
    # the job's end reruns the whole page from the sidebar's timer (app/navigation.py): wait for
    # that rerun (the banner goes) before navigating. CI stop 36: the timer's rerun of the Launch
    # page landed after the click and undid it; the app now skips it when a click waits
    # (services/page_rerun.py), and the wait keeps this test off that timing
    expect(page.get_by_text("A training job is running")).to_have_count(0, timeout=30_000)

    _nav(page, "Runs")
    page.get_by_label("Active run").click()
    expect(page.get_by_role("option", name="browser-run · user · completed")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.get_by_test_id("stDataFrame").first).to_be_visible()
    expect(page.get_by_text("Delete a user run")).to_be_visible()
    page.screenshot(path=str(artifacts / "runs-after-launch.png"), full_page=True)
    assert not page.blocked, page.blocked
    shutil.rmtree(server["runs"] / "browser-run")


def test_overhead_and_audit_pages(page, server, artifacts):
    from playwright.sync_api import expect

    _nav(page, "Overhead")
    expect(page.get_by_text("Step time of the active run")).to_be_visible()
    expect(page.get_by_test_id("stPlotlyChart").first).to_be_visible()
    # the repository's measured `bench overhead` results: plain vs tracked, the split, bytes
    expect(page.get_by_text("Tracked vs plain (overhead benchmark)")).to_be_visible()
    expect(page.get_by_test_id("stPlotlyChart").nth(4)).to_be_visible()
    page.screenshot(path=str(artifacts / "overhead.png"), full_page=True)
    _nav(page, "Quality")
    expect(page.get_by_text("Attribution quality (LDS)")).to_be_visible()
    expect(page.get_by_test_id("stPlotlyChart").first).to_be_visible()
    expect(page.get_by_test_id("stDataFrame").first).to_be_visible()
    page.wait_for_timeout(500)  # let the table's canvas paint before the screenshot
    page.screenshot(path=str(artifacts / "quality.png"), full_page=True)
    _nav(page, "Audit")
    page.get_by_role("button", name="Verify").click()
    expect(page.get_by_text("match the manifest")).to_be_visible()
    expect(page.get_by_text("Use the last Influencers query")).to_be_visible()
    with page.expect_download() as dl:
        page.get_by_role("button", name="Audit trail (CSV)").click()
    rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
    assert len(rows) == 20 and all(r["run_id"] for r in rows)
    page.screenshot(path=str(artifacts / "audit.png"), full_page=True)
    assert not page.blocked, page.blocked


def test_find_distribution_compare_and_rankings(page, server, doc_shots):
    """Issue 13 items 2, 4, 6: page through more than 100 influencers, search them, export with
    the run and the query in the name and inside; the score histogram; Compare; Rankings."""
    from playwright.sync_api import expect

    _nav(page, "Influencers")
    page.get_by_text("An eval example").click()
    slider = page.get_by_role("slider").first
    slider.focus()
    slider.press("End")  # top k = 200: every signed example of the sample run
    expect(slider).to_have_attribute("aria-valuetext", "200")
    page.get_by_role("button", name="Find influencers").click()
    expect(page.get_by_text("154 of 154 rows match")).to_be_visible()
    pager = page.get_by_label("Page (of 7)")
    pager.fill("7")
    pager.press("Enter")
    expect(page.get_by_text("showing 151–154 (page 7 of 7)")).to_be_visible()
    pager.fill("1")
    pager.press("Enter")
    search = page.get_by_label("Text contains", exact=True).and_(page.get_by_role("textbox"))
    search.fill("ethmor")
    search.press("Enter")
    matched = page.get_by_text(re.compile(r"^(?!154 )\d+ of 154 rows match"))  # filtered
    expect(matched).to_be_visible()
    n = int(matched.inner_text().split()[0])
    assert 0 < n < 154
    page.get_by_role("tab", name="Score distribution").click()  # drawn when its tab opens
    # while a rerun paints, the old elements stay beside the new ones: wait for one
    expect(page.get_by_text("Score distribution (all training examples)")).to_have_count(1)
    expect(page.get_by_test_id("stPlotlyChart")).to_have_count(1)  # the by-source one is gone
    page.wait_for_timeout(800)  # the table canvas and the charts paint
    page.get_by_text("Find", exact=True).scroll_into_view_if_needed()
    page.screenshot(path=str(doc_shots / "influencers-find.png"), full_page=True)
    page.get_by_test_id("stPlotlyChart").first.screenshot(
        path=str(doc_shots / "influencers-score-histogram.png")
    )
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export CSV").click()
    name = dl.value.suggested_filename
    assert re.fullmatch(r"influencers-\d{8}-\d{6}-[0-9a-f]+-eval\d+-kfac\.csv", name), name
    rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
    assert len(rows) == n and all("ethmor" in r["text"].lower() for r in rows)
    assert {r["query_eval_example"] for r in rows} == {name.split("-eval")[1].split("-")[0]}
    assert {r["query_preconditioner"] for r in rows} == {"kfac"}  # the default

    _nav(page, "Compare")
    page.get_by_role("button", name="Compare", exact=True).click()
    expect(page.get_by_text("Overlap of the top k")).to_be_visible()
    expect(page.get_by_text("Rank changes", exact=True)).to_be_visible()
    expect(page.get_by_test_id("stPlotlyChart")).to_be_visible()
    page.wait_for_timeout(800)
    page.screenshot(path=str(doc_shots / "compare.png"), full_page=True)

    _nav(page, "Rankings")
    expect(page.get_by_text("154 of 154 examples match")).to_be_visible()
    expect(page.get_by_test_id("stPlotlyChart")).to_be_visible()
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export CSV").click()
    assert dl.value.suggested_filename.endswith("-self-influence-kfac.csv")
    ranked = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
    assert len(ranked) == 154 and [int(r["rank"]) for r in ranked] == list(range(1, 155))
    page.wait_for_timeout(800)
    page.screenshot(path=str(doc_shots / "rankings.png"), full_page=True)
    assert not page.blocked, page.blocked
    assert not _maps_torch(server["pid"])  # every page so far: the model stayed in the worker
