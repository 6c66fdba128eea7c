"""File safety of a persisted index folder: digests, the build lock, and atomic publication.

An index is written into a temporary folder under an exclusive :func:`index_lock`, its
``index.json`` records the size and digest (:func:`file_digest`) of every file, and
:func:`publish_dir` renames the folder into place; a load takes the shared lock and
:func:`check_files` refuses any file that was cut short or changed since.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from traceprop_engine.errors import StoreError

__all__ = ["FULL_DIGEST_MAX", "check_files", "file_digest", "index_lock", "publish_dir"]

FULL_DIGEST_MAX = 256 << 20
"""Files up to this size are hashed whole on every load; larger ones by :func:`file_digest`'s
evenly spaced blocks (a few hundred MiB of hashing per load stays well under a second)."""
_DIGEST_BLOCKS = 256
_DIGEST_BLOCK = 1 << 20


def file_digest(path: str | Path) -> dict:
    """``{"size", "sha256"}`` of a file: the whole file up to :data:`FULL_DIGEST_MAX` bytes, above
    it the first and last blocks and evenly spaced ones in between (``"sampled": true``)."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        if size <= FULL_DIGEST_MAX:
            while block := f.read(1 << 22):
                h.update(block)
        else:
            for off in np.linspace(0, size - _DIGEST_BLOCK, _DIGEST_BLOCKS).astype(np.int64):
                f.seek(int(off))
                h.update(f.read(_DIGEST_BLOCK))
    out = {"size": size, "sha256": h.hexdigest()}
    if size > FULL_DIGEST_MAX:
        out["sampled"] = True
    return out


def check_files(d: Path, meta: dict, required: str) -> None:
    """Check every file ``meta["files"]`` records (size and digest) against the folder ``d``.

    Raises:
        StoreError: no digests recorded (or none for ``required``), or a file missing, unreadable
            or changed since they were recorded.
    """
    files = meta.get("files")
    if not isinstance(files, dict) or required not in files:
        raise StoreError(
            f"the index in {d} records no file digests (written by an older Traceprop, or its "
            "build was interrupted); rebuild it with `traceprop index RUN --rebuild`"
        )
    for name, want in files.items():
        p = d / name
        try:
            got = file_digest(p)
        except OSError as e:
            raise StoreError(f"{p} is missing or unreadable ({e}); rebuild the index") from e
        if got != want:
            raise StoreError(
                f"{p} was changed or damaged after the index was built (size {got['size']}, "
                f"recorded {want.get('size')}; digest differs); rebuild it with "
                "`traceprop index RUN --rebuild`"
            )


@contextlib.contextmanager
def index_lock(lock_path: str | Path, *, exclusive: bool) -> Iterator[bool]:
    """Hold an advisory ``flock`` on ``lock_path``: exclusive to build, shared to load.

    Yields whether a lock is held. Only a builder creates the lock file: a reader takes the
    shared lock on one that exists and proceeds without one where none does (no build ever ran
    there, e.g. a bundled run whose indexes were shipped) or where it cannot be opened (a
    read-only folder), so reading a run writes nothing into it; an index it loads is still
    checked against its digests, and a build that starts meanwhile publishes by atomic renames.
    A builder that cannot create the lock file gets the OSError.
    """
    p = Path(lock_path)
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644) if exclusive else os.open(p, os.O_RDONLY)
    except OSError:
        if exclusive:
            raise
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield True
    finally:
        os.close(fd)  # releases the lock


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a completely written index folder ``tmp`` to ``final``, replacing an older one.

    Call under the exclusive :func:`index_lock`. The old folder is first renamed aside (a
    process that memory-mapped its files keeps reading them), then ``tmp`` is renamed into
    place, then the old one is deleted; each rename is atomic, so ``final`` is at every moment
    either absent or a complete index.
    """
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on a directory
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
