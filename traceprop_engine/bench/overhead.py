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

Honest accounting of the flushes and the K-FAC statistics. ``buffer_records`` is small (256 by
default, one flush every 32 steps at batch 8), so flushes happen inside the timed loop, and the
full-space factors accumulate the K-FAC statistics ``A``, ``S`` from every
``covariance_stride``-th batch only (32 by default: a projection of every token of that batch).
A median of per-round ratios would silently drop the few rounds that contain either, so each
tracked step's time is taken *without* the flush and the statistics it may contain (both timed
where they run), and their cost over the arm's timed rounds is amortised over the arm's timed
steps and added to every step (``overhead_pct``: the per-step cost of a run;
``flush_ms_per_step`` and ``covariance_batch_ms_per_step`` say how much of it they are). The
final flush, covariance write, store digest and close happen once per run, whatever its
length: they are reported apart (``close_ms``) and, as an upper bound for a run as short as
this bench, amortised over its steps (``overhead_with_close_pct``; a 1000-step run pays a
twentieth of that). The HDF5 write itself runs on the background writer thread; its thread CPU
time is reported (``writer_ms_per_step``) and ``overhead_sync_writer_pct`` adds it (and the
close) to the step as if the write were synchronous (an upper bound for a machine without a
spare core).

The default factors' projections (:class:`~traceprop_engine.capture.project.DeferredFactors`)
run once per buffer of steps (before its flush, or when their scratch is full): timed where they
run and spread over the steps the same way (``projection_ms_per_step``).

``covariance_pct`` is the median of the paired ratios ``tracked/logging - 1``.

Storage. ``bytes_per_example`` is the steady-state store size of one record: per sketch dataset
(and per record-metadata dataset) the HDF5 storage size divided by the rows its allocated chunks
hold (:func:`traceprop_engine.store.sizes.steady_state_bytes`). HDF5 allocates whole chunks
(~1 MiB, up to 4096 rows), so a short benchmark's file is mostly empty chunk space; dividing
the file size by a few hundred records (``short_run_file_bytes_per_example``) says nothing about
a real run. For uncompressed sketches
the steady-state figure equals the nominal ``4 · k_in · k_out`` per layer; with compression it
is the measured compressed size per row.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..capture.tracker import Tracker
from ..settings import TrackSettings, TrainSettings
from ..store.sizes import steady_state_bytes
from ..training.command import train_argv
from ..training.losses import causal_lm_losses
from ..training.models import tiny_config

log = logging.getLogger(__name__)


ARMS = ("plain", "logging", "tracked")


