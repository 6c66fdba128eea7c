"""Training side: from a run's stored records to preconditioned vectors, one per example.

The vector of example ``i`` is ``Σ_records lr · H^{-1/2} Ŝ_record``: the learning-rate-weighted
sum of its preconditioned records (TracIn along the real trajectory), or one vector per record
with ``per_record``. The preconditioner is fitted here from the store's statistics.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import polars as pl

from ... import constants as C
from ...errors import StoreError
from ...settings import IndexSettings, LayerWeighting, PreconditionerKind, SketchKind
from ...store.format import Covariance
from ..index.projection import fit_index_projection, fit_reduction
from ..overview import usable_preconditioners
from ..score.record_weights import record_weights
from .layer import (
    EkfacMoments,
    LayerStats,
    factor_grams,
    fit_reads,
    left_multiply,
    on_parts,
    record_product,
    stack_matmul,
)
from .preconditioner import Preconditioner

CHUNK = 4096
"""Records read from the store at a time (fitting, vectors, gradient norms)."""


def fit_preconditioner(
    store,
    s: IndexSettings,
    progress: Callable[[int, int], None] | None = None,
    covariances: Sequence[Covariance | None] | None = None,
) -> Preconditioner:
    """Fit from the stored statistics (EK-FAC streams the sketches once for its eigenvalues), or
    per layer from ``covariances`` where given (``IndexSettings.statistics`` final / both:
    :mod:`~traceprop_engine.attribution.model_side.statistics`)."""
    kind = s.preconditioner.fitted  # AUTO: resolved per run by AttributionRun.settings
    fisher = s.weighting is LayerWeighting.FISHER  # AUTO: resolved by AttributionRun.settings
    if kind not in usable_preconditioners(store):
        raise StoreError(
            f"{store.path} has no covariance (trained with --no-covariance, or the run stopped "
            "before it was written): use --preconditioner identity"
        )
    n = max(store.n_records, 1)
    stored = covariances is None  # else final / both: the caller's per layer
    stats = []
    for li, layer in enumerate(store.layers):
        # dense layers have no K-FAC factors: a diagonal (EK-FAC) or isotropic (K-FAC) fit
        dense = SketchKind(layer.sketch) is SketchKind.DENSE
        cov = None if dense else store.covariance(li) if stored else covariances[li]
        moments = None  # K-FAC: for its per-layer trace normalisation; EK-FAC: its eigenvalues
        whitened = kind is not PreconditionerKind.IDENTITY and (fisher or not layer.output_head)
        # fisher leaves factored K-FAC without the normalisation: no pass over the records
        if whitened and (kind is PreconditionerKind.EKFAC or dense or not fisher):
            moments = (
                # max(·, 1): a layer no statistics batch reached has A = S = 0 (fit_layer
                # scores it unwhitened)
                EkfacMoments.from_factors(
                    cov.A / max(cov.n_tokens, 1), cov.S / max(cov.n_tokens, 1)
                )
                if cov
                else EkfacMoments.dense(layer.dim)
            )
            factored = bool(cov and layer.rank)
            read = partial(store.factors, li) if factored else _one(store.sketches, li)
            for done, x in enumerate(fit_reads(read, store.n_records, layer.rank, CHUNK)):
                if factored:
                    moments.update_factors(*x)
                else:
                    moments.update(*x)
                if progress:
                    progress(
                        li * store.n_records + done * CHUNK, len(store.layers) * store.n_records
                    )
        stats.append(
            LayerStats(
                name=layer.name,
                shape=layer.record_shape,
                A=cov.A if cov else None,
                S=cov.S if cov else None,
                n_tokens=int(cov.n_tokens) if cov else 0,
                mean_sq_norm=None if moments is not None else store.sq_norm_sum(li) / n,
                moments=moments,
                output_head=layer.output_head,
            )
        )
    pre = Preconditioner.fit(kind, stats, s.damping, index_side=s.index_side, fisher=fisher)
    if not store.n_records:
        return pre
    # the index projection: the records' principal directions instead of random ones
    pre = fit_index_projection(store, pre) if s.index_side else pre
    # then all layers' principal subspace, once the vectors outnumber their dimensions (below
    # that the (full_dim, index_dims) matrix would cost more bytes than it saves)
    n_rows = store.n_records if s.per_record else len(vector_ids(store, False))
    if s.index_dims and s.index_dims < pre.full_dim < n_rows:
        pre = fit_reduction(store, pre, s.index_dims, s.cosine, partial(_vectors, store, pre))
    return pre


def _one(read, li: int):
    """``read(li, a, b)`` as a one-array tuple (:func:`fit_reads` joins tuples)."""
    return lambda a, b: (read(li, a, b),)


def vector_ids(store, per_record: bool) -> np.ndarray:
    """Row -> example index (per-example vectors: the training examples with records)."""
    rec = store.records()
    if per_record:
        return rec[C.REC_EXAMPLE]
    return np.unique(rec[C.REC_EXAMPLE])


def write_vectors(
    store,
    s: IndexSettings,
    pre: Preconditioner,
    path: Path,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Preconditioned vectors of every example (or record) into the ``.npy`` file ``path``
    (memory-mapped, so a store larger than memory streams through); returns the row ids."""
    rec = store.records()
    ids = vector_ids(store, s.per_record)
    n_rec = store.n_records
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(len(ids), pre.dim))
    _reserve(path)
    mm[:] = 0
    row_of = {int(e): i for i, e in enumerate(ids)} if not s.per_record else None
    weights = record_weights(rec, s.records)
    for start in range(0, n_rec, CHUNK):
        stop = min(start + CHUNK, n_rec)
        vec = _vectors(store, pre, start, stop)
        if s.per_record:
            mm[start:stop] = vec
        else:
            rows = np.fromiter(
                (row_of[int(e)] for e in rec[C.REC_EXAMPLE][start:stop]), np.int64, stop - start
            )
            w = weights[start:stop].astype(np.float32)[:, None]
            np.add.at(mm, rows, vec * w)  # lr-weighted sum over an example's (chosen) records
        if progress:
            progress(stop, n_rec)
    mm.flush()
    return ids


