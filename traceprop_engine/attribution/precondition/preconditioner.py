"""Preconditioners: turn stored sketches into vectors whose inner product is the influence score.

The score of DESIGN §1 is ``τ(test, i) = Σ_layers ⟨Ŝ_test, H⁻¹ Ŝ_i⟩``. We split ``H⁻¹`` symmetrically,
``v = H^{-1/2} vec(Ŝ)``, and apply the same map to the training and the test side, so the score is
a plain inner product ``⟨v_test, v_i⟩`` — exactly what FAISS searches.

Conventions (everything here works on numpy arrays; the store wires them in):

- A factored sketch is ``Ŝ ∈ R^{k_out×k_in}`` and is flattened row-major (C order), so
  ``vec(Ŝ)[o*k_in + j] = Ŝ[o, j]``. With that ordering ``(S ⊗ A) vec(Ŝ) = vec(S Ŝ A)`` for
  symmetric ``A`` (``np.kron(S, A)``), which is what the tests check against.
- ``A = Σ_t ã ãᵀ`` (k_in×k_in) and ``S = Σ_t g̃ g̃ᵀ`` (k_out×k_out) are token sums; the means are
  ``Ā = A / n_tokens``, ``S̄ = S / n_tokens``.

Kinds:

- ``identity``: ``v = vec(Ŝ)`` (TracIn / gradient dot product).
- ``kfac``: ``H = c S̄ ⊗ Ā`` with the *trace calibration*
  ``c = mean_i ‖Ŝ_i‖²_F / (tr S̄ · tr Ā)``. The token-level factors describe a per-token Fisher;
  the per-example Fisher in sketch space has trace ``mean_i ‖Ŝ_i‖²_F`` (the sum of its
  eigenvalues), which depends on sequence length and loss scaling. Rescaling makes
  ``tr H`` equal that empirical trace, so every layer's ``H⁻¹`` is on the same scale as the
  per-example Fisher and per-layer scores can be summed meaningfully. Per-factor damping:
  ``λ_F = damping × tr(F)/k`` (the factor's mean eigenvalue), default ``damping = 0.1``.
  ``v = f (c S̄ + λ_S I)^{-1/2} Ŝ (Ā + λ_A I)^{-1/2}``.
- ``ekfac``: eigenbases ``Q_A, Q_S`` of ``Ā, S̄``; eigenvalue correction
  ``Λ_ab = mean_i (Q_Sᵀ Ŝ_i Q_A)_ab²`` streamed from the stored sketches (:class:`EkfacMoments`);
  ``v = f (Q_Sᵀ Ŝ Q_A) / sqrt(Λ + λ)``, ``λ = damping × mean(Λ)``.
- **per-layer trace normalisation** ``f`` (K-FAC and EK-FAC, whenever the records' moments are
  streamed, which the store path always does): ``f² mean_i ‖H^{-1/2} Ŝ_i‖² = mean_i ‖Ŝ_i‖²``
  (for K-FAC exactly ``Σ_ab Λ_ab / ((σ_a+λ_S)(α_b+λ_A))`` from the moments in its factors'
  eigenbases): each layer keeps identity's share of the score, only directions inside it are
  reweighted, heavy damping gives identity. Without it every whitened layer weighs about the
  same (facts24: the LM head's 86 % of the energy diluted, LDS 0.826 → 0.629; EVAL.md §1e).
- dense sketches (``x ∈ R^k``, no covariance): ``identity`` is ``v = x``; ``ekfac`` the diagonal
  Fisher in the coordinate basis, ``v_j = f x_j / sqrt(Λ_j + λ)``, ``Λ_j = mean_i x_ij²``,
  ``λ = damping × mean(Λ)``; ``kfac`` the isotropic Fisher, which the trace normalisation makes
  the identity (without moments: ``v = x / sqrt((1 + damping) m / k)``, ``m = mean_i ‖x_i‖²``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import PreconditionerKind, parse_choice

__all__ = [
    "DEFAULT_DAMPING",
    "EkfacMoments",
    "LayerPreconditioner",
    "LayerStats",
    "Preconditioner",
    "check_damping",
    "parse_kind",
    "symmetrize",
]

DEFAULT_DAMPING = 0.1
"""Damping as a fraction of each factor's mean eigenvalue (a common heuristic; overridable)."""

