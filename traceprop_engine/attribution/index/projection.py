"""The index projection fitted to the store: the top principal directions of the records.

The FAISS index holds an ``m × m`` Kronecker projection ``P_L X P_Rᵀ`` of each (preconditioned)
record ``X`` per layer (``index_side``, default m = 16: 256 numbers a layer), reduced to the top
``index_dims`` (256) principal directions over all layers (:func:`fit_reduction`), and only
proposes candidates for the exact re-rank. Gradients of one model concentrate in few
directions, so ``P_L`` and ``P_R`` are not random (a JL sketch ranks real records poorly) but
the top-m eigenvectors of the records' left and right second moments ``Σ X̂ X̂ᵀ``, ``Σ X̂ᵀ X̂``
(``X̂`` the record normalised to unit norm, as cosine scoring weighs them). The recall each
choice gives: benchmarks/README.md §2b.

The ``m²`` numbers of a layer may be split unevenly between its sides (:func:`split_sides`):
the side whose records spread over more directions (on the models measured: the output side)
gets up to ``4m`` of them, the other side correspondingly fewer.

Layers stored as rank-r factors with a matrix-product preconditioner (identity, K-FAC) use
``X' = (L U)(Rᵀ V)ᵀ`` without rebuilding ``X``; other layers keep the random projection. The
projection is saved with the preconditioner, so an index and its queries always agree.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np

from ..precondition.layer import factor_grams, fit_reads, left_multiply, on_parts
from ..precondition.preconditioner import Preconditioner

_CHUNK = 8192  # records computed on at a time (the moments: up to FIT_COLUMNS, fit_reads)


def transformed_factors(lp, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Factors of ``L (U Vᵀ) R``: ``(L U, Rᵀ V)`` (float64); identity leaves them as they are."""
    if lp.left is None:
        return u.astype(np.float64), v.astype(np.float64)
    left, right_t = lp.left, lp.right.T
    lu = np.empty((len(u), left.shape[0], u.shape[2]))
    rv = np.empty((len(v), right_t.shape[0], v.shape[2]))

    def part(a: int, b: int) -> None:
        left_multiply(left, u[a:b].astype(np.float64), out=lu[a:b])
        left_multiply(right_t, v[a:b].astype(np.float64), out=rv[a:b])

    on_parts(part, len(u), u.shape[2])
    return lu, rv


def side_moments(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Σ X̂ X̂ᵀ, Σ X̂ᵀ X̂)`` of records ``X = U Vᵀ`` (u (n, k_out, r), v (n, k_in, r), float64),
    each normalised to unit norm ``X̂`` as cosine scoring weighs them."""
    gu, gv = factor_grams(u), factor_grams(v)
    w = 1.0 / np.maximum((gu * gv).sum(axis=(1, 2)), 1e-300)  # 1 / ‖X‖²
    # Σ X X^T = Σ U (VᵀV) Uᵀ and Σ XᵀX = Σ V (UᵀU) Vᵀ: one GEMM over the stack each
    return _weighted_outer(u, gv, w), _weighted_outer(v, gu, w)


def _weighted_outer(x: np.ndarray, g: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``Σ_n w_n X_n G_n X_nᵀ`` of a stack (x (n, k, r), g (n, r, r)): per part of the records
    one (k, n·r) · (n·r, k) GEMM, the parts summed (``np.einsum`` with ``optimize`` took
    several times longer at r 16)."""
    k, r = x.shape[1], x.shape[2]
    if r == 1:  # Σ_n (w_n g_n) x_n x_nᵀ: one 2-D GEMM
        x1 = x[:, :, 0]
        return (x1 * (w * g[:, 0, 0])[:, None]).T @ x1

    def part(a: int, b: int) -> np.ndarray:
        xs = x[a:b]
        y = np.matmul(xs * w[a:b, None, None], g[a:b])  # (m, k, r)
        flat = (b - a) * r
        return y.transpose(1, 0, 2).reshape(k, flat) @ xs.transpose(1, 0, 2).reshape(k, flat).T

    return sum(on_parts(part, len(x)))


def fit_index_projection(store, pre: Preconditioner) -> Preconditioner:
    """``pre`` with each eligible layer's random index projection replaced by the principal one."""
    layers = list(pre.layers)
    for li, (info, lp) in enumerate(zip(store.layers, layers, strict=True)):
        if lp.index_left is None or not info.rank or lp.scale is not None:
            continue
        m = lp.index_left.shape[0]
        ml = np.zeros((info.k_out, info.k_out))
        mr = np.zeros((info.k_in, info.k_in))
        for u, v in fit_reads(partial(store.factors, li), store.n_records, info.rank, _CHUNK):
            dl, dr = side_moments(*transformed_factors(lp, u, v))
            ml += dl
            mr += dr
        if not np.isfinite(ml).all() or not ml.any() or not np.isfinite(mr).all():
            continue
        el, vl = np.linalg.eigh(ml)
        er, vr = np.linalg.eigh(mr)
        a, b = split_sides(el[::-1], er[::-1], m)
        top_l = vl[:, ::-1][:, :a].T  # (a, k_out), orthonormal rows
        top_r = vr[:, ::-1][:, :b].T  # (b, k_in)
        layers[li] = dataclasses.replace(lp, index_left=top_l, index_right=top_r)
    return Preconditioner(pre.kind, layers, pre.damping, pre.reduce)


