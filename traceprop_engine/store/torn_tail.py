"""The torn tail: what a kill in the middle of a write does to a store's last chunk, and how the
rows the store counts are read back.

HDF5 rewrites a chunk of a growing dataset in place each time rows are added to it (with
Fletcher-32 alone its size does not change). A SIGKILL that lands during that write (the kernel
stops a write between pages) leaves the chunk half new and half old: its checksum fails, so
every read of the chunk fails, though its rows below ``n_records`` (flushed before) are the same
in both halves. Without this, one unlucky kill made a partial store's flushed records unreadable
and the run impossible to resume (stop 57's CI; before this module, 12 of 1500 kills in
``benchmarks/torn_tail.py`` left a store the reader refused).

- The writer (:class:`TailSums`) keeps per record dataset a CRC-32 of the rows of its last
  chunk, for the last two flushes, in the root dataset ``tail_crc32`` (its attribute
  ``datasets`` names the row of each): ``(first row of the chunk, n_records, crc)``.
- A reader of a partial store that meets a checksum failure (:func:`recover`) reads that chunk
  raw, checks its rows below ``n_records`` against the CRC written with that ``n_records``, and
  serves them from memory (:class:`TornTail`); rows that fail the CRC stay a damaged store.
- A resume (:func:`repair`) writes the checked rows back as a whole chunk, so HDF5 can read and
  extend it again.

Only uncompressed datasets are covered: a compressed chunk changes size, so HDF5 moves it
rather than rewriting it, and a half-written compressed chunk cannot be decoded.
"""

from __future__ import annotations

import json
import zlib

import h5py
import numpy as np

from .. import constants as C

TAIL_TABLE = "tail_crc32"  # a root dataset (n, 2, 3) int64, one row per record dataset
TAIL_NAMES = "datasets"  # its attribute: the record datasets' paths, in its row order


def _crc(rows: np.ndarray, value: int = 0) -> int:
    return zlib.crc32(np.ascontiguousarray(rows).view(np.uint8), value)


def _covered(ds: h5py.Dataset) -> bool:
    """Rows of ``ds`` are whole in its chunks and only Fletcher-32 filters them."""
    return (
        ds.chunks is not None
        and tuple(ds.chunks[1:]) == tuple(ds.shape[1:])
        and ds.compression is None
        and not ds.shuffle
        and ds.scaleoffset is None
    )


def read_entries(f: h5py.File) -> dict[str, list]:
    """The writer's last entries, by dataset path: ``[[start, n_records, crc], [the flush
    before]]`` ({} for a store written before them, or an unreadable table)."""
    try:
        if TAIL_TABLE not in f:
            return {}
        ds = f[TAIL_TABLE]
        names, table = json.loads(ds.attrs[TAIL_NAMES]), ds[()]
        return {n: table[i].tolist() for i, n in enumerate(names)}
    except (OSError, KeyError, ValueError, IndexError):
        return {}


class TailSums:
    """Writer side: the running CRC of each record dataset's last chunk (not thread-safe; the
    writer calls it under its lock). ``wrote`` after each dataset's rows, ``write`` once a flush,
    beside ``n_records``: one small dataset rewritten in place (an attribute rewritten at each
    flush grew the file by its size each time: 80 MB over 2000 flushes of a 40 KB one)."""

    def __init__(self, f: h5py.File) -> None:
        self._f = f
        old = read_entries(f)  # a reopened store's last entries
        self._state: dict[str, list] = {k: v[0] for k, v in old.items()}
        self._prev: dict[str, list] = dict(self._state)
        self._info: dict[str, tuple] = {}  # name -> (covered, chunk rows, dtype)
        self._table, self._names = None, None

    def wrote(self, ds: h5py.Dataset, n0: int, values: np.ndarray) -> None:
        """Rows ``n0 .. n0 + len(values)`` of ``ds`` were just written as ``values``."""
        name = ds.name
        if name not in self._info:  # h5py reads a dataset's filters anew at each ask
            self._info[name] = (_covered(ds), int(ds.chunks[0]) if ds.chunks else 0, ds.dtype)
        covered, c, dtype = self._info[name]
        if not len(values) or not covered:
            return
        rows = np.asarray(values, dtype=dtype)
        stop = n0 + len(rows)
        start = (stop - 1) // c * c
        prev = self._state.get(name)
        if start >= n0:
            crc = _crc(rows[start - n0 :])
        elif prev is not None and prev[0] == start and prev[1] == n0:
            crc = _crc(rows, prev[2])
        else:  # a reopened store: the chunk's rows before n0 are on disk
            crc = _crc(rows, _crc(ds[start:n0]))
        self._prev[name] = prev or [start, stop, crc]
        self._state[name] = [start, stop, crc]

    def write(self) -> None:
        """Store the entries of this flush and the one before (the table and ``n_records`` may
        reach the disk in either order)."""
        f, names = self._f, list(self._state)
        table = np.array([[self._state[k], self._prev.get(k, self._state[k])] for k in names])
        if self._table is None or self._names != names:
            ds = f.get(TAIL_TABLE)
            if ds is not None and json.loads(ds.attrs[TAIL_NAMES]) != names:
                del f[TAIL_TABLE]  # a store reopened with other datasets (not expected)
                ds = None
            if ds is None:
                ds = f.create_dataset(TAIL_TABLE, shape=table.shape, dtype=np.int64)
                ds.attrs[TAIL_NAMES] = json.dumps(names)
            self._table, self._names = ds, names
        self._table[...] = table  # in place: no new file space at each flush


