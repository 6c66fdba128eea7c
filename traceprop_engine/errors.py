"""Errors a user can act on.

Every error the engine raises on bad input is a :class:`TracepropError`. Each subclass also
subclasses the built-in exception a caller would naturally catch (``ValueError``,
``FileNotFoundError``...), and each message says what happened, why, and what to do.
Errors from h5py, faiss and torch are translated at the boundary (``raise ... from e``).
"""

from __future__ import annotations


class TracepropError(Exception):
    """Base class of every error the engine raises on purpose."""


class DataError(TracepropError, ValueError):
    """A data file or record cannot be used (malformed row, unknown layout, encoding...)."""


class ConfigError(TracepropError, ValueError):
    """A setting has a value the engine cannot work with."""


class StoreError(TracepropError, OSError):
    """An HDF5 store is missing, unreadable or inconsistent."""


class SchemaVersionError(StoreError):
    """The store was written by another schema version of Traceprop."""


class ModelMismatchError(TracepropError, ValueError):
    """A model does not match the store it is used with (layers, shapes, fingerprint)."""


class IndexBuildError(StoreError):
    """An index could not be written (disk full, permissions...); the previous one is intact."""


class IndexStaleError(TracepropError, RuntimeError):
    """A persisted index was built from another store (or another version of it)."""


class QueryError(TracepropError, ValueError):
    """A query cannot be answered as asked (empty prompt, no model in the run...)."""


class RunError(TracepropError, RuntimeError):
    """A run directory is missing, incomplete or in a state that forbids the operation."""
