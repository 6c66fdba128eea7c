"""Post-hoc K-FAC on the final model, unprojected, taken apart one choice at a time (EVAL.md §1p).

kronfluence's EK-FAC-cosine leads Traceprop's default by 0.05–0.11 LDS on a pretrained model
fine-tuned in full (peers/RESULTS.md) while its K-FAC fails from scratch. This script finds
which of its choices matter. It reads a finished ``traceprop eval lds`` folder (main run
``runs/k126``), takes every example's exact final-model gradient of each tracked linear layer
(no projection), fits the Kronecker factors ``A = E[a aᵀ]``, ``S = E[g gᵀ]`` on the final model
over the training rows, and scores ``⟨g_q, H⁻¹ g_i⟩ / √⟨g_i, H⁻¹ g_i⟩`` (the train-side cosine
LDS sees; ``H⁻¹`` in the factors' eigenbasis with damping ``0.1 × mean eigenvalue`` of the
layer's Kronecker product, kronfluence's heuristic) with each of:

- factors from the training labels (empirical Fisher) or labels sampled from the model (true
  Fisher, ``--samples`` draws);
- K-FAC eigenvalues ``s_o a_i`` or EK-FAC's, the mean squared per-example gradient in the
  eigenbasis;
- the output head whitened or left alone (identity);
- each layer's absolute curvature scale kept (kronfluence) or normalised away (the engine's
  per-layer trace normalisation: a layer's preconditioned self-scores keep its identity mean);
- the run's own projections applied to the gradients and factors first (what the engine can see),
  and there the run's own inline statistics instead of the final model's.

Usage: ``python benchmarks/kfac_probe.py DIR ... [--samples 2]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gap_probe import encodings, named_gradients, subset_data  # noqa: E402
from replay import engine_projections  # noqa: E402
from replay_true_fisher import sampled_loss  # noqa: E402

from traceprop_engine import constants as C  # noqa: E402
from traceprop_engine.attribution import open_run  # noqa: E402
from traceprop_engine.evaluate.lds_levers import trained_parameters  # noqa: E402
from traceprop_engine.evaluate.lds_report import lds_scores  # noqa: E402
from traceprop_engine.training.losses import example_losses  # noqa: E402
from traceprop_engine.training.models import collate, load_saved_model, model_inputs  # noqa: E402

BATCH = 8
DAMPING = 0.1


def _width(m, side: int) -> int:
    """A module's output (``side`` 0) or input (1) width; an embedding's input is its vocabulary."""
    if isinstance(m, torch.nn.Embedding):
        return (m.embedding_dim, m.num_embeddings)[side]
    return (m.out_features, m.in_features)[side]


# long: one hook pair per layer and the pass over the training rows, kept together
def fit_factors(model_dir: Path, task: str, names: list[str], encs: list, samples: int) -> list:
    """``(S, A)`` per module in ``names`` on the final model over ``encs``: training labels when
    ``samples`` is 0, else ``samples`` label draws from the model's own predictions."""
    loaded = load_saved_model(model_dir, "cpu")
    model = loaded.model
    model.eval()
    trained_parameters(model)  # the loader freezes every parameter for queries
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    mods = [model.get_submodule(n) for n in names]
    S = [torch.zeros(_width(m, 0), _width(m, 0), dtype=torch.float64) for m in mods]
    A = [torch.zeros(_width(m, 1), _width(m, 1), dtype=torch.float64) for m in mods]
    mask: list[torch.Tensor] = []

    def hooks(i: int):
        def grad_hook(g):
            g2 = g.detach().reshape(-1, g.shape[-1]).double()
            S[i].add_(g2.T @ g2)

        def fwd(module, inputs, output):
            if isinstance(module, torch.nn.Embedding):  # a_t one-hot: A = diag(token counts)
                ids = inputs[0].reshape(-1)[mask[0].reshape(-1) > 0]
                A[i].diagonal().add_(torch.bincount(ids, minlength=len(A[i])).double())
            else:
                a = inputs[0].detach().double()
                m = mask[0].reshape(-1, 1).double() if a.dim() == 3 else 1.0
                a2 = a.reshape(-1, a.shape[-1])
                A[i].add_((a2 * m).T @ a2)
            output.register_hook(grad_hook)

        return fwd

    handles = [m.register_forward_hook(hooks(i)) for i, m in enumerate(mods)]
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(max(samples, 1)):
            for lo in range(0, len(encs), BATCH):
                batch = collate(encs[lo : lo + BATCH], pad, task, "cpu")
                mask[:] = [batch["attention_mask"]]
                out = model(**model_inputs(batch))
                if samples:
                    loss = sampled_loss(out.logits, batch["labels"], task, gen)
                else:
                    loss = example_losses(out, batch, task).sum()
                loss.backward()
                model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return [(s.numpy(), a.numpy()) for s, a in zip(S, A, strict=True)]


