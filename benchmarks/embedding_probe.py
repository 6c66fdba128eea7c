"""Would a record of the input embedding help, and preconditioned how? (EVAL.md §1l)

Reads finished ``traceprop eval lds`` folders (main run ``runs/k126``, ``subsets.json``,
``losses.npy``) and prints the LDS of exact final-model gradient cosines over the tracked linear
weights, alone and with the input embedding's gradient appended under several
preconditioners of that embedding gradient ``E`` (``(V, d)``: row ``v`` is the sum of the
output gradients ``g_t`` of the positions holding token ``v``):

- identity;
- K-FAC's input side only: row ``v`` divided by ``sqrt(c_v / N + λ_A)``, where ``c_v / N`` is
  token ``v``'s share of the training tokens (the input covariance of one-hot inputs is that
  diagonal) and ``λ_A = 0.1 · mean``: an inverse-document-frequency weighting;
- K-FAC's output side only (what a projected input side leaves: ``P_in`` of k ≪ V columns
  cannot carry the diagonal);
- full K-FAC: also ``S^{-1/2}`` on the right, ``S ≈ Σ_i E_iᵀ E_i / N`` (exact when no token repeats
  in an example), ``λ_S = 0.1 · tr(S) / d``;

each trace-normalised to keep the embedding's mean squared norm over training rows (as the
engine's K-FAC keeps each layer's), and at weights 0.5 / 2 against the linear part.

Usage: ``python benchmarks/embedding_probe.py /tmp/q/hard60-s0 /tmp/q/pft-hard60-s0 ...``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from gap_probe import cosine, encodings, named_gradients, subset_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_report import lds_scores


def inv_sqrt(m: np.ndarray, lam: float) -> np.ndarray:
    w, v = np.linalg.eigh(m)
    return (v / np.sqrt(np.clip(w, 0, None) + lam)) @ v.T


def embedding_variants(  # noqa: PLR0914 - one probe, many variants
    et: np.ndarray, ee: np.ndarray, counts: np.ndarray
) -> dict:
    """Per preconditioner, the (train, eval) embedding gradients, trace-normalised."""
    n_tok = counts.sum()
    share = counts / n_tok
    lam_a = 0.1 * share.mean()
    da = 1.0 / np.sqrt(share + lam_a)  # (V,)
    s = np.einsum("nvd,nve->de", et, et) / n_tok
    rs = inv_sqrt(s, 0.1 * np.trace(s) / s.shape[0])
    base = np.mean(np.sum(et**2, axis=(1, 2)))
    out = {"identity": (et, ee)}
    # the input side through a Gaussian projection of k = 126 rows (what a record would keep)
    p = np.random.default_rng(0).standard_normal((et.shape[1], 126)) / np.sqrt(126)
    a_p = (p.T * share) @ p
    ra = inv_sqrt(a_p, 0.1 * np.trace(a_p) / 126)
    pt, pe = np.einsum("nvd,vk->nkd", et, p), np.einsum("nvd,vk->nkd", ee, p)
    out["projected, identity"] = (pt, pe)
    # vocab rows on the input side: the m most frequent tokens exact, the rest projected
    m = int(0.75 * 126)
    top = np.argsort(-counts, kind="stable")[:m]
    rest = np.setdiff1d(np.arange(len(counts)), top)
    pv = np.zeros((et.shape[1], 126))
    pv[top, np.arange(m)] = 1.0
    pv[rest, m:] = np.random.default_rng(1).standard_normal((len(rest), 126 - m)) / np.sqrt(126 - m)
    a_v = (pv.T * share) @ pv
    rv = inv_sqrt(a_v, 0.1 * np.trace(a_v) / 126)
    vt, ve = np.einsum("nvd,vk->nkd", et, pv), np.einsum("nvd,vk->nkd", ee, pv)

    def half_step(x):  # the default record's rank 1: G σ σᵀ / ‖σ‖², σ = Σ_t g_t = Σ_v G[v]
        sig = x.sum(1)  # (n, d)
        return np.einsum("nvd,nd,ne->nve", x, sig, sig) / (np.sum(sig**2, 1)[:, None, None] + 1e-30)

    out["projected, identity, rank-1 record"] = (half_step(pt), pe)
    out["projected, identity, rank-1 both"] = (half_step(pt), half_step(pe))
    for name, f in {
        "idf (A only)": lambda x: x * da[None, :, None],
        "K-FAC (A and S)": lambda x: (x * da[None, :, None]) @ rs,
        "K-FAC (S only)": lambda x: x @ rs,
        "projected, K-FAC (A and S)": lambda x: np.einsum("kj,njd->nkd", ra, x) @ rs,
        "vocab rows, K-FAC (A and S)": lambda x: np.einsum("kj,njd->nkd", rv, x) @ rs,
    }.items():
        t, e = (
            (f(vt), f(ve))
            if name.startswith("vocab rows")
            else (f(pt), f(pe))
            if name.startswith("projected")
            else (f(et), f(ee))
        )
        scale = np.sqrt(base / np.mean(np.sum(t**2, axis=(1, 2))))
        out[name] = (t * scale, e * scale)
    return out


def probe(ev: Path) -> dict:
    masks, losses, n_train = subset_data(ev)

    def lds(scores):
        return float(np.nanmean(lds_scores(scores, masks, losses)))

    run = open_run(ev / "runs" / "k126")
    try:
        enc_ev, enc_tr = encodings(run, n_train)
        model_dir, task = run.dir / C.MODEL_DIR, run.task
    finally:
        run.close()
    gt = named_gradients(model_dir, enc_tr, task)
    ge = named_gradients(model_dir, enc_ev, task)
    emb = [n for n in gt if "embed_in" in n or "word_embeddings" in n]
    lin = [n for n in gt if gt[n].ndim == 3 and n not in emb and "norm" not in n]
    if not emb:
        return {"note": "no trained input embedding"}
    et, ee = gt[emb[0]], ge[emb[0]]
    vocab = et.shape[1]
    counts = np.zeros(vocab)
    for enc in enc_tr:
        ids = np.asarray(enc.ids)
        counts += np.bincount(ids[ids < vocab], minlength=vocab)
    lt, le = [gt[n] for n in lin], [ge[n] for n in lin]
    rows = {"linear weights alone": lds(cosine(le, lt))}
    for name, (t, e) in embedding_variants(et, ee, counts).items():
        rows[f"embedding alone, {name}"] = lds(cosine([e], [t]))
        for w in (1.0, 0.5, 2.0):
            key = f"linear + embedding {name}" + ("" if w == 1.0 else f" × {w}")
            rows[key] = lds(cosine(le + [e * np.sqrt(w)], lt + [t * np.sqrt(w)]))
    return rows


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    results = {}
    for d in argv:
        ev = Path(d)
        results[ev.name] = probe(ev)
        print(f"== {ev.name}", flush=True)
        for k, v in results[ev.name].items():
            print(f"  {k:50s} {v if isinstance(v, str) else f'{v:.3f}'}", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
