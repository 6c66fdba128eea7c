"""Query-latency benchmark of the FAISS index on vectors that look like preconditioned sketches.

:func:`run_query_bench` builds each index kind at each size through the product path
(:func:`traceprop_engine.attribution.index.build.build_index`, including nprobe tuning), then times
single queries (batch of 1, like an interactive query) one by one, and measures recall@10 against
the exact answer (streamed numpy brute force) on a subset of the queries.

Vectors come from a low-rank-plus-noise generator (:class:`SketchGenerator`): fitted to real
preconditioned sketches when ``base_vectors`` is given (mean + top-r PCA + per-dimension
residual variance), otherwise a documented synthetic fallback. Data is generated in seeded
chunks, so it is never held twice: each pass over the data regenerates it.
"""

from __future__ import annotations

import logging
import os
import resource
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from ..attribution.index.build import build_index
from ..errors import ConfigError
from ..settings import INDEX_DIMS, IndexKind

__all__ = ["ReducedGenerator", "SketchGenerator", "run_base_vectors", "run_query_bench"]

log = logging.getLogger(__name__)

_CHUNK = 50_000
_RECALL_QUERIES = 100
_K = 10


@dataclass(frozen=True, eq=False)
class SketchGenerator:
    """``x = mean + (z · s) @ basis + sqrt(resid_var) · ε`` with ``z, ε`` standard normal,
    optionally times a per-vector log-normal norm factor and plus a cluster centre."""

    mean: np.ndarray  # (dim,)
    basis: np.ndarray  # (r, dim) orthonormal rows
    s: np.ndarray  # (r,) standard deviations along the basis
    resid_std: np.ndarray  # (dim,)
    centers: np.ndarray | None = None  # (c, dim) cluster centres (synthetic fallback)
    norm_sigma: float = 0.0  # log-normal spread of vector norms (synthetic fallback)

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    @classmethod
    def fit(
        cls, base: np.ndarray, rank: int = 64, max_rows: int = 20_000, seed: int = 0
    ) -> SketchGenerator:
        """Fit mean, top-``rank`` principal directions and residual variance to real vectors."""
        x = np.asarray(base, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < 2:
            raise ConfigError(f"base_vectors must be (n >= 2, dim), got shape {x.shape}")
        if x.shape[0] > max_rows:
            x = x[np.random.default_rng(seed).choice(x.shape[0], max_rows, replace=False)]
        mean = x.mean(axis=0)
        xc = x - mean
        r = int(min(rank, x.shape[0] - 1, x.shape[1]))
        _, sv, vt = np.linalg.svd(xc, full_matrices=False)
        basis, s = vt[:r], sv[:r] / np.sqrt(x.shape[0] - 1)
        resid = xc - (xc @ basis.T) @ basis
        resid_std = np.sqrt(np.maximum(resid.var(axis=0, ddof=1), 0.0))
        return cls(mean, basis, s, resid_std)

    @classmethod
    def synthetic(
        cls,
        dim: int,
        seed: int = 0,
        rank: int = 64,
        n_clusters: int = 256,
        noise: float = 0.05,
        norm_sigma: float = 0.5,
    ) -> SketchGenerator:
        """Fallback without real sketches.

        Power-law spectrum ``s_j ∝ (j+1)^-1`` in a random ``rank``-dim subspace (gradients are
        dominated by few directions), ``n_clusters`` cluster centres drawn from the same
        spectrum (examples of one template/topic share a direction), isotropic noise carrying
        ``noise`` of the low-rank energy, zero mean, and log-normal per-vector norms (per-example
        gradient norms spread over orders of magnitude).
        """
        rng = np.random.default_rng(seed)
        basis = np.linalg.qr(rng.normal(size=(dim, rank)))[0].T  # (rank, dim)
        s = 1.0 / (np.arange(rank) + 1.0)
        centers = (rng.normal(size=(n_clusters, rank)) * s) @ basis * 1.5
        resid = np.full(dim, np.sqrt(noise * np.sum(s**2) / dim))
        return cls(np.zeros(dim), basis, s, resid, centers, norm_sigma)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """(n, dim) float32 vectors."""
        z = rng.standard_normal((n, self.s.shape[0]), dtype=np.float32) * self.s.astype(np.float32)
        x = z @ self.basis.astype(np.float32)
        x += rng.standard_normal((n, self.dim), dtype=np.float32) * self.resid_std.astype(
            np.float32
        )
        x += self.mean.astype(np.float32)
        if self.centers is not None:
            x += self.centers[rng.integers(0, self.centers.shape[0], size=n)].astype(np.float32)
        if self.norm_sigma > 0:
            x *= np.exp(self.norm_sigma * rng.standard_normal((n, 1), dtype=np.float32))
        return x


@dataclass(frozen=True, eq=False)
class ReducedGenerator:
    """Another generator's vectors projected on ``basis`` (``(dim, d)`` orthonormal columns): the
    index's reduction to its top ``IndexSettings.index_dims`` principal directions, which every
    run with more examples than its vectors have dimensions gets (``precondition/vectors.py``),
    so the bench indexes the vectors such a run's FAISS index holds."""

    inner: SketchGenerator
    basis: np.ndarray

    @classmethod
    def fit(cls, gen: SketchGenerator, dims: int, seed: int) -> ReducedGenerator:
        from ..attribution.index.projection import REDUCE_SAMPLE, principal_basis

        x = gen.sample(REDUCE_SAMPLE, np.random.default_rng([seed, 777_777]))
        return cls(gen, principal_basis(x, dims, seed=seed))

    @property
    def dim(self) -> int:
        return int(self.basis.shape[1])

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.ascontiguousarray(self.inner.sample(n, rng) @ self.basis)


def _data(gen: SketchGenerator, n: int, seed: int) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        for c, start in enumerate(range(0, n, _CHUNK)):
            rng = np.random.default_rng([seed, c])  # same chunk on every pass
            yield gen.sample(min(_CHUNK, n - start), rng)

    return chunks


def _exact_topk(chunks: Callable[[], Iterator[np.ndarray]], q: np.ndarray, k: int) -> np.ndarray:
    best_s = np.full((q.shape[0], 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((q.shape[0], 0), dtype=np.int64)
    off = 0
    for c in chunks():
        s = np.concatenate([best_s, q @ c.T], axis=1)
        ids = np.concatenate(
            [best_i, np.broadcast_to(np.arange(off, off + len(c)), (len(q), len(c)))], axis=1
        )
        part = np.argpartition(-s, k - 1, axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(s, part, 1), np.take_along_axis(ids, part, 1)
        off += len(c)
    return best_i


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _spill(chunks: Callable[[], Iterator[np.ndarray]], n: int, dim: int) -> str:
    """Write the vectors to a temporary ``.npy`` file; returns its path (the caller unlinks it)."""
    fd, spill = tempfile.mkstemp(suffix=".npy", prefix="traceprop-bench-")
    os.close(fd)
    mm = np.lib.format.open_memmap(spill, mode="w+", dtype=np.float32, shape=(n, dim))
    pos = 0
    for c in chunks():
        mm[pos : pos + len(c)] = c
        pos += len(c)
    mm.flush()
    del mm
    return spill


def _latencies(idx, queries: np.ndarray) -> np.ndarray:
    """Seconds of each single query (batch of 1, like an interactive query), after a warm-up."""
    idx.search(queries[:5], _K)  # warm-up
    lat = np.empty(len(queries))
    for i in range(len(queries)):
        q = queries[i : i + 1]
        t = time.perf_counter()
        idx.search(q, _K)
        lat[i] = time.perf_counter() - t
    return lat


def _measure(
    chunks: Callable[[], Iterator[np.ndarray]],
    n: int,
    dim: int,
    kind: IndexKind,
    queries: np.ndarray,
    exact: np.ndarray,
    *,
    generator: str,
    seed: int,
    nlist: int | None,
    target_recall: float,
    threads: int | None,
) -> dict:
    """Build one index over ``n`` vectors, time its queries and measure recall@10 against
    ``exact`` (the true top 10 of the first ``len(exact)`` queries)."""
    fetch, spill = None, None
    if kind is IndexKind.IVFPQ:
        # compressed codes in RAM, exact re-rank from the full vectors on disk, as a run
        # does with its memory-mapped vectors.npy
        spill = _spill(chunks, n, dim)
        disk = np.load(spill, mmap_mode="r")

        def fetch(rows, disk=disk):
            return np.asarray(disk[rows])

    try:
        t0 = time.perf_counter()
        idx = build_index(
            chunks,
            dim,
            n,
            kind=kind,
            seed=seed,
            nlist=nlist,
            target_recall=target_recall,
            threads=threads,
            fetch=fetch,
        )
        build_s = time.perf_counter() - t0
        lat = _latencies(idx, queries)
        _, got = idx.search(queries[: len(exact)], _K)
        recall = float(
            np.mean([len(set(a) & set(b)) / _K for a, b in zip(got, exact, strict=True)])
        )
        row = {
            "n": n,
            "dim": dim,
            "kind": kind.value,
            "build_s": round(build_s, 3),
            "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
            "recall_at_10": round(recall, 4),
            "peak_rss_mb": round(_peak_rss_mb(), 1),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            "nlist": getattr(_ivf(idx), "nlist", None),
            "nprobe": idx.nprobe,
            "threads": idx.threads,
            "n_queries": len(queries),
            "generator": generator,
        }
        if kind is IndexKind.IVFPQ:
            row["rerank"] = idx.rerank
        del idx
        return row
    finally:
        if spill is not None:
            os.unlink(spill)


def run_query_bench(
    sizes: Sequence[int] = (10_000, 100_000, 1_000_000),
    dim: int = 1024,
    n_queries: int = 200,
    kinds: Sequence[IndexKind | str] = (IndexKind.FLAT, IndexKind.IVF),
    seed: int = 0,
    base_vectors: np.ndarray | None = None,
    *,
    target_recall: float = 0.95,
    nlist: int | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    index_dims: int = INDEX_DIMS,
) -> list[dict]:
    """Build each kind at each size and time single queries.

    Args:
        sizes: numbers of indexed vectors.
        dim: vector dimension (ignored when ``base_vectors`` is given: its width is used).
        n_queries: held-out queries timed one at a time.
        kinds: index kinds to measure (``ivfpq`` re-ranks its candidates exactly from the full
            vectors spilled to a memory-mapped file, as a run reads its ``vectors.npy``).
        seed: seeds the generator, the data and the queries.
        base_vectors: real preconditioned sketches (n, dim) to fit the generator to.
        target_recall: recall the IVF nprobe is tuned to at build time.
        nlist: IVF lists (default: the index module's rule).
        threads: FAISS threads (default: all available cores).
        progress: called with a one-line status before each measurement.
        index_dims: reduce the generated vectors to their top this many principal directions
            when they are wider (what the index of a run of that size holds:
            ``IndexSettings.index_dims``); 0 indexes them at full width.

    Returns:
        One dict per (size, kind): ``n, dim, kind, build_s, p50_ms, p99_ms, recall_at_10``
        (vs. exact search, on ``min(100, n_queries)`` queries), ``peak_rss_mb`` (process peak so
        far, monotone), ``rss_mb`` (resident after the measurement), ``nlist``, ``nprobe``,
        ``generator`` ("fitted" or "synthetic", plus ", reduced to D" when reduced).
    """
    if base_vectors is not None:
        gen = SketchGenerator.fit(base_vectors, seed=seed)
        gen_name = "fitted"
    else:
        gen = SketchGenerator.synthetic(dim, seed=seed)
        gen_name = "synthetic"
    if index_dims and gen.dim > index_dims:
        gen = ReducedGenerator.fit(gen, index_dims, seed)
        gen_name += f", reduced to {gen.dim}"
    dim = gen.dim
    queries = gen.sample(n_queries, np.random.default_rng([seed, 999_999]))  # held out
    rows: list[dict] = []
    for n in sizes:
        chunks = _data(gen, int(n), seed)
        exact = _exact_topk(chunks, queries[: min(_RECALL_QUERIES, n_queries)], _K)
        for kind in kinds:
            kind = IndexKind(kind)
            if progress:
                progress(f"building {kind.value} over {n} x {dim}")
            row = _measure(
                chunks,
                int(n),
                dim,
                kind,
                queries,
                exact,
                generator=gen_name,
                seed=seed,
                nlist=nlist,
                target_recall=target_recall,
                threads=threads,
            )
            log.info("query bench: %s", row)
            rows.append(row)
    return rows


def run_base_vectors(run_dir: str | os.PathLike) -> np.ndarray | None:
    """The default index's preconditioned vectors of the run in ``run_dir`` (built if missing),
    to fit the generator to; ``None`` when there is no such directory."""
    if not Path(run_dir).exists():
        return None
    from ..attribution import open_run
    from ..attribution.index.run_indexes import VECTORS_FILE

    run = open_run(run_dir)
    run.index()
    return np.load(run.index_dir() / VECTORS_FILE)


def _ivf(idx):
    import faiss

    try:
        return faiss.extract_index_ivf(idx.index)
    except RuntimeError:
        return None
