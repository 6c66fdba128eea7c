"""``traceprop bench overhead``: plain vs tracked training steps, interleaved on one model.

Protocol (DESIGN.md §7): one torch thread; identical inputs for every arm; warm-up first; the
same model object with the hooks attached (tracked arms) or detached (plain arm); many short
alternations whose order rotates (ABC, CBA, BCA, ...); the overhead is the median of paired
ratios ``tracked/plain - 1`` within each round, with a bootstrap 95 % interval; process CPU time
is reported beside wall time. Arms:

- ``plain``: the training step with no hooks;
- ``logging``: hooks + sketches into the device buffer + flushes to the HDF5 writer, no covariance;
- ``tracked``: logging + inline K-FAC covariance (the default configuration).

``covariance_pct`` is ``overhead_pct - logging_pct``.
"""

from __future__ import annotations

import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .losses import causal_lm_losses
from .models import tiny_config
from .settings import TrackSettings
from .tracker import Tracker

log = logging.getLogger(__name__)


def _bootstrap_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def run_overhead_bench(
    *,
    layers: int = 4,
    width: int = 256,
    vocab: int = 1024,
    batch: int = 8,
    seq: int = 128,
    scope: str = "all",
    sketch: str = "factored",
    k_in: int = 8,
    k_out: int = 8,
    dense_k: int = 512,
    repeats: int = 40,
    steps_per_arm: int = 1,
    warmup: int = 3,
    buffer_records: int = 256,
    threads: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Measure the per-step overhead of tracking; returns the JSON-ready result dict."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    from transformers import GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(tiny_config(vocab, width, layers, max(seq, 64)))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    example_index = np.arange(batch)

    tmp = tempfile.TemporaryDirectory(prefix="traceprop-bench-")
    common = dict(scope=scope, k_in=k_in, k_out=k_out, sketch=sketch, dense_k=dense_k, buffer_records=buffer_records, seed=seed)
    trackers = {
        "tracked": Tracker(model, Path(tmp.name) / "tracked.h5", TrackSettings(covariance=True, **common)),
        "logging": Tracker(model, Path(tmp.name) / "logging.h5", TrackSettings(covariance=False, **common)),
    }

    def step(arm: str, i: int) -> tuple[float, float]:
        tr = trackers.get(arm)
        if tr is not None:
            tr.capture.attach()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps_per_arm):
            if tr is None:
                causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels).mean().backward()
            else:
                with tr.step(example_index, token_mask=mask, step=i) as rec:
                    losses = causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
                    losses.mean().backward()
                    rec.losses = losses
            opt.step()
            opt.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if tr is not None:
            tr.capture.detach()
        return wall * 1e3 / steps_per_arm, cpu * 1e3 / steps_per_arm

    arms = ["plain", "logging", "tracked"]
    for i in range(warmup):
        for arm in arms:
            step(arm, i)
    times = {a: [] for a in arms}
    cpu = {a: [] for a in arms}
    orders = [arms, arms[::-1], arms[1:] + arms[:1], (arms[1:] + arms[:1])[::-1], arms[2:] + arms[:2], (arms[2:] + arms[:2])[::-1]]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=repeats, desc="bench overhead", unit="round")
    for r in range(repeats):
        for arm in orders[r % len(orders)]:
            w, c = step(arm, r)
            times[arm].append(w)
            cpu[arm].append(c)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    flush_ms = {}
    for name, tr in trackers.items():
        t0 = time.perf_counter()
        tr.close()
        flush_ms[name] = (time.perf_counter() - t0) * 1e3  # the final flush, amortised below
    plain = np.array(times["plain"])
    n_steps = repeats * steps_per_arm
    ratio = {a: np.array(times[a]) / plain - 1 for a in ("tracked", "logging")}
    # the final flush/close belongs to the tracked arms too: amortise it over their steps
    for a in ratio:
        ratio[a] = ratio[a] + (flush_ms[a] / n_steps) / plain
    cpu_ratio = np.array(cpu["tracked"]) / np.array(cpu["plain"]) - 1

    import h5py

    with h5py.File(Path(tmp.name) / "tracked.h5", "r") as f:
        n_rec = int(f.attrs["n_records"])
        sketch_bytes = sum(f["layers"][k]["sketch"].id.get_storage_size() for k in f["layers"])
        n_layers = len(f["layers"])
        nominal = sum(int(np.prod(f["layers"][k]["sketch"].shape[1:])) * 4 for k in f["layers"])
    file_bytes = os.path.getsize(Path(tmp.name) / "tracked.h5")
    tmp.cleanup()
    lo, hi = _bootstrap_ci(ratio["tracked"])
    llo, lhi = _bootstrap_ci(ratio["logging"])
    result = {
        "overhead_pct": 100 * float(np.median(ratio["tracked"])),
        "overhead_ci95_pct": [100 * lo, 100 * hi],
        "logging_pct": 100 * float(np.median(ratio["logging"])),
        "logging_ci95_pct": [100 * llo, 100 * lhi],
        "covariance_pct": 100 * float(np.median(ratio["tracked"]) - np.median(ratio["logging"])),
        "cpu_overhead_pct": 100 * float(np.median(cpu_ratio)),
        "plain_step_ms": float(np.median(plain)),
        "tracked_step_ms": float(np.median(times["tracked"])),
        "logging_step_ms": float(np.median(times["logging"])),
        "final_flush_ms": flush_ms,
        "bytes_per_example": sketch_bytes / max(n_rec, 1),
        "bytes_per_example_nominal": nominal,
        "bytes_per_example_per_layer": sketch_bytes / max(n_rec, 1) / n_layers,
        "store_file_bytes_per_example": file_bytes / max(n_rec, 1),
        "n_layers": n_layers,
        "repeats": repeats,
        "steps_per_arm": steps_per_arm,
        "config": {
            "layers": layers, "width": width, "vocab": vocab, "batch": batch, "seq": seq, "scope": scope,
            "sketch": sketch, "k_in": k_in, "k_out": k_out, "threads": threads, "buffer_records": buffer_records,
        },
        "pair_overheads_pct": [round(100 * float(x), 3) for x in ratio["tracked"]],
    }
    return result


