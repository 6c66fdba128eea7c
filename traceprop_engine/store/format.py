"""The on-disk format of a store, in one place: what the writer writes and the reader reads.

Every name is documented in docs/store-format.md and lives in :mod:`traceprop_engine.constants`.
Here: the per-layer description (:class:`LayerInfo`), the K-FAC statistics (:class:`Covariance`),
the content digest, the records table, chunk sizing and the encoding of rank-r factors.
:mod:`.writer` and :mod:`.reader` (and the factor files of :mod:`.compact`) use these and
nothing else to agree on the layout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import h5py
import numpy as np

from .. import constants as C
from .bf16 import bf16_bits, from_bf16_bits


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
    output_head: bool = False  # the layer producing the logits (stores before it: False)
    bias_column: bool = (
        False  # first U column = P_out Σ_t g_t's direction, signed (C.L_BIAS_COLUMN)
    )

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

    @classmethod
    def read(cls, i: int, g: h5py.Group) -> LayerInfo:
        """Layer ``i`` from its group's attributes (``rank`` and ``factor_dtype``: schema 2)."""
        at = g.attrs
        return cls(
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
            output_head=bool(at.get(C.L_OUTPUT_HEAD, 0)),
            bias_column=bool(at.get(C.L_BIAS_COLUMN, 0)),
        )


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays have no truth value to compare by
class Covariance:
    """The K-FAC statistics of one factored layer, as summed over the tokens of a run.

    Produced by the capture hooks (:meth:`~traceprop_engine.capture.hooks.Capture.covariance_arrays`),
    written as the layer's ``A``/``S`` datasets and ``cov_tokens`` attribute, read back by
    :meth:`Store.covariance <traceprop_engine.store.reader.Store.covariance>` and turned into a
    preconditioner by :mod:`traceprop_engine.attribution.precondition.preconditioner`.

    Attributes:
        A: (k_in, k_in) float64, ``Σ ã ãᵀ`` over the tokens (projected layer inputs).
        S: (k_out, k_out) float64, ``Σ g̃ g̃ᵀ`` (projected output gradients).
        n_tokens: tokens summed into ``A`` and ``S`` (their mean is ``A / n_tokens``).
    """

    A: np.ndarray
    S: np.ndarray
    n_tokens: float

    @classmethod
    def merge(cls, parts: Sequence[Covariance]) -> Covariance:
        """The statistics of several shards of one run (DDP ranks): sums of every field."""
        return cls(
            A=sum(c.A for c in parts),
            S=sum(c.S for c in parts),
            n_tokens=float(sum(c.n_tokens for c in parts)),
        )

    def write(self, g: h5py.Group) -> None:
        """Into a layer group: datasets ``A``, ``S`` (replaced if there) and ``cov_tokens``."""
        for data, name in ((self.A, C.L_COV_A), (self.S, C.L_COV_S)):
            if name in g:
                del g[name]
            g.create_dataset(name, data=data, fletcher32=True)
        g.attrs["cov_tokens"] = self.n_tokens

    @classmethod
    def read(cls, g: h5py.Group) -> Covariance | None:
        """From a layer group; None when the run recorded no covariance for it."""
        if C.L_COV_A not in g:
            return None
        return cls(A=g[C.L_COV_A][()], S=g[C.L_COV_S][()], n_tokens=float(g.attrs["cov_tokens"]))


DIGEST_ATTR = "content_sha256"  # root attribute: the records and covariance (content_digest)
FULL_DIGEST_ATTR = "content_sha256_v2"  # root attribute: all of it (full_content_digest)
_DIGEST_READ_BYTES = 1 << 24  # bytes read per slice while hashing (bounds memory)
DIGEST_COVERAGE = {
    1: "the records (sketches or factors, the records table) and the covariance factors only: "
    "not the projection matrices, the example table (source, row, sha256, text, tokens) or the "
    "attributes they are read with (written before stores recorded content_sha256_v2)",
    2: "everything scores and lineage claims depend on: the records, the covariance, the "
    "projection matrices, the example table (source, row, sha256, text, tokens, loss masks) "
    "and the attributes they are read with",
}
"""What a store's digest covers, by version: 1 = ``content_sha256`` alone, 2 = ``content_sha256_v2``."""
# model_origin decides the default index's weighting; a store written before it has none, and
# _attrs_json skips what is absent, so its digest is unchanged
_ROOT_ATTRS = (
    "format",
    "schema_version",
    "status",
    "sketch",
    "n_records",
    "layer_names",
    C.MODEL_ORIGIN,
)


