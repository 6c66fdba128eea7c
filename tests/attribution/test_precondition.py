"""Preconditioners against explicit (Kronecker / diagonal-in-eigenbasis) matrices."""

from __future__ import annotations

import numpy as np
import pytest

from traceprop_engine.attribution.precondition import layer as layer_module
from traceprop_engine.attribution.precondition.kfac import fit_layer
from traceprop_engine.attribution.precondition.layer import (
    DEFAULT_DAMPING,
    EkfacMoments,
    LayerStats,
    stack_matmul,
)
from traceprop_engine.attribution.precondition.preconditioner import Preconditioner
from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import PreconditionerKind

RTOL_F64 = 1e-5  # float64 path vs. an explicit inverse of a (k_out*k_in)^2 matrix
RTOL_F32 = 1e-4  # float32 output vs. float64 reference
K_OUT, K_IN, N_REC, N_TOK = 3, 4, 40, 500


def _layer(seed: int = 0, k_out: int = K_OUT, k_in: int = K_IN):
    rng = np.random.default_rng(seed)
    # anisotropic token activations / gradients so the factors are far from identity
    a_tok = rng.normal(size=(N_TOK, k_in)) * np.linspace(0.2, 3.0, k_in)
    g_tok = rng.normal(size=(N_TOK, k_out)) * np.linspace(0.5, 2.0, k_out)
    A, S = a_tok.T @ a_tok, g_tok.T @ g_tok
    sketches = rng.normal(size=(N_REC, k_out, k_in)) * np.linspace(0.3, 2.0, k_in)
    return A, S, sketches


def _psd_pow(m: np.ndarray, p: float) -> np.ndarray:
    w, v = np.linalg.eigh(m)
    return (v * w**p) @ v.T


def test_kfac_matches_explicit_kronecker_inverse():
    A, S, sk = _layer()
    msn = float(np.mean(np.sum(sk**2, axis=(1, 2))))
    lp = fit_layer("kfac", A, S, N_TOK, mean_sq_norm=msn)

    # hand-computed reference: calibrated, damped factors and H = S ⊗ A (row-major vec)
    a_bar, s_bar = A / N_TOK, S / N_TOK
    c = msn / (np.trace(s_bar) * np.trace(a_bar))
    s_bar = c * s_bar
    lam_a = DEFAULT_DAMPING * np.trace(a_bar) / K_IN
    lam_s = DEFAULT_DAMPING * np.trace(s_bar) / K_OUT
    H = np.kron(s_bar + lam_s * np.eye(K_OUT), a_bar + lam_a * np.eye(K_IN))
    flat = sk.reshape(N_REC, -1)
    ref = flat @ np.linalg.solve(H, flat.T)  # (n, n) ⟨Ŝ_t, H⁻¹ vec Ŝ_i⟩

    v = lp.apply(sk, dtype=np.float64)
    np.testing.assert_allclose(v @ v.T, ref, rtol=RTOL_F64, atol=1e-10 * np.abs(ref).max())
    assert lp.info["c"] == pytest.approx(c, rel=1e-12)
    # calibration: trace of the (undamped) K-FAC Fisher equals the empirical trace
    assert np.trace(np.kron(s_bar, a_bar)) == pytest.approx(msn, rel=1e-10)

    v32 = lp.apply(sk)
    assert v32.dtype == np.float32 and v32.shape == (N_REC, K_OUT * K_IN)
    np.testing.assert_allclose(v32, v, rtol=RTOL_F32, atol=1e-6 * np.abs(v).max())


def test_kfac_damping_is_a_fraction_of_the_mean_eigenvalue():
    A, S, sk = _layer(1)
    msn = float(np.mean(np.sum(sk**2, axis=(1, 2))))
    default = fit_layer("kfac", A, S, N_TOK, mean_sq_norm=msn)
    explicit = fit_layer("kfac", A, S, N_TOK, mean_sq_norm=msn, damping=DEFAULT_DAMPING)
    np.testing.assert_array_equal(default.left, explicit.left)
    assert default.info["lambda_A"] == pytest.approx(0.1 * np.trace(A / N_TOK) / K_IN)
    # (Ā + λ I)^{-1/2} squared and inverted gives back Ā + λ I
    right = default.right
    np.testing.assert_allclose(
        np.linalg.inv(right @ right),
        A / N_TOK + default.info["lambda_A"] * np.eye(K_IN),
        rtol=RTOL_F64,
    )
    # more damping shrinks the preconditioned vectors toward a scaled identity
    heavy = fit_layer("kfac", A, S, N_TOK, mean_sq_norm=msn, damping=1e6)
    v = heavy.apply(sk, dtype=np.float64)
    cos = np.sum(v * sk.reshape(N_REC, -1), axis=1) / (
        np.linalg.norm(v, axis=1) * np.linalg.norm(sk.reshape(N_REC, -1), axis=1)
    )
    assert np.all(cos > 1 - 1e-5)
    with pytest.raises(ConfigError, match="damping"):
        fit_layer("kfac", A, S, N_TOK, mean_sq_norm=msn, damping=-1)


