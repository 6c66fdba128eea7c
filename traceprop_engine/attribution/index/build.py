"""Building a :class:`~traceprop_engine.attribution.index.vector_index.VectorIndex` by streaming
vectors.

One pass samples the vectors to train the IVF quantiser (and finds the MIPS-to-L2 radius), a
second adds them while accumulating the exact answers of the calibration queries, which then
tune ``nprobe`` (see :mod:`traceprop_engine.attribution.index.vector_index` for the kinds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import faiss
import numpy as np

from traceprop_engine.attribution.index.nprobe import tune_nprobe
from traceprop_engine.attribution.index.vector_index import (
    VectorIndex,
    faiss_threads,
    keeps_caller_threads,
    l2_normalize,
)
from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import IndexKind, parse_choice

__all__ = ["AUTO_FLAT_MAX", "RECALL_MARGIN", "build_index", "calibration_target", "default_nlist"]

log = logging.getLogger(__name__)

AUTO_FLAT_MAX = 200_000
"""``auto`` uses exact flat search up to this many vectors. Measured on 2 cores, dim 1024: an
exact single query over 1e5 vectors takes a few tens of ms and grows linearly, so above ~2e5
IVF is needed for interactive latency."""

_CALIB_QUERIES = 200
_CALIB_K = 10
_MAX_TRAIN_PER_LIST = 64  # faiss k-means samples at most 256 per centroid; 64 is plenty here
RECALL_MARGIN = 0.03
"""nprobe is tuned to ``target_recall`` plus this (see :func:`calibration_target`), on each of
the proponent and opponent halves of the calibration queries. Those queries are stored vectors
left out of the k-means sample, and their recall@10 matches held-out queries' within 0.01-0.02 at
every nprobe (measured on 1e5 and 1e6 vectors of both bench generators, stop 36); 0.03 is about
three standard errors of a 100-query mean. It replaced a ×3 safety factor on nprobe, set when
the calibration queries came from the k-means sample, which probed 41-82 % of the lists of the
fitted 1e5 and 1e6 bench indexes for recall 1.000."""


def calibration_target(target_recall: float, margin: float = RECALL_MARGIN) -> float:
    """The calibration recall nprobe must reach: ``target_recall + margin``, but at most
    60 % of the way from the target to 1 (0.95 calibrates to 0.98, 0.99 to 0.996, not 1.0)."""
    return min(target_recall + margin, target_recall + 0.6 * (1.0 - target_recall))


def default_nlist(n: int) -> int:
    """IVF list count: ``≈ sqrt(n)`` rounded to a power of two, within [16, 8192].

    Fewer lists than the textbook ``4·sqrt(n)`` keep the k-means training affordable on 2 cores
    at dim 1024 (1024 lists at 1e6 vectors); the query cost is about the same for a fixed
    fraction of the data scanned.
    """
    target = np.sqrt(max(n, 1))
    return int(min(8192, max(16, 2 ** round(np.log2(target)))))


class _RunningTopK:
    """Exact top-k of fixed queries, accumulated chunk by chunk (for nprobe calibration)."""

    def __init__(self, queries: np.ndarray, k: int):
        self.q = queries
        self.k = k
        self.scores = np.full((queries.shape[0], 0), -np.inf, dtype=np.float32)
        self.ids = np.zeros((queries.shape[0], 0), dtype=np.int64)

    def update(self, chunk: np.ndarray, offset: int) -> None:
        s = self.q @ chunk.T  # (q, n_chunk)
        ids = np.broadcast_to(np.arange(offset, offset + chunk.shape[0]), s.shape)
        s = np.concatenate([self.scores, s], axis=1)
        ids = np.concatenate([self.ids, ids], axis=1)
        keep = min(self.k, s.shape[1])
        part = np.argpartition(-s, keep - 1, axis=1)[:, :keep]
        self.scores = np.take_along_axis(s, part, 1)
        self.ids = np.take_along_axis(ids, part, 1)


def _chunks(
    source: Callable[[], Iterable[np.ndarray]] | np.ndarray, dim: int, normalize: bool
) -> Iterator[np.ndarray]:
    it = _as_chunks(source) if isinstance(source, np.ndarray) else source()
    for chunk in it:
        c = np.ascontiguousarray(chunk, dtype=np.float32)
        if c.ndim != 2 or c.shape[1] != dim:
            raise StoreError(f"a vector chunk has shape {c.shape}, expected (n, {dim})")
        yield l2_normalize(c) if normalize else c


def _as_chunks(x: np.ndarray, size: int = 65_536) -> Iterator[np.ndarray]:
    for i in range(0, x.shape[0], size):
        yield x[i : i + size]


@keeps_caller_threads
def build_index(
    vectors: Callable[[], Iterable[np.ndarray]] | np.ndarray,
    dim: int,
    n_total: int,
    *,
    kind: IndexKind | str = IndexKind.AUTO,
    normalize: bool = False,
    nlist: int | None = None,
    nprobe: int | None = None,
    target_recall: float = 0.95,
    recall_margin: float = RECALL_MARGIN,
    pq_m: int | None = None,
    rerank: int = 100,
    fetch: Callable[[np.ndarray], np.ndarray] | None = None,
    hnsw_m: int = 32,
    ef_search: int = 128,
    threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    seed: int = 0,
) -> VectorIndex:
    """Build an inner-product index by streaming chunks of vectors.

    Args:
        vectors: a callable returning a *fresh* iterator of (n_chunk, dim) arrays (IVF kinds
            iterate twice: once for the training sample, once to add), or one array.
        dim: vector dimension D.
        n_total: total number of vectors the iterator yields.
        kind: flat, ivf, ivfpq, hnsw or auto (flat up to :data:`AUTO_FLAT_MAX`, then ivf).
        normalize: L2-normalise vectors (and later queries): cosine scoring.
        nlist: IVF lists; default :func:`default_nlist`.
        nprobe: IVF lists probed per query; default: tuned to ``target_recall``.
        target_recall: recall@10 the tuned nprobe is to give; it is calibrated with a margin
            (:func:`calibration_target`), on proponent and opponent searches separately.
        recall_margin: that margin (:data:`RECALL_MARGIN`; an index whose re-rank also takes
            the factor lists' candidates needs less, ``lists.LISTS_RECALL_MARGIN``).
        pq_m: ivfpq sub-quantisers, default dim // 16 (the augmented vectors are zero-padded
            to a multiple of it).
        rerank: ivfpq candidates re-scored exactly with ``fetch``.
        fetch: ``fetch(sorted_ids) -> (len(ids), dim)`` full vectors, for ivfpq re-ranking.
        hnsw_m, ef_search: HNSW graph degree and search breadth.
        threads: FAISS OpenMP threads (default: all available cores).
        progress: called as ``progress(done, n_total)`` after each chunk is added.
        seed: seeds the training sample, k-means and the calibration queries.

    Returns:
        The built :class:`VectorIndex`; ids are row numbers in iteration order.

    Raises:
        ConfigError: bad kind or parameters.
        StoreError: the iterator yields another count or dimension than announced, or FAISS
            fails.
    """
    kind = parse_choice(IndexKind, kind, "index kind")
    if n_total < 1 or dim < 1:
        raise ConfigError(f"cannot build an index of {n_total} vectors of dimension {dim}")
    if kind is IndexKind.AUTO:
        kind = IndexKind.FLAT if n_total <= AUTO_FLAT_MAX else IndexKind.IVF
    if not 0 < target_recall <= 1:
        raise ConfigError(f"target_recall must be in (0, 1], got {target_recall}")
    n_threads = faiss_threads(threads)
    faiss.omp_set_num_threads(n_threads)
    rng = np.random.default_rng(seed)

    index, nl = _make_index(kind, dim, n_total, nlist, pq_m, hnsw_m)
    extra = index.d - dim
    calib: _Calibration | None = None
    max_norm = None
    if nl is not None:
        max_norm, calib = _train_ivf(
            index, kind, nl, lambda: _chunks(vectors, dim, normalize), n_total, rng, seed, nprobe
        )
    _add_all(index, _chunks(vectors, dim, normalize), n_total, max_norm, extra, calib, progress)
    vi = VectorIndex(
        index,
        kind,
        dim,
        normalize=normalize,
        nprobe=nprobe,
        ef_search=ef_search if kind is IndexKind.HNSW else None,
        rerank=rerank if kind is IndexKind.IVFPQ else 0,
        fetch=fetch,
        threads=n_threads,
        extra_dims=extra,
    )
    if calib is not None:
        _tune(vi, calib, target_recall, recall_margin)
    return vi


def _tune(vi: VectorIndex, calib: _Calibration, target_recall: float, margin: float) -> None:
    """Set ``nprobe`` to the smallest one whose calibration recall reaches
    :func:`calibration_target` on both the proponent and the opponent halves."""
    goal = calibration_target(target_recall, margin)
    chosen, rec = tune_nprobe(
        vi, calib.top.q, calib.top.ids, goal, exclude=calib.rows, groups=calib.groups
    )
    log.info(
        "nprobe=%d: recall@%d %.3f (the lower of proponents and opponents; calibrated to %.3f "
        "for a target of %.2f) on %d calibration queries",
        chosen,
        _CALIB_K,
        rec,
        goal,
        target_recall,
        calib.top.q.shape[0],
    )


@dataclass
class _Calibration:
    """Leave-one-out calibration queries for the nprobe tuning: their running exact top-k and
    the stored row each was taken from (dropped from both answers)."""

    top: _RunningTopK
    rows: np.ndarray
    groups: np.ndarray  # 0: a proponent search (the stored vector), 1: an opponent one (negated)


def _train_ivf(
    index: faiss.Index,
    kind: IndexKind,
    nl: int,
    chunks: Callable[[], Iterator[np.ndarray]],
    n_total: int,
    rng: np.random.Generator,
    seed: int,
    nprobe: int | None,
) -> tuple[float, _Calibration | None]:
    """Train the coarse quantiser on a seeded sample; returns the largest vector norm (the
    MIPS-to-L2 radius) and, when nprobe is to be tuned, calibration queries from the sample."""
    n_train = min(n_total, max(nl * _MAX_TRAIN_PER_LIST, 10_000))
    train_rows = np.sort(rng.choice(n_total, size=n_train, replace=False))
    calib_rows = np.zeros(0, dtype=np.int64)
    if nprobe is None:
        calib_rows = _calibration_rows(n_total, train_rows, rng)
    rows = np.union1d(train_rows, calib_rows)
    sample, max_norm = _read_rows(chunks, n_total, rows)
    log.info("training %s (nlist=%d) on %d vectors", kind.value, nl, n_train)
    index.cp.seed = seed
    if hasattr(index, "pq"):
        index.pq.cp.seed = seed
    try:
        train = sample[np.searchsorted(rows, train_rows)]
        index.train(_augment(train, max_norm, index.d - sample.shape[1]))
    except RuntimeError as e:
        raise StoreError(f"FAISS training failed: {e}") from e
    if nprobe is not None:
        return max_norm, None
    calib_q = sample[np.searchsorted(rows, calib_rows)]
    groups = np.zeros(len(calib_rows), dtype=np.int8)
    groups[len(calib_rows) // 2 :] = 1
    calib_q[groups == 1] *= -1  # opponent searches
    return max_norm, _Calibration(_RunningTopK(calib_q, _CALIB_K + 1), calib_rows, groups)


def _calibration_rows(n_total: int, train_rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Rows for the calibration queries, outside the k-means sample when enough are left
    (a vector the centroids were fitted to is an easier query than a new one)."""
    want = min(_CALIB_QUERIES, n_total)
    if n_total - len(train_rows) < want:
        return rng.choice(n_total, size=want, replace=False)
    # the j-th row outside the sorted sample is j plus the sample rows at or before it
    free = rng.choice(n_total - len(train_rows), size=want, replace=False)
    return free + np.searchsorted(train_rows - np.arange(len(train_rows)), free, side="right")


