"""Print the markdown tables of RESULTS.md from results/*.json (any python with numpy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

R = Path(__file__).resolve().parent / "results"


def load(name):
    p = R / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def overhead_table(reps=("r1", "r2")):
    print(
        "| run | arm | layers | step ms (median) | overhead % (median of paired ratios) | 95 % CI | CPU-time overhead % | overhead ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for bench in ("overhead_logix", "overhead_bergson", "overhead_dattri", "posthoc_kronfluence"):
        for r in reps:
            d = load(f"{bench}_{r}")
            if d is None:
                continue
            lt = d.get("layers_tracked", {})
            print(
                f"| {bench.split('_')[1]} {r} | plain | – | {d['plain_step_ms']:.1f} | – | – | – | – |"
            )
            for arm, a in d["arms"].items():
                ci, cci = a["overhead_ci95_pct"], a["cpu_overhead_ci95_pct"]
                extra = ""
                if "overhead_pct_incl_context_end" in a:
                    extra = f" (+context-end flush: {a['overhead_pct_incl_context_end']:+.1f})"
                nl = (
                    lt.get(arm)
                    or lt.get(arm.rsplit("_", 1)[0])
                    or (17 if arm == "traceprop" else "")
                )
                print(
                    f"| {bench.split('_')[1]} {r} | {arm} | {nl} | {a['step_ms']:.1f} | **{a['overhead_pct']:+.2f}**{extra} | "
                    f"{ci[0]:+.2f} .. {ci[1]:+.2f} | {a['cpu_overhead_pct']:+.2f} ({cci[0]:+.2f} .. {cci[1]:+.2f}) | "
                    f"{a['overhead_ms_per_step']:.1f} |"
                )


def readiness_table(reps=("r1", "r2")):
    print(
        "| run | post-hoc pass (200 examples, 25 batches of 8) | post-hoc s | Traceprop inline overhead, one epoch (25 steps), s | ratio | ratio, overhead at CI upper end |"
    )
    print("|---|---|---|---|---|---|")
    what = {
        "overhead_logix": "LogIX: fwd+bwd with LoGRA logging (rank 8, random init) + grad covariance, finalize",
        "overhead_bergson": "bergson: `collect_gradients` (core of `bergson build`), projection_dim 8",
        "posthoc_kronfluence": "kronfluence: EK-FAC `fit_all_factors` + `compute_pairwise_scores` (8 queries)",
    }
    for bench, desc in what.items():
        for r in reps:
            d = load(f"{bench}_{r}")
            if d is None or "posthoc" not in d:
                continue
            p = d["posthoc"]
            extra = ""
            if "factors_s" in p:
                extra = f" (factors {p['factors_s']:.1f} s = {p['factors_over_inline_ratio']:.0f}x; scores {p['scores_s']:.1f} s)"
            print(
                f"| {r} | {desc} | {p['posthoc_s']:.2f}{extra} | {p['traceprop_inline_overhead_s_one_epoch']:.3f} | "
                f"**{p['posthoc_over_inline_ratio']:.0f}x** | {p['posthoc_over_inline_ratio_ci_upper']:.0f}x |"
            )


def quality_table(seeds=("s0", "s1")):
    cols = {}  # method -> {seed: (lds, lo, hi)}
    info = {}
    for sd in seeds:
        for peer in ("kronfluence", "logix", "bergson"):
            d = load(f"quality_{peer}_{sd}")
            if d is None:
                continue
            info[sd] = d
            for r in d["rows"]:
                cols.setdefault(r["method"], {})[sd] = (r["lds"], r["ci_low"], r["ci_high"])
            for r in d["traceprop_rows_from_eval_dir"]:
                nm = (
                    r["method"]
                    if r["family"] == "baseline"
                    else (
                        f"Traceprop {r['method']} (k={r['k']})"
                        if r["family"] == "dense"
                        else f"Traceprop k={r['k']} {r['method']}"
                    )
                )
                cols.setdefault(nm, {})[sd] = (r["lds"], r["ci_low"], r["ci_high"])
    if not info:
        print("(no quality results)")
        return
    for sd, d in info.items():
        print(
            f"- {sd}: eval dir `{d['eval_dir']}`: {d['n_train']} train / {d['n_eval']} eval examples, {d['n_subsets']} subsets"
        )
    print()
    print("| method | " + " | ".join(f"LDS {sd} (95 % CI)" for sd in info) + " |")
    print("|---|" + "---|" * len(info))

    def key(m):
        return (
            0
            if m.startswith("Traceprop")
            else 1
            if m.split()[0] in ("kronfluence", "logix", "bergson")
            else 2
        )

    for m in sorted(cols, key=key):
        cells = []
        for sd in info:
            v = cols[m].get(sd)
            cells.append(
                "–" if v is None or v[0] is None else f"{v[0]:.3f} ({v[1]:.3f} .. {v[2]:.3f})"
            )
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "overhead"):
        overhead_table()
        print()
    if which in ("all", "readiness"):
        readiness_table()
        print()
    if which in ("all", "quality"):
        quality_table()
