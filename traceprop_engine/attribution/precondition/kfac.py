"""Fitting one layer's ``H^{-1/2}`` from its K-FAC statistics: identity, K-FAC, EK-FAC, dense.

The kinds and their formulas are described in
:mod:`traceprop_engine.attribution.precondition.preconditioner`; :func:`fit_layer` checks the
statistics, then dispatches to one named step per kind.
"""

from __future__ import annotations

import logging

import numpy as np

from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import PreconditionerKind

from .layer import (
    DEFAULT_DAMPING,
    EkfacMoments,
    LayerPreconditioner,
    check_damping,
    parse_kind,
    symmetrize,
)

__all__ = ["fit_layer", "inverse_sqrt_psd"]

log = logging.getLogger(__name__)


def inverse_sqrt_psd(m: np.ndarray, damping_abs: float) -> np.ndarray:
    """``(M + λ I)^{-1/2}`` of a symmetric PSD matrix through ``eigh``.

    Tiny negative eigenvalues from round-off are clipped to 0 before damping.

    Args:
        m: symmetric (k, k) matrix.
        damping_abs: absolute damping ``λ`` added to every eigenvalue.

    Returns:
        The (k, k) float64 symmetric inverse square root.

    Raises:
        ConfigError: if ``M + λ I`` is singular (all-zero factor and no damping).
    """
    m = np.asarray(m, dtype=np.float64)
    evals, evecs = np.linalg.eigh((m + m.T) / 2)  # symmetrise against round-off
    evals = np.clip(evals, 0.0, None) + damping_abs
    if np.any(evals <= 0):
        raise ConfigError(
            "a covariance factor is singular and damping is 0; set damping > 0 "
            f"(default {DEFAULT_DAMPING}) or use the identity preconditioner"
        )
    return (evecs / np.sqrt(evals)) @ evecs.T


def fit_layer(
    kind: PreconditionerKind | str,
    A: np.ndarray | None,
    S: np.ndarray | None,
    n_tokens: int,
    *,
    mean_sq_norm: float | None = None,
    sketch_moments: EkfacMoments | None = None,
    damping: float | None = None,
    shape: tuple[int, ...] | None = None,
    name: str = "",
    layer_scale: bool = True,
) -> LayerPreconditioner:
    """Fit one layer's preconditioner from its K-FAC sums (see the module docstring).

    Args:
        kind: identity, kfac or ekfac.
        A: ``Σ_t ã ãᵀ`` (k_in, k_in), or None for a dense sketch layer.
        S: ``Σ_t g̃ g̃ᵀ`` (k_out, k_out), or None for a dense sketch layer.
        n_tokens: number of tokens summed into ``A`` and ``S``.
        mean_sq_norm: ``mean_i ‖Ŝ_i‖²_F`` over the layer's records (K-FAC calibration, dense
            K-FAC). Taken from ``sketch_moments`` when not given.
        sketch_moments: accumulated :class:`EkfacMoments` (required for EK-FAC).
        damping: fraction of the mean eigenvalue added as damping; default 0.1.
        shape: per-record sketch shape; inferred from ``A``/``S`` or ``sketch_moments``.
        name: layer name, kept for error messages and persistence.
        layer_scale: the per-layer trace normalisation of a factored K-FAC / EK-FAC fit; False
            keeps the per-example Fisher's own scale (``IndexSettings.weighting='fisher'``).

    Returns:
        The fitted :class:`LayerPreconditioner`.

    Raises:
        ConfigError: bad kind/damping, missing inputs for the chosen kind.
        StoreError: inconsistent statistics (zero tokens, non-square factors).
    """
    kind = parse_kind(kind)
    damping = check_damping(damping)
    dense = A is None and S is None
    if not dense and (A is None or S is None):
        raise StoreError(f"layer {name!r}: only one of the K-FAC factors A, S is present")
    shape = _layer_shape(A, S, sketch_moments, shape, name)
    if kind is PreconditionerKind.IDENTITY:
        return LayerPreconditioner(name, kind, shape)
    if mean_sq_norm is None and sketch_moments is not None:
        mean_sq_norm = sketch_moments.mean_sq_norm
    if dense:
        return _fit_dense(kind, shape, mean_sq_norm, sketch_moments, damping, name)
    if n_tokens <= 0 and not np.any(A) and not np.any(S):
        # no statistics batch reached the layer (e.g. it took no part in the first backward):
        # nothing to whiten it with, the other layers are fitted as usual
        unfit = "its K-FAC statistics were never accumulated (no statistics batch reached it)"
    else:
        a_bar, s_bar = _factor_means(A, S, n_tokens, shape, name)
        unfit = _without_statistics(kind, a_bar, s_bar, mean_sq_norm, sketch_moments)
    if unfit:
        # e.g. a LoRA A matrix: its output gradient is 0 while B is still 0, so statistics
        # batches taken then hold nothing to whiten it with; scored as recorded
        log.warning("layer %s: %s; it is scored unwhitened (identity)", name, unfit)
        return LayerPreconditioner(name, PreconditionerKind.IDENTITY, shape, info={"unfit": unfit})
    if kind is PreconditionerKind.KFAC:  # the moments serve only its trace normalisation
        moments = sketch_moments if layer_scale else None
        return _fit_kfac(a_bar, s_bar, shape, mean_sq_norm, damping, name, moments)
    return _fit_ekfac(sketch_moments, shape, damping, name, layer_scale)


