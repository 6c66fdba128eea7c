"""The influence through a causal LM head's output bias, from the final model (EVAL.md §1aa).

A classifier's default adds the gradient of its head's bias back at query time (the class
prior, ``attribution/score/class_prior.py``). A causal LM's head has a bias too in effect: the
gradient of an example's loss with respect to a (zero) output bias is ``σ = Σ_t (p_t − y_t)``
over its target positions, which the weight records leave out. This probe scores every eval
query against every training example by that term alone, computed exactly on the run's final
model: ``σ_qᵀ S⁻¹ σ_i / ‖S^{-1/2} σ_i‖`` with ``S`` the diagonal of the training tokens' output
gradients' second moment (the K-FAC output factor's diagonal, damped by 1e-3 of its mean); and
the default's scores blended with it, each query's two score rows standardised,
``(1 − w)·default + w·bias``.

    python benchmarks/lm_bias_probe.py [--cosine] EVAL_DIR [EVAL_DIR ...]

prints per folder the LDS of the default, the bias term alone, and the blends at w = 0.2, 0.35,
0.5, 0.65 (on the folder's own retrains; the default rescored by the installed engine).

``--cosine`` scores as the engine's LM-bias term does (``attribution/score/lm_bias.py``), for runs
that record no head (LoRA, EVAL.md §1ad): the term is the cosine of ``S^{-1/2} σ_q`` and
``S^{-1/2} σ_i``, and each blend is ``records + w · term`` with the records scored alone
(``lm_bias=0``), at w = 0.1, 0.2, 0.3, 0.5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from gap_probe import subset_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import IndexSettings, open_run, query_targets
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.training.models import load_saved_model

WEIGHTS = (0.2, 0.35, 0.5, 0.65)
COSINE_WEIGHTS = (0.1, 0.2, 0.3, 0.5)


def _z(m: np.ndarray) -> np.ndarray:
    return (m - m.mean(1, keepdims=True)) / (m.std(1, keepdims=True) + 1e-30)


def bias_gradients(model, enc) -> np.ndarray:
    """``(n_targets, V)``: ``p_t − y_t`` at each target position of one encoded example."""
    x = torch.as_tensor(np.asarray(enc.ids), dtype=torch.long)[None]
    t = np.flatnonzero(np.asarray(enc.loss_mask).astype(bool))
    t = t[t >= 1]  # the first token has no prediction
    with torch.no_grad():
        p = torch.softmax(model(input_ids=x).logits[0].double(), -1).numpy()
    g = p[t - 1].copy()
    g[np.arange(len(t)), np.asarray(enc.ids)[t]] -= 1.0
    return g


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)


def probe(ev: Path, cosine: bool = False) -> dict[str, float]:
    masks, losses, n_train = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        ex = run.examples()
        split = dict(zip(ex["example_id"].to_list(), ex["split"].to_list(), strict=True))
        train = [e for e, s in split.items() if s == C.SPLIT_TRAIN]
        evals = [e for e, s in split.items() if s == C.SPLIT_EVAL]
        model = load_saved_model(ev / "runs" / "k126" / "model").model.eval()
        per_token = [bias_gradients(model, run.encode(eval_example=e)[0]) for e in train]
        d = np.stack([g.sum(0) for g in per_token])
        q = np.stack([bias_gradients(model, run.encode(eval_example=e)[0]).sum(0) for e in evals])
        g2 = np.concatenate(per_token) ** 2
        s = g2.mean(0) + 1e-3 * g2.mean()
        if cosine:  # the engine's term: whitened unit directions
            bias = _unit(q / np.sqrt(s)) @ _unit(d / np.sqrt(s)).T
        else:
            bias = (q / s) @ d.T / np.linalg.norm(d / np.sqrt(s), axis=1)[None]
        default, records = np.zeros((2, len(evals), n_train))
        alone = IndexSettings(lm_bias=0)
        for r, e in enumerate(evals):
            enc = run.encode(eval_example=e)[0]
            sk = run.query_sketches(enc)[0]
            ids, row = run.query_scores(sk, query_targets(enc))
            default[r, ids] = row
            if cosine:
                s0 = run.for_query(alone, query_targets(enc), sk)
                records[r, run.index(s0)[1]] = run.all_scores(sk, s0)
    finally:
        run.close()
    out = {
        "default": lds_scores(default, masks, losses),
        "bias": lds_scores(bias, masks, losses),
    }
    if cosine:
        out["records"] = lds_scores(records, masks, losses)
        for w in COSINE_WEIGHTS:
            out[f"+{w}"] = lds_scores(records + w * bias, masks, losses)
        return {k: float(np.nanmean(v)) for k, v in out.items()}
    for w in WEIGHTS:
        out[f"+{w}"] = lds_scores((1 - w) * _z(default) + w * _z(bias), masks, losses)
    return {k: float(np.nanmean(v)) for k, v in out.items()}


def main(argv: list[str]) -> None:
    cosine = "--cosine" in argv
    argv = [a for a in argv if a != "--cosine"]
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        rows = probe(Path(d), cosine)
        print(Path(d).name, " ".join(f"{k}={v:.3f}" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
