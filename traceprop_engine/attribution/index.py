"""FAISS search over preconditioned vectors (inner product; cosine = normalised vectors).

Kinds (all ``METRIC_INNER_PRODUCT``):

- ``flat``: exact ``IndexFlatIP``. The default below :data:`AUTO_FLAT_MAX` vectors.
- ``ivf``: ``IndexIVFFlat`` over the *MIPS-to-L2 transform* (Bachrach et al. 2014): every
  stored vector gets one extra coordinate ``sqrt(M² - ‖x‖²)`` (``M`` = the largest norm, found in
  the sampling pass) and queries get a 0, so all stored vectors lie on one sphere, k-means and
  list probing by L2 are meaningful, and the inner product inside the lists is still exactly
  ``⟨q, x⟩``. Plain IP k-means probes badly when norms vary (measured on 1e5 synthetic sketches:
  recall@10 0.32 vs 0.97 at nprobe=16 of 512). The coarse quantiser is trained on a seeded sample; ``nprobe`` is
  tuned at build time to reach ``target_recall`` (default 0.95) recall@10 against exact search on
  calibration queries (sampled stored vectors, leave-one-out: the query's own row is dropped
  from both answers; half of them negated so opponent searches are covered too). Midpoints of
  pairs were tried first and were too easy (held-out recall 0.90 at a tuned 0.95). The exact answers are accumulated during the add pass, so tuning
  costs no extra pass over the data.
- ``ivfpq``: ``IndexIVFPQ`` for stores larger than memory: compressed codes in RAM, then the
  ``rerank`` top candidates are re-scored exactly from the full vectors, read through a callback
  ``fetch(ids) -> (len(ids), dim)`` (e.g. rows of an HDF5 dataset).
- ``hnsw``: ``IndexHNSWFlat`` (graph; fast queries, slow build — optional).
- ``auto``: flat up to :data:`AUTO_FLAT_MAX` vectors, ivf above.

Sign convention (DESIGN §1): positive score = proponent (up-weighting the example lowers the
test loss); :meth:`VectorIndex.search_both` returns proponents and opponents (most negative).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from traceprop_engine.attribution.index_files import check_files, file_digest
from traceprop_engine.errors import ConfigError, IndexBuildError, IndexStaleError, StoreError
from traceprop_engine.settings import IndexKind, parse_choice

__all__ = [
    "AUTO_FLAT_MAX",
    "INDEX_FILE",
    "INDEX_META_FILE",
    "SearchResult",
    "VectorIndex",
    "build_index",
    "default_nlist",
    "l2_normalize",
]

log = logging.getLogger(__name__)

AUTO_FLAT_MAX = 200_000
"""``auto`` uses exact flat search up to this many vectors. Measured on 2 cores, dim 1024: an
exact single query over 1e5 vectors takes a few tens of ms and grows linearly, so above ~2e5
IVF is needed for interactive latency."""

INDEX_FILE = "index.faiss"
INDEX_META_FILE = "index.json"
_META_FORMAT = "traceprop-index"
_CALIB_QUERIES = 200
_CALIB_K = 10
_MAX_TRAIN_PER_LIST = 64  # faiss k-means samples at most 256 per centroid; 64 is plenty here
NPROBE_SAFETY = 3.0
"""The tuned nprobe is multiplied by this: held-out queries (not stored vectors) measured
0.04-0.05 lower recall@10 than the leave-one-out calibration queries at the same nprobe
(synthetic sketches, 1e4-1e5 x 1024); 2x still gave 0.93 at 1e5, and a probe costs well under
a millisecond."""


def _parse_kind(kind: IndexKind | str) -> IndexKind:
    return parse_choice(IndexKind, kind, "index kind")


def default_nlist(n: int) -> int:
    """IVF list count: ``≈ sqrt(n)`` rounded to a power of two, within [16, 8192].

    Fewer lists than the textbook ``4·sqrt(n)`` keep the k-means training affordable on 2 cores
    at dim 1024 (1024 lists at 1e6 vectors); the query cost is about the same for a fixed
    fraction of the data scanned.
    """
    target = np.sqrt(max(n, 1))
    return int(min(8192, max(16, 2 ** round(np.log2(target)))))


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation (cosine scoring); all-zero rows stay zero. Returns float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def _threads(n: int | None) -> int:
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(n or avail or 1, avail or 1))


@contextlib.contextmanager
def _caller_threads() -> Iterator[None]:
    """Restore the caller's OpenMP/torch thread counts after FAISS set its own.

    FAISS and torch share the OpenMP runtime: ``faiss.omp_set_num_threads`` inside a search
    would otherwise change ``torch.get_num_threads()`` for the rest of the process.
    """
    torch = sys.modules.get("torch")  # only restore torch's setting when the caller uses torch
    prev_omp = faiss.omp_get_max_threads()
    prev_torch = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        faiss.omp_set_num_threads(prev_omp)
        if torch is not None and torch.get_num_threads() != prev_torch:
            torch.set_num_threads(prev_torch)


def _keeps_caller_threads(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _caller_threads():
            return fn(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class SearchResult:
    """Top-k proponents (highest scores) and opponents (most negative scores)."""

    proponent_scores: np.ndarray  # (q, k), descending
    proponent_ids: np.ndarray  # (q, k) int64, -1 where fewer than k were found
    opponent_scores: np.ndarray  # (q, k), ascending (most negative first)
    opponent_ids: np.ndarray


class VectorIndex:
    """A built or loaded index. Use :func:`build_index` or :meth:`load` to get one."""

    def __init__(
        self,
        index: faiss.Index,
        kind: IndexKind,
        dim: int,
        *,
        normalize: bool,
        nprobe: int | None = None,
        ef_search: int | None = None,
        rerank: int = 0,
        fetch: Callable[[np.ndarray], np.ndarray] | None = None,
        threads: int | None = None,
        tuned_recall: float | None = None,
        extra_dims: int = 0,
    ):
        self.index = index
        # stored vectors carry the MIPS-to-L2 coordinate (+ zero padding for PQ), queries zeros
        self.extra_dims = extra_dims
        self.kind = kind
        self.dim = dim
        self.normalize = normalize
        self.rerank = rerank
        self.fetch = fetch
        self.threads = _threads(threads)
        self.tuned_recall = tuned_recall
        self.nprobe = nprobe
        self.ef_search = ef_search
        self._apply_params()

    @property
    def n(self) -> int:
        return int(self.index.ntotal)

    def _apply_params(self) -> None:
        ivf = _ivf_of(self.index)
        if ivf is not None and self.nprobe is not None:
            ivf.nprobe = int(min(self.nprobe, ivf.nlist))
            # parallelise a single query over its probed lists instead of over queries
            ivf.parallel_mode = 1
        if self.kind is IndexKind.HNSW and self.ef_search is not None:
            self.index.hnsw.efSearch = int(self.ef_search)

    def set_nprobe(self, nprobe: int) -> None:
        """Change the number of IVF lists probed per query (recall vs. latency)."""
        if _ivf_of(self.index) is None:
            raise ConfigError(f"nprobe applies to ivf/ivfpq indexes, this one is {self.kind.value}")
        if nprobe < 1:
            raise ConfigError(f"nprobe must be >= 1, got {nprobe}")
        self.nprobe = int(min(nprobe, _ivf_of(self.index).nlist))
        self._apply_params()

    def _prep(self, queries: np.ndarray) -> np.ndarray:
        q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if q.shape[1] != self.dim:
            raise ConfigError(
                f"query vectors have dimension {q.shape[1]}, the index has {self.dim}; the query "
                "was preconditioned with another layer set or k — use the run's preconditioner"
            )
        if self.normalize:
            q = l2_normalize(q)
        if self.extra_dims:
            q = np.hstack([q, np.zeros((q.shape[0], self.extra_dims), dtype=np.float32)])
        return q

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product (cosine if the index normalises).

        Args:
            queries: (q, dim) or (dim,) preconditioned query vectors.
            k: results per query.

        Returns:
            ``(scores, ids)``, both (q, k), scores descending; ids are row numbers in the order
            the vectors were added, -1 (score -inf) where fewer than k exist.
        """
        q = self._prep(queries)
        return self._search_prepped(q, k)

    @_keeps_caller_threads
    def _search_prepped(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        faiss.omp_set_num_threads(self.threads)
        k_eff = min(k, max(self.n, 1))
        k_search = k_eff
        if self.kind is IndexKind.IVFPQ and self.fetch is not None:
            k_search = min(max(self.rerank, k_eff), self.n)
        try:
            scores, ids = self.index.search(q, k_search)
        except RuntimeError as e:
            raise StoreError(f"FAISS search failed: {e}; rebuild the index") from e
        if k_search != k_eff:
            scores, ids = self._rerank(q, ids, k_eff)
        if k_eff < k:  # fewer vectors than k: pad
            pad = k - k_eff
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        scores = np.where(ids < 0, -np.inf, scores).astype(np.float32)
        return scores, ids.astype(np.int64)

    def _rerank(self, q: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        out_s = np.full((q.shape[0], k), -np.inf, dtype=np.float32)
        out_i = np.full((q.shape[0], k), -1, dtype=np.int64)
        for r in range(q.shape[0]):
            ids = cand[r][cand[r] >= 0]
            if ids.size == 0:
                continue
            order = np.argsort(ids)  # sorted reads are friendlier to HDF5
            vecs = np.asarray(self.fetch(ids[order]), dtype=np.float32)
            if self.normalize:
                vecs = l2_normalize(vecs)
            exact = vecs @ q[r, : self.dim]
            top = np.argsort(-exact, kind="stable")[:k]
            out_s[r, : top.size] = exact[top]
            out_i[r, : top.size] = ids[order][top]
        return out_s, out_i

    def search_both(self, queries: np.ndarray, k: int) -> SearchResult:
        """Top-k proponents and the k most negative (opponents), via the negated query."""
        q = self._prep(queries)
        ps, pi = self._search_prepped(q, k)
        ns, ni = self._search_prepped(-q, k)
        return SearchResult(ps, pi, np.where(ni < 0, np.inf, -ns).astype(np.float32), ni)

    def tune_nprobe(
        self,
        queries: np.ndarray,
        exact_ids: np.ndarray,
        target_recall: float = 0.95,
        exclude: np.ndarray | None = None,
    ) -> tuple[int, float]:
        """Smallest nprobe whose recall@k on ``queries`` reaches ``target_recall``.

        Args:
            queries: (q, dim) calibration queries.
            exact_ids: (q, k) exact top-k ids of those queries (or top-(k+1) with ``exclude``).
            target_recall: mean recall@k to reach.
            exclude: (q,) one id per query dropped from both answers (leave-one-out queries
                taken from the indexed vectors).

        Returns:
            ``(nprobe, recall)``; the index is left set to that nprobe.
        """
        ivf = _ivf_of(self.index)
        if ivf is None:
            raise ConfigError(f"nprobe applies to ivf/ivfpq indexes, this one is {self.kind.value}")
        q = self._prep(queries)
        k_search = exact_ids.shape[1]
        k = k_search - (exclude is not None)
        exact = _drop(exact_ids, exclude, k)

        def recall_at(p: int) -> float:
            self.set_nprobe(p)
            return _recall(_drop(self._search_prepped(q, k_search)[1], exclude, k), exact)

        # double until the target is reached, then bisect between the last two powers of two
        lo, hi = 0, 1
        rec_hi = recall_at(hi)
        while rec_hi < target_recall and hi < ivf.nlist:
            lo, hi = hi, min(hi * 2, ivf.nlist)
            rec_hi = recall_at(hi)
        while hi - lo > 1 and rec_hi >= target_recall:
            mid = (lo + hi) // 2
            rec_mid = recall_at(mid)
            if rec_mid >= target_recall:
                hi, rec_hi = mid, rec_mid
            else:
                lo = mid
        self.set_nprobe(hi)
        self.tuned_recall = rec_hi
        return hi, rec_hi

    # ---------------------------------------------------------------- persistence
    def save(self, directory: str | Path, fingerprint: str, files: Iterable[str] = ()) -> None:
        """Write ``index.faiss`` and then ``index.json`` into ``directory`` (created if missing).

        Args:
            directory: target folder (the run's index folder, or the temporary folder it is
                built in; see :func:`~traceprop_engine.attribution.index_files.publish_dir`).
            fingerprint: identifies the store contents the vectors came from (and the
                preconditioner); :meth:`load` refuses another one.
            files: other files of ``directory`` that belong to the index (already written);
                their sizes and digests are recorded and :meth:`load` checks them.
        """
        d = Path(directory)
        meta = {
            "format": _META_FORMAT,
            "kind": self.kind.value,
            "dim": self.dim,
            "n": self.n,
            "normalize": self.normalize,
            "fingerprint": fingerprint,
            "faiss_version": faiss.__version__,
            "nprobe": self.nprobe,
            "ef_search": self.ef_search,
            "rerank": self.rerank,
            "tuned_recall": self.tuned_recall,
            "extra_dims": self.extra_dims,
            "metric": "inner_product",
        }
        try:
            d.mkdir(parents=True, exist_ok=True)
            faiss.write_index(self.index, str(d / INDEX_FILE))
            # index.json is written last, and holds the size and digest of every file of the
            # index: an index whose files were cut short or overwritten is never used
            meta["files"] = {name: file_digest(d / name) for name in (*files, INDEX_FILE)}
            tmp = d / f".{INDEX_META_FILE}.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(meta, indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / INDEX_META_FILE)
        except (OSError, RuntimeError) as e:
            raise IndexBuildError(
                f"cannot write the index to {d}: {e}; check the path and disk space"
            ) from e

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expected_fingerprint: str | None,
        *,
        fetch: Callable[[np.ndarray], np.ndarray] | None = None,
        threads: int | None = None,
    ) -> VectorIndex:
        """Read an index written by :meth:`save`.

        Args:
            directory: folder holding ``index.faiss`` and ``index.json``.
            expected_fingerprint: the current store's fingerprint; None skips the check.
            fetch: full-vector reader for ivfpq re-ranking (not persisted).
            threads: FAISS threads (default: all available cores).

        Raises:
            StoreError: missing, unreadable or damaged files (a size or digest that differs
                from the one recorded at build time).
            IndexStaleError: the index was built from another store/preconditioner.
        """
        d = Path(directory)
        meta_path, index_path = d / INDEX_META_FILE, d / INDEX_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise StoreError(
                f"no readable index at {d} ({e}); build it with `traceprop index RUN`"
            ) from e
        if meta.get("format") != _META_FORMAT:
            raise StoreError(f"{meta_path} is not a Traceprop index description; rebuild it")
        if expected_fingerprint is not None and meta.get("fingerprint") != expected_fingerprint:
            raise IndexStaleError(
                f"the index in {d} was built from store fingerprint {meta.get('fingerprint')!r}, "
                f"the store is now {expected_fingerprint!r}; rebuild it with "
                "`traceprop index RUN --rebuild` (or let the caller rebuild it automatically)"
            )
        check_files(d, meta, required=INDEX_FILE)
        if meta.get("faiss_version") != faiss.__version__:
            log.warning(
                "index %s was written by faiss %s, running %s",
                d,
                meta.get("faiss_version"),
                faiss.__version__,
            )
        try:
            index = faiss.read_index(str(index_path))
        except RuntimeError as e:
            raise StoreError(
                f"cannot read {index_path}: {e}; rebuild it with `traceprop index RUN --rebuild`"
            ) from e
        extra = int(meta.get("extra_dims", 0))
        if index.d != meta["dim"] + extra or index.ntotal != meta["n"]:
            raise StoreError(f"{index_path} does not match {meta_path}; rebuild the index")
        return cls(
            index,
            IndexKind(meta["kind"]),
            meta["dim"],
            normalize=meta["normalize"],
            nprobe=meta.get("nprobe"),
            ef_search=meta.get("ef_search"),
            rerank=meta.get("rerank", 0),
            fetch=fetch,
            threads=threads,
            tuned_recall=meta.get("tuned_recall"),
            extra_dims=extra,
        )


def _ivf_of(index: faiss.Index):
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def _drop(ids: np.ndarray, exclude: np.ndarray | None, k: int) -> np.ndarray:
    if exclude is None:
        return ids[:, :k]
    return np.stack([row[row != ex][:k] for row, ex in zip(ids, exclude, strict=True)])


def _recall(got: np.ndarray, exact: np.ndarray) -> float:
    hits = [
        len(set(g[g >= 0]) & set(e[e >= 0])) / max(1, (e >= 0).sum())
        for g, e in zip(got, exact, strict=True)
    ]
    return float(np.mean(hits))


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


@_keeps_caller_threads
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
    nprobe_safety: float = NPROBE_SAFETY,
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
        target_recall: recall@10 the tuned nprobe must reach on calibration queries.
        nprobe_safety: factor applied to the tuned nprobe (see :data:`NPROBE_SAFETY`).
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
    kind = _parse_kind(kind)
    if n_total < 1 or dim < 1:
        raise ConfigError(f"cannot build an index of {n_total} vectors of dimension {dim}")
    if kind is IndexKind.AUTO:
        kind = IndexKind.FLAT if n_total <= AUTO_FLAT_MAX else IndexKind.IVF
    if not 0 < target_recall <= 1:
        raise ConfigError(f"target_recall must be in (0, 1], got {target_recall}")
    n_threads = _threads(threads)
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
        chosen, rec = vi.tune_nprobe(calib.top.q, calib.top.ids, target_recall, exclude=calib.rows)
        vi.set_nprobe(int(np.ceil(chosen * nprobe_safety)))
        log.info(
            "nprobe=%d reaches recall@%d=%.3f on %d calibration queries; using %d",
            chosen,
            _CALIB_K,
            rec,
            calib.top.q.shape[0],
            vi.nprobe,
        )
    return vi


@dataclass
class _Calibration:
    """Leave-one-out calibration queries for the nprobe tuning: their running exact top-k and
    the stored row each was taken from (dropped from both answers)."""

    top: _RunningTopK
    rows: np.ndarray


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
    sample, rows, max_norm = _sample_rows(chunks, n_total, n_train, rng)
    log.info("training %s (nlist=%d) on %d vectors", kind.value, nl, sample.shape[0])
    index.cp.seed = seed
    if hasattr(index, "pq"):
        index.pq.cp.seed = seed
    try:
        index.train(_augment(sample, max_norm, index.d - sample.shape[1]))
    except RuntimeError as e:
        raise StoreError(f"FAISS training failed: {e}") from e
    if nprobe is not None:
        return max_norm, None
    pick = rng.choice(sample.shape[0], size=min(_CALIB_QUERIES, len(rows)), replace=False)
    calib_q = sample[pick].copy()
    calib_q[len(pick) // 2 :] *= -1  # opponent searches
    return max_norm, _Calibration(_RunningTopK(calib_q, _CALIB_K + 1), rows[pick])


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


def _sample_rows(
    chunks: Callable[[], Iterator[np.ndarray]],
    n_total: int,
    n_sample: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, float]:
    """A seeded row sample, its row ids and the largest vector norm, in one pass."""
    rows = np.sort(rng.choice(n_total, size=n_sample, replace=False))
    out = np.empty((n_sample, 0), dtype=np.float32)
    parts, offset, max_norm = [], 0, 0.0
    for chunk in chunks():
        max_norm = max(max_norm, float(np.sqrt(np.max(np.einsum("ij,ij->i", chunk, chunk)))))
        lo, hi = np.searchsorted(rows, [offset, offset + chunk.shape[0]])
        if hi > lo:
            parts.append(chunk[rows[lo:hi] - offset].copy())
        offset += chunk.shape[0]
    if parts:
        out = np.concatenate(parts)
    if out.shape[0] != n_sample:
        raise StoreError(
            f"the vector source yielded {offset} vectors, {n_total} were announced; "
            "rebuild the index from a consistent store"
        )
    return out, rows, max_norm


def _augment(x: np.ndarray, max_norm: float, extra: int) -> np.ndarray:
    """MIPS-to-L2: append ``sqrt(M² - ‖x‖²)`` so every row has norm ``M`` (+ zero padding)."""
    out = np.zeros((x.shape[0], x.shape[1] + extra), dtype=np.float32)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1]] = np.sqrt(np.maximum(max_norm**2 - np.einsum("ij,ij->i", x, x), 0.0))
    return out