def test_ekfac_matches_explicit_diagonal_in_eigenbasis():
    A, S, sk = _layer(2)
    mom = EkfacMoments.from_factors(A, S)
    for chunk in np.array_split(sk, 3):  # streamed like the store does
        mom.update(chunk)
    lp = fit_layer("ekfac", A, S, N_TOK, sketch_moments=mom)

    q_a = np.linalg.eigh(A)[1]
    q_s = np.linalg.eigh(S)[1]
    Q = np.kron(q_s, q_a)  # eigenbasis of S ⊗ A in row-major vec ordering
    rot = sk.reshape(N_REC, -1) @ Q  # coordinates Q_Sᵀ Ŝ Q_A, flattened
    lam = np.mean(rot**2, axis=0)
    lam_d = lam + DEFAULT_DAMPING * lam.mean()
    H = Q @ np.diag(lam_d) @ Q.T
    flat = sk.reshape(N_REC, -1)
    f2 = lam.sum() / (lam / lam_d).sum()  # the per-layer trace normalisation
    ref = f2 * flat @ np.linalg.solve(H, flat.T)

    v = lp.apply(sk, dtype=np.float64)
    assert lp.info["layer_scale"] == pytest.approx(np.sqrt(f2), rel=1e-10)
    np.testing.assert_allclose(v @ v.T, ref, rtol=RTOL_F64, atol=1e-10 * np.abs(ref).max())
    assert mom.mean_sq_norm == pytest.approx(np.mean(np.sum(sk**2, axis=(1, 2))), rel=1e-12)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_trace_normalisation_keeps_each_layers_energy_and_heavy_damping_is_identity(kind):
    """With the records' moments, a layer's mean ‖H^{-1/2} Ŝ‖² equals its mean ‖Ŝ‖² (identity's
    share of the summed score), the directions are the calibrated fit's up to one scalar, and
    heavy damping gives the identity itself, not a per-layer rescaling of it (issue 26)."""
    A, S, sk = _layer(6)
    mom = EkfacMoments.from_factors(A, S)
    mom.update(sk)
    msn = float(np.mean(np.sum(sk**2, axis=(1, 2))))
    lp = fit_layer(kind, A, S, N_TOK, sketch_moments=mom)
    v = lp.apply(sk, dtype=np.float64)
    assert np.mean(np.sum(v**2, axis=1)) == pytest.approx(msn, rel=1e-10)
    if kind == "kfac":
        plain = fit_layer(kind, A, S, N_TOK, mean_sq_norm=msn).apply(sk, dtype=np.float64)
        np.testing.assert_allclose(v, lp.info["layer_scale"] * plain, rtol=RTOL_F64)
    heavy = fit_layer(kind, A, S, N_TOK, sketch_moments=mom, damping=1e8)
    flat = sk.reshape(N_REC, -1)
    got = heavy.apply(sk, dtype=np.float64)
    if kind == "ekfac":  # the eigenbasis rotation is orthogonal: compare inner products
        got, flat = got @ got.T, flat @ flat.T
    np.testing.assert_allclose(got, flat, rtol=1e-6, atol=1e-6 * np.abs(flat).max())


def test_identity_is_plain_dot_and_dense_layers():
    A, S, sk = _layer(3)
    lp = fit_layer("identity", A, S, N_TOK)
    v = lp.apply(sk, dtype=np.float64)
    flat = sk.reshape(N_REC, -1)
    np.testing.assert_array_equal(v, flat)

    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 16)) * np.linspace(0.1, 5, 16)
    mom = EkfacMoments.dense(16)
    mom.update(x)
    ek = fit_layer("ekfac", None, None, 0, sketch_moments=mom)
    lam = np.mean(x**2, axis=0)
    f = np.sqrt(lam.sum() / (lam / (lam + 0.1 * lam.mean())).sum())
    np.testing.assert_allclose(
        ek.apply(x, dtype=np.float64), f * x / np.sqrt(lam + 0.1 * lam.mean()), rtol=RTOL_F64
    )
    # isotropic K-FAC: with the trace normalisation (moments given) the identity itself
    kf = fit_layer("kfac", None, None, 0, sketch_moments=mom)
    np.testing.assert_allclose(kf.apply(x, dtype=np.float64), x, rtol=RTOL_F64)
    m = np.mean(np.sum(x**2, axis=1))
    kf_calibrated = fit_layer("kfac", None, None, 0, mean_sq_norm=m, shape=(16,))
    np.testing.assert_allclose(
        kf_calibrated.apply(x, dtype=np.float64), x / np.sqrt(1.1 * m / 16), rtol=RTOL_F64
    )
    idn = fit_layer(PreconditionerKind.IDENTITY, None, None, 0, shape=(16,))
    np.testing.assert_array_equal(idn.apply(x, dtype=np.float64), x)


