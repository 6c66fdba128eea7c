"""The fingerprint of a saved model: what ``run.json`` records and ``traceprop verify`` checks.

Plain hashing, no torch: verifying a run (the app's Audit page, ``traceprop verify``) needs no
model loaded. :func:`model_fingerprint` always reads every byte (``verify``);
:func:`cached_model_fingerprint` is the check made each time a run's model is loaded for
queries, and hashes a model again only when one of its weight files' size, modification time or
inode changed.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_CACHE_MAX = 64  # models remembered by one process (an app holds a few runs)
# (the weight files' identity) -> fingerprint: a pure function of the files' bytes, so a process
# may share it between users; bounded, oldest dropped first
_cache: dict[tuple, str] = {}
_cache_lock = threading.Lock()


def _weight_files(model_dir: Path) -> list[Path]:
    return [p for p in sorted(model_dir.rglob("*")) if p.suffix in _WEIGHT_SUFFIXES and p.is_file()]


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the saved weight files (name + content), in name order."""
    h = hashlib.sha256()
    for p in _weight_files(model_dir):
        h.update(str(p.relative_to(model_dir)).encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def model_files_key(model_dir: Path) -> tuple:
    """What :func:`cached_model_fingerprint` trusts to be unchanged: the folder and, per weight
    file, its name, size, modification time (ns), inode and device."""
    files = []
    for p in _weight_files(model_dir):
        st = p.stat()
        files.append(
            (str(p.relative_to(model_dir)), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        )
    return (os.path.realpath(model_dir), tuple(files))


def cached_model_fingerprint(model_dir: Path) -> tuple[str, tuple]:
    """``(fingerprint, files key)`` of a saved model, hashed once per files key in a process.

    Compare the key with :func:`model_files_key` after using the files to know that what was
    hashed is what was used.
    """
    key = model_files_key(model_dir)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is None:
        hit = model_fingerprint(model_dir)
        with _cache_lock:
            _cache[key] = hit
            while len(_cache) > _CACHE_MAX:
                del _cache[next(iter(_cache))]
    return hit, key
