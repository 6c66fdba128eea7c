"""Shared protocol for the peer benchmarks (same model and protocol as ``traceprop bench overhead``).

Tiny GPT-NeoX ``tiny_config(1024, 256, 4, 128)``, batch 8 x 128 random tokens, AdamW(lr=1e-4),
one torch thread, every trainable linear layer; Traceprop at its default ``TrackSettings()`` (rank-1
int8 factors of the full per-example gradient, k = 126; ``CFG["k"]`` set: a k x k configuration),
peers at rank 8.

Arms run interleaved in ONE process: each round runs every arm once (``steps_per_arm`` training
steps), the order cycles through all permutations of the arms, so load from other users of the
2 shared cores hits every arm alike; the overhead of an arm is the median over rounds of the
paired ratio ``arm/plain - 1`` with a bootstrap 95 % interval (as ``traceprop_engine/bench/overhead.py``).

An arm is a small object (see :class:`Arm`): ``attach()``/``detach()`` around its timed steps,
``step(i)`` = forward + backward of the batch with its logging (the harness then does the
optimizer step inside the same timing), ``excluded_s()`` = cumulative seconds of periodic work
inside steps that is *amortised* instead of being sampled by the median (Traceprop's buffer
flushes and the K-FAC statistics of every ``covariance_stride``-th batch, a peer's periodic
saves), ``close()`` = final flush / save, also amortised over the
arm's timed steps.  Timing matters only for arms that do work at irregular steps; every other
cost is inside the per-step wall time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from traceprop_engine.bench.overhead import time_covariance_batches
from traceprop_engine.capture.tracker import Tracker
from traceprop_engine.settings import TrackSettings
from traceprop_engine.training.losses import causal_lm_losses
from traceprop_engine.training.models import tiny_config

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# k=None: Traceprop's default TrackSettings (k = 126 rank-1 factors); an int: k_in = k_out = k.
# peer_k: the peers' rank / projection size (8: their 8 x 8 = 64-number sketch per layer).
CFG = dict(
    vocab=1024, width=256, layers=4, batch=8, seq=128, k=None, peer_k=8, lr=1e-4, threads=1, seed=0
)


def bootstrap_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def make_model(seed: int = 0):
    torch.set_num_threads(CFG["threads"])
    torch.manual_seed(seed)
    from transformers import GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(
        tiny_config(CFG["vocab"], CFG["width"], CFG["layers"], max(CFG["seq"], 64))
    )
    model.train()
    return model


def make_batch(seed: int = 0, n: int | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG["vocab"], (n or CFG["batch"], CFG["seq"]), generator=g)
    return ids, torch.ones_like(ids), ids.clone()


def linear_names(model) -> list[str]:
    from traceprop_engine.capture.layers import find_layers

    return [n for n, _ in find_layers(model, "all")]


class Arm:
    name = "arm"

    def attach(self) -> None: ...

    def detach(self) -> None: ...

    def step(self, i: int) -> None:
        raise NotImplementedError

    def excluded_s(self) -> float:
        return 0.0

    def close(self) -> None: ...


class PlainArm(Arm):
    name = "plain"

    def __init__(self, model, batch):
        self.model, (self.ids, self.mask, self.labels) = model, batch

    def step(self, i):
        causal_lm_losses(
            self.model(input_ids=self.ids, attention_mask=self.mask).logits, self.labels
        ).mean().backward()


class TraceArm(Arm):
    """Traceprop inline: Tracker with covariance on, the default ``TrackSettings`` (or k x k)."""

    name = "traceprop"

    def __init__(self, model, batch, store: Path, covariance: bool = True, name: str | None = None):
        self.model, (self.ids, self.mask, self.labels) = model, batch
        self.name = name or self.name
        k = {} if CFG["k"] is None else {"k_in": CFG["k"], "k_out": CFG["k"]}
        self.track(store, TrackSettings(covariance=covariance, scope="all", seed=CFG["seed"], **k))

    def track(self, store: Path, settings: TrackSettings) -> None:
        """The arm's Tracker; the K-FAC statistics of every ``covariance_stride``-th batch are
        periodic work like the flushes: timed where they run and amortised (a median would
        drop their rounds)."""
        self.tr = Tracker(self.model, store, settings)
        self.idx = np.arange(len(self.ids))
        self._cov = {"covariance_s": 0.0}
        time_covariance_batches(self.tr, self._cov)

    def attach(self):
        self.tr.capture.attach()

    def detach(self):
        self.tr.capture.detach()

    def step(self, i):
        with self.tr.step(self.idx, padding_mask=self.mask, step=i) as rec:
            losses = causal_lm_losses(
                self.model(input_ids=self.ids, attention_mask=self.mask).logits, self.labels
            )
            losses.mean().backward()
            rec.losses = losses

    def excluded_s(self):
        # the flushes, the K-FAC statistics batches and the default factors' projections (once
        # per buffer of steps): periodic, timed where they run, amortised by the harness
        return self.tr.buffer.flush_s + self._cov["covariance_s"] + self.tr.capture.deferred_write_s

    def close(self):
        self.tr.close()


def run_interleaved(
    arms: list[Arm],
    opts: dict[str, torch.optim.Optimizer],
    repeats: int = 24,
    steps_per_arm: int = 1,
    warmup: int = 2,
    progress: bool = True,
) -> dict:
    """Interleave ``arms`` (first must be ``plain``); ``opts[arm.name]`` is stepped after each step."""
    assert arms[0].name == "plain"
    names = [a.name for a in arms]

    def one(arm: Arm, i: int):
        opt = opts[arm.name]
        arm.attach()
        e0 = arm.excluded_s()
        t0, c0 = time.perf_counter(), time.process_time()
        for j in range(steps_per_arm):
            arm.step(i * steps_per_arm + j)
            opt.step()
            opt.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ex = arm.excluded_s() - e0
        arm.detach()
        k = steps_per_arm
        return wall * 1e3 / k, cpu * 1e3 / k, ex * 1e3 / k

    load_before = os.getloadavg()
    for i in range(warmup):
        for arm in arms:
            one(arm, i)
    orders = list(itertools.permutations(arms))
    rng = np.random.default_rng(0)
    rng.shuffle(orders)  # with >3 arms the 24+ permutations are cycled in a shuffled order
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    excl = {n: [] for n in names}
    t_start = time.time()
    for r in range(repeats):
        for arm in orders[r % len(orders)]:
            w, c, e = one(arm, warmup + r)
            times[arm.name].append(w)
            cpu[arm.name].append(c)
            excl[arm.name].append(e)
        if progress:
            print(
                f"round {r + 1}/{repeats}  "
                + "  ".join(f"{n} {times[n][-1]:.0f}ms" for n in names),
                file=sys.stderr,
                flush=True,
            )
    n_steps = repeats * steps_per_arm
    close_ms = {}
    for arm in arms:
        t0 = time.perf_counter()
        arm.close()
        close_ms[arm.name] = (time.perf_counter() - t0) * 1e3
    plain = np.array(times["plain"])
    plain_cpu = np.array(cpu["plain"])
    out = {
        "arms": {},
        "plain_step_ms": float(np.median(plain)),
        "repeats": repeats,
        "steps_per_arm": steps_per_arm,
        "warmup": warmup,
        "elapsed_s": time.time() - t_start,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    pct = lambda x: 100 * float(x)  # noqa: E731
    for n in names[1:]:
        amort = (float(np.sum(excl[n])) + close_ms[n]) / n_steps
        adj = np.array(times[n]) - np.array(excl[n]) + amort
        adj_cpu = np.array(cpu[n]) - np.array(excl[n]) + amort
        ratio = adj / plain - 1
        cratio = adj_cpu / plain_cpu - 1
        out["arms"][n] = {
            "overhead_pct": pct(np.median(ratio)),
            "overhead_ci95_pct": [pct(v) for v in bootstrap_ci(ratio)],
            "cpu_overhead_pct": pct(np.median(cratio)),
            "cpu_overhead_ci95_pct": [pct(v) for v in bootstrap_ci(cratio)],
            "overhead_mean_pct": pct(np.mean(adj) / np.mean(plain) - 1),
            "step_ms": float(np.median(adj)),
            "overhead_ms_per_step": float(np.median(adj - plain)),
            "amortised_ms_per_step": amort,
            "close_ms": close_ms[n],
            "pair_overheads_pct": [round(pct(x), 3) for x in ratio],
        }
    out["raw_ms"] = {n: [round(x, 3) for x in times[n]] for n in names}
    return out


def versions() -> dict:
    import importlib.metadata as md

    v = {"python": platform.python_version(), "torch": torch.__version__}
    for d in [
        "logix-ai",
        "bergson",
        "kronfluence",
        "traker",
        "dattri",
        "transformers",
        "traceprop",
        "peft",
    ]:
        with contextlib.suppress(md.PackageNotFoundError):
            v[d] = md.version(d)
    return v


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    result = {
        "config": CFG,
        "versions": versions(),
        "cmd": " ".join([Path(sys.executable).parent.parent.name] + sys.argv),
        **result,
    }
    p = RESULTS / f"{name}.json"
    p.write_text(json.dumps(result, indent=1))
    return p


def summary(result: dict) -> str:
    lines = [
        f"plain step {result['plain_step_ms']:.1f} ms (median of {result['repeats']} interleaved rounds)"
    ]
    for n, a in result["arms"].items():
        ci = a["overhead_ci95_pct"]
        cci = a["cpu_overhead_ci95_pct"]
        lines.append(
            f"{n:<22} step {a['step_ms']:7.1f} ms  overhead {a['overhead_pct']:+7.2f} % (95% CI {ci[0]:+.2f} .. {ci[1]:+.2f})"
            f"  cpu {a['cpu_overhead_pct']:+7.2f} % ({cci[0]:+.2f} .. {cci[1]:+.2f})  [{a['overhead_ms_per_step']:.2f} ms/step]"
        )
    lines.append(
        f"load average {result['loadavg_before_after'][0]} -> {result['loadavg_before_after'][1]}"
    )
    return "\n".join(lines)


def tmpdir(prefix: str) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=prefix)


def readiness(res: dict, posthoc_s: float, steps: int) -> dict:
    """Traceprop's inline overhead for one epoch (``steps`` steps) vs one post-hoc pass.

    ``overhead_ms_per_step`` is the median paired difference; the conservative variant uses
    the upper end of the overhead's 95 % interval times the plain step time.
    """
    tp = res["arms"]["traceprop"]
    inline_s = tp["overhead_ms_per_step"] * steps / 1e3
    upper_ms = tp["overhead_ci95_pct"][1] / 100 * res["plain_step_ms"]
    upper_s = upper_ms * steps / 1e3
    nan = float("nan")
    return {
        "epoch_steps": steps,
        "traceprop_overhead_ms_per_step": tp["overhead_ms_per_step"],
        "traceprop_inline_overhead_s_one_epoch": inline_s,
        "traceprop_inline_overhead_s_one_epoch_ci_upper": upper_s,
        "posthoc_over_inline_ratio": posthoc_s / inline_s if inline_s > 0 else nan,
        "posthoc_over_inline_ratio_ci_upper": posthoc_s / upper_s if upper_s > 0 else nan,
    }
