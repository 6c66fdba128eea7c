"""Constant or per-query class prior? (``IndexSettings.class_prior``; EVAL.md §1t)

Reads finished classification ``traceprop eval lds`` folders and, for every eval row of the main
run (``runs/k126``), takes the engine's records-alone scores (``class_prior=0``), the prior's
own term (``class_prior=1`` minus them) and the final model's loss on the row (what
``query_sketches`` returns with the sketches). Then prints the LDS of each rule for the prior's
weight: constants, and weights that grow with the query's loss over ln C (``r``: 1 where the
final model predicts the query's class at chance), the evaluation's same-label and full-gradient
cosine rows beside them, and the mean over the folders.

Usage: ``python benchmarks/class_prior_rules.py DIR ...``
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from gap_probe import subset_data
from records_probe import reference

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.settings import IndexSettings

RULES = {
    **{f"constant {w:g}": (lambda r, w=w: np.full_like(r, w)) for w in (0.2, 0.5, 1.0, 2.0)},
    "r": lambda r: r,
    "max(0.2, r)": lambda r: np.maximum(0.2, r),
    "clip(r, 0.2, 1)": lambda r: np.clip(r, 0.2, 1.0),
    "max(0.2, r²)": lambda r: np.maximum(0.2, r**2),
    "0.2 r": lambda r: 0.2 * r,
}


def parts(ev: Path, n_train: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(records-alone scores (q, n_train), the prior's term at weight 1, r (q,))``: one exact
    pass a query, the prior's term from ``class_prior_scores`` (what every score adds)."""
    run = open_run(ev / "runs" / "k126")
    try:
        if run.task != "classification":
            raise SystemExit(f"{ev}: a {run.task} run has no class prior")
        ex = run.examples()
        classes = {x for x in ex["label"].to_list() if x}
        eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
        _, ids, _ = run.index(IndexSettings(), rebuild=True)
        alone = np.zeros((len(eval_ids), n_train))
        prior, r = np.zeros_like(alone), np.zeros(len(eval_ids))
        for i, e in enumerate(eval_ids):
            sk, loss = run.query_sketches(run.encode(eval_example=e)[0])
            alone[i, ids] = run.all_scores(sk, IndexSettings(class_prior=0.0))
            prior[i, ids] = run.class_prior_scores(sk, IndexSettings(class_prior=1.0))
            r[i] = loss / math.log(len(classes))
    finally:
        run.close()
    return alone, prior, r


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    table = {}
    for d in argv:
        ev = Path(d)
        masks, losses, n_train = subset_data(ev)
        alone, prior, r = parts(ev, n_train)
        row = {
            k: float(np.nanmean(lds_scores(alone + f(r)[:, None] * prior, masks, losses)))
            for k, f in RULES.items()
        }
        row.update(reference(ev, ("same label", "full-gradient cosine")))
        row["median r"] = float(np.median(r))
        table[ev.name] = row
        print(f"== {ev.name}  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    print("== mean over", len(table), "folders")
    for k in RULES:
        print(f"  {k:18s} {np.mean([row[k] for row in table.values()]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
