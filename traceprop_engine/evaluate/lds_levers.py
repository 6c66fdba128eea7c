"""Extra LDS rows from one tracked run and its final model: scoring levers and post-hoc gradients.

**Levers** (family ``lever``): the main run's stored records re-weighted and normalised in
other ways than identity-cosine (the default until stop 39: identity preconditioner, ``Σ_records lr·Ŝ`` per example, one
cosine over all layers), all from the same records and query sketches:

- ``weights``: how an example's records are summed: ``lr`` (TracIn along the whole trajectory,
  the engine's ``records=all``), ``last-epoch`` (lr, records of the run's last epoch only:
  closest to the final model; the engine's default ``records=last-epoch`` since stop 42 keeps
  each example's own last epoch at its epoch's mean rate), ``uniform`` (every record 1),
  ``late`` (lr·(epoch + 1): later epochs count more).
- ``norm``: ``cosine`` (one cosine over all layers, the default), ``layer`` (each layer's
  query and example vectors scaled to unit norm, the per-layer cosines summed: every layer
  counts the same) or ``dot`` (no normalisation).

Everything is computed from per-record, per-layer products ``<T_l, Ŝ_r,l>`` and the Gram of an
example's own records, so any weighting costs one pass over the store.

**Final-model gradients** (family ``final-model``): the exact per-example gradient of every
trainable parameter on the run's final model (one backward per example, no projection),
scored as ``full-gradient dot`` and ``full-gradient cosine``: the best post-hoc similarity a
user could compute with no tracking at all.

**Same label** (classification only, family ``baseline``): ``+1`` for a training example of the
eval example's class, ``−1/(C−1)`` otherwise (a zero-sum score over the C classes).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import constants as C

log = logging.getLogger(__name__)

WEIGHTS = ("lr", "last-epoch", "uniform", "late")
NORMS = ("cosine", "layer", "dot")
LEVERS: tuple[tuple[str, str], ...] = (
    ("lr", "layer"),
    ("last-epoch", "cosine"),
    ("last-epoch", "layer"),
    ("uniform", "cosine"),
    ("late", "cosine"),
    ("late", "layer"),
)
"""(weights, norm) of the lever rows; ``("lr", "cosine")`` is identity-cosine with ``records=all``
(the engine's ``cosine`` row scores the last epoch's records)."""


def record_weights(records: dict, kind: str) -> np.ndarray:
    """Per-record weights of the ``kind`` of :data:`WEIGHTS` (float64, one per record)."""
    lr = records[C.REC_LR].astype(np.float64)
    epoch = records[C.REC_EPOCH].astype(np.int64)
    if kind == "lr":
        return lr
    if kind == "last-epoch":
        return lr * (epoch == epoch.max()) if len(epoch) else lr
    if kind == "uniform":
        return np.ones_like(lr)
    if kind == "late":
        return lr * (epoch + 1)
    raise ValueError(f"unknown record weighting {kind!r}; one of {WEIGHTS}")


class RecordProducts:
    """Per layer: ``R[l] (q, n_records)`` = ``<T_q,l, Ŝ_r,l>`` and each example's record Gram.

    Args:
        store: the run's store (records, ``sketches``).
        tests: per layer the queries' ``(q, *record_shape)`` sketches.
        n_train: training examples (ids ``0..n_train-1``).
    """

    def __init__(self, store, tests: list[np.ndarray], n_train: int) -> None:
        rec = store.records()
        self.records = rec
        self.example = rec[C.REC_EXAMPLE].astype(np.int64)
        self.n_train = n_train
        order = np.argsort(self.example, kind="stable")
        bounds = np.searchsorted(self.example[order], np.arange(n_train + 1))
        self.groups = [order[bounds[i] : bounds[i + 1]] for i in range(n_train)]
        self.t_sq = np.stack(
            [(t.reshape(len(t), -1).astype(np.float64) ** 2).sum(1) for t in tests]
        )
        self.R, self.grams = [], []  # per layer: (q, n_rec); per example its records' Gram
        for li, t in enumerate(tests):
            tq = t.reshape(len(t), -1).astype(np.float32)
            x = store.sketches(li).reshape(store.n_records, -1)  # one layer at a time
            self.R.append((tq @ x.T).astype(np.float64))
            self.grams.append([(x[g] @ x[g].T).astype(np.float64) for g in self.groups])

    def scores(self, weights: np.ndarray, norm: str) -> np.ndarray:
        """``(q, n_train)`` scores with records weighted by ``weights`` under ``norm``."""
        n_l = len(self.R)
        dots = np.zeros((n_l, self.R[0].shape[0], self.n_train))
        sq = np.zeros((n_l, self.n_train))
        for li in range(n_l):
            np.add.at(dots[li].T, self.example, (self.R[li] * weights).T)
            for i, (gram, idx) in enumerate(zip(self.grams[li], self.groups, strict=True)):
                w = weights[idx]
                sq[li, i] = w @ gram @ w
        if norm == "dot":
            return dots.sum(0)
        if norm == "cosine":
            qn = np.sqrt(np.maximum(self.t_sq.sum(0), 1e-60))
            xn = np.sqrt(np.maximum(sq.sum(0), 1e-60))
            return dots.sum(0) / qn[:, None] / xn[None, :]
        if norm == "layer":
            qn = np.sqrt(np.maximum(self.t_sq, 1e-60))  # (L, q)
            xn = np.sqrt(np.maximum(sq, 1e-60))  # (L, n)
            return (dots / qn[:, :, None] / xn[:, None, :]).sum(0)
        raise ValueError(f"unknown normalisation {norm!r}; one of {NORMS}")


def lever_methods(run_dir: Path, eval_ids: list[int], n_train: int, k):
    """Yield the lever rows of one tracked run (see the module docstring)."""
    from ..attribution import open_run

    run = open_run(run_dir)
    try:
        sketches = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]
        tests = [np.concatenate([sk[li] for sk in sketches]) for li in range(len(sketches[0]))]
        prods = RecordProducts(run.store, tests, n_train)
        for wk, norm in LEVERS:
            yield {
                "method": f"lever {wk} {norm}",
                "family": "lever",
                "k": k,
                "preconditioner": "identity",
                "weights": wk,
                "norm": norm,
                "scores": prods.scores(record_weights(prods.records, wk), norm),
            }
    finally:
        run.close()


def final_gradients(model_dir: Path, encs: list, task: str) -> np.ndarray:
    """``(n, P)`` float32: per example the gradient of its loss w.r.t. every trainable parameter."""
    return np.stack([g.numpy() for g in final_gradient_rows(model_dir, encs, task)])


def final_gradient_rows(model_dir: Path, encs: list, task: str):
    """Yield, per example, the ``(P,)`` float32 torch gradient of its loss w.r.t. every trainable
    parameter (one example at a time: nothing of size ``n × P`` is held)."""
    import torch

    from ..training.losses import example_losses
    from ..training.models import collate, load_saved_model, model_inputs

    loaded = load_saved_model(model_dir, "cpu")
    model = loaded.model
    model.eval()
    params = trained_parameters(model)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    with torch.enable_grad():
        for enc in encs:
            batch = collate([enc], pad, task, "cpu")
            loss = example_losses(model(**model_inputs(batch)), batch, task).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            yield torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                    for g, p in zip(grads, params, strict=True)
                ]
            )


def trained_parameters(model) -> list:
    """The parameters the run trained (the loader freezes all for queries): a peft model's
    adapters and ``modules_to_save`` copies, otherwise every parameter; gradients enabled."""
    named = list(model.named_parameters())
    if hasattr(model, "peft_config"):
        named = [(n, p) for n, p in named if "lora_" in n or "modules_to_save" in n]
    for _, p in named:
        p.requires_grad_(True)
    return [p for _, p in named]


def final_model_methods(run_dir: Path, eval_ids: list[int], n_train: int):
    """Yield ``full-gradient dot`` and ``full-gradient cosine`` on the run's final model."""
    from ..attribution import open_run

    run = open_run(run_dir)
    try:
        encs_tr = [run.encode(eval_example=i)[0] for i in range(n_train)]
        encs_ev = [run.encode(eval_example=e)[0] for e in eval_ids]
        task = run.task
    finally:
        run.close()
    # the eval rows' gradients are held (few rows); the training rows' are streamed one at a
    # time, so a model of 22 M parameters needs n_eval × P floats, not (n_eval + n_train) × P
    import torch

    g_ev = torch.from_numpy(final_gradients(run_dir / C.MODEL_DIR, encs_ev, task))
    dot = np.empty((len(encs_ev), n_train))
    nt = np.empty(n_train)
    for i, g in enumerate(final_gradient_rows(run_dir / C.MODEL_DIR, encs_tr, task)):
        dot[:, i] = (g_ev @ g).double().numpy()  # float32 products, as the gradients are
        nt[i] = float(torch.linalg.vector_norm(g, dtype=torch.float64))
    base = {"family": "final-model", "k": None, "preconditioner": None, "n_params": g_ev.shape[1]}
    yield {**base, "method": "full-gradient dot", "scores": dot}
    nt = np.maximum(nt, 1e-30)
    ne = np.maximum(torch.linalg.vector_norm(g_ev, dim=1, dtype=torch.float64).numpy(), 1e-30)
    yield {**base, "method": "full-gradient cosine", "scores": dot / ne[:, None] / nt[None, :]}


def same_label_scores(train_labels: list, eval_labels: list) -> np.ndarray:
    """``+1`` where the labels match, ``−1/(C−1)`` elsewhere (C = classes in training)."""
    classes = sorted({str(x) for x in train_labels})
    off = -1.0 / max(len(classes) - 1, 1)
    tr = np.array([str(x) for x in train_labels])
    ev = np.array([str(x) for x in eval_labels])
    return np.where(ev[:, None] == tr[None, :], 1.0, off)
