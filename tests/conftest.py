"""Fixtures of the whole suite.

The tiny models, their batches and the per-example autograd reference are plain functions in
``helpers.py`` (test modules import them by name; a ``conftest`` module cannot be imported
reliably, ``tests/app/conftest.py`` has the same module name). What needs pytest's machinery
lives here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import facts_data

REPO = Path(__file__).resolve().parents[1]
# what a test run must leave as it found it: the docs' screenshots and the bundled runs (the
# whole tree is not watched, so that editing a file while the suite runs is no failure)
GUARDED = ("docs", "sample_runs")


def pytest_addoption(parser):
    parser.addoption(
        "--screenshots",
        metavar="DIR",
        default=None,
        help="write the docs' screenshots that the browser tests take (home.png, compare.png, "
        "...) to DIR, e.g. docs/img to refresh them; by default a temporary folder, so that a "
        "test run changes no tracked file",
    )


def _git_status(paths: tuple[str, ...]) -> set[str] | None:
    """``git status --porcelain`` lines of ``paths`` (modified, deleted and new files), or None
    outside a git checkout."""
    try:
        r = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", *paths],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(r.stdout.splitlines()) if r.returncode == 0 else None


def _guarded(config) -> tuple[str, ...]:
    """:data:`GUARDED`, less the folder that ``--screenshots`` asks to write to."""
    shots = config.getoption("--screenshots")
    if shots is None:
        return GUARDED
    target = Path(shots).resolve()
    return tuple(p for p in GUARDED if not target.is_relative_to(REPO / p))


_BEFORE = pytest.StashKey[set | None]()


def pytest_sessionstart(session):
    session.config.stash[_BEFORE] = _git_status(_guarded(session.config))


def pytest_sessionfinish(session, exitstatus):
    """A run that changed a file under :data:`GUARDED` fails, naming the files."""
    before = session.config.stash.get(_BEFORE, None)
    after = _git_status(_guarded(session.config)) if before is not None else None
    changed = sorted(after - before) if after is not None else []
    if changed:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("")
            tr.write_sep(
                "=", "the test run changed files (tests write to temporary folders)", red=True
            )
            for line in changed:
                tr.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def doc_shots(request, tmp_path_factory) -> Path:
    """Where the browser tests save the screenshots the docs show (``docs/img`` names):
    ``--screenshots DIR``, else a temporary folder."""
    chosen = request.config.getoption("--screenshots")
    if chosen is None:
        return tmp_path_factory.mktemp("doc-shots")
    path = Path(chosen).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    """A temporary folder for the browser tests' other screenshots (to look at after a run:
    pytest keeps the last three runs' temporary folders, ``pytest --basetemp`` picks one)."""
    return tmp_path_factory.mktemp("browser-artifacts")


@pytest.fixture(scope="session")
def facts(tmp_path_factory):
    """The generated facts data set (train/ and eval/), made once per test session."""
    return facts_data(tmp_path_factory.mktemp("facts"))


@pytest.fixture
def cuda_device() -> torch.device:
    """The CUDA device for tests marked ``cuda``.

    Those tests are deselected by default (``-m "not cuda"`` in pyproject's addopts), so a CPU
    run neither runs nor lists them as skipped; ``pytest -m cuda`` selects them, and on a
    machine without a GPU they are skipped here rather than failing.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


# -- the synthetic store of the compact-storage and Woodbury tests (one per test module: those
# tests write factor files beside it) --------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory) -> Path:
    from helpers import write_synthetic_store

    from traceprop_engine import constants as C

    return write_synthetic_store(tmp_path_factory.mktemp("run") / C.STORE_FILE)


@pytest.fixture(scope="module")
def synthetic_queries() -> list:
    """3 query sketches per layer of the synthetic store."""
    import numpy as np
    from helpers import SYNTHETIC_SHAPES

    rng = np.random.default_rng(7)
    return [rng.normal(size=(3, ko, ki)) for ko, ki in SYNTHETIC_SHAPES]
