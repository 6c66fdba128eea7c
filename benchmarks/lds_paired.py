"""The default against one reference row, paired per eval example, over many evaluation folders.

    python benchmarks/lds_paired.py [--row default] [--ref "full-gradient cosine"]
        [--plus 0.0] NAME=EVAL_DIR [NAME=EVAL_DIR ...]

Each folder's ``results.json`` keeps every row's Spearman per eval example. Both rows are scored
on the same examples of the same retrains, so their difference per example has a much tighter
interval than either LDS (lds_summary.py shows each row's own). Per folder: the two LDS, the
mean paired difference ``row − (ref + plus)`` with its 95 % percentile bootstrap interval over
the examples, and whether that interval lies above 0, below it, or spans it. Then over the
folders: the mean difference, how many are ≥ 0, and a bootstrap interval over the folders.

``--plus 0.05 --ref bm25`` checks issue 26's "≥ BM25 + 0.05".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from traceprop_engine.evaluate import bootstrap_ci, paired_delta, per_example_of, scored_row


def per_example(results: dict, method: str) -> np.ndarray:
    """The row ``method``'s Spearman per eval example (the main k's row when there are several)."""
    row = scored_row(results["rows"], method, results.get("settings", {}).get("main_k"))
    if row is None:
        have = sorted({r["method"] for r in results["rows"]})
        raise SystemExit(f"no row {method!r} with per-example values; rows: {have}")
    return per_example_of(row)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="default")
    ap.add_argument("--ref", default="full-gradient cosine")
    ap.add_argument("--plus", type=float, default=0.0, help="added to the reference row")
    ap.add_argument("folders", nargs="+", metavar="NAME=EVAL_DIR")
    a = ap.parse_args(argv)
    ref = a.ref + (f" + {a.plus:g}" if a.plus else "")
    print(f"| pair | {a.row} | {ref} | Δ paired [95 % CI] | verdict |")
    print("|---|---|---|---|---|")
    deltas = []
    for item in a.folders:
        name, _, folder = item.partition("=")
        results = json.loads((Path(folder) / "results.json").read_text())
        x, y = per_example(results, a.row), per_example(results, a.ref) + a.plus
        p = paired_delta(x, y)
        (lo, hi), mean = p["ci"], p["delta"]
        deltas.append(mean)
        print(
            f"| {name} | {np.nanmean(x):.3f} | {np.nanmean(y):.3f} | "
            f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] | {p['verdict']} |"
        )
    deltas_a = np.asarray(deltas)
    lo, hi = bootstrap_ci(deltas_a) if len(deltas_a) > 1 else (np.nan, np.nan)
    print(
        f"\nover {len(deltas_a)} pairs: mean Δ {deltas_a.mean():+.4f} [{lo:+.4f}, {hi:+.4f}] "
        f"(bootstrap over pairs); ≥ 0 on {(deltas_a >= 0).sum()} of {len(deltas_a)}; "
        f"range {deltas_a.min():+.3f} … {deltas_a.max():+.3f}"
    )


if __name__ == "__main__":
    main()
