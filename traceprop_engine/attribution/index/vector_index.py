"""FAISS search over preconditioned vectors (inner product; cosine = normalised vectors).

Kinds (all ``METRIC_INNER_PRODUCT``):

- ``flat``: exact ``IndexFlatIP``. The default below
  :data:`~traceprop_engine.attribution.index.build.AUTO_FLAT_MAX` vectors.
- ``ivf``: ``IndexIVFFlat`` over the *MIPS-to-L2 transform* (Bachrach et al. 2014): every
  stored vector gets one extra coordinate ``sqrt(M² - ‖x‖²)`` (``M`` = the largest norm, found in
  the sampling pass) and queries get a 0, so all stored vectors lie on one sphere, k-means and
  list probing by L2 are meaningful, and the inner product inside the lists is still exactly
  ``⟨q, x⟩``. Plain IP k-means probes badly when norms vary (measured on 1e5 synthetic sketches:
  recall@10 0.32 vs 0.97 at nprobe=16 of 512). The coarse quantiser is trained on a seeded
  sample; ``nprobe`` is tuned at build time so that recall@10 against exact search reaches
  ``target_recall`` (default 0.95) plus a margin (``build.calibration_target``; less with factor
  lists, ``lists.LISTS_RECALL_MARGIN``) on calibration queries: stored vectors left out of the
  k-means sample, leave-one-out (the query's own row is dropped from both answers), half of them
  negated so opponent searches are covered too, and each half must reach it (their recall
  tracks held-out queries' within 0.02). The exact answers are accumulated during the add pass:
  tuning costs no extra pass over the data.
- ``ivfpq``: ``IndexIVFPQ`` for stores larger than memory: compressed codes in RAM, then the
  ``rerank`` top candidates are re-scored exactly from the full vectors, read through a callback
  ``fetch(ids) -> (len(ids), dim)`` (e.g. rows of an HDF5 dataset).
- ``hnsw``: ``IndexHNSWFlat`` (graph; fast queries, slow build — optional).
- ``auto``: flat up to :data:`~.build.AUTO_FLAT_MAX` vectors, ivf above.

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

from traceprop_engine.attribution.index.files import check_files, file_digest
from traceprop_engine.errors import ConfigError, IndexBuildError, IndexStaleError, StoreError
from traceprop_engine.settings import IndexKind

__all__ = [
    "INDEX_FILE",
    "INDEX_META_FILE",
    "SearchResult",
    "VectorIndex",
    "l2_normalize",
]

log = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
INDEX_META_FILE = "index.json"
_META_FORMAT = "traceprop-index"


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation (cosine scoring); all-zero rows stay zero. Returns float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def faiss_threads(n: int | None) -> int:
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


def keeps_caller_threads(fn):
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

    @classmethod
    def of_ends(cls, ps, pi, ns, ni) -> SearchResult:
        """From a search of ``q`` (``ps``, ``pi``) and one of ``-q`` (``ns``, ``ni``)."""
        return cls(ps, pi, np.where(ni < 0, np.inf, -ns).astype(np.float32), ni)


class VectorIndex:
    """A built or loaded index. Use :func:`~traceprop_engine.attribution.index.build.build_index` or
    :meth:`load` to get one."""

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
        self.threads = faiss_threads(threads)
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

    @keeps_caller_threads
    def _search_prepped(
        self, q: np.ndarray, k: int, threads: int | None = None, params=None
    ) -> tuple[np.ndarray, np.ndarray]:
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        faiss.omp_set_num_threads(threads or self.threads)
        k_eff = min(k, max(self.n, 1))
        k_search = k_eff
        if self.kind is IndexKind.IVFPQ and self.fetch is not None:
            k_search = min(max(self.rerank, k_eff), self.n)
        try:
            scores, ids = self.index.search(q, k_search, params=params)
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
        if self._flat_both_applies(k):
            return self._flat_both(q, k)
        # both ends in one call (10⁶ rows, nprobe 59, k 1000, 2 threads: 7.4 ms, two calls 8.3)
        s, i = self._search_prepped(np.concatenate([q, -q]), k)
        return SearchResult.of_ends(s[: len(q)], i[: len(q)], s[len(q) :], i[len(q) :])

    def search_ends(
        self, queries: np.ndarray, k: int
    ) -> tuple[list[Callable[[], tuple]], Callable[[list], SearchResult]]:
        """:meth:`search_both` of one query as jobs to run side by side (``score/two_hands.py``):
        ``(jobs, join)``, the two ends one job each on one FAISS thread (the query's other jobs
        hold the other cores), and ``join(their results)`` the :class:`SearchResult`. A flat
        index is one job (both ends from one pass over its vectors)."""
        if len(queries) != 1 or self._flat_both_applies(k):
            return [lambda: self.search_both(queries, k)], lambda got: got[0]
        q = self._prep(queries)
        jobs = [lambda sign=sign: self._search_prepped(sign * q, k, threads=1) for sign in (1, -1)]

        return jobs, lambda got: SearchResult.of_ends(*got[0], *got[1])

    def search_among(
        self, queries: np.ndarray, k: int, among: np.ndarray, sign: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top ``k`` of ``sign`` × score over the rows where ``among`` ((n,) bool) holds:
        ``(sign × scores, ids)``, (q, k) each, as :meth:`search` (one FAISS thread). FAISS skips
        the other rows through an ID selector (flat indexes: a masked pass over the vectors)."""
        among = np.asarray(among, bool)
        if among.shape != (self.n,):
            raise ValueError(f"among has shape {among.shape}, the index holds {self.n} rows")
        q = sign * self._prep(queries)
        if self.kind is IndexKind.FLAT and not self.extra_dims:
            n, d = self.n, self.index.d
            xb = faiss.rev_swig_ptr(self.index.get_xb(), n * d).reshape(n, d)  # no copy
            rows = np.flatnonzero(among)
            k_eff = min(k, len(rows))
            scores = np.full((len(q), k), -np.inf, np.float32)
            ids = np.full((len(q), k), -1, np.int64)
            for r in range(len(q)):
                s = (xb @ q[r])[rows]  # one pass over the vectors, no copy of the chosen rows
                top = (
                    np.argpartition(-s, k_eff - 1)[:k_eff]
                    if 0 < k_eff < len(s)
                    else np.arange(k_eff)
                )
                top = top[np.argsort(-s[top], kind="stable")]
                scores[r, :k_eff], ids[r, :k_eff] = s[top], rows[top]
            return scores, ids
        bits = np.packbits(among, bitorder="little")  # alive until the search returns
        sel = faiss.IDSelectorBitmap(self.n, faiss.swig_ptr(bits))
        ivf = _ivf_of(self.index)
        if ivf is not None:
            params = faiss.SearchParametersIVF(sel=sel, nprobe=int(ivf.nprobe))
        elif self.kind is IndexKind.HNSW:
            params = faiss.SearchParametersHNSW(sel=sel, efSearch=int(self.index.hnsw.efSearch))
        else:
            params = faiss.SearchParameters(sel=sel)
        return self._search_prepped(q, k, threads=1, params=params)

    def _flat_both_applies(self, k: int) -> bool:
        """Whether :meth:`_flat_both` answers a search of ``k`` (an exact index of plain vectors)."""
        return self.kind is IndexKind.FLAT and not self.extra_dims and self.n > 0 and k >= 1

    def _flat_both(self, q: np.ndarray, k: int) -> SearchResult:
        """Both ends of an exact (flat) index from one pass over its vectors: FAISS searches
        each end with its own pass and keeps a k-heap per query, which at the re-rank's
        thousands of candidates costs several times the inner products themselves."""
        n, d = self.n, self.index.d
        xb = faiss.rev_swig_ptr(self.index.get_xb(), n * d).reshape(n, d)  # no copy
        k_eff = min(k, n)
        out = [np.full((len(q), k), fill, np.float32) for fill in (-np.inf, np.inf)]
        ids = [np.full((len(q), k), -1, np.int64) for _ in range(2)]
        for r in range(len(q)):
            s = xb @ q[r]
            for side, sign in enumerate((1.0, -1.0)):
                top = np.argpartition(-sign * s, k_eff - 1)[:k_eff] if k_eff < n else np.arange(n)
                top = top[np.argsort(-sign * s[top], kind="stable")]
                out[side][r, :k_eff], ids[side][r, :k_eff] = s[top], top
        return SearchResult(out[0], ids[0], out[1], ids[1])

    # ---------------------------------------------------------------- persistence
    def save(self, directory: str | Path, fingerprint: str, files: Iterable[str] = ()) -> None:
        """Write ``index.faiss`` and then ``index.json`` into ``directory`` (created if missing).

        Args:
            directory: target folder (the run's index folder, or the temporary folder it is
                built in; see :func:`~traceprop_engine.attribution.index.files.publish_dir`).
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
                f"the index in {d} was built from other records or settings (fingerprint "
                f"{meta.get('fingerprint')!r}, the store and settings now give "
                f"{expected_fingerprint!r}); rebuild it with "
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
