"""A second candidate search: the dominant layer's own rank-1 records, in lists by output factor.

Why. The index vectors (:mod:`~traceprop_engine.attribution.index.projection`) summarise every layer
of an example in 256 numbers. At 10⁶ examples of a language model the true top 10 are among
thousands of rows that share the query's answer token (proponents) or a competing one (opponents),
and the summary does not order them as the exact scores do. On those runs one layer, the LM head, holds ≈ 0.99 of the records' energy, and its records
are rank 1, ``x = u vᵀ``. Against a query whose pulled-back sketch is ``T' = A Bᵀ`` (rank ≤ its loss
tokens, :class:`~traceprop_engine.attribution.score.factor_scores.LowRankTest`) a record
scores exactly

    ``lr · (uᵀA)·(vᵀB) / ‖x_row‖``  (cosine; the query's norm is the same for every row),

``O((k_out + k_in) · r)`` numbers per record, with no summary in between.

Build (:func:`build_lists`). The entries are the layer's records (a row with several records
has several entries). ``ū = u/‖u‖`` is the direction of the record's logit gradient, so records
of one answer token point the same way. Each entry keeps ``ū`` and ``w = γ v`` with
``γ = lr · ‖u‖ / ‖x_row‖``, so that its score is ``Σ_t (ū·a_t)(w·b_t)``, both sides reduced to
their principal directions holding :data:`ENERGY_KEEP` of their energy (116 numbers instead
of 252 at 10⁶ real rows), stored as int8 with one scale per entry (:data:`INT8_ENTRIES`).
Spherical k-means on the reduced ``ū`` makes :func:`n_lists` lists, stored contiguously; each
list keeps its centroid ``c``, the mean ``m`` of its ``w`` and their root-mean-square spread
``σ``.

Query (:meth:`FactorLists.candidates`). A list's estimate on the proponents' side is
``cᵀT'm + ‖T'ᵀc‖·σ`` (its mean entry's score if every ``ū`` were ``c``, plus one spread), on
the opponents' side ``−cᵀT'm + ‖T'ᵀc‖·σ``. The lists with the largest estimates are scanned
per side until a share of the entries (:data:`SCAN_FRACTION`), every scanned entry is scored
at that layer (to the reduction's rounding), and the :data:`CANDIDATES` best rows per side
join FAISS's candidates. The exact re-rank (:mod:`~traceprop_engine.attribution.score.rerank`) then
scores every candidate at every layer as before: the lists only propose rows, every returned score
is still the exact one.

The layers: the dominant one and the next by energy (:func:`list_layers`); a query scans a
layer's lists only where it holds :data:`MIN_QUERY_SHARE` of its norm.

What the lists add to FAISS's candidates at 10⁶ examples: benchmarks/README.md §2b
(``benchmarks/query_real_run.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def file_names(li: int) -> tuple[str, str, str, str]:
    """The files of layer ``li``'s lists: the lists (``.npz``), the entries' rows, the entries,
    and the entries' scales (int8 entries; lists built before them have float32 entries and no
    scales)."""
    stem = f"lists-{li:03d}"
    return f"{stem}.npz", f"{stem}-rows.npy", f"{stem}-entries.npy", f"{stem}-scales.npy"


MIN_ROWS = 200_000
"""``IndexSettings(lists=None)`` (auto) builds the lists from this many index rows: where FAISS
is an IVF index (``AUTO_FLAT_MAX``). Below it the summary alone finds the true top 10 (10⁵
real rows: recall@10 0.998 / 0.992)."""
ROWS_PER_LIST = 64
MAX_LISTS = 1024
SCAN_FRACTION = (0.01, 0.04)
"""Entries scanned for the proponents and for the opponents (a share of all entries each), the
lists with the largest estimates on that side. On the real run of 10⁶ examples (48 questions)
the proponents found by 0.01 / 0.025 were 0.985 / 0.988, the opponents by 0.025 / 0.04
0.935 / 0.958; every 0.01 more costs ≈ 0.5 ms a query."""
CANDIDATES = 300
"""Rows per side the lists add to FAISS's candidates."""
MIN_SHARE = 0.5
"""The lists are built on the layer holding the largest share of the rows' squared norms, when
that share is at least this (otherwise no one layer decides the ranking) ..."""
LIST_LAYERS = 2
"""... and on the next ``LIST_LAYERS - 1`` layers by that share. On the real run of 10⁶ examples
the opponents that the LM head's lists missed scored at the first layers (queries whose head
holds ≈ 0.6 of their norm, rows whose head holds ≈ 5 % of their score): the second layer's
lists (the first block's attention input, 0.3 % of the energy) took the opponents the lists
find from 0.916 to 0.967 (96 questions)."""
MIN_QUERY_SHARE = 0.05
"""A layer's lists are scanned for a query holding at least this share of its squared norm
there (a query whose score sits in the LM head scans only the head's lists)."""
ENERGY_KEEP = 0.999
"""Each side of the entries keeps the principal directions holding this share of its energy
(measured at 10⁶ real rows, LM head: ``ū`` 64 of 126 directions hold 0.9997, ``w`` 32 hold
0.996, 48 0.9988; kept 63 + 53): a query reads 116 numbers an entry instead of 252."""
INT8_ENTRIES = True
"""Entries are stored as int8, each side scaled to its largest coordinate (``q = round(127 x /
max|x|)``), with the product of the two sides' scales per entry. A query's scan reads memory at
the rate of a copy (10⁶ rows: 5 % of the entries, 37 MB in float32, ≈ 5.5 ms on one core); in
int8, converted a :data:`SCAN_CHUNK` at a time, it reads a quarter of that in ≈ 2 ms. The lists
only propose rows (the re-rank scores every candidate exactly), so the rounding (≤ 0.5/127 of
each side's largest coordinate) only moves which near-ties are proposed."""
SCAN_CHUNK = 1024
"""Entries converted and scored at a time (int8 → float32 stays in the cache)."""
LISTS_RECALL_MARGIN = 0.01
"""The margin over ``target_recall`` that FAISS's nprobe is calibrated to when the index has
lists (``build.RECALL_MARGIN``, 0.03, without them). The calibration measures FAISS alone; with
lists the re-rank also takes their candidates, which hold the dominant layers' top rows of both
signs, so FAISS no longer bounds the recall. Measured on the 10⁶ synthetic store (real queries,
recall@10 of proponents / opponents against brute force on the first 24 / all 40, AMD):
nprobe 124 (margin 0.03) 0.996 / 0.979 and 0.997 / 0.988 at rank p50 19.8 ms; 64: 0.996 / 0.963
and 0.997 / 0.978 at 17.7 ms; 48: the same at 16.5 ms; 37 (margin 0.01): 0.996 / 0.958 and
0.997 / 0.975 at 16.5 ms. A margin of 0.02 calibrated to nprobe 94 on that store (the
calibration's opponent searches, negated stored rows, are harder than real queries)."""
_BASIS_SAMPLE = 65_536
_KMEANS_SAMPLE = 64
_KMEANS_ITERS = 20
_CHUNK = 65_536


