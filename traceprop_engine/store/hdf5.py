"""The HDF5 store: writer (used by the tracker) and validating reader.

Layout and every name are documented in docs/store-format.md; the names live in
:mod:`traceprop_engine.constants`. The writer appends records in chunks (resizable, chunked
datasets), updates ``n_records`` only after the data of a chunk is written and flushes the file,
so a run that stops (cancelled, failed, crashed between flushes) leaves a store whose first
``n_records`` records are complete and whose ``status`` says what happened.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from .. import constants as C
from ..capture.sketch import bf16_bits, from_bf16_bits
from ..errors import ModelMismatchError, SchemaVersionError, StoreError

log = logging.getLogger(__name__)
_STR = h5py.string_dtype("utf-8")


@dataclass(frozen=True)
class LayerInfo:
    """What the store says about one tracked layer."""

    index: int
    name: str
    kind: str
    sketch: str
    d_in: int
    d_out: int
    k_in: int
    k_out: int
    dense_k: int
    rank: int = 0  # > 0: records stored as rank-r factors U (k_out, r), V (k_in, r)
    factor_dtype: str = ""

    @property
    def record_shape(self) -> tuple[int, ...]:
        """Shape of one record as read (factored records are rebuilt as ``U Vᵀ``)."""
        return (self.dense_k,) if self.sketch == "dense" else (self.k_out, self.k_in)

    @property
    def bytes_per_record(self) -> int:
        if self.rank:
            n = self.rank * (self.k_out + self.k_in)
            if self.factor_dtype == "int8":
                return n + 4  # + the float32 scale
            return n * (2 if self.factor_dtype == "bfloat16" else 4)
        return 4 * self.dim

    @property
    def dim(self) -> int:
        return int(np.prod(self.record_shape))

    @property
    def group(self) -> str:
        return f"{C.G_LAYERS}/{self.index:03d}"


DIGEST_ATTR = "content_sha256"  # root attribute: sha256 over the content (content_digest)
_DIGEST_READ_BYTES = 1 << 24  # bytes read per slice while hashing (bounds memory)


def content_digest(f: h5py.File) -> str:
    """sha256 over the bytes of every layer's sketches (first ``n_records`` rows), the records
    table and the covariance factors, streamed in slices, in a fixed order.

    Written as the ``content_sha256`` root attribute when the writer closes; ``traceprop verify``
    recomputes it. Each dataset also carries HDF5's Fletcher-32 checksum per chunk, so a flipped
    byte fails the read itself.
    """
    n = int(f.attrs["n_records"])
    h = hashlib.sha256()

    def feed(ds: h5py.Dataset, stop: int) -> None:
        h.update(ds.name.encode())
        row = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
        step = max(1, _DIGEST_READ_BYTES // row)
        for lo in range(0, stop, step):
            h.update(np.ascontiguousarray(ds[lo : min(stop, lo + step)]).tobytes())

    for k in sorted(f[C.G_LAYERS]):
        g = f[f"{C.G_LAYERS}/{k}"]
        for name in (C.L_SKETCH, C.L_U, C.L_V, C.L_SCALE):  # full sketches, or rank-r factors
            if name in g:
                feed(g[name], n)
        for name in (C.L_COV_A, C.L_COV_S):
            if name in g:
                feed(g[name], g[name].shape[0])
    for name in C.RECORD_FIELDS:
        feed(f[f"{C.G_RECORDS}/{name}"], n)
    return h.hexdigest()


def _chunk_rows(record_numel: int, target_bytes: int = 1 << 17) -> int:
    return max(1, min(4096, target_bytes // (4 * max(1, record_numel))))


def create_records_group(f: h5py.File) -> h5py.Group:
    """The resizable per-record metadata datasets (names and types in constants)."""
    rec = f.create_group(C.G_RECORDS)
    for name in C.RECORD_FIELDS:
        rec.create_dataset(
            name,
            shape=(0,),
            maxshape=(None,),
            dtype=C.RECORD_DTYPES[name],
            chunks=(16384,),
            fletcher32=True,  # a flipped byte fails the read instead of being used
        )
    return rec


def append_records(rec: h5py.Group, n0: int, meta: dict[str, np.ndarray]) -> None:
    """Write rows ``n0 .. n0 + len(meta)`` of every record field."""
    n = len(meta[C.REC_EXAMPLE])
    for name in C.RECORD_FIELDS:
        rec[name].resize(n0 + n, axis=0)
        rec[name][n0 : n0 + n] = meta[name]


_FACTOR_STORAGE = {"int8": "i1", "bfloat16": "u2", "float32": "f4"}


def encode_factors(u: np.ndarray, v: np.ndarray, dtype: str):
    """The stored arrays of float32 factors ``u`` (n, k_out, r), ``v`` (n, k_in, r), and what a
    reader gets back from them (float32, for the stored-norm sums).

    int8: each record's ``u`` and ``v`` are scaled to ±127 by their own max-abs value and the
    product of both scales is kept as one float32 ``scale``, so the record is
    ``scale · U_q V_qᵀ`` (1 byte per number + 4 bytes per record and layer).
    """
    if dtype == "int8":
        su = np.abs(u).max(axis=(1, 2)).astype(np.float32) / 127
        sv = np.abs(v).max(axis=(1, 2)).astype(np.float32) / 127
        su = np.where(su > 0, su, np.float32(1))
        sv = np.where(sv > 0, sv, np.float32(1))
        qu = np.rint(u / su[:, None, None]).astype(np.int8)
        qv = np.rint(v / sv[:, None, None]).astype(np.int8)
        scale = (su * sv).astype(np.float32)
        return (qu, qv, scale), *decode_factors(qu, qv, "int8", scale)
    if dtype == "bfloat16":
        bu, bv = bf16_bits(u), bf16_bits(v)
        return (bu, bv), from_bf16_bits(bu), from_bf16_bits(bv)
    return (u, v), u, v


def decode_factors(u, v, dtype: str, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``U`` (scale folded in) and ``V`` from the stored arrays."""
    if dtype == "int8":
        su = np.asarray(scale, np.float32)[:, None, None]
        return u.astype(np.float32) * su, v.astype(np.float32)
    if dtype == "bfloat16":
        return from_bf16_bits(u), from_bf16_bits(v)
    return u, v


