"""capture/sketch.py on its own: the projections, the rank-r factorisations and the bfloat16
bits, each against a reference computed another way (numpy, a dense matrix, LAPACK's SVD)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from helpers import best_rank_r

from traceprop_engine.capture.sketch import (
    apply_sparse_jl,
    bf16_bits,
    from_bf16_bits,
    full_factors,
    gaussian_projection,
    layer_seed,
    orthogonal_projection,
    sparse_jl,
    top_factors,
)

# float32 products of a few hundred terms against a float64 reference, relative to the scale
FP32_RTOL = 1e-5
# subspace iteration against LAPACK's SVD, on matrices with a clear spectral gap
FACTOR_RTOL = 1e-3
# bfloat16 keeps 8 significant bits: rounding to nearest moves a number by at most 2^-9 of it
BF16_RTOL = 2.0**-9
# E‖P x‖² = ‖x‖² for a JL matrix: the mean over 4096 unit vectors of a chi²(k)/k with k = 64
# has a standard deviation of sqrt(2/64)/64 ≈ 0.003; 0.02 is more than six of them
JL_NORM_TOL = 0.02
# the same for the sparse matrix, d = 300 columns: a column's squared norm is 1 plus ±2/nnz per
# colliding pair (std 0.31 at nnz = 4, k = 16), so the mean has a std of 0.018
SPARSE_NORM_TOL = 0.1


def _close(got, want, rtol, what=""):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        want,
        rtol=0,
        atol=rtol * max(np.abs(want).max(), 1e-30),
        err_msg=what,
    )


# -- seeds and Gaussian projections ------------------------------------------------------------
def test_layer_seed_is_stable_and_separates_run_layer_and_side():
    s = layer_seed(0, "gpt_neox.layers.0.mlp.dense_h_to_4h", "in")
    assert s == layer_seed(0, "gpt_neox.layers.0.mlp.dense_h_to_4h", "in")
    assert 0 <= s < 2**63
    others = {
        layer_seed(1, "gpt_neox.layers.0.mlp.dense_h_to_4h", "in"),
        layer_seed(0, "gpt_neox.layers.1.mlp.dense_h_to_4h", "in"),
        layer_seed(0, "gpt_neox.layers.0.mlp.dense_h_to_4h", "out"),
    }
    assert s not in others and len(others) == 3
    # sha256 of "seed|layer|side", not Python's salted hash: fixed across processes
    digest = hashlib.sha256(b"0|x|in").digest()
    assert layer_seed(0, "x", "in") == int.from_bytes(digest[:8], "little") & (2**63 - 1)


# orthonormality of the rows after the float64 polar factor and the float32 rounding
ORTHO_ATOL = 1e-5


def test_orthogonal_projection_has_scaled_orthonormal_rows_and_is_unbiased():
    k, d = 48, 200
    p = orthogonal_projection(k, d, seed=7)
    assert p.shape == (k, d) and p.dtype == torch.float32 and p.device.type == "cpu"
    torch.testing.assert_close(p, orthogonal_projection(k, d, seed=7), rtol=0, atol=0)
    assert not torch.equal(p, orthogonal_projection(k, d, seed=8))
    gram = (p.double() @ p.double().T) * (k / d)  # Qᵀ Q
    torch.testing.assert_close(gram, torch.eye(k, dtype=torch.float64), rtol=0, atol=ORTHO_ATOL)
    # the polar factor U Vᵀ of the Gaussian matrix of that seed (numpy's SVD, G = U S Vᵀ)
    g = torch.randn(d, k, generator=torch.Generator().manual_seed(7)).double().numpy()
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    want = torch.from_numpy((u @ vt).T * (d / k) ** 0.5)
    torch.testing.assert_close(p.double(), want, rtol=0, atol=ORTHO_ATOL)
    # E[PᵀP] = I over seeds: inner products stay unbiased (mean of 200 draws within 4 sd)
    x, y = torch.randn(2, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    est = torch.tensor(
        [
            float(
                (orthogonal_projection(k, d, s).double() @ x)
                @ (orthogonal_projection(k, d, s).double() @ y)
            )
            for s in range(200)
        ]
    )
    want = float(x @ y)
    assert abs(float(est.mean()) - want) < 4 * float(est.std()) / 200**0.5
    # lower variance than the Gaussian matrices of the same seeds
    gauss = torch.tensor(
        [
            float(
                (gaussian_projection(k, d, s).double() @ x)
                @ (gaussian_projection(k, d, s).double() @ y)
            )
            for s in range(200)
        ]
    )
    assert float(est.var()) < float(gauss.var())
    assert orthogonal_projection(32, 32, seed=0) is None


def test_gaussian_projection_shape_seed_and_scale():
    p = gaussian_projection(64, 4096, seed=7)
    assert p.shape == (64, 4096) and p.dtype == torch.float32 and p.device.type == "cpu"
    # the same seed gives the same matrix; it is N(0, 1/k) from a generator of that seed
    torch.testing.assert_close(p, gaussian_projection(64, 4096, seed=7), rtol=0, atol=0)
    want = torch.randn(64, 4096, generator=torch.Generator().manual_seed(7)) / 8.0
    torch.testing.assert_close(p, want, rtol=0, atol=0)
    assert not torch.equal(p, gaussian_projection(64, 4096, seed=8))
    # JL: every unit input vector keeps its squared norm in expectation
    col_sq = (p.double() ** 2).sum(0)
    assert abs(float(col_sq.mean()) - 1.0) < JL_NORM_TOL
    # k >= d: no projection (that side is exact)
    assert gaussian_projection(32, 32, seed=0) is None
    assert gaussian_projection(33, 32, seed=0) is None


# -- the sparse JL projection of the dense sketch ------------------------------------------------
def _dense_matrix(index: torch.Tensor, sign: torch.Tensor, k: int) -> np.ndarray:
    """The (k, d) matrix the (index, sign) arrays stand for: M[index[j, c], c] += sign[j, c]."""
    nnz, d = index.shape
    m = np.zeros((k, d))
    for j in range(nnz):
        np.add.at(m, (index[j].numpy(), np.arange(d)), sign[j].double().numpy())
    return m


@pytest.mark.parametrize("nnz", [1, 2, 4])
def test_sparse_jl_equals_its_dense_matrix(nnz):
    d, k = 300, 16
    index, sign = sparse_jl(d, k, nnz, seed=3)
    assert index.shape == sign.shape == (nnz, d) and index.dtype == torch.int64
    assert int(index.min()) >= 0 and int(index.max()) < k
    np.testing.assert_array_equal(np.abs(sign.numpy()), np.float32(1 / nnz**0.5))
    again = sparse_jl(d, k, nnz, seed=3)
    assert torch.equal(index, again[0]) and torch.equal(sign, again[1])
    flat = torch.randn(5, d, generator=torch.Generator().manual_seed(4))
    m = _dense_matrix(index, sign, k)
    _close(apply_sparse_jl(flat, index, sign, k), flat.double().numpy() @ m.T, FP32_RTOL)
    # each column holds nnz entries ±1/√nnz: squared norm 1 in expectation (collisions in a
    # row add or cancel); exactly 1 with one entry per column
    col_sq = (m**2).sum(0)
    if nnz == 1:
        np.testing.assert_allclose(col_sq, 1.0, rtol=FP32_RTOL)
    assert abs(col_sq.mean() - 1) < SPARSE_NORM_TOL


# -- rank-r factors of a batch of sketches -------------------------------------------------------
def _spectrum(n, rows, cols, sv, seed=0):
    g = torch.Generator().manual_seed(seed)
    qu = torch.linalg.qr(torch.randn(n, rows, len(sv), generator=g)).Q
    qv = torch.linalg.qr(torch.randn(n, cols, len(sv), generator=g)).Q
    return qu @ torch.diag(torch.tensor(sv)) @ qv.transpose(1, 2)


def test_top_factors_match_the_truncated_svd():
    # singular values 10, 5, 1, 0.01...: the top-1 and top-2 subspaces are well separated
    m = _spectrum(50, 16, 12, [10.0, 5.0, 1.0] + [0.01] * 9)
    for r in (1, 2):
        u, v = top_factors(m, r)
        assert u.shape == (50, 16, r) and v.shape == (50, 12, r)
        vtv = (v.transpose(1, 2) @ v).double().numpy()
        _close(vtv, np.broadcast_to(np.eye(r), (50, r, r)), FP32_RTOL * 10, "V orthonormal")
        want = np.stack([best_rank_r(x, r) for x in m.double().numpy()])
        _close(u @ v.transpose(1, 2), want, FACTOR_RTOL, f"rank {r}")


def test_top_factors_full_rank_is_exact_and_zero_records_stay_finite():
    m = _spectrum(8, 6, 9, [3.0, 2.0, 1.0, 0.5, 0.1, 0.01], seed=1)  # (8, 6, 9): k_out < k_in
    for mat in (m, m.transpose(1, 2)):
        u, v = top_factors(mat, 100)  # clamped to min(k_out, k_in) = 6
        assert u.shape[-1] == v.shape[-1] == 6
        _close(u @ v.transpose(1, 2), mat.double().numpy(), FP32_RTOL)
    u, v = top_factors(torch.zeros(4, 8, 8), 1)
    assert torch.all(u == 0) and torch.isfinite(v).all()


def _g_of(a, g):
    """G_b = Σ_t g_bt a_btᵀ, formed explicitly in float64: (B, d_out, d_in)."""
    return np.einsum("bto,bti->boi", g.double().numpy(), a.double().numpy())


def _tokens(b=4, t=5, d_in=12, d_out=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, d_in, generator=gen), torch.randn(b, t, d_out, generator=gen)


def test_full_factors_exact_once_the_rank_covers_the_tokens():
    """r >= T: after one iteration v spans G's row space, so u vᵀ = G v vᵀ = G."""
    a, g = _tokens(t=5)
    u, v = full_factors(a, g, rank=5, iters=1)
    assert u.shape == (4, 10, 5) and v.shape == (4, 12, 5)
    _close(u @ v.transpose(1, 2), _g_of(a, g), FP32_RTOL * 10)
    vtv = (v.transpose(1, 2) @ v).double().numpy()
    _close(vtv, np.broadcast_to(np.eye(5), (4, 5, 5)), FP32_RTOL * 10, "V orthonormal")