SIDE_FACTORS = (1, 2, 4)
"""How an ``m × m`` index projection may split its ``m²`` numbers between a layer's sides:
``(f·m) × ⌊m/f⌋`` or ``⌊m/f⌋ × (f·m)`` (never more than ``m²``), the balanced split first
(it wins ties)."""


def split_sides(e_out: np.ndarray, e_in: np.ndarray, m: int) -> tuple[int, int]:
    """Directions ``(a, b)`` to keep on the output and input side, ``a·b ≤ m²``: the split of
    :data:`SIDE_FACTORS` that keeps the largest share of the records' energy, estimated as the
    product of each side's captured share (``e_*``: the side's second-moment eigenvalues,
    largest first; exact for rank-1 records whose sides are independent).

    Why: a layer's two sides are not alike: a few directions hold most of an input side's
    energy but much less of an output side's (the LM head's, where the answer token's identity
    lives), so the same m² numbers go further split this way (benchmarks/README.md §2b).
    """
    c_out = np.cumsum(np.maximum(e_out, 0.0))
    c_in = np.cumsum(np.maximum(e_in, 0.0))
    if c_out[-1] <= 0 or c_in[-1] <= 0:
        return min(m, len(e_out)), min(m, len(e_in))
    c_out, c_in = c_out / c_out[-1], c_in / c_in[-1]
    best, best_share = None, -1.0
    splits = [(m * f, m // f) for f in SIDE_FACTORS] + [(m // f, m * f) for f in SIDE_FACTORS[1:]]
    for a, b in splits:
        if a < 1 or b < 1:
            continue
        a, b = min(a, len(e_out)), min(b, len(e_in))
        share = float(c_out[a - 1] * c_in[b - 1])
        if share > best_share + 1e-9:
            best, best_share = (a, b), share
    return best


REDUCE_SAMPLE = 8192
"""Records the index reduction is fitted on (evenly spaced chunks of the store)."""
_REDUCE_CHUNKS = 8
_OVERSAMPLE = 16


def principal_basis(x: np.ndarray, d: int, seed: int = 0) -> np.ndarray:
    """(F, d') orthonormal columns spanning the top-``d`` right singular directions of ``x``
    (n, F): exact when ``x`` has ≤ d rows (its row space) or few columns, else a randomized
    range finder with one power iteration (Halko et al. 2011)."""
    x = np.asarray(x, dtype=np.float32)
    n, f = x.shape
    if n <= d:  # the row space itself: inner products with these rows are kept exactly
        _, s, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
        keep = s > 1e-6 * max(float(s[:1].max(initial=0.0)), 1e-300)
        return vt[keep].T.astype(np.float32)
    if f <= 2 * (d + _OVERSAMPLE):
        _, v = np.linalg.eigh(x.T.astype(np.float64) @ x)
        return v[:, ::-1][:, :d].astype(np.float32)
    omega = np.random.default_rng(seed).standard_normal((f, d + _OVERSAMPLE)).astype(np.float32)
    y = np.linalg.qr(x @ omega)[0]
    y = np.linalg.qr(x @ (x.T @ y))[0]  # one power iteration sharpens the top directions
    _, _, vt = np.linalg.svd((y.T @ x).astype(np.float64), full_matrices=False)
    return vt[:d].T.astype(np.float32)


def fit_reduction(store, pre: Preconditioner, dims: int, cosine: bool, vectors) -> Preconditioner:
    """``pre`` with a reduction of its concatenated index vectors to their top-``dims``
    principal directions, fitted on up to :data:`REDUCE_SAMPLE` records (``vectors(a, b)``: the
    full index vectors of records ``a:b``), each normalised to unit length when ``cosine``.

    The m × m projections keep each layer's principal directions; this keeps the directions
    that all layers' vectors share (a query and its candidates differ along few of them).
    """
    n = store.n_records
    size = min(REDUCE_SAMPLE, n)
    per = -(-size // _REDUCE_CHUNKS)
    starts = np.unique(np.linspace(0, max(n - per, 0), _REDUCE_CHUNKS).astype(np.int64))
    x = np.concatenate([vectors(int(a), int(min(a + per, n))) for a in starts])
    if cosine:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        x = x[norms[:, 0] > 0] / norms[norms[:, 0] > 0]
    if not len(x) or not np.isfinite(x).all():
        return pre
    basis = principal_basis(x, dims)
    if basis.shape[1] == 0:
        return pre
    return Preconditioner(pre.kind, pre.layers, pre.damping, basis)
