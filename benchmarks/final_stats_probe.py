"""The K-FAC statistics K-FAC-cosine whitens with, through the engine (EVAL.md §1q).

``kfac_probe`` found the inline statistics (every stride-th batch of the whole trajectory) cost
0.010–0.019 LDS on a pretrained model fine-tuned in full, measured with the final model's
gradients. This probe measures the engine's own choices (``IndexSettings.statistics``) on
finished ``traceprop eval lds`` folders: it scores the main run (``runs/k126``) with K-FAC-cosine
at the default weighting (``auto``, resolved per run) under ``inline`` (the run's own), ``final``
(fitted on the final model over the stored training examples,
:mod:`traceprop_engine.attribution.model_side.statistics`) and ``both`` (their mean), beside
identity-cosine and the evaluation's full-gradient cosine and BM25 rows, each index rebuilt.

Usage: ``python benchmarks/final_stats_probe.py DIR ...``
"""

from __future__ import annotations

import sys
from pathlib import Path

from gap_probe import subset_data
from records_probe import eval_sketches, index_lds, print_rows, reference

from traceprop_engine.attribution import open_run
from traceprop_engine.settings import IndexSettings

ROWS = {
    "identity-cos": IndexSettings(preconditioner="identity"),
    "default (auto)": IndexSettings(),
    "kfac-cos, inline statistics": IndexSettings(preconditioner="kfac", statistics="inline"),
    "kfac-cos, final model's": IndexSettings(preconditioner="kfac", statistics="final"),
    "kfac-cos, both (mean)": IndexSettings(preconditioner="kfac", statistics="both"),
}


def probe(ev: Path) -> dict[str, float]:
    masks, losses, _ = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        sketches = eval_sketches(run)
        out = {"default resolves to " + run.settings().name: float("nan")}
        for name, ix in ROWS.items():
            out[name] = index_lds(run, ix, sketches, masks, losses)
    finally:
        run.close()
    return out


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        ev = Path(d)
        rows = {**probe(ev), **{f"eval's {k}": v for k, v in reference(ev).items()}}
        print_rows(ev.name, rows, 45)


if __name__ == "__main__":
    main(sys.argv[1:])