_FORMAT = "traceprop-preconditioner"
_FORMAT_VERSION = 1


def parse_kind(kind: PreconditionerKind | str) -> PreconditionerKind:
    return parse_choice(PreconditionerKind, kind, "preconditioner")


def check_damping(damping: float | None) -> float:
    d = DEFAULT_DAMPING if damping is None else float(damping)
    if not np.isfinite(d) or d < 0:
        raise ConfigError(
            f"damping must be a finite number >= 0 (a fraction of the mean eigenvalue), got "
            f"{damping!r}; the default is {DEFAULT_DAMPING}"
        )
    return d


class EkfacMoments:
    """Streamed second moments of sketches in the K-FAC eigenbasis (the EK-FAC correction).

    Construct it from the layer's covariance (:meth:`from_factors`) or with ``q_s = q_a = None``
    for a dense sketch layer (coordinate basis), then feed the stored sketches chunk by chunk
    with :meth:`update`. :attr:`mean` is ``Λ = mean_i (Q_Sᵀ Ŝ_i Q_A)²`` (or ``mean_i x_i²``).
    Because the rotation is orthogonal, ``Λ.sum()`` is also ``mean_i ‖Ŝ_i‖²_F``
    (:attr:`mean_sq_norm`), which K-FAC's trace calibration needs.
    """

    def __init__(self, q_s: np.ndarray | None, q_a: np.ndarray | None, shape: tuple[int, ...]):
        self.q_s = None if q_s is None else np.asarray(q_s, dtype=np.float64)
        self.q_a = None if q_a is None else np.asarray(q_a, dtype=np.float64)
        self.shape = tuple(int(s) for s in shape)
        self.sum_sq = np.zeros(self.shape, dtype=np.float64)
        self.count = 0

    @classmethod
    def from_factors(cls, a: np.ndarray, s: np.ndarray) -> EkfacMoments:
        """Eigenbases of the K-FAC factors (scaling by ``n_tokens`` does not change them)."""
        _, q_a = np.linalg.eigh(symmetrize(a))
        _, q_s = np.linalg.eigh(symmetrize(s))
        return cls(q_s, q_a, (q_s.shape[0], q_a.shape[0]))

    @classmethod
    def dense(cls, k: int) -> EkfacMoments:
        """Per-coordinate second moments of a dense (n, k) sketch layer."""
        return cls(None, None, (int(k),))

    def update(self, sketch_chunk: np.ndarray) -> None:
        """Add a chunk of records: (n, k_out, k_in) for factored, (n, k) for dense layers."""
        x = np.asarray(sketch_chunk, dtype=np.float64)
        if x.shape[1:] != self.shape:
            raise StoreError(
                f"sketch chunk has per-record shape {x.shape[1:]}, expected {self.shape}; "
                "the chunk comes from another layer or the store is inconsistent"
            )
        if self.q_s is not None:
            x = np.einsum("ko,nkj,jl->nol", self.q_s, x, self.q_a, optimize=True)  # Q_Sᵀ X Q_A
        self.sum_sq += np.einsum("n...,n...->...", x, x)
        self.count += x.shape[0]

    @property
    def mean(self) -> np.ndarray:
        if self.count == 0:
            raise StoreError(
                "no sketches were accumulated for the EK-FAC correction; the layer has no "
                "records — check the store or use the identity preconditioner"
            )
        return self.sum_sq / self.count

    @property
    def mean_sq_norm(self) -> float:
        return float(self.mean.sum())


