"""The default record's three batched products, whole batch against a few examples at a time.

The rank-1 record's backward hook (``capture/hooks.py``, ``Capture._backward_full``) runs three
``torch.bmm`` per layer over the whole micro-batch: ``σ = 1ᵀ g``, ``c = g σ`` and ``w = cᵀ a``. It
reads ``g`` twice, and on a 2-core box a 1024-wide layer's ``g`` (4 MiB at 8 × 128 tokens) has left
L2 by its second read. Taking a few examples at a time keeps one chunk's ``g`` in L2 between its
two reads, at the price of more calls. This times both on the bench's 17 layer shapes
(``traceprop bench overhead``'s default model: 4 blocks of width 256, vocabulary 1024), one torch
thread, with L2 evicted before each layer as in the step, and checks that every order gives the
same numbers.

Usage: ``python benchmarks/products_order.py [--repeats 30] [--batch 8] [--seq 128]``. Prints the
median over interleaved repeats of the summed time of the 17 layers per order, and its ratio to
the whole-batch order measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from traceprop_engine.bench.machine import cpu_model

WIDTH, MLP, VOCAB, BLOCKS = 256, 1024, 1024, 4
SHAPES = [(WIDTH, 3 * WIDTH), (WIDTH, WIDTH), (WIDTH, MLP), (MLP, WIDTH)] * BLOCKS + [
    (WIDTH, VOCAB)
]
EVICT_BYTES = 8 << 20  # larger than a core's L2 on the boxes measured (1–2.5 MiB)


def products(a, g, ones, sigma, w, chunk: int) -> None:
    """``σ``, ``c`` and ``w`` of ``chunk`` examples per call (``chunk = B``: today's hook)."""
    for e in range(0, g.shape[0], chunk):
        ge, se = g[e : e + chunk], sigma[e : e + chunk]
        torch.bmm(ones[e : e + chunk], ge, out=se)
        c = torch.bmm(se, ge.transpose(1, 2))
        torch.bmm(c, a[e : e + chunk], out=w[e : e + chunk])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, t = args.batch, args.seq
    data = [(torch.randn(b, t, d_in), torch.randn(b, t, d_out)) for d_in, d_out in SHAPES]
    ones = torch.ones(b, 1, t)
    evict = torch.empty(EVICT_BYTES // 4)
    chunks = sorted({b, *(c for c in (1, 2, 4) if c < b)}, reverse=True)

    def outputs(chunk: int):
        out = []
        for a, g in data:
            sigma, w = torch.empty(b, 1, g.shape[2]), torch.empty(b, 1, a.shape[2])
            products(a, g, ones, sigma, w, chunk)
            out.append((sigma, w))
        return out

    want = outputs(b)
    for chunk in chunks[1:]:
        for (s0, w0), (s1, w1) in zip(want, outputs(chunk), strict=True):
            torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-5 * float(s0.abs().max()))
            torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-5 * float(w0.abs().max()))
    scratch = {
        id(g): (torch.empty(b, 1, g.shape[2]), torch.empty(b, 1, a.shape[2])) for a, g in data
    }
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for r in range(args.repeats):
        for chunk in chunks[r % len(chunks) :] + chunks[: r % len(chunks)]:  # rotate the order
            total = 0.0
            for a, g in data:
                evict.fill_(1.0)  # out of L2, as the rest of the step leaves it
                g.mul_(1.0)  # g just written by the layer's backward, as in the hook
                sigma, w = scratch[id(g)]
                t0 = time.perf_counter()
                products(a, g, ones, sigma, w, chunk)
                total += time.perf_counter() - t0
            times[chunk].append(total * 1e3)
    base = statistics.median(times[b])
    print(f"CPU: {cpu_model()}; {args.repeats} interleaved repeats; B={b}, T={t}, 17 layers")
    for chunk in chunks:
        med = statistics.median(times[chunk])
        label = "whole batch (the hook)" if chunk == b else f"{chunk} example(s) a call"
        print(f"  {label:28s} {med:7.2f} ms   x{med / base:.3f}")


if __name__ == "__main__":
    main()
