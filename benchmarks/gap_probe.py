"""Where does the default's distance to full-gradient cosine come from? (EVAL.md §1f)

Reads finished ``traceprop eval lds`` folders (their main run ``runs/k126``, ``subsets.json`` and
subset losses, replicates averaged) and prints the LDS of one similarity at a time, each one step
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
import torch

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_levers import RecordProducts, record_weights, trained_parameters
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.training.losses import example_losses
from traceprop_engine.training.models import collate, load_saved_model, model_inputs


def subset_data(ev: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """``(masks (m, n_train), losses (m, n_eval), n_train)``; replicate losses averaged."""
    sub = json.loads((ev / "subsets.json").read_text())
    n_train = sub["n_train"]
    members = [s["members"] for s in sub["subsets"]]
    masks = np.zeros((len(members), n_train), bool)
    for j, mm in enumerate(members):
        masks[j, mm] = True
    losses = np.stack(
        [
            np.mean([np.load(f) for f in sorted((ev / "losses").glob(f"subset_{j:03d}*.npy"))], 0)
            for j in range(len(members))
        ]
    )
    return masks, losses, n_train


def named_gradients(model_dir: Path, encs: list, task: str, pad: int) -> dict:
    """Per trained parameter name, the ``(n, *shape)`` float64 per-example gradients."""
    loaded = load_saved_model(model_dir, "cpu")
    model = loaded.model
    model.eval()
    params = trained_parameters(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = {n: [] for n in names}
    for enc in encs:
        b = collate([enc], pad, task, "cpu")
        loss = example_losses(model(**model_inputs(b)), b, task).sum()
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        for n, g, p in zip(names, gs, params, strict=True):
            out[n].append((g if g is not None else torch.zeros_like(p)).detach().double())
    return {n: torch.stack(v).numpy() for n, v in out.items()}


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


def exact_rows(ev: Path, run, eval_ids: list[int], n_train: int, lds) -> dict:
    """LDS of exact final-model gradient similarities over parameter groups."""
    enc_tr = [run.encode(eval_example=i)[0] for i in range(n_train)]
    enc_ev = [run.encode(eval_example=e)[0] for e in eval_ids]
    pad = run.model().tokenizer.pad_token_id or 0
    gt = named_gradients(ev / "runs" / "k126" / C.MODEL_DIR, enc_tr, run.task, pad)
    ge = named_gradients(ev / "runs" / "k126" / C.MODEL_DIR, enc_ev, run.task, pad)
    names = list(gt)
    emb = [n for n in names if "embed_in" in n or "word_embeddings" in n]
    lin = [n for n in names if n.endswith(".weight") and gt[n].ndim == 3 and n not in emb]
    lin = [n for n in lin if "norm" not in n]

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


def sketch_rows(run, eval_ids: list[int], n_train: int, lds) -> tuple[dict, dict]:
    """LDS of the final model through the run's projections, the stored records, ensembles."""

    def sketches(ids):
        s = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in ids]
        return [np.concatenate([x[li] for x in s]).astype(np.float64) for li in range(len(s[0]))]

    q, f = sketches(eval_ids), sketches(range(n_train))
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


def probe(ev: Path) -> dict:
    """Every row of the module docstring for one evaluation folder."""
    masks, losses, n_train = subset_data(ev)

    def lds(scores):
        return float(np.nanmean(lds_scores(scores, masks, losses)))

    run = open_run(ev / "runs" / "k126")
    try:
        ex = run.examples()
        eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
        rows = exact_rows(ev, run, eval_ids, n_train, lds)
        sk, layers = sketch_rows(run, eval_ids, n_train, lds)
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