def symmetrize(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return (m + m.T) / 2


@dataclass(frozen=True, eq=False)
class LayerPreconditioner:
    """The ``H^{-1/2}`` side of one layer: ``v = ((left @ Ŝ @ right) * scale).ravel()``.

    - identity: all three ``None``.
    - K-FAC: ``left = (cS̄+λ_S I)^{-1/2}``, ``right = (Ā+λ_A I)^{-1/2}``.
    - EK-FAC: ``left = Q_Sᵀ``, ``right = Q_A``, ``scale = 1/sqrt(Λ+λ)``.
    - dense: ``scale`` a (k,) vector (or None for identity).

    Index projection (large sketches): with ``index_left`` ``(m, k_out)`` and ``index_right``
    ``(m, k_in)`` (Gaussian, variance ``1/m``), :meth:`apply` returns the ``m × m`` matrix
    ``index_left · (preconditioned Ŝ) · index_rightᵀ`` instead: a second Kronecker JL
    projection, so inner products of index vectors are unbiased estimates of the exact scores
    and FAISS holds ``m²`` numbers per layer however large k is. :meth:`pullback` ignores it:
    exact scores come from the stored records (:mod:`traceprop_engine.attribution.score.scoring`).

    Attributes:
        name: layer name (as in the store).
        kind: the preconditioner kind this was fitted as.
        shape: per-record sketch shape, ``(k_out, k_in)`` or ``(k,)``.
    """

    name: str
    kind: PreconditionerKind
    shape: tuple[int, ...]
    left: np.ndarray | None = None
    right: np.ndarray | None = None
    scale: np.ndarray | None = None
    info: dict = field(default_factory=dict)  # fitted constants (c, λ) for reports
    index_left: np.ndarray | None = None  # (m, k_out) second projection of the index vectors
    index_right: np.ndarray | None = None  # (m, k_in)

    @property
    def dim(self) -> int:
        """Length of this layer's index vector (``m²`` with an index projection)."""
        if self.index_left is not None:
            return int(self.index_left.shape[0] * self.index_right.shape[0])
        return int(np.prod(self.shape))

    def with_index_projection(self, m: int, seed: int) -> LayerPreconditioner:
        """This preconditioner with an ``m × m`` index projection (only when it shrinks the vector)."""
        if len(self.shape) != 2 or m * m >= self.shape[0] * self.shape[1]:
            return self
        gen = np.random.default_rng(seed)
        left = gen.standard_normal((m, self.shape[0])) / np.sqrt(m)
        right = gen.standard_normal((m, self.shape[1])) / np.sqrt(m)
        return dataclasses.replace(self, index_left=left, index_right=right)

    def apply(self, sketches: np.ndarray, dtype: type = np.float32) -> np.ndarray:
        """Precondition and flatten.

        Args:
            sketches: (n, k_out, k_in) or (n, k) records of this layer.
            dtype: output dtype; the arithmetic runs in it too (float64 for exact checks).

        Returns:
            (n, dim) vectors.
        """
        x = np.asarray(sketches, dtype=dtype)
        if x.shape[1:] != self.shape:
            raise StoreError(
                f"layer {self.name!r}: sketches have per-record shape {x.shape[1:]}, the "
                f"preconditioner was fitted for {self.shape}; refit it from this store"
            )
        if self.left is not None:
            x = np.matmul(np.matmul(self.left.astype(dtype), x), self.right.astype(dtype))
        if self.scale is not None:
            x = x * self.scale.astype(dtype)
        if self.index_left is not None:  # (n, m, m) second Kronecker projection
            x = np.matmul(
                np.matmul(self.index_left.astype(dtype), x), self.index_right.T.astype(dtype)
            )
        return np.ascontiguousarray(x.reshape(x.shape[0], -1))

    def pullback(self, test_sketches: np.ndarray) -> np.ndarray:
        """The test sketch pushed to the training side: ``T'`` with ``⟨apply(T), apply(X)⟩ = ⟨T', X⟩``.

        ``T' = leftᵀ ((left T right) ⊙ scale²) rightᵀ`` — for K-FAC (symmetric factors)
        ``L² T R²``, i.e. ``H⁻¹ T``. Scoring unpreconditioned (e.g. low-rank factored) training
        sketches against ``T'`` needs no per-record preconditioning (:mod:`traceprop_engine.attribution.score.factor_scores`).

        Args:
            test_sketches: (q, *shape) test-side sketches of this layer.

        Returns:
            (q, *shape) float64.
        """
        t = np.asarray(test_sketches, dtype=np.float64)
        if t.shape[1:] != self.shape:
            raise StoreError(
                f"layer {self.name!r}: test sketches have per-record shape {t.shape[1:]}, the "
                f"preconditioner was fitted for {self.shape}"
            )
        if self.left is not None:
            t = np.matmul(np.matmul(self.left, t), self.right)
        if self.scale is not None:
            t = t * self.scale.astype(np.float64) ** 2
        if self.left is not None:
            t = np.matmul(np.matmul(self.left.T, t), self.right.T)
        return t

    def to_arrays(self) -> dict[str, np.ndarray]:
        """npz-friendly dict (no objects): matrices plus a JSON string of the metadata."""
        meta = {
            "name": self.name,
            "kind": self.kind.value,
            "shape": list(self.shape),
            "info": self.info,
        }
        out = {"meta": np.array(json.dumps(meta))}
        for key in ("left", "right", "scale", "index_left", "index_right"):
            val = getattr(self, key)
            if val is not None:
                out[key] = np.asarray(val, dtype=np.float64)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> LayerPreconditioner:
        meta = json.loads(str(arrays["meta"]))
        return cls(
            name=meta["name"],
            kind=PreconditionerKind(meta["kind"]),
            shape=tuple(meta["shape"]),
            left=arrays.get("left"),
            right=arrays.get("right"),
            scale=arrays.get("scale"),
            info=meta.get("info", {}),
            index_left=arrays.get("index_left"),
            index_right=arrays.get("index_right"),
        )


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"index|{name}".encode()).digest()[:8], "little")


