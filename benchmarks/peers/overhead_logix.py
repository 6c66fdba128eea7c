"""Traceprop vs LogIX (LoGRA, random init, rank 8): inline overhead + cost of one post-hoc pass.

Run inside the logix venv (``./setup_peer.sh logix``):

    .venvs/logix/bin/python overhead_logix.py --repeats 24

Arms (interleaved, one process, one model object, one AdamW):
  plain      no hooks, original Linear modules;
  traceprop  Tracker (factored 8x8 sketches, covariance on) hooks attached;
  logix      LogIX ``add_lora(init="random", rank=8)`` LoraLinear wrappers swapped in for every
             Linear (they wrap the *same* Linear objects, so weights and optimizer are shared),
             ``setup({"grad": ["log", "covariance"]})`` + ``save(True)``: per-example rank-8x8
             gradient of ``logix_lora_B`` logged and buffered, gradient covariance accumulated;
             ``finalize()`` (the mmap write + state save) is timed at the end and amortised.
Detaching LogIX swaps the original modules back and removes its hooks.

Post-hoc: LogIX's own post-hoc use is one forward+backward pass over the training set with the
same logging (no optimizer step) + finalize; timed over ``--posthoc-n`` examples (200) and
compared with Traceprop's inline overhead for one epoch over the same set
(median overhead ms/step x ceil(n / batch) steps).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from traceprop_engine.training.losses import causal_lm_losses  # noqa: E402


class LogixArm(C.Arm):
    name = "logix"

    def __init__(self, model, batch, workdir: Path, project: str = "bench"):
        import logix
        from logix.config import LoRAConfig
        from logix.lora.modules import LoraLinear

        self.model, (self.ids, self.mask, self.labels) = model, batch
        workdir.mkdir(parents=True, exist_ok=True)
        os.chdir(workdir)  # LogIX writes under ./logix/<project>
        self.run = logix.LogIX(project=project)
        self.run.watch(model, type_filter=[torch.nn.Linear])
        self.run.add_lora(lora_config=LoRAConfig(init="random", rank=C.CFG["peer_k"]))
        self.run.setup({"grad": ["log", "covariance"]})
        self.run.save(True)
        # LogIX's watch() turns requires_grad off for every untracked leaf (it is built for
        # post-hoc logging); in training the model's own parameters must keep training.
        for n, p in model.named_parameters():
            p.requires_grad = "logix_lora" not in n or "logix_lora_B" in n
        self.swaps = []  # (parent, attr, wrapper, original)
        for name, m in list(model.named_modules()):
            if isinstance(m, LoraLinear):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                self.swaps.append((parent, name.rsplit(".", 1)[-1], m, m._linear))
        self.lora_b = [w.logix_lora_B for _, _, w, _ in self.swaps]
        self.n_layers = len(self.swaps)
        self.k = 0
        self.detach()

    def attach(self):
        for parent, attr, wrapper, _ in self.swaps:
            setattr(parent, attr, wrapper)

    def detach(self):
        self.run.logger.clear(hook=True, module=False, buffer=False)
        for parent, attr, _, orig in self.swaps:
            setattr(parent, attr, orig)

    def step(self, i):
        data_id = [f"{self.k}_{j}" for j in range(len(self.ids))]
        self.k += 1
        with self.run(data_id=data_id, mask=self.mask):
            causal_lm_losses(
                self.model(input_ids=self.ids, attention_mask=self.mask).logits, self.labels
            ).mean().backward()
        for b in self.lora_b:  # not in the optimizer: B stays zero, its grad is only a carrier
            b.weight.grad = None

    def close(self):
        self.run.finalize()


def posthoc_pass(model, arm: LogixArm, n: int, seed: int = 1) -> dict:
    """LogIX's post-hoc logging pass over n examples (batch 8): fwd+bwd with logging, finalize."""
    ids, mask, labels = C.make_batch(seed, n)
    b = C.CFG["batch"]
    arm.attach()
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, n, b):
        sl = slice(s, s + b)
        with arm.run(data_id=[f"post_{j}" for j in range(s, min(s + b, n))], mask=mask[sl]):
            causal_lm_losses(
                model(input_ids=ids[sl], attention_mask=mask[sl]).logits, labels[sl]
            ).mean().backward()
        model.zero_grad(set_to_none=True)
    arm.run.finalize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    arm.detach()
    return {
        "posthoc_s": wall,
        "posthoc_cpu_s": cpu,
        "posthoc_n": n,
        "posthoc_steps": math.ceil(n / b),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--posthoc-n", type=int, default=200)
    ap.add_argument("--out", default="overhead_logix")
    a = ap.parse_args()
    model = C.make_model()
    batch = C.make_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=C.CFG["lr"])
    tmp = C.tmpdir("peer-logix-")
    work = Path(tmp.name)
    trace = C.TraceArm(model, batch, work / "tracked.h5")
    logix_arm = LogixArm(model, batch, work / "logix_inline")
    n_tracked = len(C.linear_names(model))
    arms = [C.PlainArm(model, batch), trace, logix_arm]
    res = C.run_interleaved(arms, {a_.name: opt for a_ in arms}, repeats=a.repeats, warmup=a.warmup)
    res["layers_tracked"] = {"traceprop": n_tracked, "logix": logix_arm.n_layers}
    # post-hoc pass with a fresh LogIX run (same model, trained weights)
    post_arm = LogixArm(model, batch, work / "logix_post", project="posthoc")
    ph = posthoc_pass(model, post_arm, a.posthoc_n)
    steps = ph["posthoc_steps"]
    ph.update(C.readiness(res, ph["posthoc_s"], steps))
    ph["logix_inline_overhead_s_one_epoch"] = (
        res["arms"]["logix"]["overhead_ms_per_step"] * steps / 1e3
    )
    inline_s = ph["traceprop_inline_overhead_s_one_epoch"]
    res["posthoc"] = ph
    p = C.save(a.out, res)
    print(C.summary(res))
    print(
        f"post-hoc LogIX pass over {a.posthoc_n} examples: {ph['posthoc_s']:.2f} s; Traceprop inline overhead for one "
        f"epoch ({steps} steps): {inline_s:.3f} s; ratio {ph['posthoc_over_inline_ratio']:.1f}x "
        f"(with the overhead at its CI upper end: {ph['posthoc_over_inline_ratio_ci_upper']:.1f}x)"
    )
    print("wrote", p)
    os.chdir(C.HERE)
    tmp.cleanup()


if __name__ == "__main__":
    main()
