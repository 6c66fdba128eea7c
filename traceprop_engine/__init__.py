"""Traceprop: training-data attribution recorded inside the training backward pass."""

from .capture.tracker import Tracker
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
from .settings import SketchKind, Task, TrackSettings, TrainSettings
from .store.reader import Store

__version__ = "0.1.0"

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
]
