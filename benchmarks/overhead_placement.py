"""Where in the backward should the record's three products run? (EVAL.md §1n)

    python benchmarks/overhead_placement.py

The default tiny model's shape (GPT-NeoX, 4 layers × 256, vocabulary 1024, batch 8 × 128 tokens,
17 linear layers, one thread). Each step runs one of: no products; the products (σ = Σ_t g_t,
c = g σᵀ, w = Gᵀσ) in the output-gradient hook, where Traceprop runs them (``out``); or the same
products after the layer's own backward, in the weight's post-accumulate-grad hook, when the
weight-gradient GEMM has just read ``a`` and ``g`` (``post``). The three kinds of step are
interleaved; prints the median step, the median time inside the products, and each placement's
overhead against the steps without products."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

PLACEMENTS = ("none", "out", "post")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=70, help="steps of each kind")
    ap.add_argument("--warmup", type=int, default=5, help="rounds left out of the medians")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=256,
    )
    model = GPTNeoXForCausalLM(cfg)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    b, t = 8, 128
    x = torch.randint(0, 1024, (b, t))
    ones = torch.ones(b, 1, t)
    mode = {"now": "none", "inside": 0.0}
    saved: dict = {}

    def products(g: torch.Tensor, inp: torch.Tensor) -> None:
        t0 = time.perf_counter()
        sigma = torch.bmm(ones, g)  # σ = Σ_t g_t
        c = torch.bmm(sigma, g.transpose(1, 2))  # g_t · σ
        torch.bmm(c, inp)  # w = Gᵀ σ
        mode["inside"] += time.perf_counter() - t0

    for m in linears:

        def forward_hook(mod, inp, out, m=m):
            saved[m] = {"a": inp[0].detach()}
            if mode["now"] == "none":
                return

            def grad_hook(g, m=m):
                if mode["now"] == "out":
                    products(g, saved[m]["a"])
                else:
                    saved[m]["g"] = g

            out.register_hook(grad_hook)

        def after_backward(p, m=m):
            if mode["now"] == "post":
                products(saved[m]["g"], saved[m]["a"])

        m.register_forward_hook(forward_hook)
        m.weight.register_post_accumulate_grad_hook(after_backward)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    times: dict[str, list] = {k: [] for k in PLACEMENTS}
    for i in range(len(PLACEMENTS) * (a.rounds + a.warmup)):
        kind = PLACEMENTS[i % len(PLACEMENTS)]
        mode["now"], mode["inside"] = kind, 0.0
        t0 = time.perf_counter()
        model(x, labels=x).loss.backward()
        opt.zero_grad(set_to_none=True)
        if i >= len(PLACEMENTS) * a.warmup:
            times[kind].append((time.perf_counter() - t0, mode["inside"]))
    base = np.median([s for s, _ in times["none"]])
    for kind in PLACEMENTS:
        step = np.median([s for s, _ in times[kind]])
        inside = np.median([p for _, p in times[kind]])
        print(
            f"{kind:5s} step {step * 1e3:7.1f} ms  products {inside * 1e3:5.2f} ms  "
            f"overhead {100 * (step / base - 1):+.2f} %"
        )


if __name__ == "__main__":
    main()
