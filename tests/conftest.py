"""Fixtures of the whole suite.

The tiny models, their batches and the per-example autograd reference are plain functions in
``helpers.py`` (test modules import them by name; a ``conftest`` module cannot be imported
reliably, ``tests/app/conftest.py`` has the same module name). What needs pytest's machinery
lives here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import facts_data


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
