"""Compact storage: rank-``c`` factors of every stored sketch (LoRIF), in a factor file.

A factored sketch ``Ŝ ∈ R^{k_out×k_in}`` (the score of README.md, "Scores") is replaced by its rank-``c`` truncated SVD
``Ŝ ≈ U Vᵀ`` with ``U ∈ R^{k_out×c}`` (singular values folded in) and ``V ∈ R^{k_in×c}``:
``c (k_out + k_in)`` numbers instead of ``k_out k_in`` (c = 1 at k = 32: 64 vs 1024). At
``c = min(k_out, k_in)`` the factors are exact. The residual ``R = Ŝ − U Vᵀ`` has the discarded
singular values ``σ_{c+1}, …`` of ``Ŝ``; its norms ``‖R‖_* = Σ_{j>c} σ_j`` and
``‖R‖_F = (Σ_{j>c} σ_j²)^{1/2}`` are kept per record, for the error bound of the scores.

Scores straight from the factors (never rebuilding ``Ŝ``) and their bound are in
:mod:`traceprop_engine.attribution.score.factor_scores`.

File ``RUN/factors-c{rank}.h5`` (``format = "traceprop-factors"``, ``version = 1``)::

    attrs   format, version, rank (requested), lossless (every layer kept min(k_out, k_in)),
            status, created, n_records, layer_names (JSON), source_store (file name),
            source_run_id, source_n_records, source_fingerprint (Store.fingerprint at compaction)
    records/{example_index, step, epoch, lr, loss}     (n,) copies of the store's records table
    layers/NNN/   attrs name, kind, d_in, d_out, k_out, k_in, rank (effective c of this layer),
                        sq_norm_sum (Σ‖Ŝ‖²_F), residual_sq_sum (Σ‖R‖²_F)
                  U (n, k_out, c) f4  singular values folded in
                  V (n, k_in, c)  f4
                  residual_fro (n,) f4, residual_nuc (n,) f4

Training time: :func:`factorize_chunk` works on one flushed chunk (what
:class:`~traceprop_engine.capture.buffer.BackgroundSink` hands its writer thread) and
:class:`FactorWriter` has ``StoreWriter.append``'s signature, so the writer thread can write
factors next to (or instead of) full sketches; the training hot path is untouched either way.
It is not wired into the tracker here.

Dense sketches (``(k,)`` vectors) have no matrix structure to factor; compaction refuses them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import h5py
import numpy as np

from .. import constants as C
from ..errors import ConfigError, StoreError
from .factor_file import (
    CHUNK,
    F_RES_FRO,
    F_RES_NUC,
    F_U,
    F_V,
    FACTORS_FORMAT,
    FACTORS_VERSION,
    check_rank,
    factor_file_name,
)
from .format import append_records, chunk_rows, create_records_group
from .reader import Store

log = logging.getLogger(__name__)

__all__ = [
    "FACTORS_FORMAT",
    "FACTORS_VERSION",
    "FactorWriter",
    "compact_store",
    "factor_file_name",
    "factorize_chunk",
]


def _svd_factors(arr: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U (n,k_out,c), V (n,k_in,c), all singular values (n, min(k_out,k_in))), float64."""
    x = np.asarray(arr, dtype=np.float64)
    if x.ndim != 3:
        raise ConfigError(
            f"factorize_chunk needs factored sketches of shape (n, k_out, k_in), got {x.shape}; "
            "dense sketches (n, k) cannot be factored"
        )
    c = min(rank, x.shape[1], x.shape[2])
    u, s, vt = np.linalg.svd(x, full_matrices=False)  # batched: (n,k_out,m), (n,m), (n,m,k_in)
    return u[:, :, :c] * s[:, None, :c], np.swapaxes(vt[:, :c, :], 1, 2), s


