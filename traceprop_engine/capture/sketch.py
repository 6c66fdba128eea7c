"""Random projections of the factored and dense sketches.

Factored sketch of one example on a layer ``y = W x``: ``Ŝ = P_out G P_inᵀ`` with
``G = Σ_t g_t a_tᵀ``; ``P_in ∈ R^{k_in×d_in}``, ``P_out ∈ R^{k_out×d_out}`` are random
projections with ``E[PᵀP] = I`` (so ``E‖Ŝ‖² = ‖G‖²`` and inner products are unbiased):
``orthogonal`` (default) has ``k`` orthonormal rows of a uniformly random subspace, scaled by
``√(d/k)``; ``gaussian`` has i.i.d. ``N(0, 1/k)`` entries (the JL matrix of runs before
2026-12-01). Orthogonal rows give inner products a lower variance (for squared norms by a
factor of about ``1 − k/d``; exact at ``k = d``) at the same cost per use. ``k == d`` means no projection on that side (``None``), which
makes that side exact.

Dense sketch: ``vec(G)`` (row-major, ``d_out × d_in``) times a sparse JL matrix with
``nnz`` entries ``±1/√nnz`` per input coordinate, stored as (index, sign) arrays.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from ..store.bf16 import bf16_bits, from_bf16_bits  # noqa: F401 - re-exported


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


def orthogonal_projection(k: int, d: int, seed: int) -> torch.Tensor | None:
    """``(k, d)`` float32 matrix ``√(d/k) Qᵀ`` on the CPU, or ``None`` when ``k >= d`` (exact).

    ``Q = G (GᵀG)^(-1/2)`` is the orthonormal matrix nearest the Gaussian ``(d, k)`` matrix ``G``
    of that seed (its polar factor): orthonormal columns spanning a uniformly random subspace,
    so ``E[PᵀP] = I``. Unique (no sign choice left to the LAPACK build), and cheap: one
    ``d × k`` Gram product and a ``k × k`` eigendecomposition in float64 (≈ 20 ms at d = 4096,
    k = 126, one thread), where a Householder QR took 2–3× longer.
    """
    if k >= d:
        return None
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(d, k, generator=gen, dtype=torch.float32).double()
    lam, v = torch.linalg.eigh(g.T @ g)
    q = g @ ((v * lam.rsqrt()) @ v.T)
    return (q.T * (d / k) ** 0.5).float().contiguous()


def random_projection(kind: str, k: int, d: int, seed: int) -> torch.Tensor | None:
    """The projection of ``TrackSettings.projection`` (``"orthogonal"`` or ``"gaussian"``)."""
    return (orthogonal_projection if kind == "orthogonal" else gaussian_projection)(k, d, seed)


VOCAB_ROWS_SHARE = 0.75
"""At most this share of a vocabulary side's ``k`` rows are exact target-token coordinates
(:func:`vocab_projection`); the rest project every other token."""


def vocab_projection(
    kind: str, k: int, d: int, seed: int, target_counts: np.ndarray
) -> tuple[torch.Tensor | None, np.ndarray]:
    """A ``(k, d)`` projection of an LM head's output (vocabulary) side that keeps the most
    frequent target tokens exact.

    An example's output-side factor is ``Σ_t (p_t − e_{y_t})`` (normalised): mass on its
    target tokens and on the tokens the model predicts, which are mostly other examples'
    targets. Its first ``m = min(#targets seen, ⌊VOCAB_ROWS_SHARE·k⌋)`` rows are the unit
    coordinates of the ``m`` most frequent target ids (ties: the smaller id), so inner
    products there are exact; the other ``k − m`` rows are ``random_projection(kind)`` of the
    remaining ``d − m`` coordinates. ``E[PᵀP] = I`` as for a plain projection.

    Args:
        kind: ``orthogonal`` or ``gaussian`` (the rest's projection).
        k, d: rows and vocabulary width; ``k >= d`` means no projection (``None``).
        seed: seed of the rest's projection.
        target_counts: ``(d,)`` how often each token id is a training target.

    Returns:
        ``(P or None, ids)``: the projection and the ``m`` exact token ids in row order.
    """
    if k >= d:
        return None, np.zeros(0, np.int64)
    counts = np.asarray(target_counts, dtype=np.float64)[:d]
    if counts.shape != (d,):
        counts = np.pad(counts, (0, d - counts.size))
    m = min(int((counts > 0).sum()), int(VOCAB_ROWS_SHARE * k))
    ids = np.lexsort((np.arange(d), -counts))[:m]  # most frequent first, then by id
    rest = np.setdiff1d(np.arange(d), ids)
    p = torch.zeros(k, d, dtype=torch.float32)
    p[torch.arange(m), torch.from_numpy(ids)] = 1.0
    r = random_projection(kind, k - m, d - m, seed)
    if r is None:  # cannot happen for m ≤ k - 1 and k < d, kept for clarity
        r = torch.eye(d - m)
    p[m:, torch.from_numpy(rest)] = r
    return p.contiguous(), ids.astype(np.int64)


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


# -- rank-r factors of a batch of factored sketches --------------------------------------------
POWER_ITERS = 8
"""Subspace-iteration steps of :func:`top_factors`. A per-example record is nearly rank 1 (its
top singular value holds 77-99 % of the energy on the LDS benchmarks), so the error shrinks like
``(σ₂/σ₁)^(2·iters)``: at σ₂/σ₁ = 0.5 eight steps leave 1.5e-5 of the start's error.
When the top two are close the pair is not separated, but the captured energy (what the score
uses) is still within that factor of the best rank-r approximation."""


def _orthonormal(v: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns of every ``(n, k, r)`` block (r = 1: a normalisation, no QR) whose
    first column is ``v``'s first column normalised, sign included, as at rank 1 (QR with
    ``R₀₀`` made non-negative; LAPACK's Householder QR flips it at random). A free-text record's
    first column is then the direction of ``Σ_t g_t``, which the LM-bias term reads
    (``attribution/score/lm_bias.py``). The other columns keep LAPACK's signs: every caller
    computes the other factor from these columns, so ``U Vᵀ`` does not depend on them (flipping
    every column by ``R``'s diagonal cost more than the QR itself at k 1024)."""
    if v.shape[-1] == 1:
        return v / v.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)
    q, r = torch.linalg.qr(v)
    q[..., :1].mul_(torch.where(r[..., :1, :1] < 0, -1.0, 1.0).to(q.dtype))
    return q


def top_factors(
    sketches: torch.Tensor, rank: int, iters: int = POWER_ITERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``r`` factors ``Ŝ ≈ U Vᵀ`` of a batch of sketches, on the sketches' device.

    Subspace iteration on ``ŜᵀŜ`` (a few batched ``(k, k) × (k, r)`` products), started from
    the ``r`` largest rows of ``Ŝ``; ``V`` has orthonormal columns and ``U = Ŝ V`` carries
    the singular values, so ``U Vᵀ`` is ``Ŝ`` projected onto ``V``'s span (the best rank-r
    approximation once converged; exact when ``r = min(k_out, k_in)``). No SVD: batched SVDs of
    thousands of small matrices cost ~50x more on a CPU.

    Args:
        sketches: (n, k_out, k_in) float32.
        rank: ``r``, clamped to ``min(k_out, k_in)``.
        iters: subspace-iteration steps.

    Returns:
        ``U`` (n, k_out, r) and ``V`` (n, k_in, r), float32.
    """
    n, k_out, k_in = sketches.shape
    r = min(int(rank), k_out, k_in)
    s_t = sketches.transpose(1, 2)  # (n, k_in, k_out)
    if r == min(k_out, k_in):  # full rank: any orthonormal basis of the smaller side is exact
        if k_in <= k_out:
            v = torch.eye(k_in, device=sketches.device, dtype=sketches.dtype).expand(n, k_in, k_in)
            return sketches.clone(), v.contiguous()
        u = torch.eye(k_out, device=sketches.device, dtype=sketches.dtype).expand(n, k_out, k_out)
        return u.contiguous(), s_t.contiguous()
    # start from the r largest rows of Ŝ (a nearly rank-1 record's rows are all ≈ σ₁ u_j v₁ᵀ),
    # plus a fixed Gaussian so the block has full rank even when those rows are collinear
    top = sketches.norm(dim=2).topk(r, dim=1).indices  # (n, r)
    v = torch.gather(sketches, 1, top.unsqueeze(-1).expand(n, r, k_in)).transpose(1, 2)
    gen = torch.Generator(device="cpu").manual_seed(0x7AC3)
    z = torch.randn(k_out, r, generator=gen).to(sketches.device, sketches.dtype)
    v = v + 1e-3 * torch.matmul(s_t, z)  # (n, k_in, r)
    for _ in range(iters):
        v = torch.bmm(s_t, torch.bmm(sketches, _orthonormal(v)))  # (n, k_in, r)
    v = _orthonormal(v)
    return torch.bmm(sketches, v), v  # U (n, k_out, r) with σ folded in, V (n, k_in, r)


@functools.lru_cache(maxsize=64)
def _token_weights(t: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(r, T)``: the higher-rank start's token weights, ones then a fixed Gaussian per ``T``
    (kept: a generator and its draw per layer and step cost 0.7 % of a rank-16 step)."""
    gen = torch.Generator(device="cpu").manual_seed(0x5EED + t)
    w = torch.randn(t, rank, generator=gen)
    w[:, 0] = 1.0
    return w.T.to(device, dtype).contiguous()


def full_factors(
    a: torch.Tensor,
    g: torch.Tensor,
    rank: int,
    iters: int,
    input_start: bool = False,
    token_mask: torch.Tensor | None = None,
    exact_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``r`` factors of every per-example ``G_b = Σ_t g_bt a_btᵀ`` without forming it.

    Power (subspace) iteration on the factored form: ``G v = gᵀ (a v)`` and
    ``Gᵀ u = aᵀ (g u)``, each a pair of ``(B, T, d) × (B, d, r)`` batched products, so one
    iteration reads ``a`` and ``g`` twice and costs ``O(T (d_in + d_out) r)`` per example, like
    an ``r``-column projection. Start: ``u₀ = Σ_t g_t`` (the example's summed output gradient;
    with ``r > 1``, further columns weight the tokens by a fixed Gaussian). Per-example records
    are nearly rank 1, so one or two iterations reach the top direction.

    Args:
        a: (B, T, d_in) layer inputs; g: (B, T, d_out) output gradients (float32).
        rank: ``r``; iters: iterations; ``0`` is half a step: ``u`` = the orthonormalised
            start, ``v = Gᵀ u`` (so ``u vᵀ = u uᵀ G``, the projection of ``G`` on the start's
            span; two batched products instead of four).
        input_start: with ``r = 1`` and ``iters = 0``, start from the input side instead:
            ``v̂ = Σ_t a_t / ‖·‖``, ``u = G v̂`` (``u vᵀ = G v̂ v̂ᵀ``;
            ``TrackSettings.half_step_start``), the sum over the tokens ``token_mask``
            ``(B, 1, T)`` keeps (padding has activations but no gradient; None: every token).
        exact_input: with ``iters = 0`` and ``rank = d_in + 1`` (an input no wider than the records'
            rank, e.g. a LoRA B), the start is ``Σ_t g_t`` and the ``d_in`` columns of ``G``
            (``Gᵀ = aᵀ g``, ``O(T d_in d_out)`` like the Gaussian start): ``u`` spans ``G``'s
            column space, so ``u vᵀ = G`` exactly, and the first column is still the rank-1
            record. The Gaussian token weights span another subspace, which lost 0.04–0.06 LDS
            on LoRA prose against the full sketch (benchmarks/EVAL.md §1x, §1aa).

    Returns:
        ``u`` (B, d_out, r) = ``G v`` (singular values folded in) and ``v`` (B, d_in, r) with
        orthonormal columns (``iters = 0``: the other way round); ``u vᵀ = G v vᵀ``, exact when ``v`` spans ``G``'s row space (e.g.
        ``r ≥ T`` after one iteration).
    """
    # Row-vector layout, (B, r, d) @ (B, d, T) and (B, r, T) @ (B, T, d): with the factors as
    # rows, MKL reads g and a along their contiguous dimension at ~2-4x the rate of the
    # (B, T, d) x (B, d, r) batched GEMV (measured on 8 x 128 tokens, widths 256-1024).
    b, t, _ = g.shape
    if input_start and rank == 1 and iters == 0:
        v = a.sum(1, keepdim=True) if token_mask is None else torch.bmm(token_mask, a)
        vt = _orthonormal(v.transpose(1, 2)).transpose(1, 2)  # (B, 1, d_in): v̂
        ut = torch.matmul(torch.matmul(vt, a.transpose(1, 2)), g)  # (B, 1, d_out): (G v̂)ᵀ
        return ut.transpose(1, 2), vt.transpose(1, 2)
    if rank == 1:
        ut = g.sum(1).unsqueeze(1)  # (B, 1, d_out): the example's summed output gradient
    elif exact_input and iters == 0 and rank == a.shape[2] + 1:
        # (B, 1 + d_in, d_out): Σ_t g_t, then Gᵀ's rows (G's columns)
        ut = torch.cat([g.sum(1, keepdim=True), torch.matmul(a.transpose(1, 2), g)], 1)
    else:
        ut = torch.matmul(_token_weights(t, rank, g.device, g.dtype), g)  # (B, r, d_out)
    gt, at = g.transpose(1, 2), a.transpose(1, 2)
    if iters == 0:  # half a step: project G on the start from the left, U Vᵀ = û ûᵀ G
        u = _orthonormal(ut.transpose(1, 2))  # (B, d_out, r): the first column +Σ_t g_t's
        if u.shape[2] == 1:
            vt = torch.matmul(torch.matmul(u.transpose(1, 2), gt), a)  # (B, 1, d_in) = (Gᵀ û)ᵀ
        else:  # the token weights as (B, T, r): g read along its rows, 2-3.5x ûᵀ gᵀ's rate at r 16
            vt = torch.matmul(torch.matmul(g, u).transpose(1, 2), a)  # (B, r, d_in)
        return u, vt.transpose(1, 2)
    for _ in range(iters):
        vt = torch.matmul(torch.matmul(ut, gt), a)  # (B, r, d_in): (Gᵀ u)ᵀ
        vt = _orthonormal(vt.transpose(1, 2)).transpose(1, 2)
        ut = torch.matmul(torch.matmul(vt, at), g)  # (B, r, d_out): (G v)ᵀ
    return ut.transpose(1, 2), vt.transpose(1, 2)


def project_factor(x: torch.Tensor, p_t: torch.Tensor | None) -> torch.Tensor:
    """``(B, d, r)`` factors times ``P`` (given as ``Pᵀ``, ``(d, k)``) -> ``(B, k, r)``: one 2-D
    GEMM over all examples (a broadcast ``matmul`` would copy ``Pᵀ`` once per example)."""
    if p_t is None:
        return x
    b, d, r = x.shape
    y = torch.mm(x.transpose(1, 2).reshape(b * r, d), p_t)  # (B·r, k)
    return y.view(b, r, -1).transpose(1, 2)


def transposed_on(
    p: torch.Tensor | None, cached: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """``Pᵀ`` on ``device`` in ``dtype``, contiguous; ``cached`` when it already is that."""
    if p is None:
        return None
    if (
        cached is not None
        and cached.device == device
        and cached.dtype == dtype
        and cached.shape == p.T.shape
    ):
        return cached
    return p.T.to(device, dtype).contiguous()
