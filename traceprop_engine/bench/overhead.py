"""``traceprop bench overhead``: plain vs tracked training steps, interleaved on one model.

Protocol (DESIGN.md §7): one torch thread; identical inputs for every arm; warm-up first; the
same model object with the hooks attached (tracked arms) or detached (plain arm); many short
alternations whose order cycles through all six orders of the three arms (so every arm runs
first, second and third equally often); the overhead is the median of paired ratios
``arm/plain - 1`` within each round, with a bootstrap 95 % interval; process CPU time is
reported beside wall time. Arms:

- ``plain``: the training step with no hooks;
- ``logging``: hooks + sketches into the device buffer + flushes to the HDF5 writer, no covariance;
- ``tracked``: logging + inline K-FAC covariance (the default configuration).

Honest accounting of the flushes. ``buffer_records`` is small (256 by default, one flush every
32 steps at batch 8), so flushes happen inside the timed loop. A median of per-round ratios
would silently drop the few rounds that contain a flush, so each tracked step's time is taken
*without* the flush it may contain, and the whole flush cost of the arm (every flush during the
timed rounds plus the final flush/close) is amortised over the arm's timed steps and added to
every step. The HDF5 write itself runs on the background writer thread; its thread CPU time is
reported (``writer_ms_per_step``) and ``overhead_sync_writer_pct`` adds it to the step as if
the write were synchronous (an upper bound for a machine without a spare core).

``covariance_pct`` is the median of the paired ratios ``tracked/logging - 1``.

Storage. ``bytes_per_example`` is the steady-state store size of one record: per sketch dataset
(and per record-metadata dataset) the HDF5 storage size divided by the rows its allocated chunks
hold. HDF5 allocates whole chunks (``store.format.chunk_rows``: ~128 KiB, up to 4096 rows), so a short
benchmark's file is mostly empty chunk space; dividing the file size by a few hundred records
(``short_run_file_bytes_per_example``) says nothing about a real run. For uncompressed sketches
the steady-state figure equals the nominal ``4 · k_in · k_out`` per layer; with compression it
is the measured compressed size per row.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..capture.tracker import Tracker
from ..settings import TrackSettings
from ..training.losses import causal_lm_losses
from ..training.models import tiny_config

log = logging.getLogger(__name__)


def _bootstrap_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _timed_writer(tr: Tracker, acc: dict) -> None:
    """Count the writer thread's CPU time (the background HDF5 appends) in ``acc['writer_s']``."""
    append = tr.writer.append

    def timed(arrays, meta):
        c0 = time.thread_time()
        try:
            append(arrays, meta)
        finally:
            acc["writer_s"] += time.thread_time() - c0

    tr.writer.append = timed  # BackgroundSink looks the method up on the writer at call time


