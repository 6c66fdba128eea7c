"""The LM-bias term's weight and whitening on LDS evaluation folders (EVAL.md §1ab).

    python benchmarks/lm_bias_sweep.py EVAL_DIR [EVAL_DIR ...]

For each folder (``traceprop eval lds --out EVAL_DIR``, its main run ``runs/k126`` tracked since
the records' first column is signed), scores every eval query by the records alone
(``lm_bias=0``), by the term alone, and by ``records + w · term`` for each weight ``w`` in
:data:`WEIGHTS`, with the term whitened by the final model's output factor (the engine's) and by
the inline one (the trajectory's), and prints the LDS of each on the folder's own retrains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gap_probe import subset_data

from traceprop_engine import constants as C
from traceprop_engine.attribution import HeadBias, IndexSettings, open_run, query_targets
from traceprop_engine.evaluate.lds_report import lds_scores

WEIGHTS = (0.05, 0.1, 0.15, 0.2, 0.3)


def sweep(ev: Path) -> dict[str, float] | None:
    masks, losses, n_train = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        ex = run.examples()
        evals = [e for e, s in zip(ex["example_id"], ex["split"], strict=True) if s == C.SPLIT_EVAL]
        alone = IndexSettings(lm_bias=0)
        base = run.settings(alone)
        inline = HeadBias(run.store, run.indexes.scorer(base))  # statistics=None: the inline
        inline_ids = run.index(base)[1]
        rec, term, term_inline = (np.zeros((len(evals), n_train)) for _ in range(3))
        for r, e in enumerate(evals):
            enc = run.encode(eval_example=int(e))[0]
            sk = run.query_sketches(enc)[0]
            s0 = run.for_query(alone, query_targets(enc), sk)
            ids = run.index(s0)[1]
            rec[r, ids] = run.all_scores(sk, s0)
            b = run.lm_bias_scores(sk, IndexSettings(lm_bias=1.0, columns=s0.columns))
            if b is None:
                return None  # no signed head records: tracked before 2026-12-07, or LoRA
            term[r, ids] = b
            term_inline[r, inline_ids] = inline.scores(inline.query(sk))
    finally:
        run.close()
    out = {"records": rec, "term": term, "term(inline)": term_inline}
    for w in WEIGHTS:
        out[f"+{w}"] = rec + w * term
        out[f"+{w}(inline)"] = rec + w * term_inline
    return {k: float(np.nanmean(lds_scores(m, masks, losses))) for k, m in out.items()}


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        got = sweep(Path(d))
        line = (
            "no LM-bias term" if got is None else " ".join(f"{k}={v:.3f}" for k, v in got.items())
        )
        print(Path(d).name, line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
