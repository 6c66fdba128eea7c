"""Cost of attribution-readiness: kronfluence (EK-FAC) post-hoc vs Traceprop inline.

Run inside the kronfluence venv (``./setup_peer.sh kronfluence``):

    .venvs/kronfluence/bin/python posthoc_kronfluence.py --repeats 30

kronfluence has no inline (training-time) mode, so there is no kronfluence overhead arm.  This
script (1) measures Traceprop's inline overhead on the standard protocol (plain vs traceprop,
interleaved, same model), (2) trains nothing further and runs kronfluence on the same model
over a ``--posthoc-n``-example training set (batch 8, 128 tokens, every Linear layer incl. the
LM head, as Traceprop's scope "all"):

- ``fit_all_factors`` with ``FactorArguments(strategy="ekfac")``: covariance pass +
  eigendecomposition + eigenvalue-correction pass (two passes over the training set);
- ``compute_pairwise_scores`` for ``--queries`` query examples against the training set (one
  more per-example-gradient pass over the training set; kronfluence computes training
  gradients at scoring time and stores none).

The ratio is kronfluence's post-hoc seconds over Traceprop's inline overhead seconds for one
epoch over the same training set.  The first (factors) number is what makes kronfluence
"attribution-ready"; the scores number is what a first query costs on top.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from traceprop_engine.training.losses import causal_lm_losses  # noqa: E402


class LMDataset(torch.utils.data.Dataset):
    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.ids[i]}


def make_task():
    from kronfluence.task import Task

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits = (
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                .logits[:, :-1]
                .float()
            )
            if not sample:
                labels = batch["labels"][:, 1:]
            else:
                with torch.no_grad():
                    labels = torch.multinomial(
                        F.softmax(logits.detach(), -1).flatten(0, 1), 1
                    ).view(logits.shape[:2])
            # kronfluence expects the batch loss summed over examples; each example's loss is
            # the mean over its tokens (Traceprop's per-example loss definition)
            tok = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            return tok.mean(1).sum()

        def compute_measurement(self, batch, model):
            return causal_lm_losses(
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                batch["labels"],
            ).sum()

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    return LMTask()


def posthoc(model, n: int, queries: int, out: Path, seed: int = 1) -> dict:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments

    ids, mask, _ = C.make_batch(seed, n)
    qids, qmask, _ = C.make_batch(seed + 1, queries)
    train, query = LMDataset(ids, mask), LMDataset(qids, qmask)
    task = make_task()
    b = C.CFG["batch"]
    t0, c0 = time.perf_counter(), time.process_time()
    model = prepare_model(model, task)
    an = Analyzer(
        analysis_name="peer",
        model=model,
        task=task,
        cpu=True,
        output_dir=str(out),
        disable_tqdm=True,
    )
    an.fit_all_factors(
        factors_name="ekfac",
        dataset=train,
        per_device_batch_size=b,
        factor_args=FactorArguments(strategy="ekfac"),
        overwrite_output_dir=True,
    )
    t1, c1 = time.perf_counter(), time.process_time()
    scores = an.compute_pairwise_scores(
        scores_name="s",
        factors_name="ekfac",
        query_dataset=query,
        train_dataset=train,
        per_device_query_batch_size=queries,
        per_device_train_batch_size=b,
        overwrite_output_dir=True,
    )
    t2, c2 = time.perf_counter(), time.process_time()
    scores = an.load_pairwise_scores(scores_name="s")  # compute_* writes to disk and returns None
    shape = list(scores["all_modules"].shape) if scores is not None else None
    from kronfluence.module.tracked_module import TrackedModule

    n_mod = sum(isinstance(m, TrackedModule) for m in model.modules())
    return {
        "factors_s": t1 - t0,
        "factors_cpu_s": c1 - c0,
        "scores_s": t2 - t1,
        "scores_cpu_s": c2 - c1,
        "posthoc_s": t2 - t0,
        "posthoc_n": n,
        "queries": queries,
        "posthoc_steps": math.ceil(n / b),
        "scores_shape": shape,
        "strategy": "ekfac",
        "tracked_modules": n_mod,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--posthoc-n", type=int, default=200)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--out", default="posthoc_kronfluence")
    a = ap.parse_args()
    model = C.make_model()
    batch = C.make_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=C.CFG["lr"])
    tmp = C.tmpdir("peer-kron-")
    work = Path(tmp.name)
    trace = C.TraceArm(model, batch, work / "tracked.h5")
    arms = [C.PlainArm(model, batch), trace]
    res = C.run_interleaved(arms, {x.name: opt for x in arms}, repeats=a.repeats, warmup=a.warmup)
    model.zero_grad(set_to_none=True)
    ph = posthoc(model, a.posthoc_n, a.queries, work / "kron")
    steps = ph["posthoc_steps"]
    ph.update(C.readiness(res, ph["posthoc_s"], steps))
    inline_s = ph["traceprop_inline_overhead_s_one_epoch"]
    ph["factors_over_inline_ratio"] = ph["factors_s"] / inline_s if inline_s > 0 else float("nan")
    res["posthoc"] = ph
    p = C.save(a.out, res)
    print(C.summary(res))
    print(
        f"kronfluence EK-FAC over {a.posthoc_n} examples: factors {ph['factors_s']:.2f} s + pairwise scores for "
        f"{a.queries} queries {ph['scores_s']:.2f} s = {ph['posthoc_s']:.2f} s; Traceprop inline overhead one epoch "
        f"({steps} steps) {inline_s:.3f} s; ratio {ph['posthoc_over_inline_ratio']:.1f}x (factors only "
        f"{ph['factors_over_inline_ratio']:.1f}x; overhead at CI upper end: {ph['posthoc_over_inline_ratio_ci_upper']:.1f}x)"
    )
    print("wrote", p)
    tmp.cleanup()


if __name__ == "__main__":
    main()