def median_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median of ``x`` (``n`` resamples)."""
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


def time_covariance_batches(tr: Tracker, acc: dict) -> None:
    """Count the wall time of the K-FAC statistics of the due batches (every
    ``covariance_stride``-th, in the backward hooks) in ``acc['covariance_s']``."""
    cap = tr.capture
    project = cap._covariance_projected

    def timed(layer, a, g, scale):
        t0 = time.perf_counter()
        try:
            project(layer, a, g, scale)
        finally:
            acc["covariance_s"] += time.perf_counter() - t0

    cap._covariance_projected = timed  # looked up on the instance by _covariance_if_due


class _Arms:
    """One model, one batch, and the trackers of the ``logging`` and ``tracked`` arms (hooks
    attached only while their arm runs)."""

    def __init__(self, shape: dict, track: dict, folder: Path, steps_per_arm: int, seed: int):
        from transformers import GPTNeoXForCausalLM

        torch.manual_seed(seed)
        layers, width, vocab = shape["layers"], shape["width"], shape["vocab"]
        batch, seq = shape["batch"], shape["seq"]
        self.model = GPTNeoXForCausalLM(tiny_config(vocab, width, layers, max(seq, 64)))
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (batch, seq), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.labels = self.ids.clone()
        self.example_index = np.arange(batch)
        self.steps_per_arm = steps_per_arm
        # the batch's tokens are the training targets, as `traceprop train` passes them, so the
        # LM head gets its vocabulary rows like a default run's (same shapes, same cost)
        targets = [row[1:].numpy() for row in self.labels]
        # every token a target is free text: the records stay rank 1 (what answers and labels
        # get) unless the caller asks for free_text_rank (the free-text default: 16)
        track = {"free_text_rank": 0, **track}
        self.trackers = {
            "tracked": Tracker(
                self.model,
                folder / "tracked.h5",
                TrackSettings(covariance=True, **track),
                targets=targets,
            ),
            "logging": Tracker(
                self.model,
                folder / "logging.h5",
                TrackSettings(covariance=False, **track),
                targets=targets,
            ),
        }
        self.writer_acc = {name: {"writer_s": 0.0} for name in self.trackers}
        self.covariance_acc = {name: {"covariance_s": 0.0} for name in self.trackers}
        for name, tr in self.trackers.items():
            _timed_writer(tr, self.writer_acc[name])
            time_covariance_batches(tr, self.covariance_acc[name])

    def _train_step(self, tr: Tracker | None, i: int) -> None:
        logits = lambda: self.model(input_ids=self.ids, attention_mask=self.mask).logits  # noqa: E731
        if tr is None:
            causal_lm_losses(logits(), self.labels).mean().backward()
        else:
            with tr.step(self.example_index, padding_mask=self.mask, step=i) as rec:
                losses = causal_lm_losses(logits(), self.labels)
                losses.mean().backward()
                rec.losses = losses
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, arm: str, i: int) -> tuple[float, float, float, float, float]:
        """(wall ms, process CPU ms, and the flush, covariance-batch and factor-projection ms
        inside the step) per training step."""
        tr = self.trackers.get(arm)
        if tr is not None:
            tr.capture.attach()
            f0 = tr.buffer.flush_s
            v0 = self.covariance_acc[arm]["covariance_s"]
            p0 = tr.capture.deferred_write_s
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(self.steps_per_arm):
            self._train_step(tr, i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        flush = cov = proj = 0.0
        if tr is not None:
            flush = tr.buffer.flush_s - f0
            cov = self.covariance_acc[arm]["covariance_s"] - v0
            proj = tr.capture.deferred_write_s - p0
            tr.capture.detach()
        k = self.steps_per_arm
        return wall * 1e3 / k, cpu * 1e3 / k, flush * 1e3 / k, cov * 1e3 / k, proj * 1e3 / k

    def writer_s(self) -> dict[str, float]:
        return {name: acc["writer_s"] for name, acc in self.writer_acc.items()}

    def close(self) -> dict[str, float]:
        """Close every tracker; the final flush + covariance + close (ms) is part of the arm's cost."""
        final_flush_ms = {}
        for name, tr in self.trackers.items():
            t0 = time.perf_counter()
            tr.close()
            final_flush_ms[name] = (time.perf_counter() - t0) * 1e3
        return final_flush_ms


_MEASURES = ("wall", "cpu", "flush", "covariance", "projection")


def _interleave(arms: _Arms, repeats: int, first_step: int, progress: bool) -> dict[str, dict]:
    """``repeats`` rounds of one step per arm, cycling through all six orders of the arms.

    Returns ``{"wall"|"cpu"|"flush"|"covariance"|"projection": {arm: [ms per round]}}``."""
    got = {what: {a: [] for a in ARMS} for what in _MEASURES}
    orders = list(itertools.permutations(ARMS))  # all six orders, cycled
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=repeats, desc="bench overhead", unit="round")
    for r in range(repeats):
        for arm in orders[r % len(orders)]:
            for what, v in zip(_MEASURES, arms.step(arm, first_step + r), strict=True):
                got[what][arm].append(v)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return got


