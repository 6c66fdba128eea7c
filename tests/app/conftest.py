"""Shared fixtures of the app tests: the app directory on sys.path and a temp runs root."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"
if str(APP) not in sys.path:
    sys.path.insert(0, str(APP))


@pytest.fixture
def app_env(tmp_path, monkeypatch):
    """A fresh runs root and data root; the bundled sample runs."""
    runs = tmp_path / "runs"
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("TRACEPROP_RUNS_ROOT", str(runs))
    monkeypatch.setenv("TRACEPROP_DATA_ROOT", str(data))
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(REPO / "sample_runs"))
    # only this test's bench folder, not the repository's measured results
    monkeypatch.setenv("TRACEPROP_BENCH_DIRS", str(runs / "bench"))
    # no background warm-up thread racing the test's own queries (tests/app/test_first_minute.py
    # tests the warm-up itself)
    monkeypatch.setenv("TRACEPROP_NO_WARMUP", "1")
    return {"runs": runs, "data": data, "repo": REPO}