def _storage(path: Path) -> dict:
    """Steady-state bytes per record (storage per allocated chunk row), see the module doc."""
    import h5py

    from .. import constants as C

    def per_row(ds) -> float:
        rows = ds.chunks[0] if ds.chunks else max(ds.shape[0], 1)
        n_alloc = -(-ds.shape[0] // rows) * rows
        return ds.id.get_storage_size() / max(n_alloc, 1)

    with h5py.File(path, "r") as f:
        n_rec = int(f.attrs["n_records"])
        groups = [f[C.G_LAYERS][k] for k in sorted(f[C.G_LAYERS])]
        data = [  # a layer's record datasets: the full sketch, or its factors U and V
            [g[n] for n in (C.L_SKETCH, C.L_U, C.L_V, C.L_SCALE) if n in g] for g in groups
        ]
        sketch = [sum(per_row(ds) for ds in dss) for dss in data]
        nominal = [
            sum(int(np.prod(ds.shape[1:])) * ds.dtype.itemsize for ds in dss) for dss in data
        ]
        meta = sum(per_row(f[C.G_RECORDS][name]) for name in f[C.G_RECORDS])
        alloc_sketch = sum(ds.id.get_storage_size() for dss in data for ds in dss)
    return {
        "n_records": n_rec,
        "n_layers": len(groups),
        "bytes_per_example": sum(sketch) + meta,
        "bytes_per_example_sketch": sum(sketch),
        "bytes_per_example_per_layer": sum(sketch) / len(groups),
        "bytes_per_example_meta": meta,
        "bytes_per_example_nominal": sum(nominal),
        "storage_ratio_vs_nominal": sum(sketch) / sum(nominal),
        "short_run_sketch_bytes_per_example": alloc_sketch / max(n_rec, 1),
        "short_run_file_bytes_per_example": os.path.getsize(path) / max(n_rec, 1),
    }


def run_overhead_bench(
    *,
    layers: int = 4,
    width: int = 256,
    vocab: int = 1024,
    batch: int = 8,
    seq: int = 128,
    scope: str = "all",
    sketch: str = "factored",
    k_in: int | None = None,
    k_out: int | None = None,
    rank: int | None = None,
    factor_dtype: str | None = None,
    dense_k: int = 512,
    track_extra: dict | None = None,
    repeats: int = 40,
    steps_per_arm: int = 1,
    warmup: int = 3,
    buffer_records: int = 256,
    threads: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Measure the per-step overhead of tracking; returns the JSON-ready result dict.

    ``k_in``, ``k_out``, ``rank``, ``factor_dtype`` default to :class:`TrackSettings`' defaults,
    so the bench measures the default configuration unless told otherwise."""
    d = TrackSettings()
    k_in = d.k_in if k_in is None else k_in
    k_out = d.k_out if k_out is None else k_out
    rank = d.rank if rank is None else rank
    factor_dtype = d.factor_dtype.value if factor_dtype is None else factor_dtype
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
    load_before = os.getloadavg()

    tmp = tempfile.TemporaryDirectory(prefix="traceprop-bench-")
    common = dict(
        scope=scope,
        k_in=k_in,
        k_out=k_out,
        rank=rank,
        factor_dtype=factor_dtype,
        sketch=sketch,
        dense_k=dense_k,
        buffer_records=buffer_records,
        **(track_extra or {}),
        seed=seed,
    )
    trackers = {
        "tracked": Tracker(
            model, Path(tmp.name) / "tracked.h5", TrackSettings(covariance=True, **common)
        ),
        "logging": Tracker(
            model, Path(tmp.name) / "logging.h5", TrackSettings(covariance=False, **common)
        ),
    }
    writer_acc = {name: {"writer_s": 0.0} for name in trackers}
    for name, tr in trackers.items():
        _timed_writer(tr, writer_acc[name])

    def step(arm: str, i: int) -> tuple[float, float, float]:
        """(wall ms, process CPU ms, flush ms inside the step) per training step."""
        tr = trackers.get(arm)
        if tr is not None:
            tr.capture.attach()
            f0 = tr.buffer.flush_s
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps_per_arm):
            if tr is None:
                causal_lm_losses(
                    model(input_ids=ids, attention_mask=mask).logits, labels
                ).mean().backward()
            else:
                with tr.step(example_index, padding_mask=mask, step=i) as rec:
                    losses = causal_lm_losses(
                        model(input_ids=ids, attention_mask=mask).logits, labels
                    )
                    losses.mean().backward()
                    rec.losses = losses
            opt.step()
            opt.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        flush = 0.0
        if tr is not None:
            flush = tr.buffer.flush_s - f0
            tr.capture.detach()
        k = steps_per_arm
        return wall * 1e3 / k, cpu * 1e3 / k, flush * 1e3 / k

    arms = ["plain", "logging", "tracked"]
    for i in range(warmup):
        for arm in arms:
            step(arm, i)
    writer0 = {name: acc["writer_s"] for name, acc in writer_acc.items()}
    times = {a: [] for a in arms}
    cpu = {a: [] for a in arms}
    inflush = {a: [] for a in arms}
    orders = list(itertools.permutations(arms))  # all six orders, cycled
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=repeats, desc="bench overhead", unit="round")
    for r in range(repeats):
        for arm in orders[r % len(orders)]:
            w, c, f = step(arm, warmup + r)
            times[arm].append(w)
            cpu[arm].append(c)
            inflush[arm].append(f)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    n_steps = repeats * steps_per_arm
    final_flush_ms, writer_ms = {}, {}
    for name, tr in trackers.items():
        t0 = time.perf_counter()
        tr.close()  # the final flush + covariance + close: part of the arm's cost
        final_flush_ms[name] = (time.perf_counter() - t0) * 1e3
        writer_ms[name] = (writer_acc[name]["writer_s"] - writer0[name]) * 1e3
    plain = np.array(times["plain"])
    plain_cpu = np.array(cpu["plain"])
    adj, adj_cpu, amort = {}, {}, {}
    for a in ("tracked", "logging"):
        # flush time of the timed rounds (the final flush inside close() is counted once, here)
        in_loop = float(np.sum(inflush[a]))
        amort[a] = (in_loop + final_flush_ms[a]) / n_steps
        adj[a] = np.array(times[a]) - np.array(inflush[a]) + amort[a]
        adj_cpu[a] = np.array(cpu[a]) - np.array(inflush[a]) + amort[a]
    ratio = {a: adj[a] / plain - 1 for a in adj}
    cpu_ratio = {a: adj_cpu[a] / plain_cpu - 1 for a in adj_cpu}
    cov_ratio = adj["tracked"] / adj["logging"] - 1
    sync_ratio = (adj["tracked"] + writer_ms["tracked"] / n_steps) / plain - 1
    storage = _storage(Path(tmp.name) / "tracked.h5")
    tmp.cleanup()
    ci = {a: _bootstrap_ci(ratio[a]) for a in ratio}
    cov_ci = _bootstrap_ci(cov_ratio)
    cpu_ci = _bootstrap_ci(cpu_ratio["tracked"])
    pct = lambda x: 100 * float(x)  # noqa: E731
    result = {
        "overhead_pct": pct(np.median(ratio["tracked"])),
        "overhead_ci95_pct": [pct(v) for v in ci["tracked"]],
        "logging_pct": pct(np.median(ratio["logging"])),
        "logging_ci95_pct": [pct(v) for v in ci["logging"]],
        "covariance_pct": pct(np.median(cov_ratio)),
        "covariance_ci95_pct": [pct(v) for v in cov_ci],
        "cpu_overhead_pct": pct(np.median(cpu_ratio["tracked"])),
        "cpu_overhead_ci95_pct": [pct(v) for v in cpu_ci],
        "cpu_logging_pct": pct(np.median(cpu_ratio["logging"])),
        "overhead_sync_writer_pct": pct(np.median(sync_ratio)),
        "overhead_mean_pct": pct(np.mean(adj["tracked"]) / np.mean(plain) - 1),
        "plain_step_ms": float(np.median(plain)),
        "tracked_step_ms": float(np.median(adj["tracked"])),
        "logging_step_ms": float(np.median(adj["logging"])),
        "flush_ms_per_step": amort,
        "flush_ms_in_loop": {a: float(np.sum(inflush[a])) for a in amort},
        "final_flush_ms": final_flush_ms,
        "writer_ms_per_step": {a: writer_ms[a] / n_steps for a in writer_ms},
        "n_flushes_in_loop": {a: int(np.count_nonzero(inflush[a])) for a in amort},
        **{k: v for k, v in storage.items() if k != "n_records"},
        "n_records_tracked": storage["n_records"],
        "repeats": repeats,
        "steps_per_arm": steps_per_arm,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "config": {
            "layers": layers,
            "width": width,
            "vocab": vocab,
            "batch": batch,
            "seq": seq,
            "scope": scope,
            "sketch": sketch,
            "k_in": k_in,
            "k_out": k_out,
            "rank": rank,
            **(track_extra or {}),
            "factor_dtype": factor_dtype,
            "threads": threads,
            "buffer_records": buffer_records,
            "warmup": warmup,
        },
        "pair_overheads_pct": [round(pct(x), 3) for x in ratio["tracked"]],
        "pair_logging_pct": [round(pct(x), 3) for x in ratio["logging"]],
    }
    return result


def run_rss_bench(data: str, epochs: int = 1, extra: list[str] | None = None) -> dict:
    """Peak RSS of ``traceprop train`` with and without tracking, each in its own process.

    Each child's own peak comes from ``os.wait4`` (``RUSAGE_CHILDREN`` is a running maximum over
    all children, which would hide a tracked peak below the plain one).
    """
    out = {}
    with tempfile.TemporaryDirectory(prefix="traceprop-rss-") as tmp:
        for arm, flags in (("plain", ["--no-track"]), ("tracked", [])):
            cmd = [
                sys.executable,
                "-m",
                "traceprop_engine",
                "train",
                "--data",
                data,
                "--out",
                str(Path(tmp) / arm),
                "--epochs",
                str(epochs),
                "--threads",
                "1",
                *flags,
                *(extra or []),
            ]
            # stderr to a file, not a pipe: nobody reads a pipe during wait4, and a full one
            # would block the child in write() forever.
            err_path = Path(tmp) / f"{arm}.stderr"
            with open(err_path, "wb") as err_file:
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file)
                _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            err = err_path.read_text(errors="replace")
            if proc.returncode != 0:
                raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=err[-2000:])
            out[f"{arm}_peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux: KiB
    out["rss_ratio"] = out["tracked_peak_rss_mb"] / out["plain_peak_rss_mb"]
    return out


def summarize(result: dict) -> str:
    r = result
    ci = lambda k: f"(95% CI {r[k][0]:+.2f} .. {r[k][1]:+.2f})"  # noqa: E731
    lines = [
        f"plain step     {r['plain_step_ms']:.1f} ms (median of {r['repeats']} interleaved rounds)",
        f"tracked step   {r['tracked_step_ms']:.1f} ms (flushes amortised: {r['flush_ms_per_step']['tracked']:.3f} ms/step)",
        f"overhead       {r['overhead_pct']:+.2f} %  {ci('overhead_ci95_pct')}",
        f"  logging      {r['logging_pct']:+.2f} %  {ci('logging_ci95_pct')}",
        f"  covariance   {r['covariance_pct']:+.2f} %  {ci('covariance_ci95_pct')}",
        f"cpu-time overhead {r['cpu_overhead_pct']:+.2f} %  {ci('cpu_overhead_ci95_pct')}",
        f"with the HDF5 writer synchronous {r['overhead_sync_writer_pct']:+.2f} % "
        f"(writer {r['writer_ms_per_step']['tracked']:.3f} ms/step)",
        f"store          {r['bytes_per_example']:.0f} bytes/example steady state "
        f"({r['bytes_per_example_per_layer']:.0f} per layer x {r['n_layers']} + {r['bytes_per_example_meta']:.0f} record metadata; "
        f"sketch nominal {r['bytes_per_example_nominal']})",
        f"load average   {r['loadavg_before_after'][0]} -> {r['loadavg_before_after'][1]}",
    ]
    return "\n".join(lines)