def _overheads(
    got: dict, final_flush_ms: dict, writer_ms: dict, n_steps: int
) -> tuple[dict, dict[str, np.ndarray]]:
    """Paired-ratio overheads (percent) of the tracked arms against the plain one, and the
    per-round ratios ``arm/plain - 1``."""
    times, cpu = got["wall"], got["cpu"]
    plain = np.array(times["plain"])
    plain_cpu = np.array(cpu["plain"])
    adj, adj_cpu, amort, cov_amort, proj_amort = {}, {}, {}, {}, {}
    with_close = {}
    for a in ("tracked", "logging"):
        # the flushes of the timed rounds recur every buffer_records / batch steps, the K-FAC
        # statistics every covariance_stride-th batch: a median of per-round ratios would drop
        # the few rounds holding them, so each is taken out of its round and its total spread
        # over the steps; the final flush + covariance + close happens once per run: reported
        # apart (close_ms) and, for the record, amortised over this bench's few steps too
        inflush, incov = np.array(got["flush"][a]), np.array(got["covariance"][a])
        inproj = np.array(got["projection"][a])
        amort[a] = float(np.sum(inflush)) / n_steps
        cov_amort[a] = float(np.sum(incov)) / n_steps
        proj_amort[a] = float(np.sum(inproj)) / n_steps
        spread = amort[a] + cov_amort[a] + proj_amort[a] - inflush - incov - inproj
        adj[a] = np.array(times[a]) + spread
        adj_cpu[a] = np.array(cpu[a]) + spread
        with_close[a] = adj[a] + final_flush_ms[a] / n_steps
    ratio = {a: adj[a] / plain - 1 for a in adj}
    cpu_ratio = {a: adj_cpu[a] / plain_cpu - 1 for a in adj_cpu}
    cov_ratio = adj["tracked"] / adj["logging"] - 1
    sync_ratio = (with_close["tracked"] + writer_ms["tracked"] / n_steps) / plain - 1
    ci = {a: median_ci(ratio[a]) for a in ratio}
    pct = lambda x: 100 * float(x)  # noqa: E731
    result = {
        "overhead_pct": pct(np.median(ratio["tracked"])),
        "overhead_ci95_pct": [pct(v) for v in ci["tracked"]],
        "logging_pct": pct(np.median(ratio["logging"])),
        "logging_ci95_pct": [pct(v) for v in ci["logging"]],
        "covariance_pct": pct(np.median(cov_ratio)),
        "covariance_ci95_pct": [pct(v) for v in median_ci(cov_ratio)],
        "cpu_overhead_pct": pct(np.median(cpu_ratio["tracked"])),
        "cpu_overhead_ci95_pct": [pct(v) for v in median_ci(cpu_ratio["tracked"])],
        "cpu_logging_pct": pct(np.median(cpu_ratio["logging"])),
        "overhead_sync_writer_pct": pct(np.median(sync_ratio)),
        "overhead_mean_pct": pct(np.mean(adj["tracked"]) / np.mean(plain) - 1),
        "overhead_with_close_pct": pct(np.median(with_close["tracked"] / plain - 1)),
        "close_ms": final_flush_ms,
        "plain_step_ms": float(np.median(plain)),
        "tracked_step_ms": float(np.median(adj["tracked"])),
        "logging_step_ms": float(np.median(adj["logging"])),
        "flush_ms_per_step": amort,
        "flush_ms_in_loop": {a: float(np.sum(got["flush"][a])) for a in amort},
        "covariance_batch_ms_per_step": cov_amort,
        "projection_ms_per_step": proj_amort,
        "n_projections_in_loop": {
            a: int(np.count_nonzero(got["projection"][a])) for a in proj_amort
        },
        "n_covariance_batches_in_loop": {
            a: int(np.count_nonzero(got["covariance"][a])) for a in cov_amort
        },
        "final_flush_ms": final_flush_ms,
        "writer_ms_per_step": {a: writer_ms[a] / n_steps for a in writer_ms},
        "n_flushes_in_loop": {a: int(np.count_nonzero(got["flush"][a])) for a in amort},
    }
    return result, ratio


_TRAIN = TrainSettings(data="-", out="-")  # the bench measures the default tiny training shape


