"""The Woodbury (LoRIF) preconditioner: ``H^{-1/2}`` of one layer from a rank-r truncated SVD.

An alternative to the K-FAC family of
:mod:`traceprop_engine.attribution.precondition.preconditioner` for stores of rank-c factors
(:mod:`traceprop_engine.store.compact`): fitted from a sample of a layer's flattened sketches,
applied in O(D r) without a D×D matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from traceprop_engine.errors import ConfigError, StoreError

from .layer import DEFAULT_DAMPING, check_damping

__all__ = ["WoodburyPreconditioner", "fit_woodbury", "truncated_svd"]


def truncated_svd(
    g: np.ndarray, rank: int, *, oversample: int = 10, n_iter: int = 4, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``rank`` singular values and right singular vectors of ``g`` (n, D).

    Exact (LAPACK) when ``rank + oversample`` reaches ``min(n, D)``; otherwise the randomized
    range finder of Halko, Martinsson & Tropp (2011) with ``n_iter`` QR-stabilised power
    iterations, which never forms a D×D matrix: memory O((n + D)(rank + oversample)).

    Returns:
        ``(s, V)``: (r,) descending singular values and (D, r) orthonormal columns,
        ``r = min(rank, n, D)``, float64.
    """
    g = np.asarray(g, dtype=np.float64)
    n, d = g.shape
    r = min(int(rank), n, d)
    ell = r + int(oversample)
    if ell >= min(n, d):
        _, s, vt = np.linalg.svd(g, full_matrices=False)
        return s[:r], vt[:r].T.copy()
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g @ rng.standard_normal((d, ell)))  # (n, ell) range of g
    for _ in range(int(n_iter)):  # power iterations sharpen a slowly decaying spectrum
        w, _ = np.linalg.qr(g.T @ q)  # (D, ell)
        q, _ = np.linalg.qr(g @ w)  # (n, ell)
    _, s, vt = np.linalg.svd(q.T @ g, full_matrices=False)  # (ell, D) small SVD
    return s[:r], vt[:r].T.copy()


@dataclass(frozen=True, eq=False)
class WoodburyPreconditioner:
    """``H^{-1/2}`` of one layer from a rank-``r`` truncated SVD, applied with Woodbury.

    ``H = V diag(e) Vᵀ + λ I`` with ``e = s²/n`` the top-``r`` eigenvalues of the sample's
    second moment ``(1/n) GᵀG`` (directions outside span V are treated as having eigenvalue 0,
    so they get only the damping). Because ``V`` has orthonormal columns,

    - ``H^{-1/2} x = λ^{-1/2} x + V [((e+λ)^{-1/2} − λ^{-1/2}) ⊙ Vᵀx]``
    - ``H^{-1} x = λ^{-1} x + V [((e+λ)^{-1} − λ^{-1}) ⊙ Vᵀx]``

    in O(D r) memory and time per vector — no D×D matrix (the LoRIF preconditioner). Same
    ``apply``/``pullback`` interface as :class:`LayerPreconditioner`; vectors are the row-major
    flattening of the sketch (``vec(Ŝ)[o*k_in + j] = Ŝ[o, j]``).

    Attributes:
        name: layer name.
        shape: per-record sketch shape, ``(k_out, k_in)`` or ``(k,)``.
        basis: (D, r) orthonormal ``V``.
        eigenvalues: (r,) ``e = s²/n``.
        lam: absolute damping ``λ > 0``.
        info: fitted constants (rank, λ, captured fraction of the trace) for reports.
    """

    name: str
    shape: tuple[int, ...]
    basis: np.ndarray
    eigenvalues: np.ndarray
    lam: float
    info: dict = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return int(np.prod(self.shape))

    @property
    def rank(self) -> int:
        return int(self.eigenvalues.shape[0])

    def _flat(self, x: np.ndarray, dtype) -> np.ndarray:
        x = np.asarray(x, dtype=dtype)
        if x.shape[1:] != self.shape:
            raise StoreError(
                f"layer {self.name!r}: sketches have per-record shape {x.shape[1:]}, the Woodbury "
                f"preconditioner was fitted for {self.shape}; refit it from this layer"
            )
        return x.reshape(x.shape[0], -1)

    def _power(self, x: np.ndarray, p: float, dtype) -> np.ndarray:
        v = self.basis.astype(dtype)
        coef = ((self.eigenvalues + self.lam) ** p - self.lam**p).astype(dtype)
        return dtype(self.lam**p) * x + ((x @ v) * coef) @ v.T  # (n, D)

    def apply(self, sketches: np.ndarray, dtype: type = np.float32) -> np.ndarray:
        """(n, *shape) sketches → (n, D) vectors ``H^{-1/2} vec(Ŝ)``."""
        return np.ascontiguousarray(self._power(self._flat(sketches, dtype), -0.5, dtype))

    def pullback(self, test_sketches: np.ndarray) -> np.ndarray:
        """``H⁻¹ vec(T)`` reshaped to (q, *shape), float64 (see :meth:`LayerPreconditioner.pullback`)."""
        t = self._flat(test_sketches, np.float64)
        return self._power(t, -1.0, np.float64).reshape(t.shape[0], *self.shape)

    def dense_inverse_sqrt(self) -> np.ndarray:
        """The explicit (D, D) ``H^{-1/2}`` — for tests and small D only."""
        return self._power(np.eye(self.dim), -0.5, np.float64)