def run_rss_bench(data: str, epochs: int = 1, extra: list[str] | None = None) -> dict:
    """Peak RSS of ``traceprop train`` with and without tracking, each in its own process."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="traceprop-rss-") as tmp:
        for arm, flags in (("plain", ["--no-track"]), ("tracked", [])):
            cmd = [sys.executable, "-m", "traceprop_engine", "train", "--data", data, "--out", str(Path(tmp) / arm),
                   "--epochs", str(epochs), "--threads", "1", *flags, *(extra or [])]
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            # ru_maxrss of children is a running max; run plain first so a larger tracked peak shows
            out[f"{arm}_peak_rss_mb"] = max(before, after) / 1024
    out["rss_ratio"] = out["tracked_peak_rss_mb"] / out["plain_peak_rss_mb"]
    return out


def summarize(result: dict) -> str:
    r = result
    lines = [
        f"plain step     {r['plain_step_ms']:.1f} ms (median of {r['repeats']} interleaved rounds)",
        f"tracked step   {r['tracked_step_ms']:.1f} ms",
        f"overhead       {r['overhead_pct']:+.2f} %  (95% CI {r['overhead_ci95_pct'][0]:+.2f} .. {r['overhead_ci95_pct'][1]:+.2f})",
        f"  logging      {r['logging_pct']:+.2f} %  (95% CI {r['logging_ci95_pct'][0]:+.2f} .. {r['logging_ci95_pct'][1]:+.2f})",
        f"  covariance   {r['covariance_pct']:+.2f} %",
        f"cpu-time overhead {r['cpu_overhead_pct']:+.2f} %",
        f"store          {r['bytes_per_example']:.0f} bytes/example ({r['bytes_per_example_per_layer']:.0f} per layer; nominal {r['bytes_per_example_nominal']})",
    ]
    _ = statistics  # medians above are numpy's
    return "\n".join(lines)
