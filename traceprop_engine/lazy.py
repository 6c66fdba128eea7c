"""Names a package exports but imports on first use (``module.__getattr__``, PEP 562), so that
importing the package loads no torch, FAISS or h5py until a name that needs them is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, table: dict[str, str], namespace: dict) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``table`` maps each lazy name to the module
    (relative to ``package``) it comes from; the value is cached in ``namespace`` (the
    package's ``globals()``) on first use."""

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