def _two_layers(kind: str) -> tuple[Preconditioner, list[np.ndarray]]:
    A, S, sk = _layer(4)
    rng = np.random.default_rng(5)
    dense = rng.normal(size=(N_REC, 10))
    m1 = EkfacMoments.from_factors(A, S)
    m1.update(sk)
    m2 = EkfacMoments.dense(10)
    m2.update(dense)
    stats = [
        LayerStats("blk.fc", (K_OUT, K_IN), A, S, N_TOK, moments=m1),
        LayerStats("blk.dense", (10,), moments=m2),
    ]
    return Preconditioner.fit(kind, stats), [sk, dense]


@pytest.mark.parametrize("kind", ["identity", "kfac", "ekfac"])
def test_multi_layer_slices_and_save_load_round_trip(tmp_path, kind):
    pre, sketches = _two_layers(kind)
    v = pre.apply(sketches)
    assert v.shape == (N_REC, K_OUT * K_IN + 10) and v.dtype == np.float32
    assert pre.layer_slices == {"blk.fc": slice(0, 12), "blk.dense": slice(12, 22)}
    # per-layer shares sum to the total score
    total = v @ v[0]
    shares = sum(v[:, sl] @ v[0, sl] for sl in pre.layer_slices.values())
    np.testing.assert_allclose(shares, total, rtol=RTOL_F32, atol=RTOL_F32 * np.abs(total).max())

    path = tmp_path / "pre.npz"
    pre.save(path)
    back = Preconditioner.load(path)
    assert back.kind.value == kind and back.layer_names == pre.layer_names
    np.testing.assert_array_equal(back.apply(sketches), v)


def test_errors_are_actionable(tmp_path):
    A, S, sk = _layer(6)
    with pytest.raises(ConfigError, match="must be one of 'auto', 'identity', 'kfac', 'ekfac'"):
        fit_layer("lissa", A, S, N_TOK)
    with pytest.raises(ConfigError, match="mean_sq_norm"):
        fit_layer("kfac", A, S, N_TOK)
    with pytest.raises(ConfigError, match="sketch_moments"):
        fit_layer("ekfac", A, S, N_TOK)
    with pytest.raises(StoreError, match="n_tokens"):
        fit_layer("kfac", A, S, 0, mean_sq_norm=1.0)
    lp = fit_layer("identity", A, S, N_TOK)
    with pytest.raises(StoreError, match="refit"):
        lp.apply(np.zeros((2, K_IN, K_OUT)))
    bad = tmp_path / "x.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(StoreError, match="refit"):
        Preconditioner.load(bad)
    with pytest.raises(StoreError):
        Preconditioner.load(tmp_path / "missing.npz")


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_a_layer_without_statistics_is_scored_unwhitened(kind, caplog):
    """A LoRA A matrix sees no output gradient while B is still zero, so statistics batches
    taken then leave its S at 0: that layer falls back to identity (with a warning and the
    reason in ``info``), the others are whitened as usual."""
    A, S, sk = _layer(7)
    moments = EkfacMoments.from_factors(A / N_TOK, np.zeros_like(S))
    moments.update(sk)
    lp = fit_layer(kind, A, np.zeros_like(S), N_TOK, sketch_moments=moments, name="lora_A")
    assert lp.kind is PreconditionerKind.IDENTITY and "all zero" in lp.info["unfit"]
    np.testing.assert_array_equal(lp.apply(sk, dtype=np.float64), sk.reshape(N_REC, -1))
    assert "lora_A" in caplog.text and "unwhitened" in caplog.text
    ok_moments = EkfacMoments.from_factors(A / N_TOK, S / N_TOK)
    ok_moments.update(sk)
    fitted = fit_layer(kind, A, S, N_TOK, sketch_moments=ok_moments)
    assert fitted.kind is PreconditionerKind(kind)


# float64 products of the same numbers by another summation order
PRODUCT_RTOL = 1e-10


def test_stack_matmul_is_the_stacked_product():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4, 3))
    left, right = rng.standard_normal((6, 4)), rng.standard_normal((3, 2))
    np.testing.assert_allclose(stack_matmul(left, x, right), left @ x @ right, rtol=PRODUCT_RTOL)
    np.testing.assert_allclose(stack_matmul(left, x), left @ x, rtol=PRODUCT_RTOL)
    np.testing.assert_allclose(stack_matmul(None, x, right), x @ right, rtol=PRODUCT_RTOL)