@dataclass(frozen=True)
class LayerStats:
    """What the store provides per layer to fit a preconditioner.

    Attributes:
        name: layer name.
        shape: per-record sketch shape, (k_out, k_in) or (k,).
        A, S: K-FAC token sums, None for dense layers.
        n_tokens: token count of A and S (0 for dense layers).
        mean_sq_norm: ``mean_i ‖Ŝ_i‖²`` over records (None if ``moments`` is given).
        moments: streamed :class:`EkfacMoments` (needed for EK-FAC).
    """

    name: str
    shape: tuple[int, ...]
    A: np.ndarray | None = None
    S: np.ndarray | None = None
    n_tokens: int = 0
    mean_sq_norm: float | None = None
    moments: EkfacMoments | None = None


class Preconditioner:
    """Several layers' preconditioners; ``apply`` concatenates their vectors into (n, D)."""

    def __init__(
        self,
        kind: PreconditionerKind | str,
        layers: Sequence[LayerPreconditioner],
        damping: float | None = None,
        reduce: np.ndarray | None = None,
    ):
        if not layers:
            raise ConfigError("a preconditioner needs at least one layer")
        names = [lp.name for lp in layers]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate layer names in the preconditioner: {names}")
        self.kind = parse_kind(kind)
        self.damping = check_damping(damping)
        self.layers = list(layers)
        bounds = np.cumsum([0] + [lp.dim for lp in self.layers])
        self.layer_slices: dict[str, slice] = {
            lp.name: slice(int(b0), int(b1))
            for lp, b0, b1 in zip(self.layers, bounds[:-1], bounds[1:], strict=True)
        }
        # concatenated per-layer width; `reduce` (full_dim, D): the index vectors' principal
        # subspace (index_projection.fit_reduction) or None; `dim`: the index vectors' width
        self.full_dim = int(bounds[-1])
        self.reduce = None if reduce is None else np.asarray(reduce, dtype=np.float32)
        if self.reduce is not None and self.reduce.shape[0] != self.full_dim:
            raise ConfigError(
                f"index reduction of {self.reduce.shape[0]} dims, layers give {self.full_dim}; refit"
            )
        self.dim = self.full_dim if self.reduce is None else int(self.reduce.shape[1])

    @classmethod
    def fit(
        cls,
        kind: PreconditionerKind | str,
        layers: Sequence[LayerStats],
        damping: float | None = None,
        index_side: int = 0,
    ) -> Preconditioner:
        """Fit every layer with the same kind and damping (see :func:`~traceprop_engine.attribution.precondition.kfac.fit_layer`).

        ``index_side = m > 0`` adds an ``m × m`` index projection to every factored layer whose
        sketch is larger (:meth:`LayerPreconditioner.with_index_projection`), seeded by the
        layer's name.
        """
        from .kfac import fit_layer  # kfac builds LayerPreconditioners: imported here, not above

        fitted = [
            fit_layer(
                kind,
                st.A,
                st.S,
                st.n_tokens,
                mean_sq_norm=st.mean_sq_norm,
                sketch_moments=st.moments,
                damping=damping,
                shape=st.shape,
                name=st.name,
            )
            for st in layers
        ]
        if index_side:
            fitted = [lp.with_index_projection(index_side, _name_seed(lp.name)) for lp in fitted]
        return cls(kind, fitted, damping)

    @property
    def layer_names(self) -> list[str]:
        return [lp.name for lp in self.layers]

    def apply(self, layer_sketches: Sequence[np.ndarray], dtype: type = np.float32) -> np.ndarray:
        """Precondition each layer and concatenate.

        Args:
            layer_sketches: one array per layer, in :attr:`layer_names` order, same n.
            dtype: output dtype.

        Returns:
            (n, D) vectors; columns ``layer_slices[name]`` belong to that layer, so a
            per-layer score share is the partial inner product over that slice.
        """
        if len(layer_sketches) != len(self.layers):
            raise ConfigError(
                f"got sketches for {len(layer_sketches)} layers, the preconditioner has "
                f"{len(self.layers)} ({self.layer_names})"
            )
        n = {int(np.shape(x)[0]) for x in layer_sketches}
        if len(n) != 1:
            raise StoreError(f"layers have different record counts {sorted(n)}; store inconsistent")
        out = np.empty((n.pop(), self.full_dim), dtype=dtype)
        for lp, x in zip(self.layers, layer_sketches, strict=True):
            out[:, self.layer_slices[lp.name]] = lp.apply(x, dtype=dtype)
        return self.reduced(out)

    def reduced(self, full: np.ndarray) -> np.ndarray:
        """Concatenated per-layer vectors (n, full_dim) -> index vectors (n, dim)."""
        return full if self.reduce is None else full @ self.reduce.astype(full.dtype, copy=False)

    def save(self, path: str | Path) -> None:
        """Write a ``.npz`` (plain arrays, loadable with ``allow_pickle=False``)."""
        meta = {"format": _FORMAT, "version": _FORMAT_VERSION, "kind": self.kind.value}
        meta |= {"damping": self.damping, "n_layers": len(self.layers)}
        arrays = {"meta": np.array(json.dumps(meta))}
        for i, lp in enumerate(self.layers):
            for key, val in lp.to_arrays().items():
                arrays[f"layer{i}/{key}"] = val
        if self.reduce is not None:
            arrays["reduce"] = self.reduce
        try:
            with open(path, "wb") as fh:
                np.savez(fh, **arrays)
        except OSError as e:
            raise StoreError(f"cannot write the preconditioner to {path}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> Preconditioner:
        """Read what :meth:`save` wrote.

        Raises:
            StoreError: missing, unreadable or foreign file.
        """
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
            meta = json.loads(str(data["meta"]))
        except (OSError, ValueError, KeyError) as e:
            raise StoreError(
                f"cannot read a preconditioner from {path}: {e}; refit it from the store"
            ) from e
        if meta.get("format") != _FORMAT or meta.get("version") != _FORMAT_VERSION:
            raise StoreError(
                f"{path} is not a Traceprop preconditioner of version {_FORMAT_VERSION} "
                f"(found {meta.get('format')!r} v{meta.get('version')!r}); refit it"
            )
        layers = []
        for i in range(meta["n_layers"]):
            prefix = f"layer{i}/"
            layers.append(
                LayerPreconditioner.from_arrays(
                    {k[len(prefix) :]: v for k, v in data.items() if k.startswith(prefix)}
                )
            )
        return cls(meta["kind"], layers, meta["damping"], data.get("reduce"))
