"""The rank-1 record's left vector from every n-th token (``TrackSettings.sigma_stride``).

The default record of a layer is ``û ûᵀ G`` with ``û ∝ σ = Σ_t g_t``; its hook reads the output
gradient ``g`` twice (``σ``, then ``g_t · σ``) and the input ``a`` once. Summing ``σ`` over every
n-th token only leaves ``1 + 1/n`` reads of ``g`` (``benchmarks/overhead_parts.py
--sigma-stride N`` times the hook). This probe measures what it costs in quality: for each
finished ``traceprop eval lds`` folder it trains the main run again with ``sigma_stride=N``
(``runs/sgN``, as ``--config sgN:sigma_stride=N`` would, reused when there) and scores both
through the engine at the default query settings (``IndexSettings()``: identity, cosine, the
class prior of a classifier) against the evaluation's own retrained subsets, beside its
full-gradient cosine and BM25 rows. Only those two runs are scored, so a folder costs one
training and two scorings instead of a whole ``eval lds`` resume.

Usage: ``python benchmarks/sigma_stride_probe.py [--strides 4,8] DIR ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from pathlib import Path

import numpy as np
from gap_probe import subset_data
from records_probe import eval_sketches, index_lds, print_rows, reference

from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds import _base_model, _ensure_run
from traceprop_engine.settings import IndexSettings, TrackSettings, TrainSettings

MAIN = "k126"


def _train_settings(ev: Path) -> TrainSettings:
    d = dict(json.loads((ev / "eval.json").read_text())["settings"]["train"])
    track = d.pop("track", None)
    t = TrainSettings(**d)
    if track is not None:
        t = dataclasses.replace(t, track=TrackSettings.from_dict(track))
    return t


def default_lds(ev: Path, name: str, masks, losses) -> float:
    run = open_run(ev / "runs" / name)
    try:
        return index_lds(run, IndexSettings(), eval_sketches(run), masks, losses)
    finally:
        run.close()


def probe(ev: Path, strides: list[int]) -> dict[str, float]:
    masks, losses, _ = subset_data(ev)
    s = types.SimpleNamespace(train=_train_settings(ev))
    main = TrackSettings.from_dict(json.loads((ev / "runs" / MAIN / "lds_track.json").read_text()))
    base = _base_model(s, ev)
    out = {"stride 1 (k126)": default_lds(ev, MAIN, masks, losses)}
    for n in strides:
        track = dataclasses.replace(main, sigma_stride=n)
        _ensure_run(f"sg{n}", track, s, base, ev)
        out[f"stride {n}"] = default_lds(ev, f"sg{n}", masks, losses)
    out |= reference(ev, names=("full-gradient cosine", "bm25", "same label"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strides", default="4,8", help="comma-separated sigma_stride values")
    p.add_argument("dirs", nargs="+", type=Path)
    a = p.parse_args()
    strides = [int(x) for x in a.strides.split(",")]
    table = {}
    for ev in a.dirs:
        table[ev.name] = probe(ev, strides)
        print_rows(ev.name, table[ev.name])
    keys = list(next(iter(table.values())))
    print(f"== mean over {len(table)} folders")
    for k in keys:
        vals = [row[k] for row in table.values() if k in row]
        print(f"  {k:35s} {np.mean(vals):.3f}  (n={len(vals)})")
    for n in strides:
        d = [row[f"stride {n}"] - row["stride 1 (k126)"] for row in table.values()]
        print(
            f"  stride {n} - stride 1: mean {np.mean(d):+.4f}, min {min(d):+.4f}, "
            f"max {max(d):+.4f}, >= 0 on {sum(x >= 0 for x in d)}/{len(d)}"
        )


if __name__ == "__main__":
    main()