def test_on_parts_covers_every_record_once_in_order(monkeypatch):
    """The build's stack products run on contiguous parts of the records (up to one a hand),
    each record in exactly one part, the parts' results in order."""
    monkeypatch.setattr(layer_module, "_PART_MIN", 4)
    monkeypatch.setattr(layer_module, "hands", lambda: 3)
    assert layer_module.on_parts(lambda a, b: (a, b), 13) == [(0, 4), (4, 8), (8, 13)]
    assert layer_module.on_parts(lambda a, b: (a, b), 5) == [(0, 5)]  # below 2 parts: one
    assert layer_module.on_parts(lambda a, b: (a, b), 13, rank=1) == [(0, 13)]  # 2-D GEMMs
    x = np.random.default_rng(3).standard_normal((13, 4, 2))
    np.testing.assert_allclose(
        layer_module.factor_grams(x), x.transpose(0, 2, 1) @ x, rtol=PRODUCT_RTOL
    )


@pytest.mark.parametrize("rank", [1, 2])
def test_ekfac_moments_from_factors_equal_those_of_the_sketches(rank, monkeypatch):
    """Rank 1 takes the factored route ((Q_Sᵀu)² (Q_Aᵀv)²ᵀ), rank 2 rebuilds the sketch in the
    eigenbasis, ``(Q_Sᵀ U)(Q_Aᵀ V)ᵀ``, a block of records at a time (2 here, the last ragged);
    both must give the moments of the sketches ``U Vᵀ`` themselves."""
    monkeypatch.setattr(layer_module, "_SQ_BLOCK", 2)
    monkeypatch.setattr(layer_module, "_PART_MIN", 3)  # 9 records: three parts on three hands
    monkeypatch.setattr(layer_module, "hands", lambda: 3)
    rng = np.random.default_rng(1)
    a, s = rng.standard_normal((7, 7)), rng.standard_normal((5, 5))
    u, v = rng.standard_normal((9, 5, rank)), rng.standard_normal((9, 7, rank))
    want = EkfacMoments.from_factors(a @ a.T, s @ s.T)
    want.update(u @ v.transpose(0, 2, 1))
    got = EkfacMoments.from_factors(a @ a.T, s @ s.T)
    got.update_factors(u[:4], v[:4])
    got.update_factors(u[4:], v[4:])
    assert got.count == want.count == 9
    np.testing.assert_allclose(got.mean, want.mean, rtol=PRODUCT_RTOL)
    with pytest.raises(StoreError, match="per-record shape"):
        got.update_factors(v, u)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_a_layer_no_statistics_batch_reached_is_scored_unwhitened_in_a_store(
    kind, tmp_path, caplog
):
    """A tracked layer that took no part in any statistics batch (``n_tokens = 0``, zero sums)
    and never received a gradient (zero records) does not stop the run's K-FAC / EK-FAC index:
    it is scored unwhitened with a warning, and every score equals that of the same store
    without the layer. Statistics that are not zero under ``n_tokens = 0`` stay an error."""
    from helpers import write_factor_store

    from traceprop_engine.attribution.index.run_indexes import RunIndexes
    from traceprop_engine.settings import IndexSettings

    shapes = [(6, 4), (5, 5)]
    rng = np.random.default_rng(5)
    ex = np.arange(24)
    arrays = [rng.normal(size=(24, ko + ki, 1)).astype(np.float32) for ko, ki in shapes]
    dead = np.zeros((24, 3 + 7, 1), np.float32)
    plain = write_factor_store(tmp_path / "p.h5", shapes, arrays, ex, np.random.default_rng(7), "a")
    with_dead = write_factor_store(
        tmp_path / "d.h5", [*shapes, (3, 7)], [*arrays, dead], ex, np.random.default_rng(7), "a",
        no_statistics=[2],
    )  # fmt: skip
    assert with_dead.covariance(2).n_tokens == 0
    queries = [rng.normal(size=(2, ko, ki)).astype(np.float32) for ko, ki in shapes]
    for cosine in (True, False):
        s = IndexSettings(preconditioner=kind, cosine=cosine)
        with caplog.at_level("WARNING"):
            got = RunIndexes(tmp_path / f"d{cosine}", with_dead).scorer(s)
        assert "blk.2" in caplog.text and "never accumulated" in caplog.text
        want = RunIndexes(tmp_path / f"p{cosine}", plain).scorer(s)
        a = got.scores(got.pullbacks([*queries, rng.normal(size=(2, 3, 7)).astype(np.float32)]))
        b = want.scores(want.pullbacks(queries))
        np.testing.assert_allclose(a, b, rtol=RTOL_F32, atol=RTOL_F32 * abs(b).max())
    A, S, _ = _layer(8)
    with pytest.raises(StoreError, match="inconsistent"):
        fit_layer(kind, A, S, 0, mean_sq_norm=1.0, name="x")
