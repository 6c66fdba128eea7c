"""Where the default rank-1 record's half step starts (``TrackSettings.half_step_start``), in LDS.

For each finished ``traceprop eval lds`` folder (its main run ``runs/k126`` recorded with
``half_step_start='output'``, as every run before stop 49 was) this trains the same run again
with ``'narrow'`` (``runs/narrow``, reused when there) and scores both through the engine at the
default query settings (``IndexSettings()``) against the evaluation's own retrained subsets,
beside its full-gradient cosine, BM25 and same-label rows. One training and two scorings a
folder, not a whole ``eval lds`` resume. (``benchmarks/overhead_parts.py --half-step-start``
times the hooks of each.)

Usage: ``python benchmarks/half_step_probe.py DIR ...``
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import numpy as np
from gap_probe import subset_data
from records_probe import eval_sketches, index_lds, print_rows, reference

from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds import _base_model, _ensure_run
from traceprop_engine.settings import IndexSettings, TrackSettings
from traceprop_engine.training.resume import settings_from_config

MAIN, NARROW = "k126", "narrow"


def default_lds(ev: Path, name: str, masks, losses) -> float:
    run = open_run(ev / "runs" / name)
    try:
        return index_lds(run, IndexSettings(), eval_sketches(run), masks, losses)
    finally:
        run.close()


def probe(ev: Path) -> dict[str, float]:
    masks, losses, _ = subset_data(ev)
    config = json.loads((ev / "eval.json").read_text())["settings"]["train"]
    s = types.SimpleNamespace(train=settings_from_config(config, ev))
    main = TrackSettings.from_dict(json.loads((ev / "runs" / MAIN / "lds_track.json").read_text()))
    if main.half_step_start.value != "output":
        raise SystemExit(f"{ev}: runs/{MAIN} is not recorded from the output side")
    _ensure_run(
        NARROW, dataclasses.replace(main, half_step_start="narrow"), s, _base_model(s, ev), ev
    )
    out = {
        "output start (k126)": default_lds(ev, MAIN, masks, losses),
        "narrow start": default_lds(ev, NARROW, masks, losses),
    }
    return out | reference(ev, names=("full-gradient cosine", "bm25", "same label"))


def main(dirs: list[str]) -> None:
    table = {}
    for d in map(Path, dirs):
        table[d.name] = probe(d)
        print_rows(d.name, table[d.name])
    diff = [r["narrow start"] - r["output start (k126)"] for r in table.values()]
    print(
        f"== {len(diff)} folders: narrow - output mean {np.mean(diff):+.4f}, min {min(diff):+.4f}, "
        f"max {max(diff):+.4f}, >= 0 on {sum(x >= 0 for x in diff)}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