def factorize_chunk(arr: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank-``c`` truncated SVD factors of a chunk of sketches: ``Ŝ_i ≈ U_i V_iᵀ``.

    Safe to call from a background writer thread on a flushed chunk (pure numpy, no state):
    ``U, V = factorize_chunk(arrays[layer], c)`` before handing the chunk to a writer.

    Args:
        arr: (n, k_out, k_in) sketches of one layer.
        rank: ``c``; clamped to ``min(k_out, k_in)`` (which is exact).

    Returns:
        ``U`` (n, k_out, c) with the singular values folded in and ``V`` (n, k_in, c), float32.

    Raises:
        ConfigError: bad rank, or not a (n, k_out, k_in) array.
    """
    u, v, _ = _svd_factors(arr, check_rank(rank))
    return u.astype(np.float32), v.astype(np.float32)


class FactorWriter:
    """Writes a factor file chunk by chunk (what :func:`compact_store` and a writer thread use).

    Args:
        path: the ``.h5`` to create; written as ``path.tmp`` and renamed on :meth:`close` with
            status ``completed``, so a killed compaction never leaves a file that looks complete.
        layers: per tracked layer an object with ``name``, ``k_out``, ``k_in`` (and optionally
            ``kind``, ``d_in``, ``d_out``): the store's ``LayerInfo`` or the tracker's layers.
        rank: requested ``c`` (each layer keeps ``min(c, k_out, k_in)``).
        source: attributes describing the source store (``source_run_id``, ...).
        compression: HDF5 filter for U and V (``None``, ``"lzf"``, ``"gzip"``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layers: Sequence,
        rank: int,
        source: dict | None = None,
        compression: str | None = None,
    ) -> None:
        self.rank = check_rank(rank)
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._f = h5py.File(self._tmp, "w", libver="latest")
        except OSError as e:
            raise StoreError(f"cannot create the factor file {self._tmp}: {e}") from e
        f = self._f
        f.attrs.update(
            format=FACTORS_FORMAT,
            version=FACTORS_VERSION,
            rank=self.rank,
            status=C.STATUS_RUNNING,
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            n_records=0,
            layer_names=json.dumps([layer.name for layer in layers]),
        )
        for k, v in (source or {}).items():
            f.attrs[k] = v
        create_records_group(f)
        lg = f.create_group(C.G_LAYERS)
        self._ranks, self._sq, self._res = [], np.zeros(len(layers)), np.zeros(len(layers))
        lossless = True
        for i, layer in enumerate(layers):
            ko, ki = int(layer.k_out), int(layer.k_in)
            c = min(self.rank, ko, ki)
            lossless &= c == min(ko, ki)
            self._ranks.append(c)
            g = lg.create_group(f"{i:03d}")
            g.attrs.update(
                name=layer.name,
                kind=str(getattr(layer, "kind", "")),
                d_in=int(getattr(layer, "d_in", 0)),
                d_out=int(getattr(layer, "d_out", 0)),
                k_out=ko,
                k_in=ki,
                rank=c,
                sq_norm_sum=0.0,
                residual_sq_sum=0.0,
            )
            for name, rows in ((F_U, ko), (F_V, ki)):
                g.create_dataset(
                    name,
                    shape=(0, rows, c),
                    maxshape=(None, rows, c),
                    dtype="f4",
                    chunks=(chunk_rows(rows * c), rows, c),
                    compression=compression,
                )
            for name in (F_RES_FRO, F_RES_NUC):
                g.create_dataset(name, shape=(0,), maxshape=(None,), dtype="f4", chunks=(16384,))
        f.attrs["lossless"] = bool(lossless)
        self.n_records = 0

    def append(self, arrays: Sequence[np.ndarray], meta: dict[str, np.ndarray]) -> None:
        """Factor and append one chunk: per layer (n, k_out, k_in) sketches, plus the records' metadata."""
        n0, n = self.n_records, len(meta[C.REC_EXAMPLE])
        lg = self._f[C.G_LAYERS]
        if len(arrays) != len(self._ranks):
            raise StoreError(f"got {len(arrays)} layers, the factor file has {len(self._ranks)}")
        for i, arr in enumerate(arrays):
            u, v, s = _svd_factors(arr, self._ranks[i])  # (n,ko,c), (n,ki,c), (n,m)
            tail = s[:, self._ranks[i] :]
            g = lg[f"{i:03d}"]
            for name, val in (
                (F_U, u),
                (F_V, v),
                (F_RES_FRO, np.sqrt((tail**2).sum(1))),
                (F_RES_NUC, tail.sum(1)),
            ):
                g[name].resize(n0 + n, axis=0)
                g[name][n0 : n0 + n] = val
            self._sq[i] += float((s**2).sum())
            self._res[i] += float((tail**2).sum())
        append_records(self._f[C.G_RECORDS], n0, meta)
        self.n_records = n0 + n
        self._f.attrs["n_records"] = self.n_records
        for i in range(len(self._ranks)):
            lg[f"{i:03d}"].attrs.update(sq_norm_sum=self._sq[i], residual_sq_sum=self._res[i])
        self._f.flush()

    def close(self, status: str = C.STATUS_COMPLETED, **attrs) -> Path:
        """Finish the file; with status ``completed`` it is renamed to its final path."""
        if self._f.id.valid:
            for k, v in attrs.items():
                self._f.attrs[k] = v
            self._f.attrs["status"] = status
            self._f.close()
        if status == C.STATUS_COMPLETED:
            os.replace(self._tmp, self.path)
            return self.path
        return self._tmp


def compact_store(
    run_dir_or_store_path: str | os.PathLike | Store,
    rank: int,
    out: str | os.PathLike | None = None,
    *,
    chunk: int = CHUNK,
    compression: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the rank-``c`` factors of every record of a store, streamed chunk by chunk.

    Args:
        run_dir_or_store_path: a run directory (its ``store.h5``), a store file, or an open
            store object (``Store`` or anything with its reader interface, e.g. the sharded
            store of a DDP run, ``AttributionRun.store``; it is not closed here).
        rank: ``c``; each layer keeps ``min(c, k_out, k_in)`` (then exact).
        out: output file; default ``factors-c{rank}.h5`` in the run directory.
        chunk: records per chunk (memory is O(chunk × layer size), never the whole store).
        compression: HDF5 filter for U and V.
        progress: called with (records done, total).

    Returns:
        The written factor file.

    Raises:
        StoreError: unreadable store; ConfigError: bad rank or a dense-sketch store.
    """
    rank = check_rank(rank)
    if hasattr(run_dir_or_store_path, "sketches"):
        return _compact(run_dir_or_store_path, rank, out, chunk, compression, progress)
    p = Path(run_dir_or_store_path)
    with Store(p / C.STORE_FILE if p.is_dir() else p) as store:
        return _compact(store, rank, out, chunk, compression, progress)


def _compact(store, rank, out, chunk, compression, progress) -> Path:
    if store.sketch != "factored" or any(layer.sketch != "factored" for layer in store.layers):
        raise ConfigError(
            f"{store.path} holds dense sketches (vectors); only factored (k_out×k_in) sketches have "
            "low-rank factors. Train with --sketch factored to use compact storage."
        )
    run_dir = store.path if store.path.is_dir() else store.path.parent
    out = Path(out) if out is not None else run_dir / factor_file_name(rank)
    source = {
        "source_store": store.path.name,
        "source_run_id": str(store.manifest.get("run_id", "")),
        "source_n_records": store.n_records,
        "source_fingerprint": store.fingerprint,
        "source_status": store.status,
    }
    writer = FactorWriter(out, store.layers, rank, source, compression)
    n = store.n_records
    try:
        rec = store.records()
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            arrays = [store.sketches(li, start, stop) for li in range(len(store.layers))]
            writer.append(arrays, {k: v[start:stop] for k, v in rec.items()})
            if progress:
                progress(stop, n)
    except BaseException:
        writer.close(C.STATUS_FAILED)
        raise
    path = writer.close(C.STATUS_COMPLETED)
    log.info("wrote %s (rank %d, %d records)", path, rank, n)
    return path
