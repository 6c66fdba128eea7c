"""Traceprop vs dattri-llm's trainer-time capture (HookManager + OffloadCallback): inline overhead.

Run inside the dattri venv (``./setup_peer.sh dattri`` installs ``dattri`` and ``dattri-llm``):

    .venvs/dattri/bin/python overhead_dattri.py --repeats 40

dattri-llm captures per-example gradients from any loop that calls ``backward()``:
``HookManager(model, config=HookManagerConfig(...), callbacks=[...]).collect()``.  Here:

- ``linear_io`` hooks on exactly the 17 linear layers Traceprop tracks;
- capture-time LoGRA projection (``projection_kwargs={"__default__": {"style": "logra",
  "proj_dim": 8, ...}}``: both factors projected to 8, i.e. an 8x8 sketch per layer), with
  ``capture_style="materialized"`` (the projected per-example 8x8 gradient is formed in the
  backward hook, as Traceprop does);
- ``OffloadCallback(offload_interval=1, recording_type="per_sample")`` writing to a
  ``GradientStorageManager`` (memmap on disk) after every step;
- arm ``dattri_llm_kfac`` adds ``KroneckerCovarianceCallback`` (inline K-FAC factors, as
  Traceprop's covariance).

Attach = entering ``collect()`` (registers the hooks); detach = leaving it
(``deregister_on_exit=True``: callbacks' ``on_context_end`` flush, hooks removed) — both outside
the timed step.  The flush at context end is timed separately and amortised over the steps.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from traceprop_engine.training.losses import causal_lm_losses  # noqa: E402


class DattriArm(C.Arm):
    def __init__(
        self, model, batch, path: Path, kfac: bool, name: str, capture_style: str = "materialized"
    ):
        from dattri_llm import (
            GradientStorageManager,
            HookManager,
            HookManagerConfig,
            KroneckerCovarianceCallback,
            OffloadCallback,
        )

        self.name = name
        self.model, (self.ids, self.mask, self.labels) = model, batch
        names = C.linear_names(model)
        cfg = HookManagerConfig(
            linear_io=[f"^{re.escape(n)}$" for n in names],
            capture_style=capture_style,
            projection_kwargs={
                "__default__": {
                    "style": "logra",
                    "proj_dim": C.CFG["peer_k"],
                    "proj_max_batch_size": C.CFG["batch"],
                    "proj_type": "normal",
                    "proj_seed": 0,
                }
            },
        )
        self.fm = GradientStorageManager(str(path))
        cbs = [
            OffloadCallback(offload_interval=1, file_manager=self.fm, recording_type="per_sample")
        ]
        if kfac:
            cbs.append(KroneckerCovarianceCallback())
        self.hm = HookManager(model, config=cfg, callbacks=cbs)
        self.hm.remove()
        self.ctx = None
        self.end_s = 0.0

    def attach(self):
        self.ctx = self.hm.collect(deregister_on_exit=True)
        self.ctx.__enter__()

    def detach(self):
        t0 = time.perf_counter()
        self.ctx.__exit__(None, None, None)
        self.end_s += time.perf_counter() - t0  # the context-end flush: amortised via close()

    def step(self, i):
        causal_lm_losses(
            self.model(input_ids=self.ids, attention_mask=self.mask).logits, self.labels
        ).mean().backward()

    def close(self):
        pass  # the per-round context-end flushes are added in main() (context_end_ms_per_step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="overhead_dattri")
    a = ap.parse_args()
    model = C.make_model()
    batch = C.make_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=C.CFG["lr"])
    tmp = C.tmpdir("peer-dattri-")
    work = Path(tmp.name)
    trace = C.TraceArm(model, batch, work / "tracked.h5")
    d1 = DattriArm(model, batch, work / "dattri", kfac=False, name="dattri_llm")
    d2 = DattriArm(model, batch, work / "dattri_kfac", kfac=True, name="dattri_llm_kfac")
    arms = [C.PlainArm(model, batch), trace, d1, d2]
    res = C.run_interleaved(arms, {x.name: opt for x in arms}, repeats=a.repeats, warmup=a.warmup)
    steps = a.repeats + a.warmup
    for d in (d1, d2):
        # context-end flush time, outside the timed steps, amortised as an extra per-step cost
        extra = d.end_s * 1e3 / steps
        arm = res["arms"][d.name]
        arm["context_end_ms_per_step"] = extra
        arm["overhead_pct_incl_context_end"] = (
            arm["overhead_pct"] + 100 * extra / res["plain_step_ms"]
        )
    rec = d1.hm.get_gradient()
    res["dattri_gradient_repr"] = repr(rec)[:600] if rec is not None else None
    res["layers_tracked"] = {
        "traceprop": len(trace.tr.layers),
        "dattri_llm": len(rec.representation) if rec is not None else None,
    }
    if rec is not None:
        res["dattri_per_layer_shape"] = list(next(iter(rec.data.values())).shape)  # (batch, 8*8)
    p = C.save(a.out, res)
    print(C.summary(res))
    for d in (d1, d2):
        print(
            f"{d.name}: context-end flush {res['arms'][d.name]['context_end_ms_per_step']:.2f} ms/step amortised -> "
            f"{res['arms'][d.name]['overhead_pct_incl_context_end']:+.2f} %"
        )
    print("layers", res["layers_tracked"], "gradient:", res["dattri_gradient_repr"])
    print("wrote", p)
    tmp.cleanup()


if __name__ == "__main__":
    main()
