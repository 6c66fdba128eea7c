"""Attribution quality (LDS) of the peers on the subsets and retrained losses of a finished
``traceprop_engine.evaluate.lds`` evaluation directory.

    .venvs/kronfluence/bin/python quality_lds.py --peer kronfluence --eval-dir /tmp/traceprop_eval/lds
    .venvs/logix/bin/python       quality_lds.py --peer logix       --eval-dir /tmp/traceprop_eval/lds
    .venvs/bergson/bin/python     quality_lds.py --peer bergson     --eval-dir /tmp/traceprop_eval/lds

The evaluation directory is only read: its ``subsets.json`` (the m random half-size subsets),
``losses.npy`` (eval losses of the m retrained models), the main tracked run ``runs/k8``
(final model, tokenised train/eval examples).  Each peer scores every (eval, train) pair on the
*final* model of that run — the peers are post-hoc tools — with the per-example loss Traceprop
defines (mean over target tokens), and the LDS is computed by the harness's own
``lds_scores``/``summarize`` (Spearman per eval example, mean, bootstrap 95 % CI).  Traceprop's
rows for the same subsets are read from the directory's ``results.json`` (its scores are the
lr-weighted sum of sketches recorded along the training trajectory, not final-model gradients).

Peers:
  kronfluence  EK-FAC, K-FAC and identity (``FactorArguments(strategy=...)``), every Linear,
               pairwise scores, and each divided by the square root of the train example's
               self-influence under the same strategy (train-side normalisation: Traceprop's
               cosine, since LDS ignores a query's scale);
  logix        LoGRA random-init rank 8 on every Linear, grad log + grad covariance,
               ``compute_influence_all(precondition=True)``;
  bergson      post-hoc build (projection_dim 8, no optimizer normaliser) of train and eval
               gradients with ``collect_gradients``; score = inner product (bergson's default
               ``score`` without preconditioner) and cosine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from traceprop_engine import constants as TC  # noqa: E402
from traceprop_engine.attribution import open_run  # noqa: E402
from traceprop_engine.evaluate.lds_report import lds_scores, summarize  # noqa: E402
from traceprop_engine.training.losses import (  # noqa: E402
    causal_lm_losses,
    classification_losses,
)
from traceprop_engine.training.models import collate, load_saved_model  # noqa: E402


def load_eval(eval_dir: Path, run_name: str):
    run = open_run(eval_dir / "runs" / run_name)
    task = run.task
    ex = run.examples()
    eval_ids = ex.filter(ex["split"] == TC.SPLIT_EVAL)["example_id"].to_list()
    n_train = ex.filter(ex["split"] == TC.SPLIT_TRAIN).height
    train_encs = [run.encode(eval_example=i)[0] for i in range(n_train)]
    eval_encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    run.close()
    sub = json.loads((eval_dir / "subsets.json").read_text())
    assert sub["n_train"] == n_train, (sub["n_train"], n_train)
    masks = np.zeros((len(sub["subsets"]), n_train), bool)
    for j, s in enumerate(sub["subsets"]):
        masks[j, s["members"]] = True
    losses = np.load(eval_dir / "losses.npy")
    return train_encs, eval_encs, masks, losses, task


def fresh_model(eval_dir: Path, run_name: str):
    loaded = load_saved_model(eval_dir / "runs" / run_name / "model", "cpu")
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    loaded.model.eval()
    return loaded.model, pad


def padded(encs, pad, task: str = "causal-lm") -> dict:
    return collate(encs, pad, task, "cpu")


# -- kronfluence ------------------------------------------------------------------------------------
def scores_kronfluence(
    model, pad, train_encs, eval_encs, work: Path, task_name: str = "causal-lm"
) -> dict[str, np.ndarray]:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task

    # a run that trained adapters: kronfluence tracks the modules that were trained (peft's LoRA
    # A/B and the modules it saved, e.g. a new classifier head), as its own LoRA examples do, not
    # the frozen base layers beside them; a full fine-tune: every linear layer (None)
    adapters = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ("lora_" in n or "modules_to_save" in n)
    ]
    tracked = adapters or None

    class DS(torch.utils.data.Dataset):
        def __init__(self, b):
            self.b = b

        def __len__(self):
            return len(self.b["input_ids"])

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.b.items()}

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            labels = batch["labels"]
            if sample:
                with torch.no_grad():
                    probs = F.softmax(logits[:, :-1].detach().float(), -1)
                    s = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
                    labels = labels.clone()
                    labels[:, 1:] = torch.where(labels[:, 1:] != -100, s, labels[:, 1:])
            return causal_lm_losses(logits, labels).sum()

        def compute_measurement(self, batch, model):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            return causal_lm_losses(logits, batch["labels"]).sum()

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

        def get_influence_tracked_modules(self):
            return tracked

    class ClassifierTask(Task):
        """A classifier's loss, as Traceprop's (cross-entropy per example); the true Fisher's
        labels sampled from the model's own prediction."""

        def _logits(self, batch, model):
            return model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits

        def compute_train_loss(self, batch, model, sample=False):
            logits = self._logits(batch, model)
            labels = batch["labels"]
            if sample:
                with torch.no_grad():
                    probs = F.softmax(logits.detach().float(), -1)
                    labels = torch.multinomial(probs, 1).squeeze(-1)
            return classification_losses(logits, labels).sum()

        def compute_measurement(self, batch, model):
            return classification_losses(self._logits(batch, model), batch["labels"]).sum()

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

        def get_influence_tracked_modules(self):
            return tracked

    task = ClassifierTask() if task_name == "classification" else LMTask()
    model = prepare_model(model, task)
    an = Analyzer(
        analysis_name="q", model=model, task=task, cpu=True, output_dir=str(work), disable_tqdm=True
    )
    train = DS(padded(train_encs, pad, task_name))
    query = DS(padded(eval_encs, pad, task_name))
    out = {}
    for strategy in ("ekfac", "kfac", "identity"):
        an.fit_all_factors(
            factors_name=strategy,
            dataset=train,
            per_device_batch_size=8,
            factor_args=FactorArguments(strategy=strategy),
            overwrite_output_dir=True,
        )
        an.compute_pairwise_scores(
            scores_name=f"s_{strategy}",
            factors_name=strategy,
            query_dataset=query,
            train_dataset=train,
            per_device_query_batch_size=8,
            per_device_train_batch_size=8,
            overwrite_output_dir=True,
        )
        s = an.load_pairwise_scores(
            scores_name=f"s_{strategy}"
        )  # compute_* writes to disk, returns None
        out[f"kronfluence {strategy}"] = s["all_modules"].double().numpy()
        # its train-side normalisation (what Traceprop's cosine does): pairwise / sqrt(self)
        an.compute_self_scores(
            scores_name=f"self_{strategy}",
            factors_name=strategy,
            train_dataset=train,
            per_device_train_batch_size=8,
            overwrite_output_dir=True,
        )
        own = an.load_self_scores(scores_name=f"self_{strategy}")["all_modules"].double().numpy()
        norm = np.sqrt(np.maximum(own, 1e-30))
        out[f"kronfluence {strategy}, cosine"] = out[f"kronfluence {strategy}"] / norm[None, :]
    return out


