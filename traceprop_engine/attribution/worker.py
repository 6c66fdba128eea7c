"""Deprecated path of the query worker, kept for one release: import :class:`QueryWorker` from
:mod:`traceprop_engine.attribution` (it lives in
:mod:`traceprop_engine.attribution.model_side.worker`)."""

from __future__ import annotations

import warnings

from .model_side.worker import QueryWorker, WorkerUnavailable

__all__ = ["QueryWorker", "WorkerUnavailable"]

warnings.warn(
    "traceprop_engine.attribution.worker is deprecated: import QueryWorker from "
    "traceprop_engine.attribution",
    DeprecationWarning,
    stacklevel=2,
)
