"""Item 8 in a real browser: cold first page, first and later queries within generous limits
(benchmarks/app_speed.py, one cold start), with the screenshots of its views that the docs show
(``doc_shots``: a temporary folder, or ``pytest --screenshots docs/img``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# generous: the goals are 3 s / 3 s / 1 s on an idle machine; these catch a regression to the
# former 14-16 s first page (torch imported at start) without failing on a loaded 2-core box;
# the Runs page: 5 s when it waited on the warm-up's torch import (it needs none)
LIMITS = {
    "page_after_server_s": 20.0,
    "runs_page_s": 20.0,
    "first_query_s": 45.0,
    "later_query_s": 15.0,
}


def _bench():
    spec = importlib.util.spec_from_file_location("app_speed", REPO / "benchmarks" / "app_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_first_page_and_queries_are_fast_enough(doc_shots):
    from test_browser import _need_browser

    _need_browser()
    res = _bench().measure(repeats=1, later=2, shots=doc_shots)
    med = res["medians"]
    for key, limit in LIMITS.items():
        assert med[key] <= limit, (key, med)
    for name in (
        "home.png",
        "runs-story.png",
        "influencers-answer.png",
        "influencers-mismatch.png",
    ):
        assert (doc_shots / name).stat().st_size > 10_000