def test_full_factors_half_step_projects_g_on_the_summed_output_gradient():
    """iters = 0, r = 1: u vᵀ = û ûᵀ G with û = Σ_t g_t / ‖Σ_t g_t‖ (a hand computation)."""
    a, g = _tokens()
    u, v = full_factors(a, g, rank=1, iters=0)
    G = _g_of(a, g)
    s = g.double().sum(1).numpy()  # (B, d_out)
    uh = s / np.linalg.norm(s, axis=1, keepdims=True)
    want = np.einsum("bo,bp,bpi->boi", uh, uh, G)
    _close(u @ v.transpose(1, 2), want, FP32_RTOL * 10)
    _close(u[..., 0].double().numpy(), uh, FP32_RTOL * 10, "u is the unit summed gradient")


def test_full_factors_half_step_from_the_input_side():
    """``input_start``: u vᵀ = G v̂ v̂ᵀ with v̂ = Σ_t a_t / ‖·‖ (a hand computation), the sum over
    the tokens a mask keeps when one is given; v is the unit vector."""
    a, g = _tokens()
    G = _g_of(a, g)
    mask = torch.ones(4, 1, 5)
    mask[0, 0, 3:] = 0
    for m in (None, mask):
        u, v = full_factors(a, g, rank=1, iters=0, input_start=True, token_mask=m)
        w = a.double().numpy() * (1 if m is None else m.double().numpy().transpose(0, 2, 1))
        s = w.sum(1)
        vh = s / np.linalg.norm(s, axis=1, keepdims=True)
        _close(u @ v.transpose(1, 2), np.einsum("boi,bi,bj->boj", G, vh, vh), FP32_RTOL * 10)
        _close(v[..., 0].double().numpy(), vh, FP32_RTOL * 10, "v is the unit summed input")


