"""Deprecated path of the query worker, kept for one release: import :class:`QueryWorker` from
:mod:`traceprop_engine.attribution` (it lives in
:mod:`traceprop_engine.attribution.model_side.worker`)."""

from __future__ import annotations

import warnings

_MOVED = ("QueryWorker", "WorkerUnavailable")  # to traceprop_engine.attribution


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(
            f"traceprop_engine.attribution.worker is deprecated: import {name} from "
            "traceprop_engine.attribution",
            DeprecationWarning,
            stacklevel=2,  # the line that imports it
        )
        from .model_side import worker

        return getattr(worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
