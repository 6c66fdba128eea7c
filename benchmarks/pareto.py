"""Quality per byte per FLOP: the Pareto table and figure of every tracking configuration tried.

Reads ``benchmarks/results/pareto.json`` (one entry per configuration; every number measured
with the command named in its ``source``: LDS per data set from ``traceprop eval lds``,
overhead and bytes per example from ``traceprop bench overhead``) and writes

- ``benchmarks/results/pareto.md``: the table, configurations on the front marked;
- ``benchmarks/results/pareto_figure.json``: a plotly figure (``fig.to_json()``): mean LDS
  against overhead, marker size = bytes per example.

    python benchmarks/pareto.py
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from traceprop_engine.evaluate.pareto import PARETO_FILE, front, load_measured

OUT = Path(PARETO_FILE).parent


def main() -> None:
    sets, rows = load_measured()
    on_front = {r.name for r in front(rows)}
    head = (
        "| configuration | "
        + " | ".join(sets)
        + " | mean LDS | overhead | bytes / example | front |\n"
    )
    head += "|---" * (len(sets) + 5) + "|\n"
    lines = [
        f"| {r.name}{' **(default)**' if r.default else ''} | "
        + " | ".join(f"{r.lds[d]:.3f}" for d in sets)
        + f" | {r.lds_mean:.3f} | {r.overhead_pct:+.1f} % | {r.bytes_per_example:.0f} | "
        + ("yes" if r.name in on_front else "")
        + " |"
        for r in sorted(rows, key=lambda r: -r.lds_mean)
    ]
    (OUT / "pareto.md").write_text(head + "\n".join(lines) + "\n")
    fig = go.Figure()
    for is_front in (True, False):
        sel = [r for r in rows if (r.name in on_front) == is_front]
        fig.add_trace(
            go.Scatter(
                x=[r.overhead_pct for r in sel],
                y=[r.lds_mean for r in sel],
                text=[f"{r.name} ({r.bytes_per_example:.0f} B)" for r in sel],
                mode="markers+text",
                textposition="top center",
                marker={"size": [8 + r.bytes_per_example / 500 for r in sel]},
                name="Pareto front" if is_front else "dominated",
            )
        )
    fig.update_layout(
        title=f"Mean LDS over {', '.join(sets)} vs training-step overhead (marker: bytes/example)",
        xaxis_title="overhead, % (traceprop bench overhead, default tiny model, 1 thread)",
        yaxis_title="mean LDS",
    )
    (OUT / "pareto_figure.json").write_text(fig.to_json())
    print((OUT / "pareto.md").read_text())


if __name__ == "__main__":
    main()