def _feed(h, ds: h5py.Dataset, stop: int | None = None) -> None:
    """Dataset ``ds``'s path and the bytes of its first ``stop`` rows (all: None), in slices."""
    h.update(ds.name.encode())
    if ds.shape == ():
        h.update(np.asarray(ds[()]).tobytes())
        return
    stop = ds.shape[0] if stop is None else stop
    row = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
    step = max(1, _DIGEST_READ_BYTES // row)
    for lo in range(0, stop, step):
        h.update(np.ascontiguousarray(ds[lo : min(stop, lo + step)]).tobytes())


def content_digest(f: h5py.File) -> str:
    """sha256 over the bytes of every layer's sketches (first ``n_records`` rows), the records
    table and the covariance factors, streamed in slices, in a fixed order (coverage version 1).

    Written as the ``content_sha256`` root attribute when the writer closes; ``traceprop verify``
    recomputes it. Each dataset also carries HDF5's Fletcher-32 checksum per chunk, so a flipped
    byte fails the read itself. :func:`full_content_digest` covers the rest of the store.
    """
    n = int(f.attrs["n_records"])
    h = hashlib.sha256()
    for k in sorted(f[C.G_LAYERS]):
        g = f[f"{C.G_LAYERS}/{k}"]
        for name in (C.L_SKETCH, C.L_U, C.L_V, C.L_SCALE):  # full sketches, or rank-r factors
            if name in g:
                _feed(h, g[name], n)
        for name in (C.L_COV_A, C.L_COV_S):
            if name in g:
                _feed(h, g[name])
    for name in C.RECORD_FIELDS:
        _feed(h, f[f"{C.G_RECORDS}/{name}"], n)
    return h.hexdigest()


def _plain(v):
    """An HDF5 attribute value as JSON (numpy scalars and arrays, bytes)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    return v.item() if hasattr(v, "item") else v


def _attrs_json(obj, names: Sequence[str] | None = None) -> bytes:
    at = obj.attrs
    keys = sorted(at) if names is None else [k for k in names if k in at]
    return json.dumps({k: _plain(at[k]) for k in keys}, sort_keys=True).encode()


def strings_digest(columns: dict[str, Sequence[bytes]]) -> str:
    """sha256 over the example table's UTF-8 string columns (name, then each value's length and
    bytes). Kept as ``/examples`` attribute ``strings_sha256``: HDF5 cannot checksum
    variable-length strings, so the reader checks them against it."""
    h = hashlib.sha256()
    for col in C.EX_STRING_COLUMNS:
        vals = columns.get(col)
        if vals is None:
            continue
        h.update(col.encode() + b"\0")
        h.update(np.array([len(b) for b in vals], dtype="<i8").tobytes())
        h.update(b"".join(vals))
    return h.hexdigest()


def raw_strings(g: h5py.Group) -> dict[str, list[bytes]]:
    """The example table's string columns as stored (UTF-8 bytes)."""
    return {
        col: [b if isinstance(b, bytes) else str(b).encode() for b in g[col][()]]
        for col in C.EX_STRING_COLUMNS
        if col in g
    }


def full_content_digest(f: h5py.File, records_digest: str | None = None) -> str:
    """sha256 over :func:`content_digest` (``records_digest`` when already computed), the
    projection matrices, every layer's attributes, the root attributes a score is read with and
    the whole example table (coverage version 2, the ``content_sha256_v2`` root attribute)."""
    h = hashlib.sha256(b"traceprop content digest v2\0")
    h.update((records_digest or content_digest(f)).encode())
    h.update(_attrs_json(f, _ROOT_ATTRS))
    for k in sorted(f[C.G_LAYERS]):
        g = f[f"{C.G_LAYERS}/{k}"]
        h.update(_attrs_json(g))
        for name in (C.L_P_IN, C.L_P_OUT, C.L_DENSE_INDEX, C.L_DENSE_SIGN, C.L_VOCAB_IDS):
            if name in g:
                _feed(h, g[name])
    if C.G_EXAMPLES in f:
        g = f[C.G_EXAMPLES]
        h.update(_attrs_json(g))
        for name in (C.EX_ROW, C.EX_TOKEN_OFFSETS, C.EX_TOKENS, C.EX_LOSS_MASK):
            if name in g:
                _feed(h, g[name])
        h.update(strings_digest(raw_strings(g)).encode())
    return h.hexdigest()


def records_full_digest(f: h5py.File) -> bool:
    """Whether the writer of ``f`` recorded :func:`full_content_digest` (its projections and
    example table are checksummed too): a store of this kind without the attribute lost it."""
    for k in sorted(f[C.G_LAYERS]):
        g = f[f"{C.G_LAYERS}/{k}"]
        for name in (C.L_P_IN, C.L_P_OUT, C.L_DENSE_INDEX):
            if name in g:
                return bool(g[name].fletcher32)
    g = f.get(C.G_EXAMPLES)
    return g is not None and C.EX_ROW in g and bool(g[C.EX_ROW].fletcher32)


def chunk_rows(record_numel: int, target_bytes: int = 1 << 17) -> int:
    """Rows per HDF5 chunk of a resizable dataset of ``record_numel``-number rows: about
    ``target_bytes`` (128 KiB at 4 bytes a number), at most 4096 rows. HDF5 allocates whole
    chunks, so this also sets how much a short run's file over-allocates."""
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


# the stored element type of each factor dtype (bfloat16 as its raw 16 bits)
FACTOR_STORAGE = {"int8": "i1", "bfloat16": "u2", "float32": "f4"}


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
