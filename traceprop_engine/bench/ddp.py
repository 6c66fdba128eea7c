"""``torchrun --nproc_per_node N -m traceprop_engine.bench.ddp [PAIRS]``: tracked vs plain DDP
training steps on every rank (plain ``python -m traceprop_engine.bench.ddp`` for the one-process
reference); prints rank 0's numbers as JSON."""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch

from ..capture.tracker import Tracker
from ..settings import TrackSettings
from ..training.distributed import setup
from ..training.losses import causal_lm_losses
from ..training.models import tiny_config
from .overhead import median_ci


def bench_overhead(
    pairs: int = 30, steps: int = 2, batch: int = 4, seq: int = 48, width: int = 64, layers: int = 2
) -> dict | None:
    """Tracked vs plain DDP steps on this rank, interleaved ABBA on one model (DESIGN.md §7).

    Run under ``torchrun --nproc_per_node N -m traceprop_engine.bench.ddp`` (or plain
    ``python -m traceprop_engine.bench.ddp`` for the one-process reference). Returns rank 0's
    numbers (``None`` on other ranks): median step times, the median of paired ratios
    ``tracked/plain - 1`` with a bootstrap 95 % interval.
    """
    torch.set_num_threads(1)
    ctx, device = setup(torch.device("cpu"))
    try:
        from transformers import GPTNeoXForCausalLM

        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(tiny_config(512, width, layers))
        ddp = ctx.wrap(model, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(ctx.rank)
        x = torch.randint(0, 512, (batch, seq), generator=g)
        mask = torch.ones_like(x)
        with tempfile.TemporaryDirectory() as tmp:
            tracker = Tracker(model, f"{tmp}/{ctx.store_file}", TrackSettings(), background=True)

            def run(tracked: bool) -> float:
                t0 = time.perf_counter()
                for _ in range(steps):
                    if tracked:
                        with tracker.step(np.arange(batch), padding_mask=mask) as rec:
                            losses = causal_lm_losses(ddp(input_ids=x).logits, x)
                            losses.mean().backward()
                            rec.losses = losses
                    else:
                        causal_lm_losses(ddp(input_ids=x).logits, x).mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                return (time.perf_counter() - t0) * 1e3 / steps

            def arm(tracked: bool) -> float:
                if tracked:
                    tracker.capture.attach()
                else:
                    tracker.capture.detach()
                ctx.barrier()
                return run(tracked)

            for t in (False, True, False, True):  # warm-up
                arm(t)
            plain, tracked = [], []
            for i in range(pairs):
                order = (False, True, True, False) if i % 2 == 0 else (True, False, False, True)
                got = {False: [], True: []}
                for t in order:
                    got[t].append(arm(t))
                plain.append(np.mean(got[False]))
                tracked.append(np.mean(got[True]))
            tracker.close()
        ratios = np.array(tracked) / np.array(plain) - 1
        lo, hi = median_ci(ratios)
        out = {
            "world_size": ctx.world_size,
            "pairs": pairs,
            "steps_per_arm": steps,
            "batch_per_rank": batch,
            "plain_ms": float(np.median(plain)),
            "tracked_ms": float(np.median(tracked)),
            "overhead_pct": 100 * float(np.median(ratios)),
            "ci95_pct": [100 * lo, 100 * hi],
        }
        return out if ctx.is_main else None
    finally:
        ctx.close()


if __name__ == "__main__":
    import json
    import sys

    result = bench_overhead(*(int(a) for a in sys.argv[1:2]))
    if result is not None:
        print(json.dumps(result))
