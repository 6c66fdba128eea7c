"""Traceprop vs bergson's trainer-time collector: inline overhead + cost of one post-hoc build.

Run inside the bergson venv (``./setup_peer.sh bergson``):

    .venvs/bergson/bin/python overhead_bergson.py --repeats 40

bergson's trainer-time capture is ``bergson.huggingface.GradientCollectorCallback`` (an HF
``TrainerCallback``).  No HF Trainer is used here (its own loop would differ from the other
arms); the callback's hooks are driven exactly as the Trainer drives them: ``on_train_begin``
(builds the ``StreamingGradientCollector`` and enters it, registers the ``_idx`` forward
pre-hook), ``on_epoch_begin`` (allocates the on-disk memmap index), each step the model is
called with ``_idx`` and after backward ``on_step_end`` (writes the batch's gradients into the
memmap and, with ``use_optimizer_state=True`` (its default), rebuilds the Adam normalisers from
the optimizer state), ``on_epoch_end``/``on_train_end`` at the end (timed, amortised).
Attach/detach = the collector's ``__enter__``/``__exit__`` + the pre-hook.

bergson tracks the linear layers of ``model.base_model`` (the callback's choice), i.e. not the
LM head: 16 layers here vs Traceprop's 17.  Arm ``traceprop_base`` tracks the same 16 layers.
``projection_dim=8`` gives bergson an 8x8 sketch per layer, as Traceprop's k = 8 x 8.

Arms: plain | traceprop (17 layers) | traceprop_base (16) | bergson (callback defaults:
use_optimizer_state=True, fp16 store) | bergson_noopt (use_optimizer_state=False).

Post-hoc: ``bergson.collection.collect_gradients`` (the core of ``bergson build``) over
``--posthoc-n`` examples, batch 8, projection_dim 8, no optimizer state, vs Traceprop's inline
overhead for one epoch over the same set.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from traceprop_engine.settings import TrackSettings  # noqa: E402
from traceprop_engine.training.losses import causal_lm_losses  # noqa: E402


class TraceBaseArm(C.TraceArm):
    """Traceprop on the layers bergson tracks (model.base_model = gpt_neox.*)."""

    def __init__(self, model, batch, store: Path):
        self.model, (self.ids, self.mask, self.labels) = model, batch
        self.name = "traceprop_base"
        s = TrackSettings(
            covariance=True,
            scope=r"^gpt_neox\.",
            seed=C.CFG["seed"],
            **({} if C.CFG["k"] is None else {"k_in": C.CFG["k"], "k_out": C.CFG["k"]}),
        )
        self.track(store, s)


class BergsonArm(C.Arm):
    def __init__(
        self, model, opt, batch, path: Path, n_rows: int, use_optimizer_state: bool, name: str
    ):
        from bergson.huggingface import GradientCollectorCallback

        self.name = name
        self.model, self.opt, (self.ids, self.mask, self.labels) = model, opt, batch
        self.cb = GradientCollectorCallback(
            path, projection_dim=C.CFG["peer_k"], use_optimizer_state=use_optimizer_state
        )
        self.args = SimpleNamespace()
        self.args.__gradient_collection_enabled__ = True
        self.state = SimpleNamespace(epoch=0, global_step=0)
        self.control = SimpleNamespace()
        self.cb.on_train_begin(
            self.args, self.state, self.control, model=model
        )  # enters the collector
        self.cb.on_epoch_begin(
            self.args,
            self.state,
            self.control,
            train_dataloader=SimpleNamespace(dataset=range(n_rows)),
        )
        self.n_rows, self.k = n_rows, 0
        self.n_layers = len(self.cb.collector.target_info)
        self._attached = True
        self.detach()

    def attach(self):
        self.cb.collector.__enter__()
        self.cb.fwd_handle = self.model.register_forward_pre_hook(
            self.cb.on_forward_begin, with_kwargs=True
        )

    def detach(self):
        self.cb.collector.__exit__(None, None, None)
        self.cb.fwd_handle.remove()

    def step(self, i):
        b = len(self.ids)
        idx = (torch.arange(b) + self.k * b) % self.n_rows
        self.k += 1
        out = self.model(input_ids=self.ids, attention_mask=self.mask, _idx=idx)
        causal_lm_losses(out.logits, self.labels).mean().backward()
        self.state.global_step += 1
        self.cb.on_step_end(
            self.args, self.state, self.control, model=self.model, optimizer=self.opt
        )

    def close(self):
        self.attach()
        self.state.epoch = 1
        self.cb.on_epoch_end(self.args, self.state, self.control)
        self.cb.on_train_end(
            self.args, self.state, self.control
        )  # exits the collector, removes the pre-hook


def posthoc_build(model, n: int, path: Path, seed: int = 1) -> dict:
    """bergson's post-hoc gradient pass (collect_gradients, as ``bergson build`` runs it)."""
    from bergson.collection import collect_gradients
    from bergson.config.config import IndexConfig
    from bergson.utils.worker_utils import processor_for
    from datasets import Dataset

    ids, _, _ = C.make_batch(seed, n)
    b = C.CFG["batch"]
    cfg = IndexConfig(run_path=str(path), projection_dim=C.CFG["peer_k"], loss_reduction="mean")
    cfg.partial_run_path.mkdir(parents=True, exist_ok=True)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "length": [ids.shape[1]] * n})
    batches = [list(range(s, min(s + b, n))) for s in range(0, n, b)]
    t0, c0 = time.perf_counter(), time.process_time()
    processor = processor_for(cfg)
    collect_gradients(model, data, processor, cfg, batches=batches)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "posthoc_s": wall,
        "posthoc_cpu_s": cpu,
        "posthoc_n": n,
        "posthoc_steps": math.ceil(n / b),
        "posthoc_cfg": {"projection_dim": cfg.projection_dim, "loss_reduction": cfg.loss_reduction},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--posthoc-n", type=int, default=200)
    ap.add_argument("--out", default="overhead_bergson")
    a = ap.parse_args()
    model = C.make_model()
    batch = C.make_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=C.CFG["lr"])
    tmp = C.tmpdir("peer-bergson-")
    work = Path(tmp.name)
    n_rows = (a.repeats + a.warmup + 2) * C.CFG["batch"]
    trace = C.TraceArm(model, batch, work / "tracked.h5")
    trace_base = TraceBaseArm(model, batch, work / "tracked_base.h5")
    berg = BergsonArm(model, opt, batch, work / "bergson", n_rows, True, "bergson")
    berg_noopt = BergsonArm(
        model, opt, batch, work / "bergson_noopt", n_rows, False, "bergson_noopt"
    )
    arms = [C.PlainArm(model, batch), trace, trace_base, berg, berg_noopt]
    res = C.run_interleaved(arms, {x.name: opt for x in arms}, repeats=a.repeats, warmup=a.warmup)
    res["layers_tracked"] = {
        "traceprop": len(trace.tr.layers),
        "traceprop_base": len(trace_base.tr.layers),
        "bergson": berg.n_layers,
    }
    model.zero_grad(set_to_none=True)
    ph = posthoc_build(model, a.posthoc_n, work / "build")
    ph.update(C.readiness(res, ph["posthoc_s"], ph["posthoc_steps"]))
    res["posthoc"] = ph
    p = C.save(a.out, res)
    print(C.summary(res))
    print(
        f"post-hoc bergson build over {a.posthoc_n} examples: {ph['posthoc_s']:.2f} s; Traceprop inline overhead for one "
        f"epoch ({ph['epoch_steps']} steps): {ph['traceprop_inline_overhead_s_one_epoch']:.3f} s; ratio "
        f"{ph['posthoc_over_inline_ratio']:.1f}x (overhead at its CI upper end: {ph['posthoc_over_inline_ratio_ci_upper']:.1f}x)"
    )
    print("wrote", p)
    tmp.cleanup()


if __name__ == "__main__":
    main()
