"""One markdown table of LDS rows over several evaluation folders (benchmarks/EVAL.md §1d).

    python benchmarks/lds_summary.py [--default KEY] NAME=EVAL_DIR [NAME=EVAL_DIR ...]

Rows: the default (``kfac-cos`` of the main run since stop 39; ``--default cosine`` for the
identity-cosine default of earlier tables), every preconditioner, the optimizer-aware
config, the lever rows, full-gradient cosine/dot on the final model, BM25, same label, random;
columns: one per folder, then the mean over folders. Each cell is LDS [95 % CI]; the last
columns give the mean paired difference to the default over the folders and how many folders
the row beats the default in. The split-half noise ceiling closes the table where recorded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = [
    ("kfac-cos", "K-FAC, cosine (the default from stop 39)"),
    ("cosine", "identity, cosine (the default until stop 39)"),
    ("identity", "identity, dot"),
    ("kfac", "K-FAC"),
    ("ekfac", "EK-FAC"),
    ("ekfac-cos", "EK-FAC, cosine"),
    ("x1 cosine", "exact rank-1 records (no projection), cosine"),
    ("before cosine", "before vocabulary rows (stop 33 default), cosine"),
    ("before kfac-cos", "before vocabulary rows, K-FAC cosine (LM head whitened)"),
    ("adam cosine", "optimizer-aware (AdamW) records, cosine"),
    ("adam identity", "optimizer-aware records, dot"),
    ("lever lr layer", "per-layer unit normalisation"),
    ("lever last-epoch cosine", "last epoch only, cosine"),
    ("lever last-epoch layer", "last epoch only, per-layer"),
    ("lever late cosine", "lr x (epoch+1), cosine"),
    ("lever late layer", "lr x (epoch+1), per-layer"),
    ("lever uniform cosine", "every record 1 (no lr), cosine"),
    ("full-gradient cosine", "full-gradient cosine, final model"),
    ("full-gradient dot", "full-gradient dot, final model"),
    ("bm25", "BM25"),
    ("same label", "same label"),
    ("representation similarity", "representation similarity"),
    ("random", "random"),
]


def main(args: list[str]) -> None:
    default = "kfac-cos"
    if args[:1] == ["--default"]:
        default, args = args[1], args[2:]
    sets = [a.split("=", 1) for a in args]
    docs = {n: json.loads((Path(d) / "results.json").read_text()) for n, d in sets}
    rows = {n: {r["method"]: r for r in doc["rows"]} for n, doc in docs.items()}
    names = [n for n, _ in sets]
    print("| method | " + " | ".join(names) + " | mean | Δ vs default (mean) | wins |")
    print("|---" * (len(names) + 4) + "|")
    for key, label in ORDER:
        cells, vals, deltas = [], [], []
        for n in names:
            r = rows[n].get(key)
            if r is None or r.get("lds") is None:
                cells.append("—")
                continue
            cells.append(f"{r['lds']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")
            vals.append(r["lds"])
            base = rows[n].get(default)
            if base is not None:
                deltas.append(r["lds"] - base["lds"])
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        d = f"{sum(deltas) / len(deltas):+.3f}" if deltas and key != default else ""
        wins = f"{sum(x > 0 for x in deltas)}/{len(deltas)}" if key != default else ""
        print(f"| {label} | " + " | ".join(cells) + f" | {mean:.3f} | {d} | {wins} |")
    ceil = []
    for n in names:
        nc = docs[n].get("noise_ceiling")
        ceil.append(
            f"{nc['split_half_spearman']:.3f} [{nc['ci'][0]:.3f}, {nc['ci'][1]:.3f}]" if nc else "—"
        )
    print("| split-half noise ceiling | " + " | ".join(ceil) + " | | | |")
    att = [
        f"{(docs[n].get('noise_ceiling') or {}).get('attainable_lds', float('nan')):.3f}"
        for n in names
    ]
    if any(a != "nan" for a in att):  # results written since stop 49
        print("| attainable LDS (Spearman–Brown) | " + " | ".join(att) + " | | | |")


if __name__ == "__main__":
    main(sys.argv[1:])
