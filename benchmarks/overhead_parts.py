"""Where the default's tracking overhead goes, timed inside the step (issue 26, stop 38).

``traceprop bench overhead`` measures the tracked step against the plain one, and on a noisy
2-core machine the per-round difference scatters by ±20 % (its 95 % CI spans ~5 points). This
script times the capture's own work *inside* the tracked steps, where the noise is small: the
forward hooks (keep the input, register the output's gradient hook), the backward hooks (the
three batched products per layer of the default rank-1 record, :mod:`capture.hooks`), and the
batched work reported amortised over the rounds: the deferred projection and the buffer's
flush (every ``buffer_records / batch``-th step) and the covariance batches (every
``covariance_stride``-th), each as a share of the plain step measured in the same run. The sum is the
direct cost; the A/B difference of the same rounds is printed beside it for reference.

Usage: ``python benchmarks/overhead_parts.py [--repeats 64]`` (the bench's default shape: 4
layers, width 256, vocabulary 1024, batch 8 × 128 tokens, one torch thread; ``--layers 12
--width 768 --vocab 50257 --batch 4 --seq 128`` for GPT-2 small; ``--rank 16`` for what a
free-text run records, which takes the per-layer path: its products are not split out). The covariance share is
the mean cost of the tracked arm's statistics batches (warm-up included) divided by the stride.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from traceprop_engine.bench.machine import cpu_model
from traceprop_engine.bench.overhead import _Arms
from traceprop_engine.capture import hooks
from traceprop_engine.settings import TrackSettings


class HookTimer:
    """Wraps :class:`~traceprop_engine.capture.hooks.Capture`'s hooks with timers (seconds)."""

    def __init__(self) -> None:
        self.fwd = self.bwd = self.ops = 0.0
        self._patch()

    def _patch(self) -> None:
        timer = self
        backward_full, make_forward = hooks.Capture._backward_full, hooks.Capture._make_forward_hook
        bmm = torch.bmm

        def timed_bmm(*a, **k):
            t = time.perf_counter()
            out = bmm(*a, **k)
            timer.ops += time.perf_counter() - t
            return out

        def backward(self, layer, i, g):
            t = time.perf_counter()
            hooks.torch.bmm = timed_bmm  # the record's batched products, counted apart
            try:
                backward_full(self, layer, i, g)
            finally:
                hooks.torch.bmm = bmm
            timer.bwd += time.perf_counter() - t

        def forward_factory(self, i):
            inner = make_forward(self, i)

            def forward_hook(module, inputs, output):
                t = time.perf_counter()
                out = inner(module, inputs, output)
                timer.fwd += time.perf_counter() - t
                return out

            return forward_hook

        hooks.Capture._backward_full = backward
        hooks.Capture._make_forward_hook = forward_factory

    def snapshot(self) -> tuple[float, float, float]:
        return self.fwd, self.bwd, self.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats",
        type=int,
        default=64,
        help="rounds; ≥ 64 sees two flushes and covariance batches",
    )
    for name, default in (
        ("layers", 4),
        ("width", 256),
        ("vocab", 1024),
        ("batch", 8),
        ("seq", 128),
    ):
        p.add_argument(
            f"--{name}", type=int, default=default, help=f"model shape (default {default})"
        )
    p.add_argument(
        "--embedding",
        choices=("auto", "on", "off"),
        default="auto",
        help="TrackSettings.embedding (the bench's model is built from a config: auto is off)",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=TrackSettings().rank,
        help="TrackSettings.rank (16: what a free-text run records by default)",
    )
    p.add_argument(
        "--half-step-start",
        choices=("output", "narrow"),
        default=TrackSettings().half_step_start.value,
        help="TrackSettings.half_step_start",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    timer = HookTimer()
    d = TrackSettings().to_dict()
    keys = ("scope", "k_in", "k_out", "rank", "factor_dtype", "sketch", "dense_k")
    track = {k: d[k] for k in keys} | {"buffer_records": 256, "seed": 0}
    track["embedding"] = args.embedding
    track["half_step_start"] = args.half_step_start
    track["rank"] = args.rank
    shape = {k: getattr(args, k) for k in ("layers", "width", "vocab", "batch", "seq")}
    rows = {k: [] for k in ("plain", "tracked", "fwd", "bwd", "ops", "proj", "flush")}
    cov_s = 0.0
    with tempfile.TemporaryDirectory(prefix="traceprop-parts-") as tmp:
        arms = _Arms(shape, track, Path(tmp), 1, 0)
        for i in range(3):
            for arm in ("plain", "tracked"):
                arms.step(arm, i)
        for r in range(args.repeats):
            for arm in ("plain", "tracked") if r % 2 else ("tracked", "plain"):
                before = timer.snapshot()
                _wall, cpu, flush, _cov, proj = arms.step(arm, 3 + r)
                rows[arm].append(cpu)
                if arm == "tracked":
                    after = timer.snapshot()
                    for k, a, b in zip(("fwd", "bwd", "ops"), after, before, strict=True):
                        rows[k].append((a - b) * 1e3)
                    rows["proj"].append(proj)
                    rows["flush"].append(flush)
        # every statistics batch of the tracked arm (warm-up included: a short run at a large
        # shape may hold one only there), amortised over the stride
        cov_s = arms.covariance_acc["tracked"]["covariance_s"]
        stride = TrackSettings().covariance_stride
        stats_batches = -(-(3 + args.repeats) // stride)
        arms.close()
    med = {k: float(np.median(v)) for k, v in rows.items()}
    mean = {k: float(np.mean(v)) for k, v in rows.items()}  # the batched work: every 32nd step
    plain = med["plain"]
    cov_ms = cov_s * 1e3 / stats_batches / stride
    parts = {
        "forward hooks": med["fwd"],
        "backward hooks: the record's products (torch.bmm)": med["ops"],
        "backward hooks: the rest (Python, slots)": med["bwd"] - med["ops"],
        "deferred projection (amortised)": mean["proj"],
        "buffer flush to the writer thread (amortised)": mean["flush"],
        f"covariance batches ({stats_batches}, amortised over 1 in {stride})": cov_ms,
    }
    seen = sum(v > 0 for v in rows["flush"])
    print(f"CPU: {cpu_model()}; {args.repeats} rounds; plain step (process CPU) {plain:.1f} ms")
    print(f"  (batched work amortised over the rounds: {seen} flushes fell inside them)")
    for name, ms in parts.items():
        print(f"  {name:52s} {ms:6.2f} ms  {100 * ms / plain:5.2f} %")
    total = sum(parts.values())
    print(f"  {'sum (direct cost)':52s} {total:6.2f} ms  {100 * total / plain:5.2f} %")
    diff = med["tracked"] - plain
    print(
        f"  A/B difference of the same rounds (noisy): {diff:+.2f} ms ({100 * diff / plain:+.2f} %)"
    )


if __name__ == "__main__":
    main()
