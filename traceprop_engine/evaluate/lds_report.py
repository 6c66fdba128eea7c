"""The LDS statistic and its report: Spearman per eval example, bootstrap interval, results files.

:func:`lds_scores` correlates, for every eval example, the predicted sum of attribution scores
over each subset with the negated loss of the model retrained on it; :func:`summarize` averages
over eval examples with a percentile-bootstrap interval. :func:`write_results` writes
``results.json``, ``results.csv`` and the plotly ``figure.json`` of the evaluation directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .lds_settings import (
    DEFAULT_METHOD,
    FIGURE_FILE,
    PRECONDITIONERS,
    RESULTS_CSV,
    RESULTS_JSON,
    LdsSettings,
    atomic_write_text,
)


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman correlation of each row of ``x`` with the same row of ``y`` (ties: average ranks).

    Args:
        x, y: ``(n, m)`` arrays.

    Returns:
        ``(n,)`` correlations; ``nan`` where a row is constant (the correlation is undefined).
    """
    from scipy.stats import rankdata

    x, y = np.atleast_2d(x), np.atleast_2d(y)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have one shape, got {x.shape} and {y.shape}")
    rx = rankdata(x, axis=1)  # (n, m)
    ry = rankdata(y, axis=1)
    rx -= rx.mean(1, keepdims=True)
    ry -= ry.mean(1, keepdims=True)
    den = np.sqrt((rx * rx).sum(1) * (ry * ry).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(1) / np.where(den > 0, den, 1.0), np.nan)


