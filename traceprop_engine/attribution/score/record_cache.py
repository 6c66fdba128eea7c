"""A memory-mapped copy of the store's records, for the exact re-rank of query candidates.

The exact re-rank reads a few hundred scattered records per query (the FAISS candidates). The
store keeps records in chunked, checksummed HDF5 datasets (a chunk holds ~260 rank-1 int8
records), so a scattered read decompresses and checks one whole chunk per record and layer:
measured at 10⁶ examples, hundreds of milliseconds per query. The index build therefore writes,
per layer, the records exactly as the store holds them (int8 / bfloat16 / float32 factors and
the int8 scale, or the float32 sketch), one fixed-size row of bytes per record, to
``records-LLL.npy`` in the index folder; a query reads its candidates from the memory map (the
operating system's page cache), decoded by the store's own :func:`decode_factors`, so the scores
are bit-for-bit those computed from the store.

Cost: about the store's record bytes again on disk (the files are part of the index: digested
in ``index.json``, rebuilt with it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ... import constants as C
from ...store.format import FACTOR_STORAGE, decode_factors

CHUNK = 65_536  # records copied at a time
MIN_RECORDS = 16_384
"""Stores with fewer records get no cache: a query's candidates are then a large share of the
store and :meth:`Store.factors_at` reads them as one contiguous slice per layer (a few MB), so
the copy would only double the run's size on disk (the bundled sample run's five indexes)."""
MIN_BYTES = 64 << 20
"""...unless their records hold this many bytes (what 16 384 of the rank-1 default's hold): a
free-text run's rank-16 records (68 KB each on the tiny model) reach it at about 1000 records,
where every query read and checked tens of MB of HDF5 chunks per layer (3888 such records:
0.35 s a query against the first column, 1.4 s against every column, EVAL.md §1aa)."""


def wanted(store) -> bool:
    """Whether an index of ``store`` gets a record cache (:data:`MIN_RECORDS`, :data:`MIN_BYTES`)."""
    if store.n_records >= MIN_RECORDS:
        return True
    whole = getattr(store, "base", store)  # a column view reads its base store's whole chunks
    row = sum(
        dt.itemsize * int(np.prod(shape)) for info in whole.layers for _, dt, shape in _parts(info)
    )
    return store.n_records * row >= MIN_BYTES


def cache_files(n_layers: int) -> list[str]:
    return [f"records-{li:03d}.npy" for li in range(n_layers)]


def _parts(info) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """``(dataset, dtype, per-record shape)`` of what the store keeps for one record of a layer."""
    if info.rank:
        dt = np.dtype(FACTOR_STORAGE[info.factor_dtype])
        out = [(C.L_U, dt, (info.k_out, info.rank)), (C.L_V, dt, (info.k_in, info.rank))]
        if info.factor_dtype == "int8":
            out.append((C.L_SCALE, np.dtype("f4"), ()))
        return out
    return [(C.L_SKETCH, np.dtype("f4"), tuple(info.record_shape))]


def _raw_rows(store, li: int, start: int, stop: int, info=None) -> list[np.ndarray]:
    """The stored arrays of records ``start:stop`` of layer ``li`` (shards read in turn), as
    ``info`` (default: the store's layer) describes them: a column view's first factor columns
    (:mod:`~traceprop_engine.store.column_view`)."""
    info = store.layers[li] if info is None else info
    shards = getattr(store, "shards", None)
    if shards is None:
        return [
            store.stored_rows(
                li,
                name,
                np.s_[start:stop, :, : shape[1]]
                if len(shape) == 2 and info.rank
                else np.s_[start:stop],
            )
            for name, _, shape in _parts(info)
        ]
    out = []
    offsets = store._offsets
    for sh, lo, hi in zip(shards, offsets[:-1], offsets[1:], strict=True):
        a, b = max(start, lo), min(stop, hi)
        if a < b:
            out.append(_raw_rows(sh, li, int(a - lo), int(b - lo), info))
    return [np.concatenate(col) for col in zip(*out, strict=True)]


def write_record_cache(
    store, out_dir: Path, progress: Callable[[int, int], None] | None = None
) -> list[str]:
    """Write ``records-LLL.npy`` of every layer into ``out_dir``; returns the file names."""
    n = store.n_records
    names = cache_files(len(store.layers))
    for li, info in enumerate(store.layers):
        parts = _parts(info)
        row_bytes = sum(dt.itemsize * int(np.prod(shape)) for _, dt, shape in parts)
        mm = np.lib.format.open_memmap(
            out_dir / names[li], mode="w+", dtype=np.uint8, shape=(n, row_bytes)
        )
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            arrays = _raw_rows(store, li, start, stop)
            mm[start:stop] = np.concatenate(
                [np.ascontiguousarray(a).reshape(stop - start, -1).view(np.uint8) for a in arrays],
                axis=1,
            )
        mm.flush()
        del mm
        if progress is not None:
            progress(li + 1, len(store.layers))
    return names


class RecordCache:
    """The memory-mapped records of an index folder (see the module doc)."""

    def __init__(self, directory: Path, store) -> None:
        self.layers = store.layers
        self.maps = [  # plain ndarray views: indexing an np.memmap adds Python-level overhead
            np.load(directory / name, mmap_mode="r").view(np.ndarray)
            for name in cache_files(len(store.layers))
        ]
        for m in self.maps:
            if m.shape[0] != store.n_records:
                raise ValueError(
                    f"record cache holds {m.shape[0]} records, store {store.n_records}"
                )

    @classmethod
    def open(cls, directory: Path, store) -> RecordCache | None:
        """The cache of ``directory``, or None when it has none (an index built before it)."""
        if not all((directory / n).exists() for n in cache_files(len(store.layers))):
            return None
        return cls(directory, store)

    def _split(self, li: int, records: np.ndarray) -> list[np.ndarray]:
        raw = np.asarray(self.maps[li][records])  # one fancy-indexed read of the rows
        out, pos = [], 0
        for _, dt, shape in _parts(self.layers[li]):
            nb = dt.itemsize * int(np.prod(shape))
            col = np.ascontiguousarray(raw[:, pos : pos + nb]).view(dt)
            out.append(col.reshape(len(records), *shape))
            pos += nb
        return out

    def factors_at(self, li: int, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As ``Store.factors_at``: float32 ``U`` (scale folded in) and ``V`` of ``records``."""
        parts = self._split(li, records)
        return decode_factors(*parts[:2], self.layers[li].factor_dtype, *parts[2:])

    def int8_rows(self, li: int, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored bytes of int8 ``records``, uncopied beyond the gather: ``(uv, scale)``,
        ``uv`` (n, (k_out + k_in)·rank) int8 (``U`` then ``V``, each (k, rank) row-major) and the
        scale (n,) float32 (:meth:`LowRankTest.inner_int8` contracts them)."""
        info = self.layers[li]
        nb = (info.k_out + info.k_in) * info.rank
        raw = np.asarray(self.maps[li][records])  # (n, nb + 4): u, v (int8), scale (f4)
        return raw[:, :nb].view(np.int8), np.ascontiguousarray(raw[:, nb:]).view(np.float32)[:, 0]

    def sketches_at(self, li: int, records: np.ndarray) -> np.ndarray:
        """As ``Store.sketches_at`` for a layer stored as full sketches."""
        return self._split(li, records)[0]