def _damaged(store, info, read):
    """``read()``, with a Fletcher-32 mismatch (bytes changed on disk) as a clear StoreError."""
    try:
        return read()
    except OSError as e:
        raise StoreError(
            f"{store.path}: the records of layer {info.name} are damaged ({e}); "
            "the store cannot be trusted: re-run the training"
        ) from e


def _rows_at(ds: h5py.Dataset, records: np.ndarray) -> np.ndarray:
    """Rows ``records`` (sorted, unique) of a dataset: one contiguous read when they are dense
    enough (h5py's point selection is slow for many rows), else a point selection."""
    records = np.asarray(records, dtype=np.int64)
    if len(records) == 0:
        return np.zeros((0, *ds.shape[1:]), ds.dtype)
    lo, hi = int(records[0]), int(records[-1]) + 1
    if hi - lo <= 4 * len(records) + 64:
        return ds[lo:hi][records - lo]
    return ds[records]


class StoreWriter:
    """Creates a store and appends records; thread-safe for one background writer.

    Args:
        path: the ``store.h5`` to create (an existing file is replaced).
        layers: tracked layers (``TrackedLayer`` objects: name, kind, widths, projections).
        manifest: the run manifest (JSON-serialisable), stored as the ``manifest`` attribute.
        sketch: ``"factored"`` or ``"dense"``.
        compression: HDF5 filter for the sketch datasets (``None``, ``"lzf"``, ``"gzip"``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layers: Sequence,
        manifest: dict,
        sketch: str,
        compression: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".h5.tmp")
        # v110 at most: "latest" (superblock v3) marks the file open-for-write in its header, and
        # after a SIGKILL (OOM killer, preempted node) no reader could open it again; with
        # superblock v2 the first n_records records (flushed) stay readable
        self._f = h5py.File(tmp, "w", libver=("earliest", "v110"))
        os.replace(tmp, self.path)  # the open handle follows the rename (same filesystem)
        f = self._f
        f.attrs["format"] = C.STORE_FORMAT
        f.attrs["schema_version"] = C.SCHEMA_VERSION
        f.attrs["status"] = C.STATUS_RUNNING
        f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        f.attrs["loss_definition"] = C.LOSS_DEFINITION
        f.attrs["sketch"] = sketch
        f.attrs["n_records"] = 0
        f.attrs["manifest"] = json.dumps(manifest, sort_keys=True, default=str)
        f.attrs["layer_names"] = json.dumps([layer.name for layer in layers])
        create_records_group(f)
        lg = f.create_group(C.G_LAYERS)
        self._sketch_ds = []
        self._sq_norm = np.zeros(len(layers), dtype=np.float64)
        for i, layer in enumerate(layers):
            g = lg.create_group(f"{i:03d}")
            g.attrs.update(
                name=layer.name,
                kind=layer.kind,
                sketch=sketch,
                d_in=layer.d_in,
                d_out=layer.d_out,
                k_in=layer.k_in,
                k_out=layer.k_out,
                dense_k=getattr(layer, "dense_k", 0),
            )
            rank = int(getattr(layer, "rank", 0))
            if rank:  # rank-r factors: U (n, k_out, r), V (n, k_in, r)
                fdt = str(getattr(layer, "factor_dtype", "float32"))
                g.attrs[C.L_RANK] = rank
                g.attrs[C.L_FACTOR_DTYPE] = fdt
                pair = []
                for name, rows in ((C.L_U, layer.k_out), (C.L_V, layer.k_in)):
                    pair.append(
                        g.create_dataset(
                            name,
                            shape=(0, rows, rank),
                            maxshape=(None, rows, rank),
                            dtype=_FACTOR_STORAGE[fdt],
                            chunks=(_chunk_rows(rows * rank), rows, rank),
                            compression=compression,
                            fletcher32=True,
                        )
                    )
                if fdt == "int8":
                    pair.append(
                        g.create_dataset(
                            C.L_SCALE,
                            shape=(0,),
                            maxshape=(None,),
                            dtype="f4",
                            chunks=(_chunk_rows(layer.k_out * rank),),  # as U's chunks
                            fletcher32=True,
                        )
                    )
                self._sketch_ds.append((pair, layer.k_out, fdt))
            else:
                shape = tuple(layer.record_shape)
                self._sketch_ds.append(
                    g.create_dataset(
                        C.L_SKETCH,
                        shape=(0, *shape),
                        maxshape=(None, *shape),
                        dtype="f4",
                        chunks=(_chunk_rows(int(np.prod(shape))), *shape),
                        compression=compression,
                        fletcher32=True,
                    )
                )
            if layer.P_in is not None:
                g.create_dataset(C.L_P_IN, data=layer.P_in.numpy())
            if layer.P_out is not None:
                g.create_dataset(C.L_P_OUT, data=layer.P_out.numpy())
            if getattr(layer, "dense_index", None) is not None:
                g.create_dataset(
                    C.L_DENSE_INDEX,
                    data=layer.dense_index.numpy().astype(np.int32),
                    compression="gzip",
                )
                g.create_dataset(
                    C.L_DENSE_SIGN,
                    data=(layer.dense_sign.numpy() > 0).astype(np.int8),
                    compression="gzip",
                )
                g.attrs["dense_nnz"] = int(layer.dense_index.shape[0])
        f.create_group(C.G_TIMINGS)
        f.flush()
        self._lock = threading.Lock()
        self.n_records = 0

    def write_examples(
        self,
        table: dict[str, Sequence],
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
    ) -> None:
        """The example table with lineage and the exact token ids / loss masks trained on.

        ``table`` columns: source, row, sha256, split, text, prompt, completion, label (str or
        None). Row ``i`` of the table is example index ``i``.
        """
        with self._lock:
            g = self._f.require_group(C.G_EXAMPLES)
            n = len(table[C.EX_SOURCE])
            for col in C.EX_STRING_COLUMNS:
                vals = [("" if v is None else str(v)) for v in table.get(col, [None] * n)]
                g.create_dataset(col, data=np.array(vals, dtype=object), dtype=_STR)
            g.create_dataset(C.EX_ROW, data=np.asarray(table[C.EX_ROW], dtype=np.int64))
            lengths = np.array([len(t) for t in tokens], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            g.create_dataset(C.EX_TOKEN_OFFSETS, data=offsets)
            flat_t = np.concatenate(tokens).astype(np.int32) if n else np.zeros(0, np.int32)
            flat_m = np.concatenate(loss_masks).astype(np.uint8) if n else np.zeros(0, np.uint8)
            g.create_dataset(C.EX_TOKENS, data=flat_t, compression="gzip")
            g.create_dataset(C.EX_LOSS_MASK, data=flat_m, compression="gzip")
            g.attrs["n_examples"] = n
            self._f.flush()

    def append(self, arrays: list[np.ndarray], meta: dict[str, np.ndarray]) -> None:
        """Append one flushed chunk of records (all layers + metadata), then mark it readable."""
        with self._lock:
            n0, n = self.n_records, len(meta[C.REC_EXAMPLE])
            for i, (ds, arr) in enumerate(zip(self._sketch_ds, arrays, strict=True)):
                if isinstance(ds, tuple):  # ([U, V(, scale)], k_out, dtype); arr (n, ko + ki, r)
                    pair, k_out, fdt = ds
                    vals, ru, rv = encode_factors(arr[:, :k_out], arr[:, k_out:], fdt)
                    for d, val in zip(pair, vals, strict=True):
                        d.resize(n0 + n, axis=0)
                        d[n0 : n0 + n] = val
                    # ||U V^T||_F^2 = sum((U^T U) * (V^T V)) of what is stored
                    gu = np.matmul(ru.transpose(0, 2, 1).astype(np.float64), ru)
                    gv = np.matmul(rv.transpose(0, 2, 1).astype(np.float64), rv)
                    self._sq_norm[i] += float((gu * gv).sum())
                    continue
                ds.resize(n0 + n, axis=0)
                ds[n0 : n0 + n] = arr
                self._sq_norm[i] += float(
                    np.einsum("i,i->", arr.ravel(), arr.ravel(), dtype=np.float64)
                )
            append_records(self._f[C.G_RECORDS], n0, meta)
            self.n_records = n0 + n
            self._f.attrs["n_records"] = self.n_records
            for i, ds in enumerate(self._sketch_ds):
                group = ds[0][0].parent if isinstance(ds, tuple) else ds.parent
                group.attrs[C.L_SQNORM] = self._sq_norm[i]
            self._f.flush()

    def write_covariance(self, cov: list[dict]) -> None:
        with self._lock:
            for i, c in enumerate(cov):
                if not c:
                    continue
                g = self._f[f"{C.G_LAYERS}/{i:03d}"]
                for key, name in (("A", C.L_COV_A), ("S", C.L_COV_S)):
                    if name in g:
                        del g[name]
                    g.create_dataset(name, data=c[key], fletcher32=True)
                g.attrs["cov_tokens"] = c["n_tokens"]
            self._f.flush()

    def write_timings(self, step_ms: Sequence[float], extra: dict | None = None) -> None:
        with self._lock:
            g = self._f[C.G_TIMINGS]
            if C.T_STEP_MS in g:
                del g[C.T_STEP_MS]
            g.create_dataset(C.T_STEP_MS, data=np.asarray(step_ms, dtype=np.float64))
            for k, v in (extra or {}).items():
                g.attrs[k] = v
            self._f.flush()

    def set_attrs(self, **attrs) -> None:
        with self._lock:
            for k, v in attrs.items():
                self._f.attrs[k] = (
                    json.dumps(v, sort_keys=True, default=str) if isinstance(v, dict) else v
                )
            self._f.flush()

    def close(self, status: str) -> None:
        with self._lock:
            if not self._f.id.valid:
                return
            self._f.attrs["status"] = status
            try:
                self._f.attrs[DIGEST_ATTR] = content_digest(self._f)
            except (OSError, KeyError) as e:  # never hide the run's own outcome behind this
                log.error("could not compute the store's content digest: %s", e)
            self._f.attrs["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            self._f.flush()
            self._f.close()


class BackgroundSink:
    """Hands flushed chunks to a writer thread so training does not wait on HDF5.

    At most ``max_pending`` chunks wait in the queue, which bounds host memory; an error in the
    writer thread is raised on the next :meth:`__call__` or on :meth:`close`.
    """

    def __init__(self, writer: StoreWriter, max_pending: int = 2) -> None:
        self._writer = writer
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="traceprop-writer", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._writer.append(*item)
                except BaseException as e:  # surfaced to the training thread
                    self._error = e

    def __call__(self, arrays, meta) -> None:
        if self._error is not None:
            raise StoreError(f"writing the store failed: {self._error}") from self._error
        self._q.put((arrays, meta))

    def close(self) -> None:
        self._q.put(None)
        self._t.join()
        if self._error is not None:
            raise StoreError(f"writing the store failed: {self._error}") from self._error


class Store:
    """Read-only view of a store, validated on open.

    Raises:
        StoreError: the file is missing or not a readable Traceprop store (truncated, corrupt).
        SchemaVersionError: written by another schema version.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / C.STORE_FILE
        if not self.path.exists():
            raise StoreError(
                f"no store at {self.path}: run 'traceprop train --out DIR' first, or check the path"
            )
        try:
            self._f = h5py.File(self.path, "r", locking=False)
        except OSError as e:
            raise StoreError(
                f"{self.path} is not a readable HDF5 file ({e}); it may be truncated or corrupt "
                "(a run killed mid-write). Re-run the training to rebuild it."
            ) from e
        a = self._f.attrs
        if a.get("format") != C.STORE_FORMAT:
            self._f.close()
            raise StoreError(
                f"{self.path} is an HDF5 file but not a Traceprop store (no format='{C.STORE_FORMAT}' attribute)"
            )
        try:
            version = int(a.get("schema_version", -1))
        except (TypeError, ValueError):
            self._f.close()
            raise StoreError(
                f"{self.path} has a schema_version attribute that is not an integer "
                f"({a.get('schema_version')!r}): the file is damaged or was not written by Traceprop"
            ) from None
        if version not in C.READABLE_SCHEMA_VERSIONS:
            self._f.close()
            raise SchemaVersionError(
                f"{self.path} has store schema version {version}; this Traceprop reads version "
                f"{C.SCHEMA_VERSION}. Re-run the training with this version, or use the Traceprop "
                "release that wrote it."
            )
        try:
            self.status = str(a["status"])
            self.n_records = int(a["n_records"])
            self.sketch = str(a["sketch"])
            self.manifest = json.loads(a["manifest"])
            self.layers = [
                self._layer_info(i, self._f[f"{C.G_LAYERS}/{k}"])
                for i, k in enumerate(sorted(self._f[C.G_LAYERS]))
            ]
            for layer in self.layers:
                data = C.L_U if layer.rank else C.L_SKETCH
                have = self._f[f"{layer.group}/{data}"].shape[0]
                if have < self.n_records:
                    raise StoreError(
                        f"layer {layer.name} holds {have} records, the store says {self.n_records}"
                    )
            self._check_complete_layout()
        except (KeyError, ValueError, OSError) as e:
            self._f.close()
            raise StoreError(
                f"{self.path} is damaged or incomplete ({e}); re-run the training"
            ) from e

    def _check_complete_layout(self) -> None:
        """Every dataset the readers use is there (raises KeyError naming the first missing one)."""
        f = self._f
        need = [f"{C.G_RECORDS}/{name}" for name in C.RECORD_FIELDS]
        if C.G_EXAMPLES in f:
            need += [
                f"{C.G_EXAMPLES}/{col}"
                for col in (
                    *C.EX_STRING_COLUMNS,
                    C.EX_ROW,
                    C.EX_TOKEN_OFFSETS,
                    C.EX_TOKENS,
                    C.EX_LOSS_MASK,
                )
            ]
        missing = [n for n in need if n not in f]
        if missing:
            raise KeyError(
                f"missing dataset {missing[0]!r}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            )

    def verify_content(self) -> dict:
        """Recompute the content digest and compare it with the one written at completion.

        Returns:
            ``{"status": ok|changed|unreadable|absent|unchecked, "expected", "actual", "detail"}``:
            ``absent`` when a store with checksummed datasets has lost its digest attribute,
            ``unchecked`` for a store written before digests were recorded (nothing to compare).
        """
        want = self._f.attrs.get(DIGEST_ATTR)
        want = str(want) if want is not None else None
        try:
            got = content_digest(self._f)
        except (OSError, KeyError, ValueError) as e:
            return {"status": "unreadable", "expected": want, "actual": None, "detail": str(e)}
        if want is None:
            first = (
                self._f[f"{self.layers[0].group}/{C.L_U if self.layers[0].rank else C.L_SKETCH}"]
                if self.layers
                else None
            )
            legacy = first is None or not first.fletcher32
            return {
                "status": "unchecked" if legacy else "absent",
                "expected": None,
                "actual": got,
                "detail": "written before stores recorded a content digest"
                if legacy
                else "the content digest attribute was removed",
            }
        return {
            "status": "ok" if got == want else "changed",
            "expected": want,
            "actual": got,
            "detail": "",
        }

    @staticmethod
    def _layer_info(i: int, g: h5py.Group) -> LayerInfo:
        at = g.attrs
        return LayerInfo(
            index=i,
            name=str(at["name"]),
            kind=str(at["kind"]),
            sketch=str(at["sketch"]),
            d_in=int(at["d_in"]),
            d_out=int(at["d_out"]),
            k_in=int(at["k_in"]),
            k_out=int(at["k_out"]),
            dense_k=int(at["dense_k"]),
            rank=int(at.get(C.L_RANK, 0)),
            factor_dtype=str(at.get(C.L_FACTOR_DTYPE, "")),
        )

    # -- state ------------------------------------------------------------------------------
    @property
    def is_partial(self) -> bool:
        """True unless the run that wrote the store completed."""
        return self.status != C.STATUS_COMPLETED

    def describe_partial(self) -> str:
        """A sentence for users about a partial store (empty string when complete)."""
        if not self.is_partial:
            return ""
        return (
            f"this store is partial (status '{self.status}'): it holds the {self.n_records} records "
            f"written before the run stopped; scores cover only the examples seen so far"
            + (
                ""
                if self.has_covariance
                else ", and it has no covariance (identity preconditioning only)"
            )
        )

    @property
    def n_examples(self) -> int:
        return int(self._f[C.G_EXAMPLES].attrs["n_examples"]) if C.G_EXAMPLES in self._f else 0

    @property
    def has_covariance(self) -> bool:
        return all(C.L_COV_A in self._f[layer.group] for layer in self.layers)

    @property
    def fingerprint(self) -> str:
        """Identity of the store's content: changes when records or statistics change."""
        at = self._f.attrs
        digest = at.get(DIGEST_ATTR)  # absent in stores written before digests (fingerprint kept)
        return (
            f"{self.manifest.get('run_id', '')}:{self.n_records}:{at.get('status')}:{at.get('finished', '')}"
            + (f":{digest}" if digest is not None else "")
        )

    @property
    def dim(self) -> int:
        return sum(layer.dim for layer in self.layers)

    # -- data -------------------------------------------------------------------------------
    def sketches(self, layer: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Records ``start:stop`` of one layer, (n, *record_shape) float32.

        A layer stored as rank-r factors is rebuilt as ``U Vᵀ`` (what was recorded, to the
        factors' precision); scoring code that can use the factors directly calls
        :meth:`factors` instead.
        """
        info = self.layers[layer]
        if info.rank:
            u, v = self.factors(layer, start, stop)
            return np.matmul(u, v.transpose(0, 2, 1))
        stop = self.n_records if stop is None else min(stop, self.n_records)
        return _damaged(self, info, lambda: self._f[f"{info.group}/{C.L_SKETCH}"][start:stop])

    def factors(
        self, layer: int, start: int = 0, stop: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``U`` (n, k_out, r) and ``V`` (n, k_in, r) float32 of a factor-stored layer.

        Raises:
            StoreError: the layer stores full sketches (``rank`` 0).
        """
        info = self.layers[layer]
        if not info.rank:
            raise StoreError(f"layer {info.name} stores full sketches, not factors")
        stop = self.n_records if stop is None else min(stop, self.n_records)
        g = self._f[info.group]
        u, v, sc = _damaged(
            self,
            info,
            lambda: (
                g[C.L_U][start:stop],
                g[C.L_V][start:stop],
                g[C.L_SCALE][start:stop] if C.L_SCALE in g else None,
            ),
        )
        return decode_factors(u, v, info.factor_dtype, sc)

    def sketches_at(self, layer: int, records: np.ndarray) -> np.ndarray:
        """Like :meth:`sketches` for a sorted array of record numbers."""
        info = self.layers[layer]
        if info.rank:
            u, v = self.factors_at(layer, records)
            return np.matmul(u, v.transpose(0, 2, 1))
        return _damaged(
            self, info, lambda: _rows_at(self._f[f"{info.group}/{C.L_SKETCH}"], records)
        )

    def factors_at(self, layer: int, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`factors` for a sorted array of record numbers."""
        info = self.layers[layer]
        if not info.rank:
            raise StoreError(f"layer {info.name} stores full sketches, not factors")
        g = self._f[info.group]
        u, v, sc = _damaged(
            self,
            info,
            lambda: (
                _rows_at(g[C.L_U], records),
                _rows_at(g[C.L_V], records),
                _rows_at(g[C.L_SCALE], records) if C.L_SCALE in g else None,
            ),
        )
        return decode_factors(u, v, info.factor_dtype, sc)

    def records(self) -> dict[str, np.ndarray]:
        g = self._f[C.G_RECORDS]
        try:
            return {name: g[name][: self.n_records] for name in C.RECORD_FIELDS}
        except OSError as e:
            raise StoreError(
                f"{self.path}: the records table is damaged ({e}); re-run the training"
            ) from e

    def projection(self, layer: int, side: str) -> np.ndarray | None:
        name = C.L_P_IN if side == "in" else C.L_P_OUT
        info = self.layers[layer]
        g = self._f[info.group]
        if name in g:
            return g[name][()]
        k, d = (info.k_in, info.d_in) if side == "in" else (info.k_out, info.d_out)
        if info.sketch != "dense" and k < d:
            # a side is projected unless its k equals the layer width (then no matrix is stored)
            raise StoreError(
                f"{self.path} is damaged or incomplete (missing dataset '{info.group}/{name}': "
                f"layer {info.name} projects {d} -> {k}); re-run the training"
            )
        return None

    def dense_projection(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        g = self._f[self.layers[layer].group]
        nnz = int(g.attrs["dense_nnz"])
        sign = g[C.L_DENSE_SIGN][()].astype(np.float32) * 2 - 1
        return g[C.L_DENSE_INDEX][()].astype(np.int64), (sign / np.sqrt(nnz)).astype(np.float32)

    def covariance(self, layer: int) -> dict | None:
        g = self._f[self.layers[layer].group]
        if C.L_COV_A not in g:
            return None
        return {
            "A": g[C.L_COV_A][()],
            "S": g[C.L_COV_S][()],
            "n_tokens": float(g.attrs["cov_tokens"]),
        }

    def sq_norm_sum(self, layer: int) -> float:
        return float(self._f[self.layers[layer].group].attrs.get(C.L_SQNORM, 0.0))

    def examples(self) -> dict[str, np.ndarray]:
        """The example table (index = example index) as numpy columns."""
        if C.G_EXAMPLES not in self._f:
            return {}
        g = self._f[C.G_EXAMPLES]
        out = {}
        for col in C.EX_STRING_COLUMNS:
            out[col] = g[col].asstr()[()]
        out[C.EX_ROW] = g[C.EX_ROW][()]
        return out

    def tokens(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact token ids and loss mask example ``example`` was trained on."""
        g = self._f[C.G_EXAMPLES]
        lo, hi = g[C.EX_TOKEN_OFFSETS][example : example + 2]
        return g[C.EX_TOKENS][lo:hi], g[C.EX_LOSS_MASK][lo:hi]

    def timings(self) -> dict:
        g = self._f[C.G_TIMINGS]
        out = {k: (v.item() if hasattr(v, "item") else v) for k, v in g.attrs.items()}
        out["step_ms"] = g[C.T_STEP_MS][()] if C.T_STEP_MS in g else np.zeros(0)
        return out

    def attrs(self) -> dict:
        return dict(self._f.attrs)

    def check_model(self, layer_names: Sequence[str], widths: Sequence[tuple[int, int]]) -> None:
        """Raise :class:`ModelMismatchError` unless the model's tracked layers match the store."""
        want = [(layer.name, layer.d_in, layer.d_out) for layer in self.layers]
        have = [(n, di, do) for n, (di, do) in zip(layer_names, widths, strict=False)]
        if want != have:
            diff = next(((w, h) for w, h in zip(want, have, strict=False) if w != h), None)
            detail = (
                f"first difference: store has {diff[0]}, model has {diff[1]}"
                if diff
                else (f"store tracks {len(want)} layers, model has {len(have)}")
            )
            raise ModelMismatchError(
                f"the model does not match the store {self.path} ({detail}); query with the run's own "
                "saved model (RUN/model) and the same scope"
            )

    def close(self) -> None:
        if self._f.id.valid:
            self._f.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_STATUS_RANK = {
    C.STATUS_COMPLETED: 0,
    C.STATUS_RUNNING: 1,
    C.STATUS_CANCELLED: 2,
    C.STATUS_FAILED: 3,
}


class ShardedStore:
    """Several shards of one run (``store.rank{r}.h5``, one per DDP rank) read as one store.

    The read API is :class:`Store`'s: records are the shards' records one after the other (shard 0
    first); the example table, tokens and projections come from shard 0; covariance factors,
    token counts and squared-norm sums are summed over shards; the status is the worst shard's.

    Args:
        paths: the shard files, in rank order.

    Raises:
        StoreError: a shard is missing or unreadable, or the shards track different layers or
            were written with different projections.
    """

    def __init__(self, paths: Sequence[str | os.PathLike]) -> None:
        if not paths:
            raise StoreError("a sharded store needs at least one shard file")
        self.shards: list[Store] = []
        try:
            for p in paths:
                self.shards.append(Store(p))
            first = self.shards[0]
            for sh in self.shards[1:]:
                if sh.layers != first.layers or sh.sketch != first.sketch:
                    raise StoreError(
                        f"{sh.path} tracks other layers than {first.path}: the shards are not from one run"
                    )
                for li in range(len(first.layers)):
                    for side in ("in", "out"):
                        a, b = first.projection(li, side), sh.projection(li, side)
                        if (a is None) != (b is None) or (
                            a is not None and not np.array_equal(a, b)
                        ):
                            raise StoreError(
                                f"{sh.path} and {first.path} use different projections for "
                                f"{first.layers[li].name}: the shards are not from one run"
                            )
        except BaseException:
            self.close()
            raise
        self.path = first.path.parent
        self.paths = [sh.path for sh in self.shards]
        self.layers = first.layers
        self.sketch = first.sketch
        self.manifest = first.manifest
        self._offsets = np.concatenate(
            [[0], np.cumsum([sh.n_records for sh in self.shards])]
        ).astype(np.int64)
        self.n_records = int(self._offsets[-1])

    # -- state ------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        return max((sh.status for sh in self.shards), key=lambda s: _STATUS_RANK.get(s, 3))

    @property
    def is_partial(self) -> bool:
        return self.status != C.STATUS_COMPLETED

    def describe_partial(self) -> str:
        if not self.is_partial:
            return ""
        worst = [str(sh.path.name) for sh in self.shards if sh.status != C.STATUS_COMPLETED]
        return (
            f"this store is partial (status '{self.status}' in {', '.join(worst)}): it holds the {self.n_records} "
            f"records written before the run stopped; scores cover only the examples seen so far"
            + (
                ""
                if self.has_covariance
                else ", and it has no covariance (identity preconditioning only)"
            )
        )

    @property
    def n_examples(self) -> int:
        return self.shards[0].n_examples

    @property
    def has_covariance(self) -> bool:
        return all(sh.has_covariance for sh in self.shards)

    @property
    def fingerprint(self) -> str:
        return "|".join(sh.fingerprint for sh in self.shards)

    @property
    def dim(self) -> int:
        return self.shards[0].dim

    # -- data -------------------------------------------------------------------------------
    def sketches(self, layer: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.n_records if stop is None else min(stop, self.n_records)
        parts = []
        for sh, lo, hi in zip(self.shards, self._offsets[:-1], self._offsets[1:], strict=True):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                parts.append(sh.sketches(layer, int(a - lo), int(b - lo)))
        if not parts:
            return np.zeros((0, *self.layers[layer].record_shape), np.float32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def factors(
        self, layer: int, start: int = 0, stop: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        stop = self.n_records if stop is None else min(stop, self.n_records)
        us, vs = [], []
        for sh, lo, hi in zip(self.shards, self._offsets[:-1], self._offsets[1:], strict=True):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                u, v = sh.factors(layer, int(a - lo), int(b - lo))
                us.append(u)
                vs.append(v)
        if not us:
            info = self.layers[layer]
            return (
                np.zeros((0, info.k_out, info.rank), np.float32),
                np.zeros((0, info.k_in, info.rank), np.float32),
            )
        return np.concatenate(us), np.concatenate(vs)

    def _split(self, records: np.ndarray):
        records = np.asarray(records, dtype=np.int64)
        for sh, lo, hi in zip(self.shards, self._offsets[:-1], self._offsets[1:], strict=True):
            sel = records[(records >= lo) & (records < hi)]
            if len(sel):
                yield sh, sel - lo

    def sketches_at(self, layer: int, records: np.ndarray) -> np.ndarray:
        parts = [sh.sketches_at(layer, sel) for sh, sel in self._split(records)]
        if not parts:
            return np.zeros((0, *self.layers[layer].record_shape), np.float32)
        return np.concatenate(parts)

    def factors_at(self, layer: int, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = [sh.factors_at(layer, sel) for sh, sel in self._split(records)]
        if not parts:
            return self.factors(layer, 0, 0)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def records(self) -> dict[str, np.ndarray]:
        recs = [sh.records() for sh in self.shards]
        return {name: np.concatenate([r[name] for r in recs]) for name in C.RECORD_FIELDS}

    def projection(self, layer: int, side: str) -> np.ndarray | None:
        return self.shards[0].projection(layer, side)

    def dense_projection(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.shards[0].dense_projection(layer)

    def covariance(self, layer: int) -> dict | None:
        covs = [sh.covariance(layer) for sh in self.shards]
        if any(c is None for c in covs):
            return None
        return {
            "A": sum(c["A"] for c in covs),
            "S": sum(c["S"] for c in covs),
            "n_tokens": float(sum(c["n_tokens"] for c in covs)),
        }

    def sq_norm_sum(self, layer: int) -> float:
        return float(sum(sh.sq_norm_sum(layer) for sh in self.shards))

    def examples(self) -> dict[str, np.ndarray]:
        return self.shards[0].examples()

    def tokens(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        return self.shards[0].tokens(example)

    def timings(self) -> dict:
        """Shard 0's timings, plus every shard's step times (``step_ms_per_shard``)."""
        out = self.shards[0].timings()
        out["step_ms_per_shard"] = [sh.timings()["step_ms"] for sh in self.shards]
        return out

    def attrs(self) -> dict:
        return {**self.shards[0].attrs(), "status": self.status, "n_records": self.n_records}

    def check_model(self, layer_names: Sequence[str], widths: Sequence[tuple[int, int]]) -> None:
        self.shards[0].check_model(layer_names, widths)

    def close(self) -> None:
        for sh in self.shards:
            sh.close()

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_run_store(
    run_dir: str | os.PathLike, manifest: dict | None = None
) -> Store | ShardedStore:
    """The store of a run directory: ``store.h5``, or the shards ``run.json`` lists (DDP runs)."""
    run_dir = Path(run_dir)
    if manifest is None and (run_dir / C.MANIFEST_FILE).exists():
        manifest = json.loads((run_dir / C.MANIFEST_FILE).read_text())
    shards = (manifest or {}).get("shards")
    if shards:
        return ShardedStore([run_dir / s for s in shards])
    return Store(run_dir / C.STORE_FILE)