def _without_statistics(kind, a_bar, s_bar, mean_sq_norm, moments) -> str:
    """Why this layer cannot be whitened (its statistics or records hold no gradient), or ''."""
    if np.trace(a_bar) <= 0 or np.trace(s_bar) <= 0:
        return "its K-FAC statistics are all zero (no gradient in the statistics batches)"
    msq = mean_sq_norm if mean_sq_norm is not None else getattr(moments, "mean_sq_norm", None)
    if msq is not None and msq <= 0:
        return "its records are all zero (it never received a gradient)"
    if kind is PreconditionerKind.EKFAC and moments is not None and not moments.mean.sum() > 0:
        return "its records are all zero in the factors' eigenbases"
    return ""


def _layer_scale(mean_sq_norm: float, preconditioned_sq_norm: float, name: str) -> float:
    """The per-layer trace normalisation ``f``: ``f² · mean_i ‖H^{-1/2} Ŝ_i‖² = mean_i ‖Ŝ_i‖²``,
    so each layer keeps identity's share of the summed score and only its directions are
    reweighted (heavy damping then tends to identity itself, not to a per-layer rescaling)."""
    if not preconditioned_sq_norm > 0 or not mean_sq_norm > 0:
        raise ConfigError(
            f"layer {name!r}: the layer's sketches are all zero (mean ‖Ŝ‖² = {mean_sq_norm:.3g}); "
            "it received no gradient — drop it from tracking or use the identity preconditioner"
        )
    return float(np.sqrt(mean_sq_norm / preconditioned_sq_norm))


def _layer_shape(A, S, moments: EkfacMoments | None, shape, name: str) -> tuple[int, ...]:
    """The per-record sketch shape: given, else from the factors, else from the moments."""
    if shape is None:
        if A is not None:
            shape = (np.shape(S)[0], np.shape(A)[0])
        elif moments is not None:
            shape = moments.shape
        else:
            raise ConfigError(f"layer {name!r}: pass shape=(k,) for a dense layer")
    return tuple(int(s) for s in shape)


def _fit_dense(
    kind: PreconditionerKind,
    shape: tuple[int, ...],
    mean_sq_norm: float | None,
    moments: EkfacMoments | None,
    damping: float,
    name: str,
) -> LayerPreconditioner:
    """A dense layer: isotropic (K-FAC) or diagonal (EK-FAC) Fisher (see the module docstring)."""
    if kind is PreconditionerKind.KFAC:
        if mean_sq_norm is None or mean_sq_norm <= 0:
            raise ConfigError(
                f"dense layer {name!r}: K-FAC (isotropic) needs mean_sq_norm > 0, got "
                f"{mean_sq_norm!r}; pass the store's mean squared sketch norm"
            )
        # isotropic: the trace normalisation (with moments) makes it the identity exactly
        var = 1.0 if moments is not None else (1.0 + damping) * mean_sq_norm / shape[0]
        return LayerPreconditioner(
            name,
            kind,
            shape,
            scale=np.full(shape, 1.0 / np.sqrt(var)),
            info={"mean_sq_norm": float(mean_sq_norm), "damping": damping},
        )
    lam_diag = _moments_for(kind, moments, shape, name)
    lam, inv, f = _damped_inverse(lam_diag, damping, name)
    return LayerPreconditioner(
        name,
        kind,
        shape,
        scale=f * np.sqrt(inv),
        info={"lambda": lam, "damping": damping, "layer_scale": f},
    )


