"""Random projections of the factored and dense sketches.

Factored sketch of one example on a layer ``y = W x``: ``Ŝ = P_out G P_inᵀ`` with
``G = Σ_t g_t a_tᵀ``; ``P_in ∈ R^{k_in×d_in}``, ``P_out ∈ R^{k_out×d_out}`` are Gaussian with
variance ``1/k`` (a JL projection, so ``E‖Ŝ‖² = ‖G‖²``). ``k == d`` means no projection on
that side (``None``), which makes that side exact.

Dense sketch: ``vec(G)`` (row-major, ``d_out × d_in``) times a sparse JL matrix with
``nnz`` entries ``±1/√nnz`` per input coordinate, stored as (index, sign) arrays.
"""

from __future__ import annotations

import hashlib

import torch


def layer_seed(base_seed: int, layer_name: str, side: str) -> int:
    """A stable 63-bit seed per (run seed, layer, side), independent of Python's hash salt."""
    h = hashlib.sha256(f"{base_seed}|{layer_name}|{side}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def gaussian_projection(k: int, d: int, seed: int) -> torch.Tensor | None:
    """``(k, d)`` float32 Gaussian JL matrix on the CPU, or ``None`` when ``k >= d`` (exact)."""
    if k >= d:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, d, generator=gen, dtype=torch.float32) / k**0.5


def sparse_jl(d: int, k: int, nnz: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse JL matrix as ``index (nnz, d) int64`` in ``[0, k)`` and ``sign (nnz, d)`` ±1/√nnz."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, k, (nnz, d), generator=gen, dtype=torch.int64)
    sign = (torch.randint(0, 2, (nnz, d), generator=gen, dtype=torch.int8) * 2 - 1).float()
    return index, sign / nnz**0.5


def apply_sparse_jl(
    flat: torch.Tensor, index: torch.Tensor, sign: torch.Tensor, k: int
) -> torch.Tensor:
    """``(B, D)`` -> ``(B, k)``: out[b, index[j, c]] += sign[j, c] * flat[b, c]."""
    out = flat.new_zeros(flat.shape[0], k)
    for j in range(index.shape[0]):
        out.index_add_(1, index[j], flat * sign[j])
    return out
