"""K-FAC end to end against a hand-computed, unprojected reference on a tiny model (issue 26).

Two tracked steps of a tiny GPT-NeoX (no optimizer step, so the per-example autograd gradients
of the same model are the reference), statistics from every token of every batch. By hand:
``A = Σ_t a aᵀ`` over the real tokens and ``S = Σ_t (s g)(s g)ᵀ`` (``s`` the loss scale the hooks
use), the per-example gradients ``G_i`` with ``loss_i.backward()``, and the explicit Kronecker
inverse. The engine must record ``P_in A P_inᵀ`` and ``P_out S P_outᵀ`` and, at ``k`` = the
layer's widths (no projection), score exactly ``vec(G_t)ᵀ H⁻¹ vec(Σ lr G_i)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import causal_batch, per_example_grads, single_causal_losses, tiny_neox

from traceprop_engine import Store, Tracker, TrackSettings
from traceprop_engine.attribution.precondition.vectors import fit_preconditioner
from traceprop_engine.capture.layers import build_layers
from traceprop_engine.settings import IndexSettings
from traceprop_engine.training.losses import causal_lm_losses

LAYERS = r"layers\.0\.mlp\.dense_4h_to_h|lm_head|embed_out"  # 64 -> 32 and the head 32 -> 97
LRS = (0.5, 0.25)  # the two steps' learning rates (records are weighted by them)
RTOL_STATS = 1e-4  # fp32 sums of a few dozen token products against float64
RTOL_SCORE = 1e-3  # fp32 records and statistics through a damped inverse, against float64


def _track(tmp_path, **kw):
    """Two tracked steps (examples 0-2, 3-5), no optimizer step; returns store, layers, and the
    hand reference: per layer A, S (unprojected token sums), n_tokens; per example G_i."""
    model = tiny_neox()
    settings = TrackSettings(
        scope=LAYERS, covariance_stride=1, covariance_tokens=0, factor_dtype="float32", **kw
    )
    layers = build_layers(model, settings)
    seen = {i: [] for i in range(len(layers))}

    def spy(i):
        def hook(module, inputs, output):
            rec = {"a": inputs[0].detach()}
            seen[i].append(rec)
            output.register_hook(lambda g: rec.update(g=g.detach()))

        return hook

    handles = [layer.module.register_forward_hook(spy(i)) for i, layer in enumerate(layers)]
    batches = [causal_batch(0), causal_batch(1)]
    path = tmp_path / "store.h5"
    try:
        with Tracker(model, path, settings, background=False) as tracker:
            for step, ((ids, mask, labels, _), lr) in enumerate(zip(batches, LRS, strict=True)):
                with tracker.step(
                    [3 * step, 3 * step + 1, 3 * step + 2], padding_mask=mask, step=step, lr=lr
                ) as rec:
                    losses = causal_lm_losses(
                        model(input_ids=ids, attention_mask=mask).logits, labels
                    )
                    losses.mean().backward()
                    rec.losses = losses
                model.zero_grad()
    finally:
        for h in handles:
            h.remove()
    ref = []
    for i, _ in enumerate(layers):
        A = S = 0.0
        n = 0
        for (_, mask, _, _), r in zip(batches, seen[i], strict=True):
            m = mask.bool().flatten()
            a = r["a"].double().flatten(0, 1)[m]
            g = 3 * r["g"].double().flatten(0, 1)  # loss scale: the batch loss is a mean of 3
            A, S, n = A + a.T @ a, S + g.T @ g, n + int(m.sum())
        ref.append({"A": A.numpy(), "S": S.numpy(), "n": n})
    grads = []
    for ids, _, labels, lengths in batches:
        grads += per_example_grads(model, layers, single_causal_losses(model, ids, labels, lengths))
    return Store(path), layers, ref, grads


def _proj(layer, side: str, d: int) -> np.ndarray:
    p = layer.P_in if side == "in" else layer.P_out
    return np.eye(d) if p is None else p.double().numpy()


@pytest.mark.parametrize("kw", [dict(rank=0, k_in=8, k_out=6), dict(k_in=8, k_out=6)])
def test_recorded_statistics_are_the_projected_token_sums(tmp_path, kw):
    """Sketch path (rank 0) and the default full-space factors: A = P_in A P_inᵀ, S = P_out S
    P_outᵀ over the same tokens, S from the per-example-rescaled g the sketches use."""
    store, layers, ref, _ = _track(tmp_path, **kw)
    for li, (layer, r) in enumerate(zip(layers, ref, strict=True)):
        cov = store.covariance(li)
        p_in, p_out = _proj(layer, "in", layer.d_in), _proj(layer, "out", layer.d_out)
        want_a, want_s = p_in @ r["A"] @ p_in.T, p_out @ r["S"] @ p_out.T
        np.testing.assert_allclose(
            cov.A, want_a, rtol=RTOL_STATS, atol=RTOL_STATS * abs(want_a).max()
        )
        np.testing.assert_allclose(
            cov.S, want_s, rtol=RTOL_STATS, atol=RTOL_STATS * abs(want_s).max()
        )
        assert cov.n_tokens == r["n"]
    store.close()


def _kron_scores(G_test, X, A, S, n, records, damping, normalise=True):
    """Explicit ``f² vec(G_t)ᵀ H⁻¹ vec(X_i)``, ``H = c S̄ ⊗ Ā`` + per-factor damping, written out
    with an explicit (d_out d_in)² inverse; ``f²`` the per-layer trace normalisation
    ``mean ‖Ŝ‖² / mean vec(Ŝ)ᵀ H⁻¹ vec(Ŝ)`` over the records (precondition.py's docstring), or 1
    without ``normalise`` (``weighting='fisher'``)."""
    flat = records.reshape(len(records), -1)
    msq = float(np.mean(np.sum(flat**2, axis=1)))
    a_bar, s_bar = A / n, S / n
    c = msq / (np.trace(s_bar) * np.trace(a_bar))
    lam_a = damping * np.trace(a_bar) / len(a_bar)
    lam_s = damping * c * np.trace(s_bar) / len(s_bar)
    h_inv = np.kron(
        np.linalg.inv(c * s_bar + lam_s * np.eye(len(s_bar))),
        np.linalg.inv(a_bar + lam_a * np.eye(len(a_bar))),
    )
    f2 = msq / float(np.mean(np.einsum("ni,ij,nj->n", flat, h_inv, flat))) if normalise else 1.0
    return f2 * G_test.reshape(len(G_test), -1) @ h_inv @ X.reshape(len(X), -1).T


@pytest.mark.parametrize("damping", [0.1, 10.0])
def test_unprojected_kfac_scores_equal_the_explicit_kronecker_inverse(tmp_path, damping):
    """k = every width (no projection): the engine's K-FAC score of a test gradient against the
    lr-weighted training vectors is the explicit Kronecker inverse of the hand-made factors; the
    LM head (the model's output embedding) is left unwhitened: its score is the plain product."""
    store, layers, ref, grads = _track(tmp_path, rank=0, k_in=1 << 20, k_out=1 << 20)
    assert all(layer.P_in is None and layer.P_out is None for layer in layers)
    assert [layer.output_head for layer in layers] == [False, True]
    pre = fit_preconditioner(
        store,
        IndexSettings(
            preconditioner="kfac", damping=damping, cosine=False, index_side=0, index_dims=0
        ),
    )
    lr = np.repeat(LRS, 3)
    for li, (lp, r) in enumerate(zip(pre.layers, ref, strict=True)):
        G = np.stack([g[li] for g in grads])  # (6, d_out, d_in) autograd
        X = G * lr[:, None, None]
        if layers[li].output_head:
            want = G[:2].reshape(2, -1) @ X.reshape(len(X), -1).T
        else:
            want = _kron_scores(G[:2], X, r["A"], r["S"], r["n"], G, damping)
        got = np.einsum(
            "qoi,noi->qn",
            lp.pullback(G[:2]),
            store.sketches(li).astype(np.float64) * lr[:, None, None],
        )
        np.testing.assert_allclose(got, want, rtol=RTOL_SCORE, atol=RTOL_SCORE * abs(want).max())
    store.close()


def test_fisher_weighting_whitens_the_head_and_keeps_each_layers_fisher_scale(tmp_path):
    """``weighting='fisher'``: every layer, the LM head too, scores ``vec(G_t)ᵀ H⁻¹ vec(X_i)``
    with the explicit Kronecker inverse and no per-layer trace normalisation (``f = 1``)."""
    store, layers, ref, grads = _track(tmp_path, rank=0, k_in=1 << 20, k_out=1 << 20)
    s = IndexSettings(
        preconditioner="kfac", cosine=False, index_side=0, index_dims=0, weighting="fisher"
    )
    pre = fit_preconditioner(store, s)
    lr = np.repeat(LRS, 3)
    for li, (lp, r) in enumerate(zip(pre.layers, ref, strict=True)):
        G = np.stack([g[li] for g in grads])
        X = G * lr[:, None, None]
        want = _kron_scores(G[:2], X, r["A"], r["S"], r["n"], G, 0.1, normalise=False)
        got = np.einsum(
            "qoi,noi->qn",
            lp.pullback(G[:2]),
            store.sketches(li).astype(np.float64) * lr[:, None, None],
        )
        np.testing.assert_allclose(got, want, rtol=RTOL_SCORE, atol=RTOL_SCORE * abs(want).max())
    assert layers[-1].output_head and pre.layers[-1].kind.value == "kfac"  # the head whitened
    store.close()
