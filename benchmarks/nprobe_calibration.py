"""Recall@10 against nprobe for three kinds of IVF query: is leave-one-out calibration honest?

``build_index`` tunes nprobe on *calibration queries*: stored vectors, their own row dropped
from both answers, half of them negated (opponent searches). This script measures, at each
nprobe of a list, the recall@10 of

- ``loo-in-sample``: such queries drawn from the k-means training sample (the rule until stop 35),
- ``loo-out-sample``: drawn from the rows left out of it (the rule since stop 36),
- ``held-out``: fresh vectors from the same generator (what a user's query is, in the bench),

each split into proponent / opponent halves, on the vectors of ``traceprop bench query``
(the generator fitted to the sample run's index vectors, or the synthetic fallback, reduced to
the index's 256 dims). If the left-out queries track the held-out ones, nprobe needs a recall
margin of a few standard errors, not a multiplier. Results of stop 36 (AMD EPYC, 2 cores):
``benchmarks/results/nprobe-calibration-stop36-*.json``.

Usage::

    python benchmarks/nprobe_calibration.py --n 100000 --generator fitted --json OUT.json
    python benchmarks/nprobe_calibration.py --n 1000000 --generator fitted   # ~6 min, 3 GB
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from traceprop_engine.attribution.index import build as B
from traceprop_engine.attribution.index.build import build_index, calibration_target
from traceprop_engine.bench import query as Q
from traceprop_engine.bench.machine import cpu_model
from traceprop_engine.samples.run import default_root

_Q = 200  # queries of each kind, the first half proponent searches, the second opponent ones
NPROBES = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--generator", choices=("fitted", "synthetic"), default="fitted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    if a.generator == "fitted":
        gen = Q.SketchGenerator.fit(Q.run_base_vectors(default_root() / "facts"), seed=a.seed)
    else:
        gen = Q.SketchGenerator.synthetic(1024, seed=a.seed)
    if gen.dim > 256:
        gen = Q.ReducedGenerator.fit(gen, 256, a.seed)
    chunks = Q._data(gen, a.n, a.seed)
    t = time.perf_counter()
    idx = build_index(chunks, gen.dim, a.n, kind="ivf", seed=a.seed)
    build_s = time.perf_counter() - t
    tuned = idx.nprobe
    nl = Q._ivf(idx).nlist
    # build_index's first draw from default_rng(seed) is the k-means sample
    rng = np.random.default_rng(a.seed)
    n_train = min(a.n, max(nl * B._MAX_TRAIN_PER_LIST, 10_000))
    train_rows = np.sort(rng.choice(a.n, size=n_train, replace=False))
    pick = np.random.default_rng(a.seed + 1)
    in_rows = pick.choice(train_rows, size=_Q, replace=False)
    out_rows = B._calibration_rows(a.n, train_rows, pick)
    allv = np.concatenate(list(chunks()))
    sign = np.where(np.arange(_Q) < _Q // 2, 1.0, -1.0).astype(np.float32)[:, None]
    held = gen.sample(_Q, np.random.default_rng([a.seed, 999_999])) * sign
    kinds = {
        "loo-in-sample": (allv[in_rows] * sign, in_rows),
        "loo-out-sample": (allv[out_rows] * sign, out_rows),
        "held-out": (held, None),
    }
    exact = {}
    for name, (q, own) in kinds.items():
        s = q @ allv.T
        if own is not None:
            s[np.arange(len(q)), own] = -np.inf
        exact[name] = np.argsort(-s, 1)[:, :10]

    rows = []
    for p in NPROBES:
        if p > nl:
            break
        idx.set_nprobe(p)
        row = {"nprobe": p}
        for name, (q, own) in kinds.items():
            _, got = idx.search(q, 11)
            r = np.array(
                [
                    len(
                        set([x for x in got[i] if own is None or x != own[i]][:10])
                        & set(exact[name][i])
                    )
                    / 10
                    for i in range(len(q))
                ]
            )
            row[name] = [round(float(r[: _Q // 2].mean()), 4), round(float(r[_Q // 2 :].mean()), 4)]
        rows.append(row)
        print(
            p,
            "  ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in row.items() if k != "nprobe"),
            flush=True,
        )
    out = {
        "n": a.n,
        "generator": a.generator,
        "seed": a.seed,
        "nlist": nl,
        "tuned_nprobe": tuned,
        "calibration_target": calibration_target(0.95),
        "build_s": round(build_s, 1),
        "cpu": cpu_model(),
        "recall_proponents_opponents": rows,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
