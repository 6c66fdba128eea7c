"""Traceprop: training-data attribution recorded inside the training backward pass."""

from .errors import (
    ConfigError,
    DataError,
    IndexBuildError,
    IndexStaleError,
    ModelMismatchError,
    QueryError,
    RunError,
    SchemaVersionError,
    StoreError,
    TracepropError,
)
from .lazy import lazy_getattr
from .settings import SketchKind, Task, TrackSettings, TrainSettings

__version__ = "0.1.0"

# Tracker and Store pull torch / h5py, open_run FAISS: imported on first use, so that
# `import traceprop_engine.x` (the app's pages, `traceprop runs`) starts without loading torch.
_LAZY = {"Tracker": ".capture.tracker", "Store": ".store.reader", "open_run": ".attribution"}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "ConfigError",
    "DataError",
    "IndexBuildError",
    "IndexStaleError",
    "ModelMismatchError",
    "QueryError",
    "RunError",
    "SchemaVersionError",
    "SketchKind",
    "Store",
    "StoreError",
    "Task",
    "TrackSettings",
    "TrainSettings",
    "Tracker",
    "TracepropError",
    "__version__",
    "open_run",
]
