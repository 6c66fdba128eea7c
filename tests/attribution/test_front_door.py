"""``traceprop_engine.attribution`` is the package's front door: it loads nothing heavy until a
name is used, and the import paths the README used to show keep working for one release."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from traceprop_engine import attribution


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip()


def test_the_front_door_and_open_run_import_no_torch():
    code = (
        "import sys, traceprop_engine.attribution as a\n"
        "heavy = [m for m in ('torch', 'faiss', 'polars') if m in sys.modules]\n"
        "a.open_run, a.AttributionRun, a.QueryResult, a.IndexSettings\n"
        "import traceprop_engine\n"
        "assert traceprop_engine.open_run is a.open_run\n"
        "print(heavy, 'torch' in sys.modules)"
    )
    assert _run(code) == "[] False"


def test_front_door_names_are_the_owners_objects():
    from traceprop_engine.attribution.model_side.worker import QueryWorker
    from traceprop_engine.attribution.query import AttributionRun, open_run
    from traceprop_engine.settings import IndexSettings

    assert attribution.open_run is open_run and attribution.AttributionRun is AttributionRun
    assert attribution.QueryWorker is QueryWorker and attribution.IndexSettings is IndexSettings
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        attribution.nothing  # noqa: B018


def test_old_worker_path_warns_at_the_importing_line_and_gives_the_same_class():
    with pytest.warns(
        DeprecationWarning, match="import QueryWorker from traceprop_engine.attribution"
    ) as w:
        from traceprop_engine.attribution.worker import QueryWorker
    assert w[0].filename == __file__  # the warning points at the import, not at importlib
    assert QueryWorker is attribution.QueryWorker
    with pytest.warns(DeprecationWarning, match="import WorkerUnavailable"):
        from traceprop_engine.attribution.worker import WorkerUnavailable
    assert WorkerUnavailable is attribution.WorkerUnavailable


def test_the_query_module_path_still_gives_open_run_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from traceprop_engine.attribution.query import open_run
    assert open_run is attribution.open_run