class TornTail:
    """A record dataset whose last chunk is read from its checked rows: ``ds[sel]`` for rows
    ``sel`` below ``stop`` (a slice, or sorted row numbers, then the trailing selection)."""

    def __init__(self, ds: h5py.Dataset, start: int, rows: np.ndarray) -> None:
        self.ds, self.start, self.rows = ds, start, rows
        self.stop = start + len(rows)
        self.shape, self.dtype = ds.shape, ds.dtype

    def __getitem__(self, sel) -> np.ndarray:
        sel = sel if isinstance(sel, tuple) else (sel,)
        which, rest = sel[0], sel[1:]
        if isinstance(which, slice):
            a, b, step = which.indices(self.stop)
            if step != 1:
                raise ValueError("a torn tail reads contiguous rows only")
            b = max(a, b)
            head = self.ds[(slice(a, min(b, self.start)), *rest)] if a < self.start else None
            tail = self.rows[
                (slice(max(a, self.start) - self.start, max(b - self.start, 0)), *rest)
            ]
        else:
            which = np.asarray(which, dtype=np.int64)
            if len(which) and which[-1] >= self.stop:
                raise IndexError(f"row {int(which[-1])} is past the store's {self.stop} records")
            low = which[which < self.start]
            head = self.ds[(low, *rest)] if len(low) else None
            tail = self.rows[(which[which >= self.start] - self.start, *rest)]
        return tail if head is None else np.concatenate([head, tail])


def read_chunk_rows(ds: h5py.Dataset, n_records: int) -> tuple[int, np.ndarray] | None:
    """``(start, rows)``: the rows ``start .. n_records`` of the last chunk of ``ds`` read raw
    (no checksum) and checked against the CRC the writer stored with ``n_records``; None when
    they cannot be checked (no CRC for this ``n_records``, a compressed dataset) or fail it."""
    if n_records <= 0 or not _covered(ds) or not ds.fletcher32:
        return None
    c = int(ds.chunks[0])
    start = (n_records - 1) // c * c
    entries = read_entries(ds.file).get(ds.name, [])
    want = [int(e[2]) for e in entries if e[0] == start and e[1] == n_records]
    if not want:
        return None
    try:
        mask, raw = ds.id.read_direct_chunk((start,) + (0,) * (ds.ndim - 1))
    except (OSError, ValueError):
        return None
    row = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
    need = (n_records - start) * row
    if len(raw) < need:
        return None
    rows = np.frombuffer(raw[:need], dtype=ds.dtype).reshape(n_records - start, *ds.shape[1:])
    return (start, rows.copy()) if _crc(rows) == want[0] else None


def recover(ds: h5py.Dataset, n_records: int) -> TornTail | None:
    """``ds`` as a :class:`TornTail` when its last chunk fails its checksum but its counted rows
    pass their CRC; None when the chunk reads (nothing torn) or cannot be recovered."""
    if n_records <= 0:
        return None
    try:
        ds[n_records - 1 : n_records]
        return None
    except OSError:
        pass
    got = read_chunk_rows(ds, n_records)
    return None if got is None else TornTail(ds, *got)


def record_paths(f: h5py.File) -> list[str]:
    """The record datasets of a store: the records table's fields, then the sketch or factors
    of each layer group, in layer order."""
    groups = [f"{C.G_LAYERS}/{k}" for k in sorted(f[C.G_LAYERS])]
    paths = [f"{C.G_RECORDS}/{n}" for n in C.RECORD_FIELDS]
    return paths + [
        f"{g}/{n}" for g in groups for n in (C.L_SKETCH, C.L_U, C.L_V, C.L_SCALE) if n in f[g]
    ]


def recover_store(f: h5py.File, n_records: int) -> dict[str, TornTail]:
    """Every record dataset of a store whose last chunk a kill tore, recovered, by path."""
    torn = {p: recover(f[p], n_records) for p in record_paths(f)}
    return {p: t for p, t in torn.items() if t is not None}


def flushed_records(f: h5py.File, n_records: int) -> tuple[int, str]:
    """``(n, why)``: the records every record dataset holds, ``n_records`` unless a kill in the
    middle of a flush wrote the root's ``n_records`` but not every dataset's new length (HDF5
    writes a flush's metadata in no set order; ``benchmarks/torn_tail.py`` met it in 3 of 1500
    kills before this module, 3 of 600 after). Then ``n`` is the shortest length, ``why`` names that dataset, and the rows below
    ``n`` in every dataset's last chunk must pass the CRC written with ``n`` (else ``n`` is -1:
    they cannot be trusted)."""
    lengths = {p: f[p].shape[0] for p in record_paths(f)}
    short = min(lengths, key=lengths.get, default=None)
    if short is None or lengths[short] >= n_records:
        return n_records, ""
    n = lengths[short]
    why = f"{short} holds {n} records, the store says {n_records}"
    if n == 0 or all(read_chunk_rows(f[p], n) is not None for p in lengths):
        return n, why
    return -1, f"{why}, and its rows do not match the CRC written with {n} records"


def repair(ds: h5py.Dataset, n_records: int) -> bool:
    """Rewrite a torn last chunk of ``ds`` (open for writing) from its checked rows, as a whole
    chunk (HDF5 reads nothing of a chunk it overwrites whole). Returns whether it did."""
    torn = recover(ds, min(n_records, ds.shape[0]))
    if torn is None:
        return False
    c = int(ds.chunks[0])
    whole = np.zeros((c, *ds.shape[1:]), dtype=ds.dtype)
    whole[: len(torn.rows)] = torn.rows
    ds.resize(max(ds.shape[0], torn.start + c), axis=0)
    ds[torn.start : torn.start + c] = whole
    ds.resize(torn.stop, axis=0)
    return True