def _factor_means(A, S, n_tokens: int, shape, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``Ā = A / n_tokens`` and ``S̄ = S / n_tokens``, symmetrised, after checking their shapes."""
    a_mat, s_mat = np.asarray(A, dtype=np.float64), np.asarray(S, dtype=np.float64)
    if a_mat.shape != (shape[1], shape[1]) or s_mat.shape != (shape[0], shape[0]):
        raise StoreError(
            f"layer {name!r}: factor shapes A{a_mat.shape}, S{s_mat.shape} do not match the "
            f"sketch shape {shape}; the store is inconsistent"
        )
    if n_tokens <= 0:
        raise StoreError(
            f"layer {name!r}: n_tokens = {n_tokens} but its K-FAC statistics are not zero; the "
            "store is inconsistent — re-run the training, or use the identity preconditioner"
        )
    return symmetrize(a_mat) / n_tokens, symmetrize(s_mat) / n_tokens


def _fit_kfac(
    a_bar: np.ndarray,
    s_bar: np.ndarray,
    shape: tuple[int, ...],
    mean_sq_norm: float | None,
    damping: float,
    name: str,
    moments: EkfacMoments | None = None,
) -> LayerPreconditioner:
    """K-FAC with the trace calibration ``c`` and per-factor damping (see the module docstring);
    with ``moments`` (the records' second moments in the factors' eigenbases) also the per-layer
    trace normalisation: ``mean_i ‖L Ŝ_i R‖² = Σ_ab Λ_ab / ((σ_a + λ_S)(α_b + λ_A))`` exactly."""
    if mean_sq_norm is None:
        raise ConfigError(
            f"layer {name!r}: K-FAC needs mean_sq_norm (mean ‖Ŝ_i‖² over records) for its "
            "trace calibration; pass it from the store or pass sketch_moments"
        )
    tr_a, tr_s = float(np.trace(a_bar)), float(np.trace(s_bar))
    if tr_a <= 0 or tr_s <= 0 or mean_sq_norm <= 0:
        raise ConfigError(
            f"layer {name!r}: a covariance factor or the sketches are all zero "
            f"(tr Ā={tr_a:.3g}, tr S̄={tr_s:.3g}, mean ‖Ŝ‖²={mean_sq_norm:.3g}); the layer "
            "received no gradient — drop it from tracking or use the identity preconditioner"
        )
    c = mean_sq_norm / (tr_s * tr_a)
    s_bar = c * s_bar
    lam_a, lam_s = damping * tr_a / shape[1], damping * c * tr_s / shape[0]
    left = inverse_sqrt_psd(s_bar, lam_s)
    info = {"c": c, "lambda_A": lam_a, "lambda_S": lam_s, "damping": damping}
    if moments is not None:
        if moments.shape != shape:
            raise StoreError(
                f"layer {name!r}: moments have shape {moments.shape}, sketches {shape}; "
                "they were accumulated for another layer"
            )
        w_s = np.clip(np.linalg.eigvalsh(s_bar), 0.0, None) + lam_s  # ascending: Q_S's order
        w_a = np.clip(np.linalg.eigvalsh(a_bar), 0.0, None) + lam_a
        pre_sq = float((moments.mean / np.outer(w_s, w_a)).sum())
        info["layer_scale"] = _layer_scale(mean_sq_norm, pre_sq, name)
        left = left * info["layer_scale"]
    return LayerPreconditioner(
        name,
        PreconditionerKind.KFAC,
        shape,
        left=left,
        right=inverse_sqrt_psd(a_bar, lam_a),
        info=info,
    )


def _fit_ekfac(
    moments: EkfacMoments | None,
    shape: tuple[int, ...],
    damping: float,
    name: str,
    layer_scale: bool = True,
) -> LayerPreconditioner:
    """EK-FAC: the K-FAC eigenbases with the streamed eigenvalue correction ``Λ`` (without
    ``layer_scale``, no trace normalisation: ``f = 1``)."""
    kind = PreconditionerKind.EKFAC
    lam_ab = _moments_for(kind, moments, shape, name)
    lam, inv, f = _damped_inverse(lam_ab, damping, name)
    f = f if layer_scale else 1.0
    return LayerPreconditioner(
        name,
        kind,
        shape,
        left=moments.q_s.T.copy(),
        right=moments.q_a.copy(),
        scale=f * np.sqrt(inv),
        info={"lambda": lam, "damping": damping, "layer_scale": f},
    )


def _moments_for(kind, moments: EkfacMoments | None, shape, name) -> np.ndarray:
    if moments is None:
        raise ConfigError(
            f"layer {name!r}: {kind.value} needs sketch_moments (an EkfacMoments streamed over "
            "the layer's stored sketches)"
        )
    if moments.shape != shape:
        raise StoreError(
            f"layer {name!r}: moments have shape {moments.shape}, sketches {shape}; "
            "they were accumulated for another layer"
        )
    return moments.mean


def _damped_inverse(eig: np.ndarray, damping: float, name: str) -> tuple[float, np.ndarray, float]:
    """``(λ, 1/(Λ + λ), f)`` for eigenvalues ``Λ`` in a fixed basis: ``λ = damping · mean(Λ)``
    and the trace normalisation ``f`` that keeps the layer's mean squared norm."""
    lam = damping * float(eig.mean())
    inv = 1.0 / _positive(eig + lam, name)
    return lam, inv, _layer_scale(float(eig.sum()), float((eig * inv).sum()), name)


def _positive(x: np.ndarray, name: str) -> np.ndarray:
    if np.any(x <= 0):
        raise ConfigError(
            f"layer {name!r}: some eigenvalues are 0 and damping is 0; set damping > 0 "
            f"(default {DEFAULT_DAMPING})"
        )
    return x