def _add_all(
    index: faiss.Index,
    chunks: Iterator[np.ndarray],
    n_total: int,
    max_norm: float | None,
    extra: int,
    calib: _Calibration | None,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Add every chunk (augmented for IVF), accumulating the calibration queries' exact answers
    in the same pass."""
    done = 0
    for chunk in chunks:
        try:
            index.add(chunk if max_norm is None else _augment(chunk, max_norm, extra))
        except RuntimeError as e:
            raise StoreError(f"FAISS add failed: {e}") from e
        if calib is not None:
            calib.top.update(chunk, done)
        done += chunk.shape[0]
        if progress is not None:
            progress(done, n_total)
    if done != n_total:
        raise StoreError(
            f"the vector source yielded {done} vectors, {n_total} were announced; the store "
            "changed while indexing — rebuild the index"
        )


def _make_index(
    kind: IndexKind, dim: int, n: int, nlist: int | None, pq_m: int | None, hnsw_m: int
) -> tuple[faiss.Index, int | None]:
    ip = faiss.METRIC_INNER_PRODUCT
    if kind is IndexKind.FLAT:
        return faiss.IndexFlatIP(dim), None
    if kind is IndexKind.HNSW:
        return faiss.IndexHNSWFlat(dim, hnsw_m, ip), None
    nl = default_nlist(n) if nlist is None else int(nlist)
    if nl < 1 or nl > n:
        raise ConfigError(f"nlist must be in [1, n_total={n}], got {nl}")
    # L2 coarse quantiser over the augmented vectors; IP inside the lists
    if kind is IndexKind.IVF:
        idx = faiss.IndexIVFFlat(faiss.IndexFlatL2(dim + 1), dim + 1, nl, ip)
    else:
        m = int(pq_m or max(1, dim // 16))
        if m < 1:
            raise ConfigError(f"pq_m must be >= 1, got {pq_m}")
        d_aug = -(-(dim + 1) // m) * m  # dim + 1, zero-padded to a multiple of m
        idx = faiss.IndexIVFPQ(faiss.IndexFlatL2(d_aug), d_aug, nl, m, 8, ip)
    # faiss' python wrapper keeps the quantizer alive as long as `idx` (referenced_objects)
    return idx, nl


def _read_rows(
    chunks: Callable[[], Iterator[np.ndarray]], n_total: int, rows: np.ndarray
) -> tuple[np.ndarray, float]:
    """The vectors of the sorted ``rows`` and the largest vector norm, in one pass."""
    out = np.empty((len(rows), 0), dtype=np.float32)
    parts, offset, max_norm = [], 0, 0.0
    for chunk in chunks():
        max_norm = max(max_norm, float(np.sqrt(np.max(np.einsum("ij,ij->i", chunk, chunk)))))
        lo, hi = np.searchsorted(rows, [offset, offset + chunk.shape[0]])
        if hi > lo:
            parts.append(chunk[rows[lo:hi] - offset].copy())
        offset += chunk.shape[0]
    if parts:
        out = np.concatenate(parts)
    if out.shape[0] != len(rows) or offset != n_total:
        raise StoreError(
            f"the vector source yielded {offset} vectors, {n_total} were announced; "
            "rebuild the index from a consistent store"
        )
    return out, max_norm


def _augment(x: np.ndarray, max_norm: float, extra: int) -> np.ndarray:
    """MIPS-to-L2: append ``sqrt(M² - ‖x‖²)`` so every row has norm ``M`` (+ zero padding)."""
    out = np.zeros((x.shape[0], x.shape[1] + extra), dtype=np.float32)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1]] = np.sqrt(np.maximum(max_norm**2 - np.einsum("ij,ij->i", x, x), 0.0))
    return out