def _vectors(store, pre: Preconditioner, start: int, stop: int) -> np.ndarray:
    """``pre.apply`` of records ``start:stop``; a factor-stored layer is projected through its
    factors, ``L (U Vᵀ) R = (L U)(Rᵀ V)ᵀ``; only EK-FAC's elementwise scale needs that product
    as a matrix (never the stored sketch: the factors are transformed first)."""
    out = np.empty((stop - start, pre.full_dim), np.float32)
    for li, (info, lp) in enumerate(zip(store.layers, pre.layers, strict=True)):
        cols = pre.layer_slices[lp.name]
        if not info.rank:
            out[:, cols] = lp.apply(store.sketches(li, start, stop))
            continue
        u, v = store.factors(li, start, stop)  # (n, k_out, r), (n, k_in, r)
        # the records' parts side by side (on_parts), each through the whole layer
        on_parts(partial(_layer_part, _f32(lp), u, v, out, cols), len(u), info.rank)
    return pre.reduced(out)


def _f32(lp) -> dict:
    """A layer preconditioner's matrices in float32, as :func:`_layer_part` applies them."""
    f = {k: getattr(lp, k) for k in ("left", "scale", "index_left", "index_right")}
    f["right_t"] = None if lp.right is None else lp.right.T
    return {k: None if m is None else np.asarray(m, np.float32) for k, m in f.items()}


def _layer_part(m: dict, u, v, out: np.ndarray, cols, a: int, b: int) -> None:
    """``out[a:b, cols]``: one layer's vectors of records ``a:b`` from their factors."""
    u, v = u[a:b], v[a:b]
    if m["left"] is not None:
        u, v = left_multiply(m["left"], u), left_multiply(m["right_t"], v)
    if m["scale"] is not None:  # EK-FAC: the elementwise scale needs the (L X R) matrix
        x = record_product(u, v) * m["scale"]
        if m["index_left"] is not None:
            x = stack_matmul(m["index_left"], x, m["index_right"].T)
        out[a:b, cols] = x.reshape(len(x), -1)
        return
    if m["index_left"] is not None:
        u, v = left_multiply(m["index_left"], u), left_multiply(m["index_right"], v)
    out[a:b, cols] = record_product(u, v).reshape(len(u), -1)


def gradient_norms(store) -> pl.DataFrame:
    """Mean over an example's records of the raw (unpreconditioned) sketch norm."""
    rec = store.records()
    sq = np.zeros(store.n_records)
    for li, info in enumerate(store.layers):
        for start in range(0, store.n_records, CHUNK):
            if info.rank:  # ‖U Vᵀ‖² = Σ (UᵀU ⊙ VᵀV): no k_out × k_in rebuild
                u, v = store.factors(li, start, start + CHUNK)
                n = (factor_grams(u) * factor_grams(v)).sum(axis=(1, 2))
            else:
                x = store.sketches(li, start, start + CHUNK)
                x = x.reshape(len(x), -1)
                n = np.einsum("ij,ij->i", x, x)
            sq[start : start + len(n)] += n
    df = pl.DataFrame({"example_id": rec[C.REC_EXAMPLE], "gn": np.sqrt(sq)})
    return df.group_by("example_id").agg(pl.col("gn").mean().alias("gradient_norm"))


def _reserve(path: Path) -> None:
    """Allocate a freshly created file's blocks now: on a full disk the write then fails here with
    ENOSPC (an OSError) instead of killing the process with SIGBUS (a Bus error) when a page
    of its memory map is first written."""
    if not hasattr(os, "posix_fallocate"):
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # unsupported: write as before
            raise
    finally:
        os.close(fd)
