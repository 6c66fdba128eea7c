"""Quality per byte per FLOP: the Pareto table and figure of every tracking configuration tried.

Reads ``benchmarks/results/pareto.json`` (one entry per configuration, every number measured
with the command recorded beside it: LDS per data set from ``traceprop eval lds``, overhead
from ``traceprop bench overhead``, bytes per example from the same bench) and writes

- ``benchmarks/results/pareto.md``: the table, with the configurations on the front marked;
- ``benchmarks/results/pareto_figure.json``: a plotly figure (``fig.to_json()``), LDS (mean
  over the data sets) against overhead, marker size = bytes per example.

A configuration is on the front when no other one has at least its mean LDS with at most its
overhead and bytes (and is strictly better in one of the three).

    python benchmarks/pareto.py
"""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go

HERE = Path(__file__).resolve().parent / "results"


def dominated(a: dict, b: dict) -> bool:
    """Is ``a`` dominated by ``b``?"""
    ge = b["lds_mean"] >= a["lds_mean"] and b["overhead_pct"] <= a["overhead_pct"]
    ge = ge and b["bytes_per_example"] <= a["bytes_per_example"]
    gt = (
        b["lds_mean"] > a["lds_mean"]
        or b["overhead_pct"] < a["overhead_pct"]
        or b["bytes_per_example"] < a["bytes_per_example"]
    )
    return ge and gt


def main() -> None:
    spec = json.loads((HERE / "pareto.json").read_text())
    sets = spec["datasets"]
    rows = spec["configurations"]
    for r in rows:
        r["lds_mean"] = sum(r["lds"][d] for d in sets) / len(sets)
    for r in rows:
        r["front"] = not any(dominated(r, o) for o in rows if o is not r)
    head = (
        "| configuration | "
        + " | ".join(sets)
        + " | mean LDS | overhead % | bytes / example | front |\n"
    )
    head += "|---" * (len(sets) + 5) + "|\n"
    lines = []
    for r in sorted(rows, key=lambda r: -r["lds_mean"]):
        cells = [f"{r['lds'][d]:.3f}" for d in sets]
        lines.append(
            f"| {r['name']}{' **(default)**' if r.get('default') else ''} | "
            + " | ".join(cells)
            + f" | {r['lds_mean']:.3f} | {r['overhead_pct']:+.1f} | {r['bytes_per_example']:.0f} | "
            + ("yes" if r["front"] else "")
            + " |"
        )
    refs = "\n".join(f"- {k}: {v}" for k, v in spec.get("references", {}).items())
    (HERE / "pareto.md").write_text(
        head + "\n".join(lines) + "\n\n" + refs + "\n\n" + spec.get("notes", "") + "\n"
    )
    fig = go.Figure()
    for front in (True, False):
        sel = [r for r in rows if r["front"] == front]
        fig.add_trace(
            go.Scatter(
                x=[r["overhead_pct"] for r in sel],
                y=[r["lds_mean"] for r in sel],
                text=[f"{r['name']} ({r['bytes_per_example']:.0f} B)" for r in sel],
                mode="markers+text",
                textposition="top center",
                marker={"size": [8 + r["bytes_per_example"] / 400 for r in sel]},
                name="Pareto front" if front else "dominated",
            )
        )
    for name, val in spec.get("reference_lines", {}).items():
        fig.add_hline(y=val, line_dash="dash", annotation_text=name)
    fig.update_layout(
        title=f"LDS (mean over {', '.join(sets)}) vs overhead; marker size = bytes per example",
        xaxis_title="training-step overhead, % (traceprop bench overhead)",
        yaxis_title="LDS (identity preconditioner unless named)",
    )
    (HERE / "pareto_figure.json").write_text(fig.to_json())
    print((HERE / "pareto.md").read_text())


if __name__ == "__main__":
    main()
