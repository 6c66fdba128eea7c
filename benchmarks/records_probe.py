"""Which of an example's records should score it? (``IndexSettings.records``; EVAL.md §1n)

Reads finished ``traceprop eval lds`` folders and scores their main run (``runs/k126``) through
the engine, for the default (K-FAC, cosine) and identity-cosine, with ``records=all`` (the whole lr-weighted trajectory) and ``records=last-epoch`` (only
each example's records of the last epoch it was trained in); prints the LDS of each against the
evaluation's own retrained subsets, and the evaluation's full-gradient cosine and BM25 rows for
reference.

Usage: ``python benchmarks/records_probe.py /tmp/q/pft-hard60-s0 /tmp/q/hard60-s0 ...``

``--matrix``: instead, every preconditioner (identity, K-FAC, EK-FAC) with cosine and dot under
the default's records (``last-epoch``), beside all the evaluation's reference rows (full-gradient
dot and cosine on the final model, BM25, same label, random): the issue-26 table for the default.

``--weighting``: the same for identity-cosine, K-FAC-cosine at the default weighting (``auto``,
resolved per run) and at ``recorded`` and ``fisher``, EK-FAC-cosine and K-FAC dot (EVAL.md §1p).
The flag comes first.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
from gap_probe import subset_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.settings import IndexSettings

ROWS = {"kfac-cos": ("kfac", True), "cosine": ("identity", True)}
MATRIX = {
    f"{pre}-{'cos' if cos else 'dot'}": (pre, cos)
    for pre in ("identity", "kfac", "ekfac")
    for cos in (True, False)
}
# --weighting: the default's weighting (auto, resolved per run) beside both choices
WEIGHTING = {
    "identity-cos": ("identity", True),
    "kfac-cos": ("kfac", True),
    "kfac-cos, recorded": ("kfac", True, "recorded"),
    "kfac-cos, fisher": ("kfac", True, "fisher"),
    "ekfac-cos": ("ekfac", True),
    "kfac-dot": ("kfac", False),
}
REFERENCES = ("full-gradient cosine", "full-gradient dot", "bm25", "same label", "random")


def reference(ev: Path, names=("full-gradient cosine", "bm25", "kfac-cos")) -> dict[str, float]:
    """The evaluation's own rows of these methods (``results.csv``), where it has them."""
    out = {}
    with open(ev / "results.csv") as f:
        for row in csv.DictReader(f):
            if row["method"] in names:
                out[row["method"]] = float(row["lds"])
    return out


def eval_sketches(run) -> list:
    """The query sketches of the run's eval rows, in example order."""
    ex = run.examples()
    eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    return [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]


def index_lds(run, ix: IndexSettings, sketches: list, masks, losses, rebuild: bool = True) -> float:
    """The LDS of the engine's exact scores under ``ix``, its index rebuilt first (never one of
    older weights, nor one a probe's patch leaves the fingerprint blind to); ``rebuild=False``
    for settings that change no index (a query-time term such as ``class_prior``)."""
    _, ids, _ = run.index(ix, rebuild=rebuild)
    scores = np.zeros((len(sketches), masks.shape[1]))
    for r, sk in enumerate(sketches):
        scores[r, ids] = run.all_scores(sk, ix)
    return float(np.nanmean(lds_scores(scores, masks, losses)))


def print_rows(name: str, rows: dict[str, float], width: int = 35) -> None:
    """One evaluation folder's rows, as every probe prints them."""
    print(f"== {name}", flush=True)
    for k, v in rows.items():
        print(f"  {k:{width}s} {v:.3f}", flush=True)


def probe(ev: Path, rows=None, choices=("all", "last-epoch")) -> dict[str, float]:
    masks, losses, _ = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        sketches = eval_sketches(run)
        epochs = int(run.store.records()[C.REC_EPOCH].max()) + 1
        out = {"epochs": float(epochs)}
        for name, (pre, cos, *weighting) in (rows or ROWS).items():
            for records in choices:
                w = weighting[0] if weighting else "auto"
                ix = IndexSettings(preconditioner=pre, cosine=cos, records=records, weighting=w)
                out[f"{name}, {records}"] = index_lds(run, ix, sketches, masks, losses)
    finally:
        run.close()
    return out


def main(argv: list[str]) -> None:
    matrix = {"--matrix": MATRIX, "--weighting": WEIGHTING}.get(next(iter(argv), ""))
    argv = [a for a in argv if a not in ("--matrix", "--weighting")]
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        ev = Path(d)
        if matrix:
            got = probe(ev, matrix, ("last-epoch",))
            rows = {**got, **{f"eval's {k}": v for k, v in reference(ev, REFERENCES).items()}}
        else:
            rows = {**probe(ev), **{f"eval's {k}": v for k, v in reference(ev).items()}}
        print_rows(ev.name, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