# -- LogIX ------------------------------------------------------------------------------------------
def scores_logix(model, pad, train_encs, eval_encs, work: Path) -> dict[str, np.ndarray]:
    import logix
    from logix.config import LoRAConfig

    for p in model.parameters():
        p.requires_grad_(True)
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)
    run = logix.LogIX(project="q")
    run.watch(model, type_filter=[torch.nn.Linear])
    run.add_lora(lora_config=LoRAConfig(init="random", rank=C.CFG["peer_k"]))
    run.setup({"grad": ["log", "covariance"]})
    run.save(True)
    tb = padded(train_encs, pad)
    n = len(train_encs)
    for s in range(0, n, 8):
        sl = slice(s, min(s + 8, n))
        with run(data_id=[str(i) for i in range(sl.start, sl.stop)], mask=tb["attention_mask"][sl]):
            logits = model(
                input_ids=tb["input_ids"][sl], attention_mask=tb["attention_mask"][sl]
            ).logits
            causal_lm_losses(logits, tb["labels"][sl]).sum().backward()
        model.zero_grad(set_to_none=True)
    run.finalize()
    loader = run.build_log_dataloader(batch_size=64)
    run.setup({"grad": ["log"]})
    run.eval()
    eb = padded(eval_encs, pad)
    with run(data_id=[f"e{i}" for i in range(len(eval_encs))], mask=eb["attention_mask"]):
        logits = model(input_ids=eb["input_ids"], attention_mask=eb["attention_mask"]).logits
        causal_lm_losses(logits, eb["labels"]).sum().backward()
    test_log = run.get_log()
    out = {}
    for name, pre in (("logix logra (precond.)", True), ("logix logra (no precond.)", False)):
        r = run.compute_influence_all(test_log, loader, precondition=pre)
        inf = r["influence"].double().numpy()  # (n_eval, n_train) in src/tgt id order
        order = np.argsort([int(t) for t in r["tgt_ids"]])
        out[name] = inf[:, order]
    model.zero_grad(set_to_none=True)
    os.chdir(C.HERE)
    return out