def principal_basis(x: np.ndarray, keep: float = ENERGY_KEEP) -> np.ndarray:
    """``(d, m)`` orthonormal: the fewest principal directions of the rows of ``x`` (through the
    origin) holding ``keep`` of their energy."""
    x = np.asarray(x, np.float64)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    energy = np.cumsum(s**2)
    if not energy[-1] > 0:
        return np.eye(x.shape[1], 1, dtype=np.float32)
    m = int(np.searchsorted(energy / energy[-1], keep) + 1)
    return np.ascontiguousarray(vt[: min(m, len(s))].T, dtype=np.float32)


def n_lists(n_entries: int) -> int:
    return int(min(MAX_LISTS, max(1, n_entries // ROWS_PER_LIST)))


def wants_lists(setting: bool | None, n_rows: int) -> bool:
    """Whether an index of ``n_rows`` rows with ``IndexSettings.lists == setting`` gets lists."""
    return setting if setting is not None else n_rows >= MIN_ROWS


def list_layers(layer_sq: np.ndarray, rank1: list[bool]) -> list[int]:
    """The layers that get lists: the one with the largest share of the rows' summed squared
    norms (``layer_sq`` (n, L)) if that share is at least :data:`MIN_SHARE` and its records are
    rank-1 factors, then the next rank-1 layers by share, :data:`LIST_LAYERS` in all; none when
    no layer dominates."""
    tot = np.asarray(layer_sq, dtype=np.float64).sum(0)
    if not tot.sum() > 0:
        return []
    order = [int(li) for li in np.argsort(-tot, kind="stable")]
    if not (rank1[order[0]] and tot[order[0]] / tot.sum() >= MIN_SHARE):
        return []
    return [li for li in order if rank1[li] and tot[li] > 0][:LIST_LAYERS]


def build_lists(
    scorer,
    li: int,
    row_norms: np.ndarray,
    out_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write the lists of layer ``li`` of ``scorer``'s rows into ``out_dir``; returns the file
    names. ``row_norms``: the cosine denominators of the rows (ones for raw scores)."""
    import faiss

    store = scorer.store
    info = store.layers[li]
    ko = info.k_out
    keep = np.flatnonzero(scorer.rec_row >= 0)  # records of indexed rows
    m = len(keep)
    u_all = np.empty((m, ko), np.float32)
    w_all = np.empty((m, info.k_in), np.float32)
    for start in range(0, m, _CHUNK):
        recs = keep[start : start + _CHUNK]
        if scorer.cache is not None:
            u, v = scorer.cache.factors_at(li, recs)
        else:
            u, v = store.factors_at(li, recs)
        u, v = u[:, :, 0], v[:, :, 0]  # rank 1
        un = np.linalg.norm(u, axis=1)
        gamma = scorer.rec_weight[recs] * un / row_norms[scorer.rec_row[recs]]
        u_all[start : start + len(recs)] = u / np.maximum(un, 1e-30)[:, None]
        w_all[start : start + len(recs)] = v * gamma[:, None]
        if progress is not None:
            progress(min(start + _CHUNK, m), 2 * m)
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(m, min(m, _BASIS_SAMPLE), replace=False))
    basis_u, basis_w = principal_basis(u_all[sample]), principal_basis(w_all[sample])
    mu = basis_u.shape[1]
    entries = np.empty((m, mu + basis_w.shape[1]), np.float32)
    for i in range(0, m, _CHUNK):  # [ū Qu | w Qw]: the entry's two sides, reduced
        entries[i : i + _CHUNK, :mu] = u_all[i : i + _CHUNK] @ basis_u
        entries[i : i + _CHUNK, mu:] = w_all[i : i + _CHUNK] @ basis_w
    del u_all, w_all
    nl = n_lists(m)
    sample = np.sort(rng.choice(m, min(m, nl * _KMEANS_SAMPLE), replace=False))
    km = faiss.Kmeans(
        mu, nl, niter=_KMEANS_ITERS, spherical=True, seed=0, max_points_per_centroid=_KMEANS_SAMPLE
    )
    km.train(np.ascontiguousarray(entries[sample, :mu]))
    assign = np.concatenate(
        [
            km.index.search(np.ascontiguousarray(entries[i : i + _CHUNK, :mu]), 1)[1][:, 0]
            for i in range(0, m, _CHUNK)
        ]
    )
    order = np.argsort(assign, kind="stable")
    starts = np.searchsorted(assign[order], np.arange(nl + 1)).astype(np.int64)
    counts = np.diff(starts)
    cent = km.centroids / np.maximum(np.linalg.norm(km.centroids, axis=1, keepdims=True), 1e-30)
    lists_file, rows_file, entries_file, scales_file = file_names(li)
    np.save(out_dir / rows_file, scorer.rec_row[keep][order].astype(np.int64))
    entries = entries[order]  # list by list: each list's mean and spread are sums over a slice
    if INT8_ENTRIES:
        q, scales = quantized(entries, mu)
        np.save(out_dir / entries_file, q)
        np.save(out_dir / scales_file, scales)
        del q
    else:
        np.save(out_dir / entries_file, entries)
    w = entries[:, mu:]
    full = np.flatnonzero(counts)
    mean = np.zeros((nl, w.shape[1]))
    mean[full] = np.add.reduceat(w, starts[full], dtype=np.float64) / counts[full, None]
    dev = np.einsum("ni,ni->n", w, w, dtype=np.float64)  # Σ‖w − m‖² = Σ‖w‖² − n‖m‖²
    spread = np.zeros(nl)
    spread[full] = np.add.reduceat(dev, starts[full]) / counts[full] - (mean[full] ** 2).sum(1)
    spread = np.sqrt(np.maximum(spread, 0.0))
    np.savez(
        out_dir / lists_file,
        layer=np.int64(li),
        n_rows=np.int64(scorer.n_rows),
        starts=starts,
        centroids=cent.astype(np.float64),
        mean=mean,
        spread=spread,
        basis_u=basis_u,
        basis_w=basis_w,
    )
    if progress is not None:
        progress(2 * m, 2 * m)
    log.info("factor lists: layer %d, %d entries in %d lists", li, m, nl)
    return list(file_names(li)[: 4 if INT8_ENTRIES else 3])


def quantized(entries: np.ndarray, mu: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 entries (each side, ``[:mu]`` and ``[mu:]``, rounded to 127 steps of its largest
    coordinate) and, per entry, the product of the two sides' steps (:data:`INT8_ENTRIES`)."""
    q = np.empty(entries.shape, np.int8)
    scales = np.empty(len(entries), np.float32)
    for i in range(0, len(entries), _CHUNK):
        e = entries[i : i + _CHUNK].astype(np.float64)
        step = np.ones((len(e), 2))
        for side, cols in enumerate((slice(0, mu), slice(mu, None))):
            big = np.abs(e[:, cols]).max(1)
            step[:, side] = np.where(big > 0, big / 127.0, 1.0)
            q[i : i + _CHUNK, cols] = np.rint(e[:, cols] / step[:, side : side + 1])
        scales[i : i + _CHUNK] = step[:, 0] * step[:, 1]
    return q, scales


def list_candidates(scorer, sketches, opponents: bool = True, prepared=None) -> np.ndarray:
    """The rows ``scorer.lists`` propose for one query's ``sketches`` (per layer (1, ...)): the
    lists of every layer where the query holds :data:`MIN_QUERY_SHARE` of its squared norm
    (none: no lists, several queries, or a full-rank ``T'`` there, as EK-FAC's).

    ``prepared``: the query's ``scorer.prepared_lazily(...)`` when the caller has it (the
    re-rank then reuses the pullbacks and the factored ``T'`` of the lists' layers)."""
    return sorted_unique(*[job() for job in list_jobs(scorer, sketches, opponents, prepared)])


def list_jobs(scorer, sketches, opponents: bool = True, prepared=None) -> list:
    """:func:`list_candidates` as one job (no arguments) per scanned layer, to run side by side
    (:func:`~traceprop_engine.attribution.score.two_hands.both`); :func:`sorted_unique` merges
    their results."""
    from ..score.factor_scores import LowRankTest

    if not scorer.lists or len(sketches[0]) != 1:
        return []
    if prepared is None:
        prepared = scorer.prepared_lazily(sketches)
    sq = prepared.sq_norms()
    total = float(sq.sum())
    jobs = []
    for lists in scorer.lists:
        li = lists.layer
        if not total > 0 or sq[li] < MIN_QUERY_SHARE * total:
            continue

        def job(lists=lists, li=li) -> np.ndarray:
            low = prepared[li]  # T' = A Bᵀ, factored once for the lists and the re-rank
            if not isinstance(low, LowRankTest):
                return np.zeros(0, np.int64)
            return lists.candidates(low.a, low.b, opponents)

        jobs.append(job)
    return jobs


def sorted_unique(*parts: np.ndarray) -> np.ndarray:
    """The integers of ``parts``, sorted, once each (int64). numpy ≥ 2.3's ``np.unique`` hashes
    integer arrays: 0.7–0.9 ms for a query's 6000 candidate rows, against 0.04–0.06 ms for this
    sort (numpy 2.4, stop 58)."""
    a = np.concatenate([np.zeros(0, np.int64), *parts]).astype(np.int64, copy=False)
    a.sort()
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if len(a) > 1 else a


def _mapped(path: Path) -> np.ndarray:
    """``path``'s array, memory-mapped read-only, as a plain ndarray view: slicing a
    ``np.memmap`` costs a Python-level ``__array_finalize__`` per slice (≈ 100 a query)."""
    return np.load(path, mmap_mode="r").view(np.ndarray)


def open_lists(directory: Path, n_rows: int) -> list[FactorLists] | None:
    """Every layer's lists in ``directory`` (an index of ``n_rows`` rows), or None when it has
    none (a small run, ``lists=False``, or built before them)."""
    found = sorted(directory.glob("lists-[0-9][0-9][0-9].npz"))
    out = [FactorLists(directory, int(p.stem.split("-")[1])) for p in found]
    for lists in out:
        if lists.n_rows != n_rows:
            raise ValueError(f"factor lists of {lists.n_rows} rows, index of {n_rows}")
    return out or None


class FactorLists:
    """The lists of an index folder (see the module doc), memory-mapped."""

    def __init__(self, directory: Path, li: int) -> None:
        lists_file, rows_file, entries_file, scales_file = file_names(li)
        with np.load(directory / lists_file) as z:
            self.layer = int(z["layer"])
            self.n_rows = int(z["n_rows"])
            self.starts = z["starts"]
            self.centroids = z["centroids"]
            self.mean = z["mean"]
            self.spread = z["spread"]
            self.basis_u = z["basis_u"]
            self.basis_w = z["basis_w"]
        if self.layer != li:
            raise ValueError(f"{lists_file} holds the lists of layer {self.layer}")
        self.rows = _mapped(directory / rows_file)
        self.entries = _mapped(directory / entries_file)
        n = self.n_entries
        width = self.basis_u.shape[1] + self.basis_w.shape[1]
        if len(self.rows) != n or self.entries.shape != (n, width):
            raise ValueError(
                f"factor lists hold {len(self.rows)} rows and {self.entries.shape} entries, "
                f"not {n} x {width}"
            )
        # int8 entries: per entry the product of its two sides' steps (float32: none)
        self.scales = None
        if self.entries.dtype == np.int8:
            self.scales = _mapped(directory / scales_file)
            if self.scales.shape != (n,):
                raise ValueError(f"factor lists hold {self.scales.shape} scales, not ({n},)")

    @property
    def n_entries(self) -> int:
        return int(self.starts[-1])

    def _scan_order(self, a: np.ndarray, b: np.ndarray, opponents: bool) -> np.ndarray:
        """The lists to scan, both sides' choices merged, in list order (``a``, ``b``: the
        query in the entries' bases)."""
        ca = self.centroids @ a  # (L, r)
        mean = np.einsum("lr,lr->l", ca, self.mean @ b)  # cᵀ T' m
        spread = np.linalg.norm(ca @ b.T, axis=1) * self.spread  # ‖T'ᵀc‖ σ
        sizes = np.diff(self.starts)
        chosen = []
        sides = zip((mean + spread, -mean + spread), SCAN_FRACTION, strict=True)
        for est, share in list(sides)[: 2 if opponents else 1]:
            lists = np.argsort(-est, kind="stable")
            taken = np.cumsum(sizes[lists])
            chosen.append(lists[: int(np.searchsorted(taken, share * self.n_entries)) + 1])
        return sorted_unique(*chosen)

    def _scan(self, lists: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Scores of every entry of ``lists`` (ascending) at this layer, in list order:
        ``Σ_t (ū·a_t)(w·b_t)`` (``a``, ``b``: the query in the entries' bases). The chosen
        lists' entries are converted to float32 into one :data:`SCAN_CHUNK`-row buffer across
        list boundaries (one product per buffer, not one per list)."""
        mu = a.shape[0]
        buf = np.empty((SCAN_CHUNK, self.entries.shape[1]), np.float32)
        out = np.empty(int(np.diff(self.starts)[lists].sum()), np.float32)
        done = fill = 0

        def flush() -> None:
            nonlocal done, fill
            x = buf[:fill]
            out[done : done + fill] = np.einsum("nr,nr->n", x[:, :mu] @ a, x[:, mu:] @ b)
            done, fill = done + fill, 0

        for lo, hi in zip(self.starts[lists], self.starts[lists + 1], strict=True):
            while lo < hi:
                take = min(hi - lo, SCAN_CHUNK - fill)
                np.copyto(buf[fill : fill + take], self.entries[lo : lo + take], casting="unsafe")
                fill, lo = fill + take, lo + take
                if fill == SCAN_CHUNK:
                    flush()
        if fill:
            flush()
        if self.scales is not None:
            out *= np.concatenate([self.scales[lo:hi] for lo, hi in self._runs(lists)])
        return out

    def _runs(self, lists: np.ndarray) -> list[tuple[int, int]]:
        """Entry ranges ``[lo, hi)`` of ``lists`` (ascending), consecutive lists merged."""
        cut = np.flatnonzero(np.diff(lists) != 1) + 1
        first, last = lists[np.r_[0, cut]], lists[np.r_[cut - 1, len(lists) - 1]]
        return list(zip(self.starts[first].tolist(), self.starts[last + 1].tolist(), strict=True))

    def candidates(
        self, a: np.ndarray, b: np.ndarray, opponents: bool = True, k: int | None = None
    ) -> np.ndarray:
        """Index rows the lists propose for a query whose pulled-back sketch at :attr:`layer` is
        ``A Bᵀ`` (``a`` (k_out, r), ``b`` (k_in, r)): the best ``k`` per side among the scanned
        entries' exact scores at that layer (``k``: :data:`CANDIDATES`)."""
        k = CANDIDATES if k is None else k
        a = self.basis_u.T @ np.asarray(a, np.float32)  # the query in the entries' bases
        b = self.basis_w.T @ np.asarray(b, np.float32)
        lists = self._scan_order(a, b, opponents)
        if not np.diff(self.starts)[lists].sum():  # nothing chosen, or only empty lists
            return np.zeros(0, np.int64)
        score = self._scan(lists, a, b)
        row = np.concatenate([self.rows[lo:hi] for lo, hi in self._runs(lists)])
        n, kk = len(score), min(k, len(score))
        # one partition for both ends: the kk smallest first, the kk largest last
        part = np.argpartition(score, sorted({kk - 1, n - kk}) if opponents else n - kk)
        top = part[n - kk :]
        out = [row[top[score[top] > 0]]]
        if opponents:
            low = part[:kk]
            out.append(row[low[score[low] < 0]])
        return sorted_unique(*out)