def test_full_factors_of_a_narrow_input_are_exact_with_the_rank_1_record_first():
    """``exact_input`` (a raw input narrower than the rank, e.g. a LoRA B of width 3), r = d_in + 1
    and more tokens than r: u vᵀ = G exactly (a hand computation), where the Gaussian token start
    of the same rank is not; the first column is still û ûᵀ G."""
    a, g = _tokens(t=9, d_in=3, d_out=10)
    G = _g_of(a, g)
    u, v = full_factors(a, g, rank=4, iters=0, exact_input=True)
    assert u.shape == (4, 10, 4) and v.shape == (4, 3, 4)
    _close(u @ v.transpose(1, 2), G, FP32_RTOL * 10)
    s = g.double().sum(1).numpy()
    uh = s / np.linalg.norm(s, axis=1, keepdims=True)
    want = np.einsum("bo,bp,bpi->boi", uh, uh, G)
    _close(u[..., :1] @ v[..., :1].transpose(1, 2), want, FP32_RTOL * 10, "the rank-1 record")
    u, v = full_factors(a, g, rank=4, iters=0)  # the Gaussian token weights: another subspace
    err = np.linalg.norm((u @ v.transpose(1, 2)).double().numpy() - G) / np.linalg.norm(G)
    assert err > 0.05