def rotate(g: np.ndarray, qs: np.ndarray, qa: np.ndarray) -> np.ndarray:
    """``Q_Sᵀ G Q_A`` for a ``(n, out, in)`` stack."""
    return np.einsum("ao,nab,bi->noi", qs, g, qa, optimize=True)


def layer_scores(
    gq, gf, factors, ekfac: bool, normalise: bool, damping: float = DAMPING
) -> tuple[np.ndarray, np.ndarray]:
    """``(pairwise (n_q, n_f), self (n_f,))`` of one layer; ``factors`` None: identity."""
    if factors is None:
        q, f = gq.reshape(len(gq), -1), gf.reshape(len(gf), -1)
        return q @ f.T, (f**2).sum(1)
    s, qs = np.linalg.eigh(factors[0])
    a, qa = np.linalg.eigh(factors[1])
    rq, rf = rotate(gq, qs, qa), rotate(gf, qs, qa)
    lam = (rf**2).mean(0) if ekfac else np.clip(s, 0, None)[:, None] * np.clip(a, 0, None)[None]
    inv = 1.0 / (lam + damping * lam.mean())
    q = rq.reshape(len(rq), -1)
    f = (rf * inv[None]).reshape(len(rf), -1)
    pair, own = q @ f.T, (rf.reshape(len(rf), -1) * f).sum(1)
    if normalise:  # the layer keeps its identity mean self-score (engine's trace normalisation)
        c = (gf.reshape(len(gf), -1) ** 2).sum(1).mean() / own.mean()
        pair, own = pair * c, own * c
    return pair, own


def scores(
    gq: list, gf: list, factors: list, ekfac: bool, normalise: bool, damping: float = DAMPING
) -> np.ndarray:
    """Train-side cosine over every layer: ``Σ_l pair_l / √(Σ_l self_l)``."""
    parts = [
        layer_scores(q, f, x, ekfac, normalise, damping)
        for q, f, x in zip(gq, gf, factors, strict=True)
    ]
    return sum(p for p, _ in parts) / np.sqrt(sum(o for _, o in parts) + 1e-300)[None]


def project(g: np.ndarray, p_out, p_in) -> np.ndarray:
    g = g if p_out is None else np.einsum("ko,nob->nkb", p_out, g)
    return g if p_in is None else np.einsum("nkb,jb->nkj", g, p_in)


def project_factors(f: tuple, p_out, p_in) -> tuple:
    s, a = f
    return (s if p_out is None else p_out @ s @ p_out.T, a if p_in is None else p_in @ a @ p_in.T)


def curvature(f) -> float:
    """The mean eigenvalue of a layer's Kronecker product ``S ⊗ A``."""
    return float(np.trace(f[0]) / len(f[0]) * np.trace(f[1]) / len(f[1]))


def weighted(gs: list, w: list[float]) -> list:
    """Each layer's gradients scaled by √w (its inner products by w)."""
    return [g * np.sqrt(x) for g, x in zip(gs, w, strict=True)]


