"""The store writer (used by the tracker during training).

Layout and every name are documented in docs/store-format.md and :mod:`.format`. The writer
appends records in chunks (resizable, chunked datasets), updates ``n_records`` only after the data
of a chunk is written and flushes the file, so a run that stops (cancelled, failed, crashed
between flushes) leaves a store whose first ``n_records`` records are complete and whose
``status`` says what happened. The training loop hands it chunks through
:class:`~traceprop_engine.capture.buffer.BackgroundSink` (a writer thread).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from .. import constants as C
from ..errors import ConfigError
from .format import (
    DIGEST_ATTR,
    FULL_DIGEST_ATTR,
    Covariance,
    append_records,
    content_digest,
    create_records_group,
    encode_factors,
    full_content_digest,
    strings_digest,
)
from .layer_datasets import create_factors, create_layer
from .live import WriteLock
from .space import METADATA_BYTES, array_bytes, ensure_room, growth_bytes
from .torn_tail import TailSums, flushed_records, repair

log = logging.getLogger(__name__)
_STR = h5py.string_dtype("utf-8")


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
        projections = [
            getattr(layer, name)
            for layer in layers
            for name in ("P_in", "P_out", "dense_index", "dense_sign")
            if getattr(layer, name, None) is not None
        ]
        # every dataset's header and the manifest, beside the projections (see .space)
        need = array_bytes(*projections) + METADATA_BYTES * 4 * (len(layers) + 2)
        self._lock = WriteLock(self.path)  # before the file: no reader opens it half made
        try:
            with self._lock:
                f = self._create(tmp, need, layers, manifest, sketch, compression)
        except BaseException:
            self._lock.remove_now()
            raise
        self._tail_sums = TailSums(f)
        self.n_records = 0

    def _create(self, tmp: Path, need: int, layers, manifest, sketch, compression) -> h5py.File:
        """The new file, its attributes and empty datasets, flushed (under the lock)."""
        ensure_room(tmp, need + len(json.dumps(manifest, default=str)), "creating the store")
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
        self._compression = compression
        self._sketch_ds = []
        self._sq_norm = np.zeros(len(layers), dtype=np.float64)
        for i, layer in enumerate(layers):
            self._sketch_ds.append(
                create_layer(lg.create_group(f"{i:03d}"), layer, sketch, compression)
            )
        f.create_group(C.G_TIMINGS)
        f.flush()
        return f

    @classmethod
    def reopen(
        cls, path: str | os.PathLike, n_records: int, sq_norm: Sequence[float]
    ) -> StoreWriter:
        """Reopen an existing store to append to it (``traceprop train --resume``).

        Records past ``n_records`` (written after the checkpoint being resumed) are dropped, the
        per-layer stored norms are set to ``sq_norm`` (their value at ``n_records``), and the
        store is marked running again (its content digest and ``finished`` removed).

        Raises:
            StoreError: the store holds fewer than ``n_records`` complete records.
        """
        self = cls.__new__(cls)
        self.path = Path(path)
        self._compression = None
        self._lock = WriteLock(self.path)
        try:
            with self._lock:
                f = self._reopen(n_records, sq_norm)
        except BaseException:
            self._lock.remove_now()
            raise
        self._tail_sums = TailSums(f)
        self.n_records = n_records
        return self

    def _reopen(self, n_records: int, sq_norm: Sequence[float]) -> h5py.File:
        """:meth:`reopen`'s file, cut to ``n_records`` and marked running (under the lock)."""
        from ..errors import StoreError

        try:
            self._f = h5py.File(self.path, "r+", libver=("earliest", "v110"))
        except OSError as e:
            raise StoreError(f"cannot reopen the store {self.path} to append ({e})") from None
        f = self._f
        # a kill in the middle of the last flush may have left some datasets shorter than
        # n_records says (.torn_tail.flushed_records)
        have, why = flushed_records(f, int(f.attrs.get("n_records", 0)))
        if have < n_records:
            f.close()
            held = f"{max(have, 0)} complete records" + (f" ({why})" if why else "")
            raise StoreError(
                f"{self.path} holds {held}, the checkpoint counts {n_records}: "
                "the store lost records the checkpoint relies on; the run cannot be resumed"
            )
        # a kill during the last flush may have torn a last chunk (.torn_tail): rewrite it from
        # its checked rows first, or HDF5 cannot read it to cut it
        for name in f[C.G_RECORDS]:
            repair(f[C.G_RECORDS][name], have)
            f[C.G_RECORDS][name].resize(n_records, axis=0)
        self._sketch_ds = []
        for i, key in enumerate(sorted(f[C.G_LAYERS])):
            g = f[C.G_LAYERS][key]
            if int(g.attrs.get(C.L_RANK, 0)):
                pair = [g[C.L_U], g[C.L_V]] + ([g[C.L_SCALE]] if C.L_SCALE in g else [])
                ds = (pair, int(g.attrs["k_out"]), str(g.attrs[C.L_FACTOR_DTYPE]))
            else:
                pair, ds = [g[C.L_SKETCH]], g[C.L_SKETCH]
            for d in pair:
                repair(d, have)
                d.resize(n_records, axis=0)
            g.attrs[C.L_SQNORM] = float(sq_norm[i])
            self._sketch_ds.append(ds)
        self._sq_norm = np.asarray(sq_norm, dtype=np.float64)
        for attr in (DIGEST_ATTR, FULL_DIGEST_ATTR, "finished"):
            if attr in f.attrs:
                del f.attrs[attr]
        f.attrs["n_records"] = n_records
        f.attrs["status"] = C.STATUS_RUNNING
        f.flush()
        return f

    @property
    def sq_norms(self) -> list[float]:
        """Per layer the running ``Σ ||record||²`` of the records written so far."""
        with self._lock.own:
            return [float(x) for x in self._sq_norm]

    def relayout(self, layers: Sequence) -> None:
        """Recreate the record datasets of the factored layers whose rank changed, before any
        record is written (a rank decided at the first step, :mod:`~traceprop_engine.capture.free_text`).

        Raises:
            RuntimeError: records were already written (their layout is fixed).
        """
        with self._lock:
            if self.n_records:
                raise RuntimeError(
                    f"{self.path} already holds {self.n_records} records: their layout is fixed"
                )
            for i, layer in enumerate(layers):
                g = self._f[C.G_LAYERS][f"{i:03d}"]
                rank = int(getattr(layer, "rank", 0))
                if not rank or int(g.attrs.get(C.L_RANK, 0)) == rank:
                    continue
                for name in (C.L_U, C.L_V, C.L_SCALE):
                    if name in g:
                        del g[name]
                self._sketch_ds[i] = create_factors(g, layer, self._compression)
            self._f.flush()

    def write_examples(
        self,
        table: dict[str, Sequence],
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
    ) -> None:
        """The example table with lineage and the exact token ids / loss masks trained on.

        ``table`` columns: source, row, sha256, split, text, prompt, completion, label (str or
        None). Row ``i`` of the table is example index ``i``. The numeric columns carry
        Fletcher-32 checksums; the string columns (which HDF5 cannot checksum) the
        ``strings_sha256`` attribute the reader checks them against.

        Raises:
            ConfigError: columns of different lengths, not one token array and one loss mask
                per row, a token array and its mask of different lengths, a mask value other
                than 0 and 1, a negative or non-integer token id (checked here, not at query
                time).
        """
        check_example_table(table, tokens, loss_masks)
        with self._lock:
            n = len(table[C.EX_SOURCE])
            raw = {
                col: [("" if v is None else str(v)).encode() for v in table.get(col, [None] * n)]
                for col in C.EX_STRING_COLUMNS
            }
            text = sum(len(b) + 16 for vals in raw.values() for b in vals)  # + heap entries
            n_tokens = sum(len(t) for t in tokens)
            ensure_room(
                self.path, text + n_tokens * 5 + n * 16 + 12 * METADATA_BYTES, "the example table"
            )
            g = self._f.require_group(C.G_EXAMPLES)
            for col, vals in raw.items():
                g.create_dataset(col, data=np.array(vals, dtype=object), dtype=_STR)
            g.attrs[C.EX_STRINGS_SHA256] = strings_digest(raw)

            def numeric(name, data, **kw):
                # an empty table has nothing to chunk (Fletcher-32 needs chunks)
                g.create_dataset(name, data=data, fletcher32=len(data) > 0, **kw)

            numeric(C.EX_ROW, np.asarray(table[C.EX_ROW], dtype=np.int64))
            lengths = np.array([len(t) for t in tokens], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            numeric(C.EX_TOKEN_OFFSETS, offsets)
            flat_t = np.concatenate(tokens).astype(np.int32) if n else np.zeros(0, np.int32)
            flat_m = np.concatenate(loss_masks).astype(np.uint8) if n else np.zeros(0, np.uint8)
            numeric(C.EX_TOKENS, flat_t, compression="gzip" if n else None)
            numeric(C.EX_LOSS_MASK, flat_m, compression="gzip" if n else None)
            g.attrs["n_examples"] = n
            self._f.flush()

    @property
    def layer_kinds(self) -> list[str]:
        """Each stored layer's ``kind`` (``linear``, ``conv1d``, ``embedding``), in layer order."""
        with self._lock.own:
            return [str(g.attrs.get("kind", "")) for g in self._f[C.G_LAYERS].values()]

    @property
    def layer_ranks(self) -> list[int]:
        """Each stored layer's record rank (0: full sketches), in layer order."""
        with self._lock.own:
            return [int(g.attrs.get(C.L_RANK, 0)) for g in self._f[C.G_LAYERS].values()]

    @property
    def n_examples(self) -> int | None:
        """Rows of the example table written so far (None: none written)."""
        with self._lock.own:
            g = self._f.get(C.G_EXAMPLES)
            return None if g is None else int(g.attrs.get("n_examples", 0))

    def append(self, arrays: list[np.ndarray], meta: dict[str, np.ndarray]) -> None:
        """Append one flushed chunk of records (all layers + metadata), then mark it readable."""
        with self._lock:
            n0, n = self.n_records, len(meta[C.REC_EXAMPLE])
            grown = [
                d for ds in self._sketch_ds for d in (ds[0] if isinstance(ds, tuple) else [ds])
            ]
            grown += [self._f[C.G_RECORDS][name] for name in C.RECORD_FIELDS]
            ensure_room(
                self.path,
                sum(growth_bytes(d, n0, n) for d in grown),
                f"appending records {n0}-{n0 + n - 1} to the store",
            )
            for i, (ds, arr) in enumerate(zip(self._sketch_ds, arrays, strict=True)):
                if isinstance(ds, tuple):  # ([U, V(, scale)], k_out, dtype); arr (n, ko + ki, r)
                    pair, k_out, fdt = ds
                    vals, ru, rv = encode_factors(arr[:, :k_out], arr[:, k_out:], fdt)
                    for d, val in zip(pair, vals, strict=True):
                        d.resize(n0 + n, axis=0)
                        d[n0 : n0 + n] = val
                        self._tail_sums.wrote(d, n0, val)
                    # ||U V^T||_F^2 = sum((U^T U) * (V^T V)) of what is stored
                    gu = np.matmul(ru.transpose(0, 2, 1).astype(np.float64), ru)
                    gv = np.matmul(rv.transpose(0, 2, 1).astype(np.float64), rv)
                    self._sq_norm[i] += float((gu * gv).sum())
                    continue
                ds.resize(n0 + n, axis=0)
                ds[n0 : n0 + n] = arr
                self._tail_sums.wrote(ds, n0, arr)
                self._sq_norm[i] += float(
                    np.einsum("i,i->", arr.ravel(), arr.ravel(), dtype=np.float64)
                )
            append_records(self._f[C.G_RECORDS], n0, meta)
            for name in C.RECORD_FIELDS:
                self._tail_sums.wrote(self._f[C.G_RECORDS][name], n0, meta[name])
            self._tail_sums.write()
            self.n_records = n0 + n
            self._f.attrs["n_records"] = self.n_records
            for i, ds in enumerate(self._sketch_ds):
                group = ds[0][0].parent if isinstance(ds, tuple) else ds.parent
                group.attrs[C.L_SQNORM] = self._sq_norm[i]
            self._f.flush()

    def write_covariance(self, cov: Sequence[Covariance | None]) -> None:
        """Per layer (in layer order) its K-FAC statistics, or None for a layer without any."""
        with self._lock:
            stats = [a for c in cov if c is not None for a in (c.A, c.S)]
            ensure_room(self.path, array_bytes(*stats), "the K-FAC statistics")
            for i, c in enumerate(cov):
                if c is not None:
                    c.write(self._f[f"{C.G_LAYERS}/{i:03d}"])
            self._f.flush()

    def write_timings(self, step_ms: Sequence[float], extra: dict | None = None) -> None:
        with self._lock:
            ensure_room(self.path, array_bytes(np.asarray(step_ms, np.float64)), "the timings")
            g = self._f[C.G_TIMINGS]
            if C.T_STEP_MS in g:
                del g[C.T_STEP_MS]
            g.create_dataset(C.T_STEP_MS, data=np.asarray(step_ms, dtype=np.float64))
            for k, v in (extra or {}).items():
                g.attrs[k] = v
            self._f.flush()

    def set_attrs(self, **attrs) -> None:
        with self._lock:
            size = sum(len(json.dumps(v, default=str)) for v in attrs.values())
            ensure_room(self.path, size + METADATA_BYTES, "the store's attributes")
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
                self._f.attrs[DIGEST_ATTR] = records = content_digest(self._f)
                self._f.attrs[FULL_DIGEST_ATTR] = full_content_digest(self._f, records)
            except (OSError, KeyError) as e:  # never hide the run's own outcome behind this
                log.error("could not compute the store's content digest: %s", e)
            self._f.attrs["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            self._f.flush()
            self._f.close()
            self._lock.remove()  # closed: readers need no lock from now on


def check_example_table(
    table: dict[str, Sequence], tokens: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray]
) -> None:
    """ConfigError naming what is wrong with an example table (see ``write_examples``)."""
    if C.EX_SOURCE not in table or C.EX_ROW not in table:
        raise ConfigError(
            f"the example table needs the columns {C.EX_SOURCE!r} and {C.EX_ROW!r}; got "
            f"{sorted(table)}"
        )
    n = len(table[C.EX_SOURCE])
    for col in (C.EX_ROW, *C.EX_STRING_COLUMNS):
        if col in table and len(table[col]) != n:
            raise ConfigError(
                f"the example table's column {col!r} has {len(table[col])} rows, "
                f"{C.EX_SOURCE!r} has {n}: give every column one value per example"
            )
    if len(tokens) != n or len(loss_masks) != n:
        raise ConfigError(
            f"the example table has {n} rows but {len(tokens)} token arrays and "
            f"{len(loss_masks)} loss masks: give one of each per example (row i = example i)"
        )
    for i, (t, m) in enumerate(zip(tokens, loss_masks, strict=True)):
        if np.ndim(t) != 1 or np.shape(m) != np.shape(t):
            raise ConfigError(
                f"example {i}: tokens of shape {np.shape(t)} and a loss mask of shape "
                f"{np.shape(m)}: give both as 1-D arrays of the same length (one mask value "
                "per token)"
            )
    if not n:
        return
    # the values, over all examples at once (one pass, not one per example)
    lengths = np.fromiter((len(t) for t in tokens), np.int64, n)
    flat_t, flat_m = np.concatenate(tokens), np.concatenate(loss_masks)
    if flat_t.size == 0:
        return

    def example_of(pos: int) -> int:
        return int(np.searchsorted(np.cumsum(lengths), pos, side="right"))

    if flat_t.dtype.kind not in "iu":
        raise ConfigError(f"token ids must be integers, got {flat_t.dtype}")
    bad = np.flatnonzero((flat_t < 0) | (flat_t > 2**31 - 1))
    if bad.size:
        raise ConfigError(
            f"example {example_of(bad[0])}: token id {int(flat_t[bad[0]])} is not in [0, 2^31)"
        )
    bad = np.flatnonzero((flat_m != 0) & (flat_m != 1))
    if bad.size:
        raise ConfigError(
            f"example {example_of(bad[0])}: a loss mask holds only 0 (no loss) and 1 (loss), "
            f"got {flat_m[bad[0]].item()!r}"
        )