# -- bergson ----------------------------------------------------------------------------------------
def scores_bergson(model, pad, train_encs, eval_encs, work: Path) -> dict[str, np.ndarray]:
    from bergson.collection import collect_gradients
    from bergson.config.config import IndexConfig
    from bergson.data import load_gradients
    from bergson.utils.worker_utils import processor_for
    from datasets import Dataset

    for p in model.parameters():
        p.requires_grad_(True)

    def build(encs, path):
        b = padded(encs, pad)
        rows = {"input_ids": [], "labels": [], "length": []}
        for i in range(len(encs)):
            n = int(b["attention_mask"][i].sum())
            rows["input_ids"].append(b["input_ids"][i, :n].tolist())
            rows["labels"].append(b["labels"][i, :n].tolist())
            rows["length"].append(n)
        cfg = IndexConfig(run_path=str(path), projection_dim=C.CFG["peer_k"], loss_reduction="mean")
        cfg.partial_run_path.mkdir(parents=True, exist_ok=True)
        batches = [list(range(s, min(s + 8, len(encs)))) for s in range(0, len(encs), 8)]
        collect_gradients(model, Dataset.from_dict(rows), processor_for(cfg), cfg, batches=batches)
        g = np.asarray(load_gradients(cfg.partial_run_path), np.float64)
        return g.reshape(len(encs), -1)

    gt = build(train_encs, work / "train")
    ge = build(eval_encs, work / "eval")
    nt = gt / np.maximum(np.linalg.norm(gt, axis=1, keepdims=True), 1e-30)
    ne = ge / np.maximum(np.linalg.norm(ge, axis=1, keepdims=True), 1e-30)
    # bergson's gradients are of the loss; a proponent has a positive inner product
    return {"bergson inner product": ge @ gt.T, "bergson cosine": ne @ nt.T}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, choices=["kronfluence", "logix", "bergson"])
    ap.add_argument("--eval-dir", default="/tmp/traceprop_eval/lds")
    ap.add_argument("--run", default="k8")
    ap.add_argument("--out", default=None, help="result name (default quality_<peer>)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    eval_dir = Path(a.eval_dir)
    train_encs, eval_encs, masks, losses, task = load_eval(eval_dir, a.run)
    if task != "causal-lm" and a.peer != "kronfluence":
        raise SystemExit(f"--peer {a.peer} is scored on causal-LM runs only; this run is {task}")
    model, pad = fresh_model(eval_dir, a.run)
    tmp = tempfile.TemporaryDirectory(prefix=f"peer-lds-{a.peer}-")
    t0 = time.perf_counter()
    fn = {"kronfluence": scores_kronfluence, "logix": scores_logix, "bergson": scores_bergson}[
        a.peer
    ]
    extra = {"task_name": task} if a.peer == "kronfluence" else {}
    methods = fn(model, pad, train_encs, eval_encs, Path(tmp.name), **extra)
    secs = time.perf_counter() - t0
    rows = []
    for name, s in methods.items():
        assert s.shape == (len(eval_encs), len(train_encs)), s.shape
        per = lds_scores(s, masks, losses)
        rows.append({"method": name, **summarize(per, 2000, seed=0)})
        r = rows[-1]
        print(
            f"{name:<28} LDS {r['lds']:+.3f}  (95% CI {r['ci_low']:+.3f} .. {r['ci_high']:+.3f})  n_valid {r['n_valid']}"
        )
    ref = json.loads((eval_dir / "results.json").read_text())
    trace_rows = [
        {k: r.get(k) for k in ("method", "family", "k", "lds", "ci_low", "ci_high")}
        for r in ref["rows"]
        if r.get("family") in ("factored", "baseline", "k-sweep", "dense")
    ]
    res = {
        "eval_dir": str(eval_dir),
        "run": a.run,
        "n_train": len(train_encs),
        "n_eval": len(eval_encs),
        "n_subsets": int(masks.shape[0]),
        "peer": a.peer,
        "task": task,
        "seconds": secs,
        "rows": rows,
        "traceprop_rows_from_eval_dir": trace_rows,
        "eval_settings": ref.get("settings"),
    }
    p = C.save(a.out or f"quality_{a.peer}", res)
    print("wrote", p)
    tmp.cleanup()


if __name__ == "__main__":
    main()