def fit_woodbury(
    vectors_sample: np.ndarray,
    rank: int,
    damping: float | None = None,
    *,
    shape: tuple[int, ...] | None = None,
    name: str = "",
    oversample: int = 10,
    n_iter: int = 4,
    seed: int = 0,
) -> WoodburyPreconditioner:
    """Fit ``H = (1/n) GᵀG + λ I`` from a sample of a layer's sketches, truncated to rank ``r``.

    Args:
        vectors_sample: (n, D) flattened sketches ``G`` (or (n, *shape), flattened row-major).
        rank: ``r``, the number of eigen-directions kept (clamped to ``min(n, D)``).
        damping: as elsewhere in this module, a fraction of the mean eigenvalue of
            ``(1/n) GᵀG`` (its trace / D, from the *full* sample, not the truncation):
            ``λ = damping × ‖G‖²_F / (n D)``; default 0.1.
        shape: per-record sketch shape (default ``(D,)`` or the trailing shape of the sample).
        name: layer name.
        oversample, n_iter, seed: randomized SVD parameters (:func:`truncated_svd`).

    Returns:
        A :class:`WoodburyPreconditioner` holding O(D r) numbers.

    Raises:
        ConfigError: bad rank/damping, an all-zero sample.
    """
    damping = check_damping(damping)
    g = np.asarray(vectors_sample, dtype=np.float64)
    if g.ndim < 2 or g.shape[0] == 0:
        raise ConfigError(
            f"layer {name!r}: fit_woodbury needs a non-empty (n, D) sample, got shape {g.shape}"
        )
    if shape is None:
        shape = g.shape[1:]
    g = g.reshape(g.shape[0], -1)
    shape = tuple(int(x) for x in shape)
    if int(np.prod(shape)) != g.shape[1]:
        raise ConfigError(
            f"layer {name!r}: shape {shape} does not match the sample's dimension {g.shape[1]}"
        )
    if not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ConfigError(
            f"layer {name!r}: the Woodbury rank must be a positive integer, got {rank!r}"
        )
    n, d = g.shape
    total = float(np.einsum("ij,ij->", g, g)) / n  # tr((1/n) GᵀG)
    lam = damping * total / d
    if not lam > 0:
        raise ConfigError(
            f"layer {name!r}: the Woodbury damping is {lam!r}; it must be > 0 (set damping > 0, "
            f"default {DEFAULT_DAMPING}, and check that the sample is not all zeros)"
        )
    s, v = truncated_svd(g, int(rank), oversample=oversample, n_iter=n_iter, seed=seed)
    e = s**2 / n
    info = {
        "rank": int(e.shape[0]),
        "lambda": lam,
        "damping": damping,
        "n_sample": n,
        "trace_captured": float(e.sum() / total) if total > 0 else 0.0,
    }
    return WoodburyPreconditioner(name, shape, v, e, float(lam), info)
