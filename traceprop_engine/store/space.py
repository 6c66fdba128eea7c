"""Room for a store's next write, checked before HDF5 is asked to write it.

HDF5 does not recover from a write that fails for lack of space: its metadata cache is left
half-flushed, later calls fail ("len not positive after adjustment for EOA"), the file may not
open again, and closing it can crash the process (SIGSEGV). So the writer asks first: a write
goes ahead only when it fits with :data:`RESERVE_BYTES` to spare, which is what closing the
store (status, digest, HDF5's metadata) and the run's final ``run.json`` need; otherwise it
raises ``ENOSPC`` (``EFBIG`` under a file-size limit, ``ulimit -f``) before anything is
written, and the store keeps its last complete records. Another process filling the disk in
the moment between the check and the write can still reach HDF5.
"""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

import h5py
import numpy as np

RESERVE_BYTES = 1 << 20  # kept free for closing the store and writing run.json
METADATA_BYTES = 8 << 10  # object header, B-tree node and attributes of one dataset (generous)


def room(path: Path) -> tuple[int, int]:
    """``(bytes that may still be written to the file at path, the errno when they run out)``:
    the space free to this user on its file system, capped by the process's file-size limit."""
    st = os.statvfs(path.parent)
    free, code = st.f_bavail * st.f_frsize, errno.ENOSPC
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        size = path.stat().st_size if path.exists() else 0
        if limit - size < free:
            free, code = max(0, limit - size), errno.EFBIG
    return free, code


def ensure_room(path: Path, need: int, what: str) -> None:
    """Raise ``OSError`` (``ENOSPC``/``EFBIG``) unless ``need`` bytes fit with the reserve."""
    free, code = room(path)
    if need + RESERVE_BYTES > free:
        why = "No space left on device" if code == errno.ENOSPC else "File too large"
        raise OSError(
            code,
            f"{why}: {what} needs about {need} bytes and {free} are left (Traceprop keeps "
            f"{RESERVE_BYTES} free so that the store can still be closed readable)",
            str(path),
        )


def growth_bytes(ds: h5py.Dataset, n0: int, n: int) -> int:
    """Bytes HDF5 allocates to grow the chunked dataset ``ds`` from ``n0`` to ``n0 + n`` rows:
    whole chunks (an upper bound when the dataset is compressed)."""
    rows = ds.chunks[0] if ds.chunks else 1
    new_chunks = -(-(n0 + n) // rows) - -(-n0 // rows)
    per_chunk = int(np.prod(ds.chunks or ds.shape[1:] or (1,), dtype=np.int64))
    return new_chunks * per_chunk * ds.dtype.itemsize + (METADATA_BYTES if new_chunks else 0)


def array_bytes(*arrays) -> int:
    """Bytes of data to be written as new datasets, plus their metadata."""
    return sum(int(np.asarray(a).nbytes) for a in arrays) + METADATA_BYTES * len(arrays)