# long: every variant of the module docstring for one folder, one row each
def probe(ev: Path, samples: int) -> dict[str, float]:
    masks, losses, n_train = subset_data(ev)

    def lds(sc):
        return round(float(np.nanmean(lds_scores(sc, masks, losses))), 4)

    run = open_run(ev / "runs" / "k126")
    try:
        enc_ev, enc_tr = encodings(run, n_train)
        layers = [i for i in run.store.layers if i.kind in ("linear", "embedding")]
        inline = [run.store.covariance(info.index) for info in layers]  # projected, trajectory
        inline = [(c.S / c.n_tokens, c.A / c.n_tokens) for c in inline]
        model_dir, task = run.dir / C.MODEL_DIR, run.task
    finally:
        run.close()
    names = [info.name for info in layers]
    head = [i for i, info in enumerate(layers) if info.output_head]
    emb = [i for i, info in enumerate(layers) if info.kind == "embedding"]
    gt, ge = named_gradients(model_dir, enc_tr, task), named_gradients(model_dir, enc_ev, task)

    def grads(g):  # (n, out, in); an embedding's weight is (vocab, width): its input is the vocab
        return [g[n + ".weight"].transpose(0, 2, 1) if i in emb else g[n + ".weight"]
                for i, n in enumerate(names)]  # fmt: skip

    gf, gq = grads(gt), grads(ge)
    emp = fit_factors(model_dir, task, names, enc_tr, 0)
    ident = [None] * len(names)
    curv = [curvature(f) for f in emp]
    lin = [i for i in range(len(names)) if i not in emb]
    rows: dict[str, float] = {}
    for sname, keep in (("linear", lin), ("+ embedding", list(range(len(names))))):
        if sname != "linear" and not emb:
            continue

        def sel(x, keep=keep):
            return [x[i] for i in keep]

        def unwhite(f, keep=keep):
            return [None if i in head else f[i] for i in keep]

        def row(label, q, f, fac, ek=False, nm=False, damping=DAMPING, sname=sname):
            rows[f"{sname}: {label}"] = lds(scores(q, f, fac, ek, nm, damping))

        q, f = sel(gq), sel(gf)
        w = [1.0 / c for c in sel(curv)]
        row("identity", q, f, sel(ident))
        for hw in (0.0, 0.25):
            wh = [hw if i in head else 1.0 for i in keep]
            row(f"identity, head weighted {hw}", weighted(q, wh), weighted(f, wh), sel(ident))
            row(f"K-FAC, trace-normalised, head identity weighted {hw}",
                weighted(q, wh), weighted(f, wh), unwhite(emp), nm=True)  # fmt: skip
        row(
            "identity, layers weighted 1 / mean curvature",
            weighted(q, w),
            weighted(f, w),
            sel(ident),
        )
        row("K-FAC, trace-normalised, head identity (the engine)", q, f, unwhite(emp), nm=True)
        row("K-FAC, raw scale, head identity", q, f, unwhite(emp))
        row("K-FAC, trace-normalised, head whitened", q, f, sel(emp), nm=True)
        row("K-FAC, raw scale, head whitened (kronfluence)", q, f, sel(emp))
        row("EK-FAC, raw scale, head whitened", q, f, sel(emp), ek=True)
        for damp in (0.01, 1.0):
            row(f"K-FAC, raw scale, head whitened, damping {damp}", q, f, sel(emp), damping=damp)
    if samples:
        tru = fit_factors(model_dir, task, names, enc_tr, samples)
        rows["all: K-FAC true Fisher, raw scale, head whitened"] = lds(
            scores(gq, gf, tru, False, False)
        )
    # the same through the run's own projections (what an inline method sees)
    allp = engine_projections(ev)
    projs = [allp[info.index] for info in layers]
    pq = [project(g, *p) for g, p in zip(gq, projs, strict=True)]
    pf = [project(g, *p) for g, p in zip(gf, projs, strict=True)]
    pemp = [project_factors(f, *p) for f, p in zip(emp, projs, strict=True)]
    rows["all, projected: identity"] = lds(scores(pq, pf, ident, False, False))
    rows["all, projected: K-FAC, the run's inline statistics, raw scale, head whitened"] = lds(
        scores(pq, pf, inline, False, False)
    )
    rows["all, projected: K-FAC, raw scale, head whitened"] = lds(
        scores(pq, pf, pemp, False, False)
    )
    # each layer's share of the self-scores under raw-scale whitening
    own = [
        layer_scores(q, f, x, False, False)[1].mean() for q, f, x in zip(gq, gf, emp, strict=True)
    ]
    for n, o in zip(names, own, strict=True):
        rows[f"share of self-score, K-FAC raw, head whitened: {n}"] = round(o / sum(own), 4)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument(
        "--samples", type=int, default=0, help="label draws per row for a true-Fisher row (0: none)"
    )
    args = p.parse_args()
    for ev in map(Path, args.folders):
        rows = probe(ev, args.samples)
        print(f"== {ev.name}")
        for k, v in rows.items():
            print(f"  {k:60s} {v:.3f}", flush=True)
        print(json.dumps({ev.name: rows}))


if __name__ == "__main__":
    main()