def bootstrap_ci(
    values: np.ndarray, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (``nan`` entries dropped)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if len(v) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(1)  # (n_boot,)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return float(lo), float(hi)


def lds_scores(scores: np.ndarray, masks: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """Per-eval-example LDS correlations.

    Args:
        scores: ``(n_eval, n_train)`` attribution scores ``τ(e, i)`` (positive = proponent).
        masks: ``(m, n_train)`` boolean subset membership.
        losses: ``(m, n_eval)`` loss of eval example ``e`` under the model trained on subset ``j``.

    Returns:
        ``(n_eval,)`` Spearman correlations between ``Σ_{i∈S_j} τ(e, i)`` and ``-losses[j, e]``.
    """
    pred = masks.astype(np.float64) @ scores.T.astype(np.float64)  # (m, n_eval)
    return spearman_rows(pred.T, -losses.T.astype(np.float64))


def summarize(per_example: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict:
    lo, hi = bootstrap_ci(per_example, n_boot, seed=seed)
    valid = ~np.isnan(per_example)
    return {
        "lds": float(np.mean(per_example[valid])) if valid.any() else float("nan"),
        "ci_low": lo,
        "ci_high": hi,
        "n_eval": int(len(per_example)),
        "n_valid": int(valid.sum()),
    }


GOALS = (("full-gradient cosine", 0.0), ("bm25", 0.05), ("same label", 0.05))
"""Issue 26's bars for the default row, as ``(reference row, margin)``: at least full-gradient
cosine on the final model, BM25 + 0.05 and, for a classifier, the same-label baseline + 0.05."""


def paired_delta(
    x: np.ndarray, y: np.ndarray, plus: float = 0.0, n_boot: int = 2000, seed: int = 0
) -> dict:
    """``x − (y + plus)`` per eval example (two rows scored on the same examples of the same
    retrains, ``nan`` dropped where either is): its mean, 95 % bootstrap interval and a verdict,
    ``above`` / ``below`` when the interval excludes 0, ``tie`` otherwise. The pairing cancels
    what the two rows share (an eval example that no method predicts well), so the interval is
    far tighter than either row's own."""
    d = np.asarray(x, dtype=np.float64) - (np.asarray(y, dtype=np.float64) + plus)
    lo, hi = bootstrap_ci(d, n_boot, seed=seed)
    valid = ~np.isnan(d)
    mean = float(d[valid].mean()) if valid.any() else float("nan")
    verdict = "above" if lo > 0 else "below" if hi < 0 else "tie"
    return {"delta": mean, "ci": [lo, hi], "verdict": verdict}


def per_example_of(row: dict) -> np.ndarray:
    """A table row's per-example LDS as floats (``None`` read as ``nan``)."""
    return np.array([np.nan if v is None else v for v in row["per_example"]], dtype=np.float64)


def scored_row(table: list[dict], method: str, main_k=None) -> dict | None:
    """The row ``method`` with per-example values: the one of the run at ``main_k`` where a k
    sweep gives several (else the first), or None."""
    rows = [r for r in table if r["method"] == method and r.get("per_example")]
    return next((r for r in rows if r.get("k") == main_k), rows[0] if rows else None)


def goal_checks(table: list[dict], main_k=None, n_boot: int = 2000, seed: int = 0) -> list[dict]:
    """The default row (:func:`scored_row` at ``main_k``) against each :data:`GOALS` reference
    the table has, paired per eval example (:func:`paired_delta`); empty without a scored
    default row."""
    default = scored_row(table, DEFAULT_METHOD, main_k)
    if default is None:
        return []
    x = per_example_of(default)
    refs = ((ref, plus, scored_row(table, ref)) for ref, plus in GOALS)
    return [
        {"ref": ref, "plus": plus, **paired_delta(x, per_example_of(row), plus, n_boot, seed)}
        for ref, plus, row in refs
        if row is not None
    ]


def _finite(obj):
    """NaN -> None, so the JSON is standard (an undefined LDS reads as null)."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def write_results(
    eval_dir: Path,
    s: LdsSettings,
    table: list[dict],
    losses: np.ndarray,
    seconds: dict,
    noise_ceiling: dict | None = None,
    base_model: dict | None = None,
    goals: list[dict] | None = None,
) -> None:
    import csv

    doc = {
        "what": "LDS: mean over eval examples of Spearman(sum of scores over subset, -loss of the model retrained on it); "
        "95% percentile bootstrap interval over eval examples",
        "settings": s.to_dict(),
        "compact": [list(m) for m in s.compact],
        "n_subsets": s.n_subsets,
        "alpha": s.alpha,
        "n_eval": int(losses.shape[1]),
        "loss_mean_over_subsets": float(losses.mean()),
        "seconds": seconds,
        "retrain_seeds": s.retrain_seeds,
        "noise_ceiling": noise_ceiling,
        "base_model": base_model,
        "goals": goals or [],
        "rows": table,
    }
    atomic_write_text(eval_dir / RESULTS_JSON, json.dumps(_finite(doc), indent=1))
    cols = [
        "method",
        "family",
        "k",
        "preconditioner",
        "c",
        "lds",
        "ci_low",
        "ci_high",
        "n_eval",
        "n_valid",
        "error",
        "config",  # last: readers of the columns before it keep working
    ]
    tmp = eval_dir / (RESULTS_CSV + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    os.replace(tmp, eval_dir / RESULTS_CSV)
    atomic_write_text(eval_dir / FIGURE_FILE, lds_figure(table).to_json())


def _bar_label(row: dict) -> str:
    """The bar's x label; rows of a family scored at several k (compact storage) name their k."""
    if row.get("family") in (
        "factored", "k-sweep", "dense", "baseline", "exact", "config", "lever", "final-model",
    ):  # fmt: skip
        return row["method"]
    return f"{row['method']} (k={row['k']})" if row.get("k") is not None else row["method"]


def lds_figure(table: list[dict]):
    """Plotly figure: LDS ± CI per method (main table) and the k sweep per preconditioner."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("LDS by method (95% CI)", "k sweep (k_in = k_out)")
    )
    table = [r for r in table if r["lds"] is not None and not np.isnan(r["lds"])]
    main = [r for r in table if r.get("family") != "k-sweep"]
    fig.add_trace(
        go.Bar(
            x=[_bar_label(r) for r in main],
            y=[r["lds"] for r in main],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [r["ci_high"] - r["lds"] for r in main],
                "arrayminus": [r["lds"] - r["ci_low"] for r in main],
            },
            name="LDS",
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    sweep = [r for r in table if r.get("family") in ("factored", "k-sweep")]
    for p in PRECONDITIONERS:
        pts = sorted((r for r in sweep if r["preconditioner"] == p), key=lambda r: r["k"])
        if pts:
            fig.add_trace(
                go.Scatter(
                    x=[r["k"] for r in pts],
                    y=[r["lds"] for r in pts],
                    mode="lines+markers",
                    name=p,
                    error_y={
                        "type": "data",
                        "symmetric": False,
                        "array": [r["ci_high"] - r["lds"] for r in pts],
                        "arrayminus": [r["lds"] - r["ci_low"] for r in pts],
                    },
                ),
                row=1,
                col=2,
            )
    ks = sorted({r["k"] for r in sweep})
    refs = [
        r
        for r in table
        if r.get("family") == "exact" and r["preconditioner"] in ("identity", "kfac")
    ]
    refs += [r for r in table if r["method"] == "bm25"]
    for r in refs if ks else []:
        fig.add_trace(
            go.Scatter(
                x=[ks[0], ks[-1]],
                y=[r["lds"], r["lds"]],
                mode="lines",
                line={"dash": "dash"},
                name=r["method"],
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(
        type="log", title_text="k", tickvals=ks, ticktext=[str(k) for k in ks], row=1, col=2
    )
    fig.update_yaxes(title_text="LDS (Spearman)", row=1, col=1)
    fig.update_layout(title="Linear datamodeling score", height=420)
    return fig
