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
  same, and the layer holding most of the score (often the LM head) is diluted.
- **the output head** (a layer the store marks ``output_head``: a causal LM's output embedding,
  or a classifier's ``classifier`` / ``score`` layer) is left unwhitened by every kind
  (identity). Whitening its input side by the covariance of the final hidden states turned the
  head's score, which carries most of the attribution, into noise on every benchmark (LoRA
  classification too: K-FAC 0.48 → 0.61 on docs8 seed 0 with the classifier unwhitened); the
  other layers whitened and the head as recorded match or beat identity there
  (benchmarks/EVAL.md §1g).
- **``fisher``** (``IndexSettings.weighting``; ``auto`` picks it for a pretrained causal LM
  fine-tuned in full): neither of the two above. Every factored layer, the head too, is
  whitened at the per-example Fisher's own scale (``f = 1``), as kronfluence scores. On a
  pretrained model that moves weight from the input embedding and the head to the transformer
  blocks, and LDS rose by 0.06 / 0.10; from scratch it fell to about 0.1 (EVAL.md §1p).
- dense sketches (``x ∈ R^k``, no covariance): ``identity`` is ``v = x``; ``ekfac`` the diagonal
  Fisher in the coordinate basis, ``v_j = f x_j / sqrt(Λ_j + λ)``, ``Λ_j = mean_i x_ij²``,
  ``λ = damping × mean(Λ)``; ``kfac`` the isotropic Fisher, which the trace normalisation makes
  the identity (without moments: ``v = x / sqrt((1 + damping) m / k)``, ``m = mean_i ‖x_i‖²``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import PreconditionerKind

from ..query_sketches import factors_of
from .kfac import fit_layer
from .layer import LayerPreconditioner, LayerStats, check_damping, parse_kind

__all__ = ["Preconditioner"]

_FORMAT = "traceprop-preconditioner"
_FORMAT_VERSION = 1


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"index|{name}".encode()).digest()[:8], "little")


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
        fisher: bool = False,
    ) -> Preconditioner:
        """Fit every layer with the same kind and damping (see
        :func:`~traceprop_engine.attribution.precondition.kfac.fit_layer`), but an LM head
        (``output_head``), which every kind leaves unwhitened (identity). With ``fisher``
        (``IndexSettings.weighting``) the head is whitened like the others and no layer is
        trace-normalised: every factored layer at the per-example Fisher's own scale.

        ``index_side = m > 0`` adds an ``m × m`` index projection to every factored layer whose
        sketch is larger (:meth:`LayerPreconditioner.with_index_projection`), seeded by the
        layer's name.
        """

        fitted = [
            fit_layer(
                PreconditionerKind.IDENTITY if st.output_head and not fisher else kind,
                st.A,
                st.S,
                st.n_tokens,
                mean_sq_norm=st.mean_sq_norm,
                sketch_moments=st.moments,
                damping=damping,
                shape=st.shape,
                name=st.name,
                layer_scale=not fisher,
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
        factors = factors_of(layer_sketches) or [None] * len(self.layers)
        for lp, x, f in zip(self.layers, layer_sketches, factors, strict=True):
            if f is not None and lp.scale is None and len(lp.shape) == 2:
                # one query with its token factors: thin products instead of k × k × k ones
                out[:, self.layer_slices[lp.name]] = lp.apply_factors(*f, dtype=dtype)
            else:
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
