"""Where does the default's distance to full-gradient cosine come from? (EVAL.md §1f)

Reads finished ``traceprop eval lds`` folders (their main run ``runs/k126``, ``subsets.json`` and
``losses.npy``) and prints the LDS of one similarity at a time, each one step
away from the next, so the difference between two rows is what one stage costs:

- the exact final-model gradient over all parameters, without the input embedding, the embedding
  alone, the tracked linear weights only, and their exact rank-1 / rank-4 (SVD) parts;
- the same linear layers on the final model through the run's own projections (the query side's
  full ``(k_out, k_in)`` sketches, computed for every training row too), and their rank-1 part;
- the stored trajectory records (the default ``cosine`` row) and 50/50 ensembles of it with the
  final-model sketches;
- per tracked layer alone, the final-model projected cosine.

Usage: ``python benchmarks/gap_probe.py /tmp/q/hard60-s1 /tmp/q/facts24-s0 ...``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_levers import (
    RecordProducts,
    final_gradients,
    record_weights,
    trained_parameters,
)
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.training.models import load_saved_model


def subset_data(ev: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """``(masks (m, n_train), losses (m, n_eval), n_train)``: the evaluation's own
    ``subsets.json`` and ``losses.npy`` (the replicates' mean it wrote)."""
    sub = json.loads((ev / "subsets.json").read_text())
    n_train = sub["n_train"]
    masks = np.zeros((len(sub["subsets"]), n_train), bool)
    for j, s in enumerate(sub["subsets"]):
        masks[j, s["members"]] = True
    return masks, np.load(ev / "losses.npy"), n_train


def named_gradients(model_dir: Path, encs: list, task: str) -> dict:
    """Per trained parameter name, the ``(n, *shape)`` per-example gradients: the columns of
    :func:`~traceprop_engine.evaluate.lds_levers.final_gradients`, split by parameter."""
    model = load_saved_model(model_dir, "cpu").model
    params = trained_parameters(model)  # the order final_gradients concatenates in
    names = {id(p): n for n, p in model.named_parameters()}
    flat = final_gradients(model_dir, encs, task).astype(np.float64)
    out, at = {}, 0
    for p in params:
        out[names[id(p)]] = flat[:, at : at + p.numel()].reshape(len(encs), *p.shape)
        at += p.numel()
    return out


def cosine(qs: list[np.ndarray], fs: list[np.ndarray]) -> np.ndarray:
    """Cosine over the concatenation of per-part ``(n, ...)`` arrays."""
    q = np.concatenate([x.reshape(len(x), -1) for x in qs], 1)
    f = np.concatenate([x.reshape(len(x), -1) for x in fs], 1)
    q = q / (np.linalg.norm(q, axis=1, keepdims=True) + 1e-30)
    f = f / (np.linalg.norm(f, axis=1, keepdims=True) + 1e-30)
    return q @ f.T


def low_rank(x: np.ndarray, r: int) -> np.ndarray:
    """The best rank-``r`` part of each matrix of a ``(n, a, b)`` stack; others unchanged."""
    if x.ndim != 3:
        return x
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    return (u[:, :, :r] * s[:, None, :r]) @ vh[:, :r, :]


def exact_rows(model_dir: Path, task: str, enc_ev: list, enc_tr: list, lds) -> dict:
    """LDS of exact final-model gradient similarities over parameter groups."""
    gt = named_gradients(model_dir, enc_tr, task)
    ge = named_gradients(model_dir, enc_ev, task)
    names = list(gt)
    emb = [n for n in names if "embed_in" in n or "word_embeddings" in n]
    lin = [n for n in names if gt[n].ndim == 3 and n not in emb and "norm" not in n]

    def row(sel, r=0):
        tr = [low_rank(gt[n], r) if r else gt[n] for n in sel]
        return lds(cosine([low_rank(ge[n], r) if r else ge[n] for n in sel], tr))

    return {
        "exact, all parameters": row(names),
        "exact, all but the input embedding": row([n for n in names if n not in emb]),
        "exact, input embedding alone": row(emb) if emb else float("nan"),
        "exact, tracked linear weights": row(lin),
        "exact, linear weights, rank-1 (SVD)": row(lin, 1),
        "exact, linear weights, rank-4 (SVD)": row(lin, 4),
    }


def sketch_rows(run, enc_ev: list, enc_tr: list, n_train: int, lds) -> tuple[dict, dict]:
    """LDS of the final model through the run's projections, the stored records, ensembles."""

    def sketches(encs):
        s = [run.query_sketches(enc)[0] for enc in encs]
        return [np.concatenate([x[li] for x in s]).astype(np.float64) for li in range(len(s[0]))]

    q, f = sketches(enc_ev), sketches(enc_tr)
    s_final = cosine(q, f)
    prods = RecordProducts(run.store, [x.astype(np.float32) for x in q], n_train)
    s_traj = prods.scores(record_weights(prods.records, "lr"), "cosine")
    rows = {
        "final model, projected sketches": lds(s_final),
        "final model, projected, rank-1 (SVD)": lds(cosine(q, [low_rank(x, 1) for x in f])),
        "stored trajectory records (the default)": lds(s_traj),
        "ensemble: records + final sketches, 1:1": lds(0.5 * s_traj + 0.5 * s_final),
        "ensemble: records + final sketches, 3:1": lds(0.75 * s_traj + 0.25 * s_final),
    }
    layers = {
        f"{li}: {tuple(q[li].shape[1:])}": lds(cosine([q[li]], [f[li]])) for li in range(len(q))
    }
    return rows, layers


def encodings(run, n_train: int) -> tuple[list, list]:
    """``(eval, train)`` encodings of an evaluation's main run: its eval rows, then its
    ``n_train`` training rows, as training saw them."""
    ex = run.examples()
    eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    enc_ev = [run.encode(eval_example=e)[0] for e in eval_ids]
    return enc_ev, [run.encode(eval_example=i)[0] for i in range(n_train)]


def probe(ev: Path) -> dict:
    """Every row of the module docstring for one evaluation folder."""
    masks, losses, n_train = subset_data(ev)

    def lds(scores):
        return float(np.nanmean(lds_scores(scores, masks, losses)))

    run = open_run(ev / "runs" / "k126")
    try:
        enc_ev, enc_tr = encodings(run, n_train)
        rows = exact_rows(run.dir / C.MODEL_DIR, run.task, enc_ev, enc_tr, lds)
        sk, layers = sketch_rows(run, enc_ev, enc_tr, n_train, lds)
    finally:
        run.close()
    return {**rows, **sk, "layers (final model, projected, alone)": layers}


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    results = {}
    for d in argv:
        ev = Path(d)
        results[ev.name] = probe(ev)
        print(f"== {ev.name}")
        for k, v in results[ev.name].items():
            if isinstance(v, dict):
                print(f"  {k}: " + ", ".join(f"{n} {x:.3f}" for n, x in v.items()))
            else:
                print(f"  {k:45s} {v:.3f}")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
