"""Replay: K-FAC from the true Fisher on the final model against the inline statistics (issue 26).

The engine's K-FAC factors are the run's own empirical statistics: ``A = Σ a aᵀ`` and
``S = Σ g gᵀ`` from every ``covariance_stride``-th training batch, with the training labels, over
the whole trajectory. kronfluence fits them instead on the final model with labels *sampled from
the model's own predictions* (the true Fisher). This script measures that alternative on an
evaluation folder's exact rank-1 records (``runs/x1``): one extra forward and backward per
training row on the final model (the pass an inline method exists to avoid), ``samples`` label
draws per row, factors per tracked layer over every real token, then the same K-FAC as the
engine (damping 0.1 × each factor's mean eigenvalue, per-layer trace normalisation, the output
head left unwhitened, cosine), against identity and against the inline statistics.

Usage: ``python benchmarks/replay_true_fisher.py /tmp/q/hard60-s0 ... [--samples 2]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import Data, kron_precondition, lds_of, load, project, scores  # noqa: E402

from traceprop_engine.attribution import open_run  # noqa: E402
from traceprop_engine.training.models import collate, model_inputs  # noqa: E402

BATCH = 8


def sampled_loss(logits: torch.Tensor, labels: torch.Tensor, task: str, gen) -> torch.Tensor:
    """Summed cross-entropy against labels drawn from the model's own predictions, at the
    positions the training loss uses (the true Fisher's gradient)."""
    with torch.no_grad():
        p = torch.softmax(logits.float(), -1)
        draw = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=gen).view(p.shape[:-1])
    if task == "classification":
        return F.cross_entropy(logits.float(), draw, reduction="sum")
    target = torch.where(labels[:, 1:] != -100, draw[:, :-1], -100)
    return F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), target, ignore_index=-100, reduction="sum"
    )


# long: one hook pair per tracked layer and the pass over the training rows, kept together
def true_fisher(run, d: Data, samples: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(S, A)`` per tracked layer, means over tokens, on the final model with sampled labels."""
    loaded = run.model()
    model = loaded.model
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    modules = [model.get_submodule(str(n)) for n in d.names]
    S = [torch.zeros(len(u[0]), len(u[0]), dtype=torch.float64) for u in d.U]
    A = [torch.zeros(len(v[0]), len(v[0]), dtype=torch.float64) for v in d.V]
    count = [0.0] * len(modules)
    mask_now: list[torch.Tensor] = []

    def hooks_for(i: int):
        def grad_hook(g):
            g2 = g.detach().reshape(-1, g.shape[-1]).double()
            S[i].add_(g2.T @ g2)

        def fwd(module, inputs, output):
            a = inputs[0].detach()
            m = mask_now[0].reshape(-1, 1).double() if a.dim() == 3 else None
            a2 = a.reshape(-1, a.shape[-1]).double()
            A[i].add_((a2 * m).T @ a2 if m is not None else a2.T @ a2)
            count[i] += float(m.sum()) if m is not None else a2.shape[0]
            output.register_hook(grad_hook)

        return fwd

    handles = [m.register_forward_hook(hooks_for(i)) for i, m in enumerate(modules)]
    gen = torch.Generator().manual_seed(seed)
    encs = [run.encode(eval_example=i)[0] for i in range(d.n_train)]
    try:
        for _ in range(samples):
            for lo in range(0, len(encs), BATCH):
                batch = collate(encs[lo : lo + BATCH], pad, run.task, "cpu")
                mask_now[:] = [batch["attention_mask"]]
                out = model(**model_inputs(batch))
                sampled_loss(out.logits, batch["labels"], run.task, gen).backward()
                model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return [(s.numpy() / c, a.numpy() / c) for s, a, c in zip(S, A, count, strict=True)]


def inline(d: Data) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """The run's own statistics as ``(S, A)`` means (None where a layer has none)."""
    return [
        None if a is None else (s / max(n, 1.0), a / max(n, 1.0))
        for a, s, n in zip(d.A, d.S, d.n_tok, strict=True)
    ]


def evaluate(ev: Path, samples: int) -> dict[str, float]:
    d = load(ev)
    run = open_run(ev / "runs" / "x1")
    try:
        head = [i for i, info in enumerate(run.store.layers) if info.output_head]
        fisher = true_fisher(run, d, samples)
    finally:
        run.close()
    exact = project(d, [(None, None)] * len(d.U), int8=False)

    def unwhitened(f: list) -> list:
        return [None if i in head else x for i, x in enumerate(f)]

    return {
        "identity, cosine": lds_of(d, scores(d, exact)),
        "K-FAC inline statistics, cosine": lds_of(d, scores(d, kron_precondition(exact, unwhitened(inline(d))))),
        "K-FAC true Fisher (final model), cosine": lds_of(d, scores(d, kron_precondition(exact, unwhitened(fisher)))),
        "K-FAC true Fisher, output head whitened too": lds_of(d, scores(d, kron_precondition(exact, fisher))),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--samples", type=int, default=2, help="label draws per training row")
    args = p.parse_args()
    for ev in map(Path, args.folders):
        row = evaluate(ev, args.samples)
        print(ev.name, json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
