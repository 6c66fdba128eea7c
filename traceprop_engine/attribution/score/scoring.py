"""Exact influence scores from the stored records, for any preconditioner and any storage.

The FAISS index holds *index vectors*: the preconditioned sketches, compressed by a second
Kronecker projection when the sketch is large (``LayerPreconditioner.index_left/right``), so
their inner products are unbiased estimates of the scores. This module computes the scores
themselves, from what the store holds (full sketches or rank-r factors), so that every number
a user sees is exact:

    τ(test, i) = Σ_layers Σ_records w_r ⟨T'_l, X_{r,l}⟩,   T'_l = pullback_l(T_l) = H_l⁻¹ T_l

with ``w_r`` the record's learning rate (per-example vectors, TracIn along the trajectory) or 1
(per-record vectors). For a record stored as factors ``X = U Vᵀ`` the inner product is
``Σ_c u_cᵀ T' v_c``: one ``(k_out × k_in)·(k_in × r)`` product, never the full sketch.

Used by the query path to re-rank FAISS candidates exactly, and for full score vectors (LDS,
influence by source, self-influence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

from ... import constants as C
from ...index_settings import RecordChoice
from ..index.projection import transformed_factors
from ..precondition.layer import factor_grams
from ..precondition.preconditioner import Preconditioner
from ..query_sketches import factors_of
from .factor_scores import FLOAT32_RTOL, LOWRANK_RTOL, LowRankTest
from .record_weights import record_weights

CHUNK = 4096  # records per streamed chunk
NORM_BUFFER_BYTES = 1 << 30  # exact per-example norms accumulate at most this much in memory


class ExactScorer:
    """Exact scores of test sketches against the vectors of an index (its rows).

    Args:
        store: the run's store (``Store`` or ``ShardedStore``).
        pre: the fitted preconditioner of the index.
        ids: the index's row -> example id (per-example) or row -> record (per-record).
        per_record: rows are records (weight 1) instead of examples (weight = lr).
        records: which of an example's records count (``IndexSettings.records``;
            :func:`~traceprop_engine.attribution.score.record_weights.record_weights`).
    """

    def __init__(
        self,
        store,
        pre: Preconditioner,
        ids: np.ndarray,
        per_record: bool = False,
        records: RecordChoice | str = RecordChoice.ALL,
    ):
        self.store = store
        self.pre = pre
        self.row_sq_norms: np.ndarray | None = None  # set by the query path (norms.npy)
        # (n, L) per layer (layer_norms.npy), float32 rounded up; False: the index has none
        self.layer_sq_norms: np.ndarray | None | bool = None
        # a RecordCache (memory-mapped records of the index) for scattered reads, or None
        self.cache = None
        # the index's FactorLists, one per listed layer (a second candidate search,
        # index/lists.py), or None
        self.lists = None
        self.ids = np.asarray(ids)
        rec = store.records()
        n_rec = store.n_records
        if per_record:
            self.rec_row = np.arange(n_rec, dtype=np.int64)
            self.rec_weight = np.ones(n_rec, dtype=np.float64)
        else:
            row_of = np.full(int(rec[C.REC_EXAMPLE].max(initial=-1)) + 1, -1, dtype=np.int64)
            row_of[self.ids.astype(np.int64)] = np.arange(len(self.ids))
            self.rec_row = row_of[rec[C.REC_EXAMPLE]]
            self.rec_weight = record_weights(rec, records)
        order = np.argsort(self.rec_row, kind="stable")
        self._by_row = order  # records sorted by row
        self._row_start = np.searchsorted(self.rec_row[order], np.arange(len(self.ids) + 1))

    @property
    def n_rows(self) -> int:
        return len(self.ids)

    def pullbacks(self, test_sketches: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per layer ``T' = H⁻¹ T``, (q, *record_shape) float64."""
        return [lp.pullback(t) for lp, t in zip(self.pre.layers, test_sketches, strict=True)]

    def query_sq_norm(
        self, test_sketches: Sequence[np.ndarray], pullbacks: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """``‖H^{-1/2} T‖²`` per query (the cosine denominator of the test side), (q,)."""
        pb = self.pullbacks(test_sketches) if pullbacks is None else pullbacks
        return sum(
            np.einsum("qi,qi->q", t.reshape(len(t), -1), p.reshape(len(p), -1))
            for t, p in zip(test_sketches, pb, strict=True)
        )

    def scores(
        self,
        test_sketches: Sequence[np.ndarray],
        rows: np.ndarray | None = None,
        per_layer: bool = False,
        pullbacks: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """Exact scores.

        Args:
            test_sketches: per layer (q, *record_shape) test-side sketches.
            rows: index rows to score (all when None); the output columns follow this order.
            per_layer: also split every score by layer.
            pullbacks: :meth:`pullbacks` of ``test_sketches``, when the caller has them.

        Returns:
            (q, n) scores, or (q, L, n) per-layer scores when ``per_layer``.
        """
        pb = self.prepared(test_sketches, pullbacks)
        q = len(test_sketches[0])
        if rows is None:
            out = np.zeros((q, len(pb), self.n_rows))
            for start in range(0, self.store.n_records, CHUNK):
                stop = min(start + CHUNK, self.store.n_records)
                recs = np.arange(start, stop)
                self._accumulate(out, pb, recs, self.rec_row[start:stop], slice(start, stop))
        else:
            out = self.row_scores(pb, rows, range(len(pb)), q)
        return out if per_layer else out.sum(1)

    def prepared(
        self, test_sketches: Sequence[np.ndarray], pullbacks: list[np.ndarray] | None = None
    ) -> list:
        """Per layer the query side the products take: ``T'`` (:meth:`pullbacks`), or its exact
        low-rank factorisation (:class:`LowRankTest`) where the records are factors."""
        lazy = self.prepared_lazily(test_sketches, pullbacks)
        return [lazy[li] for li in range(len(lazy))]

    def prepared_lazily(
        self, test_sketches: Sequence[np.ndarray], pullbacks: list[np.ndarray] | None = None
    ) -> PreparedQuery:
        """:meth:`prepared`, each layer computed on first use (:class:`PreparedQuery`)."""
        f32 = all(np.asarray(t).dtype.itemsize <= 4 for t in test_sketches)
        return PreparedQuery(self, test_sketches, f32, pullbacks)

    def _prepare_layer(self, li: int, t: np.ndarray, f32: bool):
        """One layer's entry of :meth:`prepared`."""
        # T' of one query has rank ≤ its tokens: ⟨T', U Vᵀ⟩ then costs O((k_out + k_in) r t)
        # per record instead of O(k_out k_in r) (exact: only round-off singular values dropped)
        # float32 queries: cut at their own rounding, factored products in float32 too
        if not self.store.layers[li].rank:
            return t
        rtol, dt = (FLOAT32_RTOL, np.float32) if f32 else (LOWRANK_RTOL, np.float64)
        # EK-FAC's elementwise scale makes T' full rank: no random-range tries
        ranged = self.pre.layers[li].scale is None
        return LowRankTest.maybe(t, dt, rtol, ranged=ranged) or t

    def _pulled_factors(self, li: int, a: np.ndarray, b: np.ndarray, f32: bool):
        """Layer ``li``'s entry from the query's token factors ``T = A Bᵀ``: ``T' = (LᵀL A)(R Rᵀ
        B)ᵀ`` as a :class:`LowRankTest`, or None where that is not the cheaper exact form (records
        stored in full, an elementwise-scaled pullback as EK-FAC's, more tokens than it pays)."""
        info, lp = self.store.layers[li], self.pre.layers[li]
        ko, ki = info.k_out, info.k_in
        t = a.shape[1]
        if not info.rank or lp.scale is not None or t * (ko + ki) >= ko * ki:
            return None
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if lp.left is not None:  # pullback = leftᵀ (left T right) rightᵀ
            a = lp.left.T @ (lp.left @ a)
            b = lp.right @ (lp.right.T @ b)
        dt = np.float32 if f32 else np.float64
        return LowRankTest(a.astype(dt), b.astype(dt), np.zeros(t, np.int64))

    def row_scores(self, pb: list, rows: np.ndarray, layers, q: int) -> np.ndarray:
        """(q, len(layers), len(rows)) exact scores of index ``rows`` at ``layers``, in that
        order; ``pb`` from :meth:`prepared`. Only those layers are allocated: the re-rank asks
        one layer at a time, and a (q, L, n) array of zeros for it cost 5 ms of page faults a
        query at 10⁵ rows (stop 58)."""
        rows = np.asarray(rows, dtype=np.int64)
        layers = list(layers)
        out = np.zeros((q, len(layers), len(rows)))
        first = self._row_start[rows]  # only these rows: the re-rank runs per query
        counts = self._row_start[rows + 1] - first
        cols = np.repeat(np.arange(len(rows)), counts)  # the output column of each record
        starts = np.repeat(first - (np.cumsum(counts) - counts), counts)
        recs = self._by_row[starts + np.arange(len(cols))]  # the records of each row, in turn
        order = np.argsort(recs)
        recs, cols = recs[order], cols[order]
        distinct = len(counts) == 0 or int(counts.max()) <= 1  # one record a row (one epoch)
        for start in range(0, len(recs), CHUNK):
            sel = recs[start : start + CHUNK]
            self._accumulate(out, pb, sel, cols[start : start + CHUNK], sel, layers, distinct)
        return out

    def _accumulate(self, out, pb, recs, cols, where, layers=None, distinct=False) -> None:
        """Add ``w_r ⟨T', X_r⟩`` of records ``recs`` into ``out[:, slot, cols]``: every layer in
        its own slot, or ``layers`` in their order; ``distinct``: no two records share a column
        (then no summing matrix)."""
        w = self.rec_weight[recs]
        q = out.shape[0]
        slots = list(enumerate(range(len(pb)) if layers is None else layers))
        if distinct:  # the re-rank of a one-epoch run: a weighted scatter, no sparse matrix
            for slot, li in slots:
                out[:, slot, cols] += self._record_scores(li, pb[li], where, q) * w
            return
        # only the output columns these records touch: a matrix over all columns made every
        # chunk of a full scan cost O(rows), i.e. O(n²) over a store of n examples
        touched, inv = np.unique(cols, return_inverse=True)
        m = sp.csr_matrix((w, (inv, np.arange(len(recs)))), shape=(len(touched), len(recs)))
        for slot, li in slots:
            s = self._record_scores(li, pb[li], where, q)  # (q, n)
            out[:, slot, touched] += (m @ s.T).T

    def _record_scores(self, li: int, t, where, q: int) -> np.ndarray:
        """``⟨T', X_r⟩`` of records ``where`` for every query, (q, n); ``t`` is the layer's
        pullback (q, *record_shape) or its exact low-rank factorisation (:class:`LowRankTest`)."""
        info = self.store.layers[li]
        # scattered records (the re-rank's candidates) from the memory-mapped copy when there is one
        src = self.store if self.cache is None or isinstance(where, slice) else self.cache
        if info.rank:
            if src is self.cache and isinstance(t, LowRankTest) and info.factor_dtype == "int8":
                return t.inner_int8(*self.cache.int8_rows(li, where), info.k_out, q)
            u, v = _read(src, "factors", li, where)  # (n, k_out, r), (n, k_in, r)
            if isinstance(t, LowRankTest):
                return t.inner(u, v, q)
            n, (q, ko, ki) = len(u), t.shape
            tt = np.ascontiguousarray(t.transpose(2, 0, 1)).reshape(ki, q * ko)
            out = np.zeros((q, n))
            for c in range(info.rank):  # Σ_c u_cᵀ T' v_c, one GEMM over all queries per c
                tv = (v[:, :, c].astype(np.float64) @ tt).reshape(n, q, ko)
                out += np.einsum("nqo,no->qn", tv, u[:, :, c].astype(np.float64))
            return out
        x = _read(src, "sketches", li, where)
        return t.reshape(len(t), -1) @ x.reshape(len(x), -1).astype(np.float64).T

    def example_sq_norms(self) -> np.ndarray | None:
        """(n, L) ``‖H_l^{-1/2} Σ_r w_r X_{r,l}‖²`` of every row and layer (summed over the
        layers: self-influence, the cosine denominator; per layer: the re-rank's bounds,
        :mod:`~traceprop_engine.attribution.score.rerank`), or None when the per-row accumulation
        would exceed :data:`NORM_BUFFER_BYTES` (then callers fall back to the index vectors' norms,
        an estimate). With a record cache, factor-stored layers and a matrix-product preconditioner
        (identity, K-FAC) they are exact at any size (:meth:`_gram_sq_norms`)."""
        if self.cache is not None and all(
            info.rank and lp.scale is None
            for info, lp in zip(self.store.layers, self.pre.layers, strict=True)
        ):
            return self._gram_sq_norms()
        out = np.zeros((self.n_rows, len(self.pre.layers)))
        for li, lp in enumerate(self.pre.layers):
            exact = dataclasses.replace(lp, index_left=None, index_right=None)
            if self.n_rows * exact.dim * 4 > NORM_BUFFER_BYTES:
                return None
            acc = np.zeros((self.n_rows, exact.dim), np.float32)
            for start in range(0, self.store.n_records, CHUNK):
                stop = min(start + CHUNK, self.store.n_records)
                x = exact.apply(self.store.sketches(li, start, stop))
                w = self.rec_weight[start:stop].astype(np.float32)[:, None]
                np.add.at(acc, self.rec_row[start:stop], x * w)
            out[:, li] = np.einsum("ij,ij->i", acc, acc, dtype=np.float64)
        return out

    def _gram_sq_norms(self, block: int = 32_768) -> np.ndarray:
        """(n, L) ``‖Σ_r w_r U_r V_rᵀ‖²`` of every row and layer from the factors alone:
        ``Σ_{r,s} w_r w_s Σ_ab (U_rᵀU_s)_ab (V_rᵀV_s)_ab`` over the pairs of records of a row
        with ``U, V`` the factors of ``L X R`` (identity or K-FAC preconditioner; read from the
        record cache, never materialising a sketch)."""
        out = np.zeros((self.n_rows, len(self.store.layers)))
        counts = np.diff(self._row_start)  # records per row (records sorted by row: _by_row)
        pairs = np.concatenate([[0], np.cumsum(counts.astype(np.int64) ** 2)])
        r0 = 0
        while r0 < self.n_rows:  # blocks of rows with at most `block` record pairs
            r1 = int(np.searchsorted(pairs, pairs[r0] + block, "right")) - 1
            r1 = min(max(r1, r0 + 1), self.n_rows)
            lo, hi = int(self._row_start[r0]), int(self._row_start[r1])
            recs = self._by_row[lo:hi]
            lens = np.repeat(counts[r0:r1], counts[r0:r1])  # per record: records of its row
            start = np.repeat(self._row_start[r0:r1] - lo, counts[r0:r1])
            i = np.repeat(np.arange(hi - lo), lens)
            j = np.repeat(start, lens) + (
                np.arange(len(i)) - np.repeat(np.cumsum(lens) - lens, lens)
            )
            w = self.rec_weight[recs]
            ww = w[i] * w[j]
            same = len(i) == len(recs)
            for li in range(len(self.store.layers)):
                u, v = transformed_factors(self.pre.layers[li], *self.cache.factors_at(li, recs))
                if same:  # one record a row: each pair is a record with itself
                    gu, gv = factor_grams(u), factor_grams(v)
                else:
                    gu = np.matmul(u[i].transpose(0, 2, 1), u[j])
                    gv = np.matmul(v[i].transpose(0, 2, 1), v[j])
                val = ww * (gu * gv).sum(axis=(1, 2))
                out[r0:r1, li] = np.bincount(self.rec_row[recs][i] - r0, val, minlength=r1 - r0)
            r0 = r1
        return out


RAW_PRODUCTS_MAX = 1 << 20
"""Largest ``rows · k_out · k_in`` a layer's records are scored for with the raw pullback
``T'`` (one dense product per record) instead of its low-rank factorisation, which costs a
fixed ≈ 0.4 ms a layer (random range, QR, SVD) however few rows it then serves."""


class PreparedQuery:
    """One query's per-layer product side (:meth:`ExactScorer.prepared`), each layer computed
    on first use. With the query's token factors (:class:`~traceprop_engine.attribution.query_sketches.QuerySketches`)
    a factor-stored layer under identity or K-FAC takes ``T' = (LᵀL A)(R Rᵀ B)ᵀ`` straight from
    them: no dense pullback and no factoring. Otherwise the pullback ``T'`` is computed densely
    and factored (:class:`LowRankTest`) when many rows need it; the bounded re-rank
    (:mod:`~traceprop_engine.attribution.score.rerank`) reaches most layers with a few dozen rows,
    for which :meth:`for_rows` hands out the raw pullback instead (exact too)."""

    def __init__(
        self,
        scorer: ExactScorer,
        sketches: Sequence[np.ndarray],
        f32: bool,
        pullbacks: list[np.ndarray] | None = None,
    ) -> None:
        self.scorer, self.sketches, self.f32 = scorer, sketches, f32
        self._raw: dict[int, np.ndarray] = {} if pullbacks is None else dict(enumerate(pullbacks))
        self._entries: dict[int, object] = {}
        self._factors = factors_of(sketches)
        self._pulled: dict[int, LowRankTest | None] = {}
        self._sq: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.sketches)

    def raw_at(self, li: int) -> np.ndarray:
        """Layer ``li``'s dense pullback ``T'`` (q, *record_shape) float64, computed once."""
        if li not in self._raw:
            self._raw[li] = self.scorer.pre.layers[li].pullback(self.sketches[li])
        return self._raw[li]

    def _from_factors(self, li: int) -> LowRankTest | None:
        """Layer ``li``'s entry from the token factors (kept), or None where it has none."""
        if li not in self._pulled:
            f = None if self._factors is None else self._factors[li]
            self._pulled[li] = None if f is None else self.scorer._pulled_factors(li, *f, self.f32)
        return self._pulled[li]

    def __getitem__(self, li: int):
        if li not in self._entries:
            entry = self._from_factors(li)
            if entry is None:
                entry = self.scorer._prepare_layer(li, self.raw_at(li), self.f32)
            self._entries[li] = entry
        return self._entries[li]

    def for_rows(self, li: int, n_rows: int):
        """Layer ``li``'s entry for scoring ``n_rows`` rows: the raw ``T'`` when that is cheaper
        than factoring it (and it is neither factored yet nor given as token factors)."""
        if li in self._entries or self._from_factors(li) is not None:
            return self[li]
        t = self.raw_at(li)
        if n_rows * t.shape[-2] * t.shape[-1] <= RAW_PRODUCTS_MAX:
            return t
        return self[li]

    def sq_norms(self) -> np.ndarray:
        """(L,) ``⟨T_l, T'_l⟩ = ‖apply_l(T_l)‖²`` of the one query, per layer (from the token
        factors where a layer has them: ``Σ (AᵀA') ⊙ (BᵀB')``); computed once."""
        if self._sq is not None:
            return self._sq
        out = np.zeros(len(self))
        for li in range(len(self)):
            entry = self._from_factors(li)
            if entry is not None:
                a, b = self._factors[li]
                ga = np.asarray(a, np.float64).T @ entry.a.astype(np.float64)
                gb = np.asarray(b, np.float64).T @ entry.b.astype(np.float64)
                out[li] = float(np.sum(ga * gb))
            else:
                t = np.asarray(self.sketches[li], np.float64)
                out[li] = float(np.vdot(t, self.raw_at(li)))
        self._sq = out
        return out


def _read(store, what: str, li: int, where):
    """Records ``where`` (a slice, or sorted record numbers) of one layer."""
    if isinstance(where, slice):
        return getattr(store, what)(li, where.start, where.stop)
    return getattr(store, f"{what}_at")(li, where)
