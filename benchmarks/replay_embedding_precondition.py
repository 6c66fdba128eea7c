"""How should K-FAC treat the input embedding's record? (EVAL.md §1l)

For finished ``traceprop eval lds`` folders whose main run ``runs/k126`` records the input
embedding, prints the LDS of the default (K-FAC, cosine) with the embedding layer fitted as the
engine fits it, left unwhitened (identity, as the output head is), or whitened on one side only
(the other factor replaced by a multiple of the identity with the same trace). Every other layer
is fitted as the engine fits it. No retraining: the run's own records and statistics, scored on
a copy of the run (its index folder left out).

Usage: ``python benchmarks/replay_embedding_precondition.py /tmp/q/pft-hard60-s0 ...``
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np
from gap_probe import subset_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import Preconditioner, open_run
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.settings import IndexSettings

_FIT = Preconditioner.fit.__func__
VARIANTS = ("engine (K-FAC)", "identity", "output side only", "input side only")


def _iso(m: np.ndarray) -> np.ndarray:
    return np.eye(len(m)) * np.trace(m) / len(m)


def _patched(variant: str):
    def fit(cls, kind, layers, damping=None, index_side=0):
        out = []
        for st in layers:
            if "embed" in st.name and st.A is not None:
                if variant == "identity":
                    st = dataclasses.replace(st, output_head=True)
                elif variant == "output side only":
                    st = dataclasses.replace(st, A=_iso(st.A))
                elif variant == "input side only":
                    st = dataclasses.replace(st, S=_iso(st.S))
            out.append(st)
        return _FIT(cls, kind, out, damping, index_side)

    return classmethod(fit)


def probe(ev: Path) -> dict:
    masks, losses, n_train = subset_data(ev)
    rows = {}
    for variant in VARIANTS:
        dst = ev / "scratch" / f"k126-emb-{VARIANTS.index(variant)}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(ev / "runs" / "k126", dst, ignore=shutil.ignore_patterns("index"))
        Preconditioner.fit = _patched(variant)
        try:
            run = open_run(dst)
            if not any(layer.kind == "embedding" for layer in run.store.layers):
                return {"note": "the main run records no embedding"}
            ex = run.examples()
            eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
            ix = IndexSettings(preconditioner="kfac", cosine=True)
            sc = run.scores(eval_example=eval_ids, settings=ix)[:, :n_train]
            rows[variant] = float(np.nanmean(lds_scores(sc, masks, losses)))
            run.close()
        finally:
            Preconditioner.fit = classmethod(_FIT)
            shutil.rmtree(dst, ignore_errors=True)
    return rows


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        print(f"== {Path(d).name}", flush=True)
        for k, v in probe(Path(d)).items():
            print(f"  {k:30s} {v if isinstance(v, str) else f'{v:.3f}'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
