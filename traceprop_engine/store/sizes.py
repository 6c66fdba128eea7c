"""Bytes a store takes: on disk per run, per record as written, per record at a compact rank.

One owner for the storage arithmetic that ``traceprop info``, ``traceprop compact`` and the
overhead benchmark print.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .. import constants as C

FLOAT32_BYTES = 4


def run_store_bytes(run_dir: str | os.PathLike) -> int:
    """Size on disk of a run's store files (``store.h5``, or every DDP shard ``store.rank*.h5``)."""
    return sum(p.stat().st_size for p in Path(run_dir).glob("store*.h5"))


def sketch_bytes_per_record(layers: Iterable) -> int:
    """float32 bytes of one record's stored numbers over ``layers`` (``LayerInfo``: ``dim`` each)."""
    return sum(layer.dim for layer in layers) * FLOAT32_BYTES


def compact_bytes_per_record(layers: Iterable, rank: int) -> int:
    """float32 bytes of one record as rank-``rank`` factors ``U`` (k_out × c), ``V`` (k_in × c)
    per layer, ``c = min(rank, k_out, k_in)`` (what ``traceprop compact`` writes)."""
    return (
        sum(min(rank, layer.k_out, layer.k_in) * (layer.k_out + layer.k_in) for layer in layers)
        * FLOAT32_BYTES
    )


def steady_state_bytes(path: str | os.PathLike) -> dict:
    """Steady-state bytes per record of the store file ``path``: per record dataset, the HDF5
    storage size divided by the rows its allocated chunks hold.

    HDF5 allocates whole chunks (~1 MiB, up to 4096 rows), so a short run's file is mostly
    empty chunk space, and its size divided by a few hundred records says nothing about a real
    run (``short_run_file_bytes_per_example``). For uncompressed sketches the steady-state figure
    equals the nominal ``4 · k_in · k_out`` per layer; with compression it is the measured
    compressed size per row.
    """
    import h5py

    from .live import read_locked

    def per_row(ds) -> float:
        rows = ds.chunks[0] if ds.chunks else max(ds.shape[0], 1)
        n_alloc = -(-ds.shape[0] // rows) * rows
        return ds.id.get_storage_size() / max(n_alloc, 1)

    # read-only without HDF5 file locking, as the Store reader opens it (the app keeps runs
    # open), under the store's own lock while a train writes it (.live)
    with read_locked(path), h5py.File(path, "r", locking=False) as f:
        n_rec = int(f.attrs["n_records"])
        groups = [f[C.G_LAYERS][k] for k in sorted(f[C.G_LAYERS])]
        data = [  # a layer's record datasets: the full sketch, or its factors U and V
            [g[n] for n in (C.L_SKETCH, C.L_U, C.L_V, C.L_SCALE) if n in g] for g in groups
        ]
        sketch = [sum(per_row(ds) for ds in dss) for dss in data]
        nominal = [
            sum(int(np.prod(ds.shape[1:])) * ds.dtype.itemsize for ds in dss) for dss in data
        ]
        meta = sum(per_row(f[C.G_RECORDS][name]) for name in f[C.G_RECORDS])
        alloc_sketch = sum(ds.id.get_storage_size() for dss in data for ds in dss)
    return {
        "n_records": n_rec,
        "n_layers": len(groups),
        "bytes_per_example": sum(sketch) + meta,
        "bytes_per_example_sketch": sum(sketch),
        "bytes_per_example_per_layer": sum(sketch) / len(groups),
        "bytes_per_example_meta": meta,
        "bytes_per_example_nominal": sum(nominal),
        "storage_ratio_vs_nominal": sum(sketch) / sum(nominal),
        "short_run_sketch_bytes_per_example": alloc_sketch / max(n_rec, 1),
        "short_run_file_bytes_per_example": os.path.getsize(path) / max(n_rec, 1),
    }


def stored_bytes_per_record(layers: Iterable) -> int:
    """Bytes of one record as the store holds it (full float32 sketches, or rank-r factors in
    their storage type: ``LayerInfo.bytes_per_record``)."""
    return sum(layer.bytes_per_record for layer in layers)


def describe_compaction(layers: Sequence, rank: int) -> list[str]:
    """What ``traceprop compact`` says about the size of a rank-``rank`` factor file: compared
    with the store as it is stored (not with full sketches it may not hold)."""
    fact = compact_bytes_per_record(layers, rank)
    stored = stored_bytes_per_record(layers)
    full = sketch_bytes_per_record(layers)
    ranks = sorted({layer.rank for layer in layers})
    if ranks == [0]:
        held = "full float32 sketches"
    else:
        dtypes = "/".join(
            sorted({layer.factor_dtype or "float32" for layer in layers if layer.rank})
        )
        held = f"rank-{'/'.join(map(str, ranks))} {dtypes} factors"
    ratio = f"{stored / fact:.1f}x smaller" if fact <= stored else f"{fact / stored:.1f}x larger"
    lines = [
        f"{fact} bytes/record (rank {rank}, float32) vs {stored} as the store holds them "
        f"({held}): {ratio}; full float32 sketches would take {full}"
    ]
    if ranks != [0] and rank >= max(ranks):
        lines.append(
            f"note: the store's records are {held} already: rank {rank} holds them exactly, "
            "in more bytes; compaction saves space on stores of full sketches (--rank 0 at train)"
        )
    return lines
