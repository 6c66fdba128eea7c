"""Replay: record and layer weightings of the default records (issue 26, stop 36).

TracIn's sum weights every record by its learning rate, so early records (large gradients)
dominate an example's vector. Three variants, each scored by cosine over all layers from an
evaluation's exact rank-1 records (:mod:`replay`), with the engine's projections and int8:

- ``recnorm^p``: record ``r`` weighted by ``lr_r / ‖x_r‖^p`` (p = 0.5, 1),
- ``mean rec cos``: the learning-rate-weighted sum of per-record cosines,
- ``head×a``: the layer holding most of the records' energy (the LM head, or a classifier's
  head under LoRA) weighted by ``a`` before the cosine (a = 0.25 ... 100; 100 is about the head
  alone).

Usage: ``python benchmarks/replay_weighting.py /tmp/q/facts24-s0 /tmp/q/hard60-s0 ...``
(folders of ``traceprop eval lds ... --config x1:k_in=1048576,k_out=1048576,factor_dtype=float32``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import engine_projections, lds_of, load, project, record_products, scores  # noqa: E402


def main(argv: list[str]) -> None:
    for ev in argv:
        d = load(ev)
        rec = project(d, engine_projections(ev))
        prods = record_products(rec)
        rn2 = np.zeros(len(d.example))
        for u, v in zip(rec.U, rec.V, strict=True):
            rn2 += (u**2).sum(1) * (v**2).sum(1)
        rn = np.sqrt(np.maximum(rn2, 1e-300))
        out = {"default": lds_of(d, scores(d, rec, prods=prods))}
        for p in (0.5, 1.0):
            out[f"recnorm^{p}"] = lds_of(d, scores(d, rec, w=d.lr / rn**p, prods=prods))
        qn = np.sqrt(sum((q.reshape(len(q), -1) ** 2).sum(1) for q in rec.Q))
        cos = sum(prods) / rn[None] / qn[:, None]
        sc = np.zeros((cos.shape[0], d.n_train))
        np.add.at(sc.T, d.example, (cos * d.lr).T)
        out["mean rec cos"] = lds_of(d, sc)
        energy = np.array(
            [
                ((u**2).sum(1) * (v**2).sum(1) * d.lr**2).sum()
                for u, v in zip(rec.U, rec.V, strict=True)
            ]
        )
        head = int(np.argmax(energy))
        for a in (0.25, 0.5, 2.0, 4.0, 100.0):
            lw = np.ones(len(prods))
            lw[head] = a
            out[f"head×{a:g}"] = lds_of(d, scores(d, rec, prods=prods, layer_w=lw))
        print(d.name, " ".join(f"{k}={v:.3f}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