def test_a_higher_rank_half_step_keeps_the_summed_gradient_first_with_its_sign():
    """r > 1, iters = 0 (a free-text record; Gaussian or exact-input start): the first column
    of u is +Σ_t g_t / ‖·‖ for every example, as at rank 1 (the LM-bias term reads it,
    attribution/score/lm_bias.py), the columns orthonormal, and the first column's record still
    û ûᵀ G. LAPACK's QR alone flips the sign on some examples (checked here, so the test can
    fail)."""
    torch.manual_seed(3)
    a, g = torch.randn(64, 7, 12), torch.randn(64, 7, 10)
    G = _g_of(a, g)
    s = g.double().sum(1).numpy()
    uh = s / np.linalg.norm(s, axis=1, keepdims=True)
    for kw in (dict(rank=4), dict(rank=13, exact_input=True)):
        u, v = full_factors(a, g, iters=0, **kw)
        _close(u[..., 0].double().numpy(), uh, FP32_RTOL * 10, f"signed first column {kw}")
        utu = (u.transpose(1, 2) @ u).double().numpy()
        _close(utu, np.broadcast_to(np.eye(u.shape[2]), utu.shape), FP32_RTOL * 10, "U orthonormal")
        want = np.einsum("bo,bp,bpi->boi", uh, uh, G)
        _close(u[..., :1] @ v[..., :1].transpose(1, 2), want, FP32_RTOL * 10, "the rank-1 record")
    start = torch.cat([g.sum(1, keepdim=True), g[:, :3]], 1).transpose(1, 2)  # (B, d_out, 4)
    plain = torch.linalg.qr(start).Q[..., 0].double().numpy()
    assert ((plain * uh).sum(1) < 0).any()


def test_full_factors_converge_to_the_top_singular_pair():
    """Many iterations, r = 1: u vᵀ is the best rank-1 approximation of G (clear σ₁ > σ₂)."""
    gen = torch.Generator().manual_seed(2)
    # tokens that share one direction on each side: G is nearly rank 1 with a clear gap
    a = torch.randn(3, 6, 12, generator=gen) * 0.3 + torch.randn(3, 1, 12, generator=gen)
    g = torch.randn(3, 6, 10, generator=gen) * 0.3 + torch.randn(3, 1, 10, generator=gen)
    G = _g_of(a, g)
    for b in range(3):
        s = np.linalg.svd(G[b], compute_uv=False)
        assert s[1] < 0.5 * s[0]  # the pair is identifiable
    u, v = full_factors(a, g, rank=1, iters=30)
    want = np.stack([best_rank_r(x, 1) for x in G])
    _close(u @ v.transpose(1, 2), want, FACTOR_RTOL)


# -- bfloat16 bits -----------------------------------------------------------------------------
def test_bf16_bits_round_trip_and_match_torch():
    x = np.array([1.0, -2.5, 3.14159265, 1e-30, 1e30, 0.0, -0.0], np.float32)
    back = from_bf16_bits(bf16_bits(x))
    np.testing.assert_allclose(back, x, rtol=BF16_RTOL, atol=0)
    assert back[0] == 1.0 and back[1] == -2.5  # exactly representable values stay exact
    assert np.signbit(back[-1])  # -0.0 keeps its sign
    # round to nearest even, like torch's float32 -> bfloat16 conversion
    r = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1e3
    want = torch.from_numpy(r).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16_bits(r), want)
    # and back: exact (bfloat16 is the top half of a float32)
    np.testing.assert_array_equal(
        from_bf16_bits(want), torch.from_numpy(r).to(torch.bfloat16).float().numpy()
    )
    # a tie rounds to the even neighbour: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7
    tie = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)
    np.testing.assert_array_equal(from_bf16_bits(bf16_bits(tie)), [1.0, 1 + 2 * 2.0**-7])
