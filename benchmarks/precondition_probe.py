"""K-FAC's damping and the output head's whitening, replayed on finished evaluations (EVAL.md §1p).

Reads finished ``traceprop eval lds`` folders and scores their main run (``runs/k126``) through
the engine with K-FAC-cosine under the default's records, rebuilding the index for each variant:

- ``--damping 0.1,0.3,1,3``: ``IndexSettings.damping`` (a fraction of each factor's mean
  eigenvalue; the default is 0.1);
- ``--head``: the output head whitened like every other layer (``both``), on its input side
  only (``in``: its output-side factor replaced by the isotropic matrix of the same trace, which
  the trace normalisation makes the identity), or its output side only (``out``). The engine
  leaves the head unwhitened (``Preconditioner.fit``); here that is patched for the run.

- ``--raw``: without the per-layer trace normalisation (each whitened layer at the per-example
  Fisher's own scale, as kronfluence scores), with the head as recorded and whitened.

Prints the LDS of each against the evaluation's own retrained subsets.

Usage: ``python benchmarks/precondition_probe.py [--damping 0.1,1] [--head] [--raw] DIR ...``
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from gap_probe import subset_data
from records_probe import eval_sketches, index_lds

from traceprop_engine.attribution import open_run
from traceprop_engine.attribution.precondition import kfac as K
from traceprop_engine.attribution.precondition import preconditioner as P
from traceprop_engine.settings import IndexSettings

_FIT = P.Preconditioner.fit.__func__
_SCALE = K._layer_scale
HEAD = {"mode": None, "raw": False}


def _layer_scale(mean_sq_norm: float, preconditioned_sq_norm: float, name: str) -> float:
    """The engine's per-layer trace normalisation, or 1 (``HEAD["raw"]``: each whitened layer
    keeps the per-example Fisher's own scale, as kronfluence's scores do)."""
    return 1.0 if HEAD["raw"] else _SCALE(mean_sq_norm, preconditioned_sq_norm, name)


K._layer_scale = _layer_scale


def _isotropic(m: np.ndarray) -> np.ndarray:
    k = m.shape[0]
    return np.eye(k, dtype=m.dtype) * (np.trace(m) / k)


def _fit_whitening_head(cls, kind, layers, damping=None, index_side=0, **kw):
    """``Preconditioner.fit`` with the output head fitted like any layer (``HEAD["mode"]``)."""
    mode, out = HEAD["mode"], []
    for st in layers:
        if mode and st.output_head and st.A is not None:
            a = _isotropic(st.A) if mode == "out" else st.A
            s = _isotropic(st.S) if mode == "in" else st.S
            st = dataclasses.replace(st, output_head=False, A=a, S=s)
        out.append(st)
    return _FIT(cls, kind, out, damping, index_side, **kw)


P.Preconditioner.fit = classmethod(_fit_whitening_head)


def probe(ev: Path, variants: list[tuple[str, str | None, float | None]]) -> dict[str, float]:
    masks, losses, _ = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        sketches = eval_sketches(run)
        out = {}
        for name, head, damping in variants:
            HEAD["mode"], HEAD["raw"] = head, name.endswith("raw scale")
            ix = IndexSettings(preconditioner="kfac", cosine=True, damping=damping)
            out[name] = index_lds(run, ix, sketches, masks, losses)
    finally:
        HEAD["mode"], HEAD["raw"] = None, False
        run.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--damping", default="", help="comma-separated damping values")
    ap.add_argument("--head", action="store_true", help="the head's whitening variants")
    ap.add_argument(
        "--raw", action="store_true", help="without the per-layer trace normalisation, head too"
    )
    a = ap.parse_args()
    variants: list[tuple[str, str | None, float | None]] = [("default", None, None)]
    variants += [(f"damping {x}", None, float(x)) for x in a.damping.split(",") if x]
    if a.head:
        variants += [(f"head whitened: {m}", m, None) for m in ("both", "in", "out")]
    if a.raw:
        variants += [("raw scale", None, None), ("head whitened: both, raw scale", "both", None)]
    for d in a.dirs:
        print(f"== {Path(d).name}", flush=True)
        for k, v in probe(Path(d), variants).items():
            print(f"  {k:28s} {v:.3f}", flush=True)


if __name__ == "__main__":
    main()
