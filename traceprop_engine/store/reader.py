"""The store reader: a read-only view of one ``store.h5``, validated on open.

Layout in docs/store-format.md and :mod:`.format`. Only the first ``n_records`` records of a
store count (see :mod:`.writer`); a damaged dataset (Fletcher-32 mismatch) reads as a
:class:`StoreError` that says so, never as numbers.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from .. import constants as C
from ..errors import ModelMismatchError, SchemaVersionError, StoreError
from .format import (
    DIGEST_ATTR,
    FULL_DIGEST_ATTR,
    Covariance,
    LayerInfo,
    decode_factors,
    raw_strings,
    strings_digest,
)
from .live import LiveReads, live_read
from .partial import PartialStatus
from .torn_tail import flushed_records, recover_store
from .verify import verify_content


def _layer_what(info) -> str:  # what _checked says is damaged
    return f"the records of layer {info.name} are"


def _rows_at(ds: h5py.Dataset, records: np.ndarray, tail: tuple = ()) -> np.ndarray:
    """Rows ``records`` (sorted, unique) of a dataset, cut by ``tail``: one contiguous read when
    they are dense enough (h5py's point selection is slow for many rows), else a point selection."""
    records = np.asarray(records, dtype=np.int64)
    if len(records) == 0:
        return np.zeros((0, *ds.shape[1:]), ds.dtype)[(slice(None), *tail)]
    lo, hi = int(records[0]), int(records[-1]) + 1
    if hi - lo <= 4 * len(records) + 64:
        return ds[(slice(lo, hi), *tail)][records - lo]
    return ds[(records, *tail)]


def _first_columns(columns: int | None) -> tuple:
    """A factor dataset's ``(n, k, r)`` selection after the rows: every column, or the first."""
    return () if columns is None else (slice(None), slice(0, int(columns)))


class Store(LiveReads, PartialStatus):
    """Read-only view of a store, validated on open.

    Raises:
        StoreError: the file is missing or not a readable Traceprop store (truncated, corrupt).
        SchemaVersionError: written by another schema version.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._tails, self._probed, self._tail_lock = {}, False, threading.Lock()  # .torn_tail
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / C.STORE_FILE
        if not self.path.exists():
            raise StoreError(
                f"no store at {self.path}: run 'traceprop train --out DIR' first, or check the path"
            )
        self._open_live(self._open)

    def _open(self) -> None:
        """Open and validate the file (under the store's lock, :mod:`.live`)."""
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
        self.schema_version = version  # what the file says, not this library's constant
        try:
            self.status = str(a["status"])
            self.n_records = int(a["n_records"])
            self.sketch = str(a["sketch"])
            self.manifest = json.loads(a["manifest"])
            self.model_origin = str(a.get(C.MODEL_ORIGIN, ""))  # "": written before 2026-12-06
            self.layers = [
                LayerInfo.read(i, self._f[f"{C.G_LAYERS}/{k}"])
                for i, k in enumerate(sorted(self._f[C.G_LAYERS]))
            ]
            self._check_complete_layout()
            have, why = flushed_records(self._f, self.n_records)
            if have < self.n_records and (have < 0 or self.status != C.STATUS_RUNNING):
                raise StoreError(
                    f"{self.path} is damaged or incomplete ({why}); re-run the training"
                )
            self.n_records = have  # a running store killed mid-flush: the records all hold
        except (KeyError, ValueError, OSError) as e:
            self._f.close()
            raise StoreError(
                f"{self.path} is damaged or incomplete ({e}); re-run the training"
            ) from e

    def _reopened(self) -> None:
        """The file again, after its writer changed it (:meth:`.live.LiveReads._fresh`)."""
        try:
            self._f = h5py.File(self.path, "r", locking=False)
        except OSError as e:
            raise StoreError(f"{self.path} could not be opened again ({e})") from e
        self._tails, self._probed = {}, False

    def _check_complete_layout(self) -> None:
        """Every dataset the readers use is there (raises KeyError naming the first missing one)."""
        f = self._f
        need = [f"{C.G_RECORDS}/{name}" for name in C.RECORD_FIELDS]
        for info in self.layers:
            need += [f"{info.group}/{n}" for n in ((C.L_U, C.L_V) if info.rank else (C.L_SKETCH,))]
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

    @live_read
    def verify_content(self) -> dict:
        """:func:`.verify.verify_content` of this store."""
        return verify_content(self)

    # -- state ------------------------------------------------------------------------------
    @property
    @live_read
    def n_examples(self) -> int:
        return int(self._f[C.G_EXAMPLES].attrs["n_examples"]) if C.G_EXAMPLES in self._f else 0

    @functools.cached_property
    @live_read
    def has_covariance(self) -> bool:
        """Every layer has K-FAC statistics; read once (0.4 ms on 9 layers, and every query asks
        it to resolve the default preconditioner). A reader sees the file as it was opened."""
        return all(C.L_COV_A in self._f[layer.group] for layer in self.layers)

    @property
    @live_read
    def fingerprint(self) -> str:
        """Identity of the store's content: changes when records or statistics change."""
        at = self._f.attrs
        # the full digest where written; stores written before it keep their fingerprint
        digest = at.get(FULL_DIGEST_ATTR, at.get(DIGEST_ATTR))
        return (
            f"{self.manifest.get('run_id', '')}:{self.n_records}:{at.get('status')}:{at.get('finished', '')}"
            + (f":{digest}" if digest is not None else "")
        )

    @property
    def dim(self) -> int:
        return sum(layer.dim for layer in self.layers)

    # -- data -------------------------------------------------------------------------------
    @live_read
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
        return self._checked(
            lambda: self._ds(f"{info.group}/{C.L_SKETCH}")[start:stop], _layer_what(info)
        )

    @live_read
    def factors(
        self, layer: int, start: int = 0, stop: int | None = None, columns: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``U`` (n, k_out, r) and ``V`` (n, k_in, r) float32 of a factor-stored layer; with
        ``columns`` only their first columns are read (a column view's: 0.4× the time of a
        whole rank-16 record, benchmarks/column_read.py).

        Raises:
            StoreError: the layer stores full sketches (``rank`` 0).
        """
        info = self.layers[layer]
        if not info.rank:
            raise StoreError(f"layer {info.name} stores full sketches, not factors")
        stop = self.n_records if stop is None else min(stop, self.n_records)
        g, cols = info.group, _first_columns(columns)
        scale = C.L_SCALE in self._f[g]
        u, v, sc = self._checked(
            lambda: (
                self._ds(f"{g}/{C.L_U}")[(slice(start, stop), *cols)],
                self._ds(f"{g}/{C.L_V}")[(slice(start, stop), *cols)],
                self._ds(f"{g}/{C.L_SCALE}")[start:stop] if scale else None,
            ),
            _layer_what(info),
        )
        return decode_factors(u, v, info.factor_dtype, sc)

    @live_read
    def sketches_at(self, layer: int, records: np.ndarray) -> np.ndarray:
        """Like :meth:`sketches` for a sorted array of record numbers."""
        info = self.layers[layer]
        if info.rank:
            u, v = self.factors_at(layer, records)
            return np.matmul(u, v.transpose(0, 2, 1))
        return self._checked(
            lambda: _rows_at(self._ds(f"{info.group}/{C.L_SKETCH}"), records), _layer_what(info)
        )

    @live_read
    def factors_at(
        self, layer: int, records: np.ndarray, columns: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`factors` for a sorted array of record numbers."""
        info = self.layers[layer]
        if not info.rank:
            raise StoreError(f"layer {info.name} stores full sketches, not factors")
        g, cols = info.group, _first_columns(columns)
        scale = C.L_SCALE in self._f[g]
        u, v, sc = self._checked(
            lambda: (
                _rows_at(self._ds(f"{g}/{C.L_U}"), records, cols),
                _rows_at(self._ds(f"{g}/{C.L_V}"), records, cols),
                _rows_at(self._ds(f"{g}/{C.L_SCALE}"), records) if scale else None,
            ),
            _layer_what(info),
        )
        return decode_factors(u, v, info.factor_dtype, sc)

    @live_read
    def records(self) -> dict[str, np.ndarray]:
        return self._checked(
            lambda: {
                name: self._ds(f"{C.G_RECORDS}/{name}")[: self.n_records]
                for name in C.RECORD_FIELDS
            },
            "the records table is",
        )

    @live_read
    def stored_rows(self, layer: int, name: str, sel) -> np.ndarray:
        """``sel`` of one layer's dataset ``name`` (``U``, ``V``, ``scale``, ``sketch``) as stored."""
        info = self.layers[layer]
        return self._checked(lambda: self._ds(f"{info.group}/{name}")[sel], _layer_what(info))

    # -- a partial store's torn last chunk (.torn_tail) -----------------------------------
    def _ds(self, path: str):
        """The record dataset at ``path``, or its recovered :class:`.torn_tail.TornTail`."""
        return self._tails.get(path) or self._f[path]

    def _recover_tails(self) -> bool:
        """Once a partial store failed a checksum: recover each record dataset whose last chunk
        a kill tore (once, locked: queries read on two threads); whether any is."""
        with self._tail_lock:
            if not self._probed and self.is_partial:
                self._probed = True
                self._tails = recover_store(self._f, self.n_records)
            return bool(self._tails)

    def _checked(self, read, what: str):
        """``read()``; a Fletcher-32 mismatch (bytes changed on disk) is a StoreError saying
        ``what`` is damaged, unless it is a partial store's torn last chunk (then read again)."""
        try:
            return read()
        except OSError as e:
            err = e
        if self._recover_tails():
            try:
                return read()
            except OSError as e:
                err = e
        raise StoreError(
            f"{self.path}: {what} damaged ({err}); the store cannot be trusted: re-run the training"
        ) from err

    @live_read
    def projection(self, layer: int, side: str) -> np.ndarray | None:
        name = C.L_P_IN if side == "in" else C.L_P_OUT
        info = self.layers[layer]
        g = self._f[info.group]
        if name in g:
            return self._read(g[name], f"the projection {name} of layer {info.name}")
        k, d = (info.k_in, info.d_in) if side == "in" else (info.k_out, info.d_out)
        if info.sketch != "dense" and k < d:
            # a side is projected unless its k equals the layer width (then no matrix is stored)
            raise StoreError(
                f"{self.path} is damaged or incomplete (missing dataset '{info.group}/{name}': "
                f"layer {info.name} projects {d} -> {k}); re-run the training"
            )
        return None

    @live_read
    def dense_projection(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        info = self.layers[layer]
        g = self._f[info.group]
        nnz = int(g.attrs["dense_nnz"])
        what = f"the dense projection of layer {info.name}"
        sign = self._read(g[C.L_DENSE_SIGN], what).astype(np.float32) * 2 - 1
        index = self._read(g[C.L_DENSE_INDEX], what).astype(np.int64)
        return index, (sign / np.sqrt(nnz)).astype(np.float32)

    def _read(self, ds: h5py.Dataset, what: str, sel=()) -> np.ndarray:
        """``ds[sel]``, with a Fletcher-32 mismatch (bytes changed on disk) as a StoreError."""
        try:
            return ds[sel]
        except OSError as e:
            raise StoreError(
                f"{self.path}: {what} is damaged ({e}); the store cannot be trusted: re-run the "
                "training"
            ) from e

    @live_read
    def covariance(self, layer: int) -> Covariance | None:
        """The layer's K-FAC statistics; None for a dense layer or a run without covariance."""
        return Covariance.read(self._f[self.layers[layer].group])

    @live_read
    def sq_norm_sum(self, layer: int) -> float:
        return float(self._f[self.layers[layer].group].attrs.get(C.L_SQNORM, 0.0))

    @live_read
    def examples(self) -> dict[str, np.ndarray]:
        """The example table (index = example index) as numpy columns."""
        if C.G_EXAMPLES not in self._f:
            return {}
        g = self._f[C.G_EXAMPLES]
        raw = raw_strings(g)
        want = g.attrs.get(C.EX_STRINGS_SHA256)  # absent in stores written before it
        if want is not None and strings_digest(raw) != str(want):
            raise StoreError(
                f"{self.path}: the example table's text columns (source, sha256, text...) are "
                "damaged or were changed: they no longer match their checksum "
                f"(/{C.G_EXAMPLES} attribute {C.EX_STRINGS_SHA256}); the store cannot be "
                "trusted: re-run the training"
            )
        out = {col: np.array([b.decode() for b in vals], dtype=object) for col, vals in raw.items()}
        out[C.EX_ROW] = self._read(g[C.EX_ROW], "the example table's row column")
        return out

    @live_read
    def tokens(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact token ids and loss mask example ``example`` was trained on."""
        g = self._f[C.G_EXAMPLES]
        what = "the example table's tokens"
        lo, hi = self._read(g[C.EX_TOKEN_OFFSETS], what, np.s_[example : example + 2])
        return self._read(g[C.EX_TOKENS], what, np.s_[lo:hi]), self._read(
            g[C.EX_LOSS_MASK], what, np.s_[lo:hi]
        )

    @live_read
    def timings(self) -> dict:
        g = self._f[C.G_TIMINGS]
        out = {k: (v.item() if hasattr(v, "item") else v) for k, v in g.attrs.items()}
        out["step_ms"] = g[C.T_STEP_MS][()] if C.T_STEP_MS in g else np.zeros(0)
        return out

    @live_read
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
        self._close_live()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
