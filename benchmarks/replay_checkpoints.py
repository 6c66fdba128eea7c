"""Replay: checkpoint-matched query gradients (TracIn-CP) against the default's final-model query.

The default scores a training row by ``Σ_r lr_r ⟨Q, x_r⟩`` over its records ``x_r`` (each taken
at the parameters ``θ_t`` of its step), with one query gradient ``Q`` on the *final* model.
TracIn proper pairs every record with the query's gradient at the same parameters,
``Σ_r lr_r ⟨Q(θ_{t(r)}), x_r⟩``. That needs the query's gradient at every step (or checkpoint),
which a stored run does not keep; this script measures whether it would pay:

1. it retrains the evaluation's tracked run from its own ``run.json`` (untracked; the final
   model is checked to equal the stored one), keeping the trained parameters before each step;
2. for each step it computes every eval question's exact query gradient through the engine's
   own query path (``open_run(...).query_sketches``) on those parameters;
3. it scores the exact rank-1 records of ``runs/x1`` with the query taken at: the record's own
   step, the start or the end of its epoch, or the last step (≈ the default), each with the
   default's cosine (the example's record sum normalised), the same with every query scaled to
   unit norm (so no step's query dominates), and the plain dot product.

Usage: ``python benchmarks/replay_checkpoints.py /tmp/q/lexical48-s0 ...`` (folders of
``traceprop eval lds ... --config x1:k_in=1048576,k_out=1048576,factor_dtype=float32``). A few
minutes per folder at the from-scratch sets' size.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import Data, example_sq_norms, lds_of, load, project, scores  # noqa: E402

from traceprop_engine import constants as C  # noqa: E402
from traceprop_engine.attribution import open_run  # noqa: E402


def trained_parameters(x1: Path, out: Path) -> tuple[dict[int, dict], dict]:
    """``{step: trainable parameters before that step's update}`` and the final trainable
    parameters, from a retrain of the run in ``x1`` (untracked, written to ``out``)."""
    from traceprop_engine.training import loop, steps
    from traceprop_engine.training.resume import settings_from_config

    kept: dict[int, dict] = {}
    final: dict = {}
    backward, train_steps = steps._backward, loop.train_steps

    def trainable(model) -> dict:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def keep(job, prep, forward, batch, idx, global_b, step, epoch, lr):
        if step not in kept:
            kept[step] = trainable(prep.model)
        return backward(job, prep, forward, batch, idx, global_b, step, epoch, lr)

    def train_and_keep_final(job, prep, *args):
        last = train_steps(job, prep, *args)
        final.update(trainable(prep.model))
        return last

    config = json.loads((x1 / C.MANIFEST_FILE).read_text())["config"]
    settings = dataclasses.replace(settings_from_config(config, x1), out=str(out), track=None)
    steps._backward, loop.train_steps = keep, train_and_keep_final
    try:
        loop.train(settings, overwrite=True)
    finally:
        steps._backward, loop.train_steps = backward, train_steps
    return kept, final


def step_maps(steps_: np.ndarray, epoch_of: dict[int, int]) -> dict[str, np.ndarray]:
    """For each pairing, the index (into ``steps_``) of the query's step for each step."""
    ep = np.array([epoch_of.get(int(s), -1) for s in steps_])
    n = len(steps_)
    return {
        "own step": np.arange(n),
        "epoch start": np.array([np.flatnonzero(ep == ep[i])[0] for i in range(n)]),
        "epoch end": np.array([np.flatnonzero(ep == ep[i])[-1] for i in range(n)]),
        "last step": np.full(n, n - 1),
    }


# long: one pass over the steps, every pairing's products from the same queries
def record_products(
    d: Data, run, kept: dict[int, dict], rec_step: np.ndarray, maps: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per pairing: ``⟨Q(θ_s), x_r⟩`` (n_eval, n_records) and ``‖Q(θ_s)‖²`` of the step used."""
    model = run.model().model
    ex = run.examples()
    eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    steps_ = np.array(sorted(kept))
    at = np.searchsorted(steps_, rec_step)
    if not np.array_equal(steps_[at], rec_step):
        raise SystemExit("the retrain's steps do not match the stored records' steps")
    nq, n_layers = len(encs), len(d.U)
    prods = {k: np.zeros((nq, len(rec_step))) for k in maps}
    qsq = {k: np.zeros((nq, len(rec_step))) for k in maps}
    import torch

    final = {n: p.detach().clone() for n, p in model.named_parameters() if n in kept[steps_[0]]}
    with torch.no_grad():
        for si, s in enumerate(steps_):
            need = {k: np.flatnonzero(m[at] == si) for k, m in maps.items()}
            if not any(len(v) for v in need.values()):
                continue
            params = dict(model.named_parameters())
            for n, v in kept[s].items():
                params[n].copy_(v)
            with torch.enable_grad():
                sks = [run.query_sketches(enc)[0] for enc in encs]
            q = [
                np.concatenate([sk[li] for sk in sks]).astype(np.float64) for li in range(n_layers)
            ]
            norm2 = sum((x.reshape(nq, -1) ** 2).sum(1) for x in q)
            for k, rr in need.items():
                if len(rr):
                    for li in range(n_layers):
                        qv = np.einsum("qab,rb->qra", q[li], d.V[li][rr], optimize=True)
                        prods[k][:, rr] += np.einsum("qra,ra->qr", qv, d.U[li][rr], optimize=True)
                    qsq[k][:, rr] = norm2[:, None]
        params = dict(model.named_parameters())
        for n, v in final.items():
            params[n].copy_(v)
    return prods, qsq


def summed(d: Data, p: np.ndarray) -> np.ndarray:
    """(n_eval, n_records) record products → the lr-weighted sum per training row."""
    out = np.zeros((p.shape[0], d.n_train))
    np.add.at(out.T, d.example, (p * d.lr).T)
    return out


def evaluate(ev: Path) -> dict[str, float]:
    """Every pairing's LDS on one evaluation folder."""
    d = load(ev)
    x1 = ev / "runs" / "x1"
    run = open_run(x1)
    try:
        rec = run.store.records()
        rec_step = rec[C.REC_STEP].astype(np.int64)
        epoch_of = {int(s): int(e) for s, e in zip(rec_step, rec[C.REC_EPOCH], strict=True)}
        with tempfile.TemporaryDirectory(prefix="traceprop-cp-") as tmp:
            kept, final = trained_parameters(x1, Path(tmp) / "run")
        stored = dict(run.model().model.named_parameters())
        diff = max(float((stored[n].detach() - v).abs().max()) for n, v in final.items())
        print(
            f"{ev.name}: {len(kept)} steps retrained; the retrain's final trainable parameters "
            f"differ from the stored model's by at most {diff:.2e}",
            flush=True,
        )
        maps = step_maps(np.array(sorted(kept)), epoch_of)
        prods, qsq = record_products(d, run, kept, rec_step, maps)
    finally:
        run.close()
    exact = project(d, [(None, None)] * len(d.U), int8=False)
    norm = np.sqrt(np.maximum(example_sq_norms(d, exact, d.lr).sum(0), 1e-300))[None]
    row = {"default (final-model query), cosine": lds_of(d, scores(d, exact))}
    for k in maps:
        unit = prods[k] / np.sqrt(np.maximum(qsq[k], 1e-300))
        row[f"{k}: cosine"] = lds_of(d, summed(d, prods[k]) / norm)
        row[f"{k}: unit queries, cosine"] = lds_of(d, summed(d, unit) / norm)
        row[f"{k}: dot"] = lds_of(d, summed(d, prods[k]))
    return row


def main(argv: list[str]) -> None:
    for ev in map(Path, argv):
        row = evaluate(ev)
        print(ev.name, json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
