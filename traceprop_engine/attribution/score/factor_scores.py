"""Brute-force influence scores straight from rank-``c`` factor files (LoRIF), with a bound.

Scores never rebuild ``Ŝ`` (:mod:`traceprop_engine.store.compact` writes ``Ŝ ≈ U Vᵀ``). Every
preconditioner here is a linear map ``P`` on the sketch, so ``⟨P T, P Ŝ⟩ = ⟨T', Ŝ⟩`` with
``T' = P*P T`` the test sketch pushed to the training side
(:meth:`~traceprop_engine.attribution.precondition.layer.LayerPreconditioner.pullback`;
K-FAC: ``L² T R²``), and

    ⟨T', U Vᵀ⟩ = Σ_c u_cᵀ T' v_c,

one (k_out×k_in)·(k_in×c) product per record on the query side only. The per-example score is
the learning-rate-weighted sum over the example's records, as in
:mod:`traceprop_engine.attribution.precondition.vectors`.

Error bound (stored, per record and layer): the residual ``R = Ŝ − U Vᵀ`` has the discarded
singular values ``σ_{c+1}, …`` of ``Ŝ``, so by von Neumann's trace inequality

    |⟨T', R⟩| ≤ min(‖T'‖_2 ‖R‖_*, ‖T'‖_F ‖R‖_F),

with ``‖R‖_* = Σ_{j>c} σ_j`` and ``‖R‖_F = (Σ_{j>c} σ_j²)^{1/2}`` kept in the factor file.
:func:`factor_scores` sums these (× |lr|) into a guaranteed per-example bound.
:func:`sketch_scores` is the reference: the same scores from the full stored sketches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ... import constants as C
from ...errors import ConfigError, StoreError
from ...store.factor_file import CHUNK, FactorStore
from ...store.reader import Store
from ..precondition.preconditioner import Preconditioner
from .record_weights import record_weights

__all__ = ["LOWRANK_RTOL", "ExampleScores", "factor_scores", "sketch_scores"]


@dataclass(frozen=True)
class ExampleScores:
    """Scores of ``q`` queries against every training example with records.

    Attributes:
        example_ids: (n_examples,) example indices, ascending (the rows of ``scores``' columns).
        scores: (q, n_examples) ``Σ_records lr · Σ_layers ⟨P T, P Ŝ⟩``; > 0 = proponent.
        bound: (q, n_examples) guaranteed ``|score − full-sketch score|`` (factored scores only).
    """

    example_ids: np.ndarray
    scores: np.ndarray
    bound: np.ndarray | None = None


def _pulled_back(
    test_sketches: Sequence[np.ndarray],
    names: list[str],
    shapes: list[tuple[int, ...]],
    preconditioner,
) -> list[np.ndarray]:
    """``T'`` per layer, (q, k_out, k_in) float64, in the order of ``names``."""
    if len(test_sketches) != len(names):
        raise ConfigError(
            f"got test sketches for {len(test_sketches)} layers, the store has {len(names)} ({names})"
        )
    ts = []
    for t, shape, name in zip(test_sketches, shapes, names, strict=True):
        t = np.asarray(t, dtype=np.float64)
        t = t[None] if t.shape == shape else t
        if t.shape[1:] != shape:
            raise StoreError(
                f"layer {name!r}: test sketch shape {t.shape}, the store holds {shape} per record"
            )
        ts.append(t)
    if preconditioner is None:
        return ts
    layers = (
        preconditioner.layers
        if isinstance(preconditioner, Preconditioner)
        else list(preconditioner)
    )
    by_name = {lp.name: lp for lp in layers}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ConfigError(
            f"the preconditioner has no layer(s) {missing}; fit it on the same store "
            f"(it has {sorted(by_name)})"
        )
    return [by_name[n].pullback(t) for n, t in zip(names, ts, strict=True)]


def _per_example(
    rec: dict[str, np.ndarray], records: str = "all"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ex = rec[C.REC_EXAMPLE]
    ids = np.unique(ex)
    return ids, np.searchsorted(ids, ex), record_weights(rec, records)


def _accumulate(out: np.ndarray, rows: np.ndarray, w: np.ndarray, per_record: np.ndarray) -> None:
    for qi in range(out.shape[0]):  # (q, m) record scores → lr-weighted sum per example
        out[qi] += np.bincount(rows, weights=w * per_record[qi], minlength=out.shape[1])


def _factored_inner(t: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``Σ_c u_cᵀ T'_q v_c`` for every query q and record: (q, m). One GEMM plus an elementwise sum."""
    q, ko, ki = t.shape
    m, _, c = u.shape
    if ki <= ko:  # contract the smaller side first
        tv = t.reshape(q * ko, ki) @ np.swapaxes(v, 0, 1).reshape(ki, m * c)  # (q·ko, m·c)
        return np.einsum("qomc,moc->qm", tv.reshape(q, ko, m, c), u, optimize=True)
    tu = np.swapaxes(t, 1, 2).reshape(q * ki, ko) @ np.swapaxes(u, 0, 1).reshape(
        ko, m * c
    )  # (q·ki, m·c)
    return np.einsum("qimc,mic->qm", tu.reshape(q, ki, m, c), v, optimize=True)


LOWRANK_RTOL = 1e-9
"""Singular values of ``T'`` below this fraction of the largest are treated as zero (round-off)."""
GRAM_RTOL = 1e-7
"""From this cut up, the factorisation comes from ``eigh(TᵀT)`` (its eigenvalues carry an absolute
error ≈ eps·σ_max², so it resolves singular values down to ≈ 1e-8 σ_max); below it, the SVD."""
FLOAT32_RTOL = 1e-6
"""The same for a test sketch computed in float32 (a query's, from the model): its own rounding
(eps 1.2e-7 per entry, ‖E‖₂ ≈ eps·√k·‖T‖ ≈ 1e-6 ‖T‖ at k = 126) puts ≈ all k singular values
above 1e-9, so the cut sits at the rounding level: the query's rank (≤ its tokens) survives."""


RANGE_WIDTHS = (8, 24, 48)
"""Random directions :func:`_range_factors` tries in turn. A query's ``T'`` has rank ≤ its
tokens: at the LM head and the last block's later layers ≤ the loss tokens (one answer word:
1-2), at earlier layers ≤ the whole sequence (the sample's questions: 13-24)."""
_OMEGA: dict[tuple[int, int], np.ndarray] = {}


def _range_factors(t: np.ndarray, rtol: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``(A, B)`` with ``T = A Bᵀ`` up to singular values below ``rtol`` times the largest, from
    the range of ``T Ω`` (``Ω``: a fixed Gaussian ``k_in × w``), or None when the residual
    ``‖T − Q Qᵀ T‖_F`` exceeds that cut for every width (then the rank is above ``w``).

    Exact to the same cut as :func:`_spectral_factors`: what the range misses is checked, not
    assumed (its spectral norm ≤ its Frobenius norm ≤ ``rtol σ_max``). Cost O(k² w) instead of
    the O(k³) eigendecomposition: at k = 126 on one core, 0.1 ms (rank ≤ 8), 0.4 ms (≤ 24),
    1.2 ms (≤ 48, after the two smaller tries) against 1.35 ms, and a query pays it for every
    layer."""
    ko, ki = t.shape
    for w in RANGE_WIDTHS:
        if 2 * w > min(ko, ki):  # no cheaper than the eigendecomposition
            return None
        omega = _OMEGA.get((ki, w))
        if omega is None:
            omega = _OMEGA[(ki, w)] = np.random.default_rng(0).standard_normal((ki, w))
        basis = np.linalg.qr(t @ omega)[0]  # (ko, w) orthonormal
        c = basis.T @ t  # (w, ki)
        uu, s, vt = np.linalg.svd(c, full_matrices=False)
        smax = float(s[0]) if len(s) else 0.0
        if smax == 0.0:  # T Ω = 0: T = 0 unless Ω missed it, which the residual tells
            if not np.any(t):
                return np.zeros((ko, 0)), np.zeros((ki, 0))
            continue
        if np.linalg.norm(t - basis @ c) > rtol * smax:
            continue
        keep = s > rtol * smax
        return (basis @ uu[:, keep]) * s[keep], vt[keep].T
    return None


def _spectral_factors(t: np.ndarray, rtol: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(A_i, B_i)`` per query of ``t`` (q, k_out, k_in) from its spectrum: singular values
    below ``rtol`` times the largest dropped."""
    q = len(t)
    if rtol >= GRAM_RTOL:  # eigh of TᵀT: a third of the SVD's time, resolves σ ≥ 1e-8 σ_max
        w, vecs = np.linalg.eigh(np.swapaxes(t, 1, 2) @ t)  # ascending (q, ki), (q, ki, ki)
        keep = w > rtol**2 * np.maximum(w[:, -1:], 1e-300)
        right = [vecs[i][:, keep[i]] for i in range(q)]  # (ki, t_i) orthonormal
        return [(t[i] @ right[i], right[i]) for i in range(q)]
    u, s, vt = np.linalg.svd(t, full_matrices=False)  # (q,ko,r), (q,r), (q,r,ki)
    keep = s > rtol * np.maximum(s[:, :1], 1e-300)
    return [(u[i][:, keep[i]] * s[i][keep[i]], vt[i][keep[i]].T) for i in range(q)]


_INT8_BLOCK = 1 << 19
"""Numbers of int8 records :meth:`LowRankTest.inner_int8` converts at a time at rank > 1 (2 MB
of float32)."""


@dataclass(frozen=True)
class LowRankTest:
    """``T'_q = A_q B_qᵀ`` for all queries of one layer, stacked: A (k_out, Σt), B (k_in, Σt)."""

    a: np.ndarray
    b: np.ndarray
    owner: np.ndarray  # (Σt,) query index of each column

    @classmethod
    def maybe(
        cls, t: np.ndarray, dtype, rtol: float = LOWRANK_RTOL, ranged: bool = True
    ) -> LowRankTest | None:
        """The exact (numerical-rank) factorisation of ``T'`` when it beats the GEMM route:
        singular values below ``rtol`` times the largest are dropped.

        A query's ``T'`` has rank at most its loss tokens, so each one is first factored from a
        few random directions (:func:`_range_factors`, checked against ``T'`` itself); only the
        queries that check fails (more tokens than :data:`RANGE_WIDTHS`, or a full-rank ``T'``)
        pay the ``k × k`` eigendecomposition or SVD. ``ranged=False`` skips those tries where
        ``T'`` is known to be full rank (an elementwise-scaled pullback: EK-FAC)."""
        q, ko, ki = t.shape
        found = [_range_factors(t[i], rtol) if ranged else None for i in range(q)]
        rest = [i for i in range(q) if found[i] is None]
        if rest:
            for i, f in zip(rest, _spectral_factors(t[rest], rtol), strict=True):
                found[i] = f
        left = [f[0] for f in found]
        right = [f[1] for f in found]
        width = [f[1].shape[1] for f in found]
        if sum(width) * (ko + ki) >= q * ko * ki:  # full-rank T' (e.g. EK-FAC): use the GEMM
            return None
        a, b = np.concatenate(left, axis=1), np.concatenate(right, axis=1)  # (ko, Σt), (ki, Σt)
        owner = np.repeat(np.arange(q), width)
        return cls(a.astype(dtype), b.astype(dtype), owner)

    def inner(self, u: np.ndarray, v: np.ndarray, q: int) -> np.ndarray:
        """``⟨A Bᵀ, U Vᵀ⟩ = Σ_{c,t} (Aᵀu_c)_t (Bᵀv_c)_t``: O((k_out + k_in) c t) per record."""
        au = np.tensordot(u, self.a, axes=([1], [0]))  # (m, c, Σt)
        bv = np.tensordot(v, self.b, axes=([1], [0]))  # (m, c, Σt)
        return self._by_query(np.einsum("mct,mct->tm", au, bv), q)

    def inner_int8(self, uv: np.ndarray, scale: np.ndarray, k_out: int, q: int) -> np.ndarray:
        """:meth:`inner` of int8-stored records straight from their bytes: ``uv`` (m, (k_out +
        k_in)·c) int8, each record's ``U`` then ``V`` row-major ((k, c): entry (o, j) at
        o·c + j), and its ``scale`` (m,), applied to the products instead of to ``U``.

        Rank 1: both factors are converted in one pass and contracted by one GEMM with a
        block-diagonal ``[A 0; 0 B]`` (at 10⁶ examples a third of the re-rank, against decoding
        first). Rank ``c > 1`` (a free-text run's records): each side is converted as stored
        and contracted with ``A`` or ``B`` alone, a ``(Σt, k) × (k, c)`` product a record; the
        block-diagonal form would multiply ``2c − 1`` zero blocks for each useful one (32× the
        work at rank 16, most of a free-text query's time)."""
        cols = self.a.shape[1]
        k_in = self.b.shape[0]
        c = uv.shape[1] // (k_out + k_in)  # the records' rank
        nu = k_out * c
        m = len(uv)
        dt = self.a.dtype
        if c == 1:
            w = np.zeros((uv.shape[1], 2 * cols), dt)
            w[:k_out, :cols] = self.a
            w[k_out:, cols:] = self.b
            y = uv.astype(dt) @ w  # (m, 2 Σt): Aᵀu, then Bᵀv
            per_col = y[:, :cols] * y[:, cols:]
        else:
            # converted as stored (a transposing conversion took twice as long), then one small
            # GEMM a record, Aᵀ U_i (Σt, c); in blocks of records whose floats stay in the cache
            # (one conversion of 4096 rank-16 records is 33 MB, allocated and faulted in anew)
            at, bt = np.ascontiguousarray(self.a.T), np.ascontiguousarray(self.b.T)
            per_col = np.empty((m, cols), dt)
            step = max(1, _INT8_BLOCK // (nu + k_in * c))
            for i in range(0, m, step):
                block = uv[i : i + step]
                u = block[:, :nu].astype(dt).reshape(-1, k_out, c)
                v = block[:, nu:].astype(dt).reshape(-1, k_in, c)
                per_col[i : i + step] = (np.matmul(at, u) * np.matmul(bt, v)).sum(2)
        return self._by_query((per_col * scale[:, None].astype(dt)).T, q)

    def _by_query(self, per_col: np.ndarray, q: int) -> np.ndarray:
        """(Σt, m) per-column products summed into each column's query: (q, m)."""
        owner = np.zeros((q, len(self.owner)), dtype=per_col.dtype)  # one-hot: query of a column
        owner[self.owner, np.arange(len(self.owner))] = 1.0
        return owner @ per_col


def factor_scores(
    test_sketches: Sequence[np.ndarray],
    factors: FactorStore,
    preconditioner: Preconditioner | Sequence | None = None,
    *,
    chunk: int = CHUNK,
    dtype: type = np.float32,
    with_bound: bool = True,
    records: str = "all",
) -> ExampleScores:
    """Brute-force influence scores of every training example, straight from the factors.

    ``score(q, i) = Σ_{records r of i} lr_r Σ_layers Σ_c u_{r,c}ᵀ T'_q v_{r,c}`` with
    ``T' = P*P T`` (module docstring) — equal to the full-sketch score when the factors are
    lossless, and within ``bound`` of it otherwise.

    Args:
        test_sketches: per layer (in the factor file's layer order), ``(k_out, k_in)`` or
            ``(q, k_out, k_in)`` test-side sketches (``AttributionRun.query_sketches``).
        factors: an open :class:`FactorStore`.
        preconditioner: a fitted :class:`Preconditioner` (identity/K-FAC/EK-FAC, from the same
            store), a sequence of per-layer objects with ``name`` and ``pullback`` (e.g.
            :class:`~traceprop_engine.attribution.precondition.woodbury.WoodburyPreconditioner`), or
            None (identity).
        chunk: records per streamed chunk.
        dtype: arithmetic dtype of the per-record products (float64 for exact checks).
        with_bound: also accumulate the guaranteed error bound.
        records: which records count (``IndexSettings.records``): ``all`` (each at its step's
            learning rate, the ``lr_r`` above) or ``last-epoch`` (an index's default;
            :func:`~traceprop_engine.attribution.score.record_weights.record_weights`).

    Returns:
        :class:`ExampleScores` (cosine similarity is not supported: the norms of the per-example
        sums need the full vectors).
    """
    names = factors.layer_names
    ts = _pulled_back(
        test_sketches, names, [layer.record_shape for layer in factors.layers], preconditioner
    )
    ids, rows, w = _per_example(factors.records(), records)
    q = ts[0].shape[0]
    out = np.zeros((q, len(ids)))
    bound = np.zeros((q, len(ids))) if with_bound else None
    # ‖T'‖_2 and ‖T'‖_F per layer and query, for the von Neumann bound
    norms = [(np.linalg.norm(t, ord=2, axis=(1, 2)), np.linalg.norm(t, axis=(1, 2))) for t in ts]
    ts_d = [t.astype(dtype) for t in ts]
    # a per-example test gradient has rank ≤ its number of target tokens and K-FAC keeps that
    # rank: then ⟨T', UVᵀ⟩ costs O((k_out + k_in) c t) per record instead of O(k_out k_in c)
    low = [LowRankTest.maybe(t, dtype) for t in ts]
    for start in range(0, factors.n_records, chunk):
        stop = min(start + chunk, factors.n_records)
        rec_scores = np.zeros((q, stop - start))
        rec_bound = np.zeros((q, stop - start)) if with_bound else None
        for li in range(len(names)):
            u, v = factors.factors(li, start, stop)
            u, v = u.astype(dtype, copy=False), v.astype(dtype, copy=False)
            if low[li] is not None:
                rec_scores += low[li].inner(u, v, q)
            else:
                rec_scores += _factored_inner(ts_d[li], u, v)
            if with_bound:
                fro, nuc = factors.residual_norms(li, start, stop)
                spec, tfro = norms[li]
                rec_bound += np.minimum(spec[:, None] * nuc[None], tfro[:, None] * fro[None])
        _accumulate(out, rows[start:stop], w[start:stop], rec_scores)
        if with_bound:
            _accumulate(bound, rows[start:stop], np.abs(w[start:stop]), rec_bound)
    return ExampleScores(ids, out, bound)


def sketch_scores(
    test_sketches: Sequence[np.ndarray],
    store: Store,
    preconditioner: Preconditioner | Sequence | None = None,
    *,
    chunk: int = CHUNK,
    dtype: type = np.float32,
    records: str = "all",
) -> ExampleScores:
    """The same brute-force scores from the full stored sketches: ``Σ lr ⟨T', Ŝ⟩`` (the reference;
    ``records`` as for :func:`factor_scores`)."""
    if store.sketch != "factored":
        raise ConfigError(
            f"{store.path} holds dense sketches; sketch_scores works on factored stores"
        )
    names = [layer.name for layer in store.layers]
    ts = _pulled_back(
        test_sketches, names, [layer.record_shape for layer in store.layers], preconditioner
    )
    ids, rows, w = _per_example(store.records(), records)
    q = ts[0].shape[0]
    out = np.zeros((q, len(ids)))
    flat = [t.reshape(q, -1).T.astype(dtype) for t in ts]  # (k_out·k_in, q)
    for start in range(0, store.n_records, chunk):
        stop = min(start + chunk, store.n_records)
        rec_scores = np.zeros((stop - start, q))
        for li in range(len(names)):
            x = store.sketches(li, start, stop)
            rec_scores += x.reshape(x.shape[0], -1).astype(dtype, copy=False) @ flat[li]
        _accumulate(out, rows[start:stop], w[start:stop], rec_scores.T)
    return ExampleScores(ids, out)
