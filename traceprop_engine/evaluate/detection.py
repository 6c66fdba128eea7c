"""Detection benchmarks: rank training examples to find planted problems with known ground truth.

Two tasks, each a generated data set, a tracked tiny GPT-NeoX trained from scratch per seed,
and one suspicion score per training example and method (higher = more suspicious):

- ``mislabel``: template product reviews from :func:`~traceprop_engine.samples.data.generate_classification_data`
  with planted flipped labels, framed as causal LM (``"<review>\\nSentiment:"`` → ``" positive"``),
  so the tiny causal model can learn it. Methods: self-influence (per preconditioner), negative
  influence on the (correctly labelled) eval set, gradient norm, training loss, and a
  representation baseline (share of the 10 nearest training neighbours, by cosine of mean-pooled
  hidden states, that carry another label).
- ``backdoor``: the facts data of :func:`~traceprop_engine.samples.data.generate_sample_data`
  plus a few poisoned copies of training questions with a rare trigger phrase and a fixed target
  completion (:func:`~.detection_data.generate_backdoor_data`). Methods: influence on trigger
  queries (held-out questions carrying the trigger, with the target as completion; per
  preconditioner), self-influence, gradient norm, training loss, representation similarity to
  the trigger queries.

The data sets and their ground truth are written by :mod:`.detection_data`.

Metrics: AUROC (Mann–Whitney U / (n_pos n_neg), ties count one half) and precision@k with
k = number planted. Every number is per seed; the summary is mean ± sd over seeds.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .. import constants as C
from ..errors import ConfigError, RunError
from ..run import is_completed
from ..settings import TrackSettings
from .detection_data import (
    TARGET,
    generate_backdoor_data,
    generate_mislabel_data,
    read_jsonl,
)
from .lds_settings import check_out_dir

log = logging.getLogger(__name__)

TASKS = ("mislabel", "backdoor")
PRECONDITIONERS = ("identity", "kfac", "ekfac")


# -- metrics --------------------------------------------------------------------------------------------
def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for the boolean labels ``positive`` (ties: 1/2)."""
    from scipy.stats import rankdata

    s = np.asarray(scores, np.float64)
    pos = np.asarray(positive, bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs at least one positive and one negative example")
    r = rankdata(s)  # average ranks, so a tie between a positive and a negative counts 1/2
    u = r[pos].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def precision_at_k(scores: np.ndarray, positive: np.ndarray, k: int) -> float:
    """Share of planted examples among the ``k`` highest scores (ties: the earlier example first)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")[:k]
    return float(np.asarray(positive, bool)[order].mean())


# -- the benchmark -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DetectSettings:
    """One detection benchmark (every run: tracked tiny model from scratch, ``k_in = k_out = k``)."""

    out: str
    tasks: tuple[str, ...] = TASKS
    seeds: tuple[int, ...] = (0, 1, 2)
    model: str = "tiny"
    epochs: int = 6
    lr: float = 3e-3
    batch_size: int = 8
    max_length: int = 48
    tiny_layers: int = 1
    tiny_width: int = 64
    tiny_vocab: int = 512
    k: int = TrackSettings().k_in  # the default tracking configuration's k (rank-1 factors)
    n_train: int = 160
    n_planted: int = 8

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ConfigError(
                f"tasks must be a non-empty subset of {list(TASKS)}, got {list(self.tasks)}"
            )
        if not self.seeds:
            raise ConfigError("give at least one seed")
        if not 1 <= self.n_planted < self.n_train // 2:
            raise ConfigError(f"n_planted must be between 1 and n_train/2, got {self.n_planted}")


def _train(s: DetectSettings, data: Path, eval_data: Path, run_dir: Path, seed: int) -> Path:
    from ..settings import TrainSettings
    from ..training.loop import train

    if is_completed(run_dir):
        return run_dir
    t = TrainSettings(
        data=str(data),
        eval_data=str(eval_data),
        out=str(run_dir),
        model=s.model,
        epochs=s.epochs,
        lr=s.lr,
        batch_size=s.batch_size,
        max_length=s.max_length,
        seed=seed,
        tiny_layers=s.tiny_layers,
        tiny_width=s.tiny_width,
        tiny_vocab=s.tiny_vocab,
        threads=1,
        track=TrackSettings(k_in=s.k, k_out=s.k, seed=seed),
    )
    train(t, overwrite=True)
    if not is_completed(run_dir):
        raise RunError(f"the detection run {run_dir} did not complete")
    return run_dir


def _train_losses(run, n_train: int) -> np.ndarray:
    """Per-example loss (the store's definition) of every training example under the final model."""
    import torch

    from ..training.losses import example_losses
    from ..training.models import collate, model_inputs

    loaded = run.model()
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    encs = [run.encode(eval_example=i)[0] for i in range(n_train)]
    out = []
    with torch.no_grad():
        for i in range(0, n_train, 16):
            batch = collate(encs[i : i + 16], pad, run.task, "cpu")
            out.append(
                example_losses(loaded.model(**model_inputs(batch)), batch, run.task)
                .double()
                .numpy()
            )
    return np.concatenate(out)


def _normed(h: np.ndarray) -> np.ndarray:
    return h / np.maximum(np.linalg.norm(h, axis=1, keepdims=True), 1e-30)


def _query_influence(run, queries: list[tuple[str, str]], n_train: int) -> dict[str, np.ndarray]:
    """Summed influence of every training example on the queries, per preconditioner."""
    from ..attribution import query_targets
    from ..settings import IndexSettings

    encs = [run.encode(p, c)[0] for p, c in queries]
    sketches = [run.query_sketches(enc)[0] for enc in encs]
    out = {}
    for p in PRECONDITIONERS:
        ix = IndexSettings(preconditioner=p, cosine=False)  # summed raw influence
        total = np.zeros(n_train)
        for sk, enc in zip(sketches, encs, strict=True):
            ids, scores = run.query_scores(sk, query_targets(enc), ix)  # its record columns
            total[ids] += scores
        out[p] = total
    return out


def score_methods(run, task: str, data_dir: Path) -> dict[str, np.ndarray]:
    """Suspicion score per training example (higher = more suspicious) for every method."""
    from ..settings import IndexSettings

    ex = run.examples()
    n_train = int((ex["split"] == C.SPLIT_TRAIN).sum())
    scores: dict[str, np.ndarray] = {}
    for p in PRECONDITIONERS:
        si = run.self_influence(IndexSettings(preconditioner=p)).sort("example_id")
        v = np.zeros(n_train)
        v[si["example_id"].to_numpy()] = si["self_influence"].to_numpy()
        scores[f"self-influence {p}"] = v
    gn = run.gradient_norms().sort("example_id")
    g = np.zeros(n_train)
    g[gn["example_id"].to_numpy()] = gn["gradient_norm"].to_numpy()
    scores["gradient norm"] = g
    scores["training loss"] = _train_losses(run, n_train)
    train_encs = [run.encode(eval_example=i)[0] for i in range(n_train)]
    h_tr = _normed(run.representations(train_encs))
    if task == "backdoor":
        queries = [
            (r["prompt"], r["completion"]) for r in read_jsonl(data_dir / "trigger_queries.jsonl")
        ]
        for p, v in _query_influence(run, queries, n_train).items():
            scores[f"influence on trigger queries {p}"] = v
        encs = [run.encode(p, c)[0] for p, c in queries]
        scores["representation similarity to trigger queries"] = (
            h_tr @ _normed(run.representations(encs)).T
        ).mean(1)
    else:
        evals = [(r["prompt"], r["completion"]) for r in read_jsonl(data_dir / "eval.jsonl")]
        for p, v in _query_influence(run, evals, n_train).items():
            scores[f"negative influence on eval set {p}"] = -v  # opponents of correct labels
        labels = np.asarray(ex["completion"].to_list()[:n_train])
        sim = h_tr @ h_tr.T
        np.fill_diagonal(sim, -np.inf)
        nn = np.argsort(-sim, axis=1)[:, :10]  # (n_train, 10) nearest neighbours
        scores["representation kNN label disagreement"] = (labels[nn] != labels[:, None]).mean(1)
    return scores


def run_detection(s: DetectSettings, *, overwrite: bool = False) -> list[dict]:
    """Generate, train, score and summarise every (task, seed); writes detection.json/.csv in ``s.out``.

    Returns:
        Summary rows: task, method, auroc_mean/sd, p_at_k_mean/sd, n_seeds.
    """
    import torch

    from ..attribution import open_run

    torch.set_num_threads(1)
    out = Path(s.out)
    check_out_dir(out)
    if overwrite:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    per_seed: list[dict] = []
    extras: list[dict] = []
    for task in s.tasks:
        for seed in s.seeds:
            data_dir = out / "data" / f"{task}-s{seed}"
            if task == "backdoor":
                gt = generate_backdoor_data(
                    data_dir, seed=seed, n_entities=24, n_poison=s.n_planted
                )
                planted = gt["poisoned"]
            else:
                gt = generate_mislabel_data(data_dir, seed=seed, n=s.n_train, n_planted=s.n_planted)
                planted = gt["mislabelled"]
            run_dir = _train(
                s,
                data_dir / "train.jsonl",
                data_dir / "eval.jsonl",
                out / "runs" / f"{task}-s{seed}",
                seed,
            )
            run = open_run(run_dir)
            n_train = int((run.examples()["split"] == C.SPLIT_TRAIN).sum())
            positive = np.zeros(n_train, bool)
            positive[np.asarray(planted) - 1] = True  # one data file: example id = row - 1
            scores = score_methods(run, task, data_dir)
            k = int(positive.sum())
            for method, v in scores.items():
                per_seed.append(
                    {
                        "task": task,
                        "seed": seed,
                        "method": method,
                        "auroc": auroc(v, positive),
                        "p_at_k": precision_at_k(v, positive, k),
                        "k": k,
                        "n_train": n_train,
                    }
                )
            extras.append({"task": task, "seed": seed, **_sanity(run, task, data_dir)})
            run.close()
            log.info("detection %s seed %d done", task, seed)
    summary = []
    for task in s.tasks:
        for method in dict.fromkeys(r["method"] for r in per_seed if r["task"] == task):
            rs = [r for r in per_seed if r["task"] == task and r["method"] == method]
            a, p = np.array([r["auroc"] for r in rs]), np.array([r["p_at_k"] for r in rs])
            summary.append(
                {
                    "task": task,
                    "method": method,
                    "auroc_mean": float(a.mean()),
                    "auroc_sd": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
                    "p_at_k_mean": float(p.mean()),
                    "p_at_k_sd": float(p.std(ddof=1)) if len(p) > 1 else 0.0,
                    "n_seeds": len(rs),
                }
            )
    (out / "detection.json").write_text(
        json.dumps(
            {"settings": asdict(s), "summary": summary, "per_seed": per_seed, "sanity": extras},
            indent=1,
        )
    )
    tmp = out / "detection.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    os.replace(tmp, out / "detection.csv")
    return summary


def _sanity(run, task: str, data_dir: Path) -> dict:
    """Did the model learn the planted behaviour? (mean query losses under the final model)"""
    import torch

    from ..training.losses import example_losses
    from ..training.models import collate, model_inputs

    loaded = run.model()
    pad = loaded.tokenizer.pad_token_id

    def mean_loss(pairs):
        encs = [run.encode(p, c)[0] for p, c in pairs]
        with torch.no_grad():
            batch = collate(encs, pad, run.task, "cpu")
            return float(
                example_losses(loaded.model(**model_inputs(batch)), batch, run.task).mean()
            )

    evals = read_jsonl(data_dir / "eval.jsonl")
    res = {"eval_loss_clean": mean_loss([(r["prompt"], r["completion"]) for r in evals])}
    if task == "backdoor":
        trig = read_jsonl(data_dir / "trigger_queries.jsonl")
        res["target_loss_with_trigger"] = mean_loss([(r["prompt"], r["completion"]) for r in trig])
        res["target_loss_without_trigger"] = mean_loss([(r["prompt"], TARGET) for r in evals])
    return res
