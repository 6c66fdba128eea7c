"""Replay: how far a classification set's LDS can go past the "same label" baseline (issue 26).

The goal "LDS ≥ same label + 0.05" on docs8 (MiniLM + LoRA, 8 classes) is not met by any
gradient method measured (benchmarks/EVAL.md §1g). This asks whether it is reachable at all on
that set: it blends the label rule with the default's own scores, per eval row, as
``z(same label) + β · z(default cosine)`` (``z``: standardised over the training rows), and
restricts the default to the eval row's class (``cosine · [same label]``). Both use the labels
outright, which the engine's scores do not; they are an upper reference, not a candidate default.

Usage: ``python benchmarks/replay_label_blend.py /tmp/q/docs8-s0 /tmp/q/docs8-s1`` (folders of
``traceprop eval lds --set docs8 ... --config x1:k_in=1048576,k_out=1048576,factor_dtype=float32``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import engine_projections, lds_of, load, project, record_products, scores  # noqa: E402

from traceprop_engine import constants as C  # noqa: E402
from traceprop_engine.attribution import open_run  # noqa: E402
from traceprop_engine.evaluate.lds_levers import same_label_scores  # noqa: E402

BLENDS = (0.25, 0.5, 1.0, 2.0)


def standardised(s: np.ndarray) -> np.ndarray:
    s = s - s.mean(1, keepdims=True)
    return s / (s.std(1, keepdims=True) + 1e-12)


def labels(ev: Path, n_train: int) -> tuple[np.ndarray, np.ndarray]:
    """The training rows' and the eval rows' labels, in the evaluation's order."""
    r = open_run(ev / "runs" / "x1")
    try:
        ex = r.examples()
        lab = ex["label"].to_list()
        eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    finally:
        r.close()
    return np.array(lab[:n_train]), np.array([lab[e] for e in eval_ids])


def main(argv: list[str]) -> None:
    for ev in map(Path, argv):
        d = load(ev)
        y_train, y_eval = labels(ev, d.n_train)
        same = same_label_scores(list(y_train), list(y_eval))
        rec = project(d, engine_projections(ev))
        cos = scores(d, rec, prods=record_products(rec))
        out = {"same label": lds_of(d, same), "default": lds_of(d, cos)}
        for b in BLENDS:
            out[f"z(same)+{b:g}·z(default)"] = lds_of(d, standardised(same) + b * standardised(cos))
        out["default within the class"] = lds_of(
            d, np.where(y_eval[:, None] == y_train[None], cos, 0.0)
        )
        print(ev.name, "  ".join(f"{k} {v:.3f}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