def run_overhead_bench(
    *,
    layers: int = _TRAIN.tiny_layers,
    width: int = _TRAIN.tiny_width,
    vocab: int = _TRAIN.tiny_vocab,
    batch: int = _TRAIN.batch_size,
    seq: int = _TRAIN.max_length,
    scope: str | None = None,
    sketch: str | None = None,
    k_in: int | None = None,
    k_out: int | None = None,
    rank: int | None = None,
    factor_dtype: str | None = None,
    dense_k: int | None = None,
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

    ``scope``, ``sketch``, ``k_in``, ``k_out``, ``rank``, ``factor_dtype``, ``dense_k`` default to
    :class:`TrackSettings`' defaults, so the bench measures the default configuration unless
    told otherwise, except ``free_text_rank``: the batch's every token is a target, so a default
    run would record it at rank 16; the bench times rank 1 (what answers and labels get) unless
    ``track_extra`` asks for ``free_text_rank``."""
    d = TrackSettings().to_dict()
    given = dict(
        scope=scope,
        k_in=k_in,
        k_out=k_out,
        rank=rank,
        factor_dtype=factor_dtype,
        sketch=sketch,
        dense_k=dense_k,
    )
    track = {k: d[k] if v is None else v for k, v in given.items()}
    track.update(buffer_records=buffer_records, **(track_extra or {}), seed=seed)
    torch.set_num_threads(threads)
    shape = dict(layers=layers, width=width, vocab=vocab, batch=batch, seq=seq)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="traceprop-bench-") as tmp:
        arms = _Arms(shape, track, Path(tmp), steps_per_arm, seed)
        for i in range(warmup):
            for arm in ARMS:
                arms.step(arm, i)
        writer0 = arms.writer_s()  # after the warm-up: its appends are not timed
        got = _interleave(arms, repeats, warmup, progress)
        final_flush_ms = arms.close()
        writer_ms = {a: (s - writer0[a]) * 1e3 for a, s in arms.writer_s().items()}
        storage = steady_state_bytes(Path(tmp) / "tracked.h5")
    result, pairs = _overheads(got, final_flush_ms, writer_ms, repeats * steps_per_arm)
    return {
        **result,
        **{k: v for k, v in storage.items() if k != "n_records"},
        "n_records_tracked": storage["n_records"],
        "repeats": repeats,
        "steps_per_arm": steps_per_arm,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "config": {
            **shape,
            **{k: track[k] for k in ("scope", "sketch", "k_in", "k_out", "rank")},
            **(track_extra or {}),
            "factor_dtype": track["factor_dtype"],
            "threads": threads,
            "buffer_records": buffer_records,
            "warmup": warmup,
        },
        "pair_overheads_pct": [round(100 * float(x), 3) for x in pairs["tracked"]],
        "pair_logging_pct": [round(100 * float(x), 3) for x in pairs["logging"]],
    }


def run_rss_bench(data: str, epochs: int = 1, extra: list[str] | None = None) -> dict:
    """Peak RSS of ``traceprop train`` with and without tracking, each in its own process.

    Each child's own peak comes from ``os.wait4`` (``RUSAGE_CHILDREN`` is a running maximum over
    all children, which would hide a tracked peak below the plain one).
    """
    out = {}
    with tempfile.TemporaryDirectory(prefix="traceprop-rss-") as tmp:
        for arm in ("plain", "tracked"):
            cmd = train_argv(
                {
                    "data": data,
                    "out": Path(tmp) / arm,
                    "epochs": epochs,
                    "threads": 1,
                    "no_track": arm == "plain",
                }
            ) + list(extra or [])
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
        f"tracked step   {r['tracked_step_ms']:.1f} ms (amortised: flushes "
        f"{r['flush_ms_per_step']['tracked']:.3f} ms/step, K-FAC statistics "
        f"{r.get('covariance_batch_ms_per_step', {}).get('tracked', 0.0):.3f} ms/step from "
        f"{r.get('n_covariance_batches_in_loop', {}).get('tracked', 0)} batches, factor "
        f"projections {r.get('projection_ms_per_step', {}).get('tracked', 0.0):.3f} ms/step)",
        f"close          {r['close_ms']['tracked']:.1f} ms once per run (final flush, covariance, "
        f"digest); amortised over these {r['repeats'] * r['steps_per_arm']} steps: "
        f"{r['overhead_with_close_pct']:+.2f} %",
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
