"""The class prior of a classification run (``IndexSettings.class_prior``; EVAL.md §1s).

Reads finished classification ``traceprop eval lds`` folders and scores their main run
(``runs/k126``) through the engine at the default settings with ``class_prior`` swept (0 is the
records alone; the default, auto, is ``DEFAULT_CLASS_PRIOR``, or ``ADAPTER_CLASS_PRIOR`` for a run
that trained adapters), beside the evaluation's own
same-label and full-gradient cosine rows. Every score comes from ``AttributionRun.all_scores``
on the eval rows' own query sketches (which carry their label), so the rows are the engine's.

Usage: ``python benchmarks/class_prior_probe.py DIR ...``
"""

from __future__ import annotations

import sys
from pathlib import Path

from gap_probe import subset_data
from records_probe import eval_sketches, index_lds, print_rows, reference

from traceprop_engine.attribution import open_run
from traceprop_engine.settings import IndexSettings

PRIORS = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0)  # DEFAULT_CLASS_PRIOR and ADAPTER_CLASS_PRIOR among them


def probe(ev: Path) -> dict[str, float]:
    masks, losses, _ = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        if run.task != "classification":
            raise SystemExit(f"{ev}: a {run.task} run has no class prior")
        sketches = eval_sketches(run)
        run.index(IndexSettings(), rebuild=True)  # once: the prior is a query-time term
        out = {}
        auto = run.settings().class_prior  # the run's own default (adapters: ADAPTER_CLASS_PRIOR)
        for c in PRIORS:
            name = f"default, class_prior {c:g}" + (" (auto)" if c == auto else "")
            ix = IndexSettings(class_prior=c)
            out[name] = index_lds(run, ix, sketches, masks, losses, rebuild=False)
    finally:
        run.close()
    return out


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        ev = Path(d)
        refs = reference(ev, ("same label", "full-gradient cosine", "bm25"))
        print_rows(ev.name, {**probe(ev), **{f"eval's {k}": v for k, v in refs.items()}}, 40)


if __name__ == "__main__":
    main(sys.argv[1:])
