"""Evaluation of attribution quality: linear datamodeling score (LDS) and detection benchmarks.

- :mod:`.lds`: retrain on random subsets, correlate predicted influence sums with the
  retrained models' test losses (``traceprop eval lds``); its parts are :mod:`.lds_settings`
  (settings, ``--config`` specs, file names), :mod:`.lds_retrain` (subsets and their retrains),
  :mod:`.lds_scoring` (every method's scores) and :mod:`.lds_report` (the statistic, results).
- :mod:`.detection`: planted mislabels and a planted backdoor with known ground truth,
  ranked by attribution scores and by simple baselines (``traceprop eval detect``).
"""

from __future__ import annotations

# imported on first use: `evaluate.pareto` (the app's Runs page, `traceprop info`) must not pull
# torch through the LDS and detection modules
_LAZY = {
    "DetectSettings": ".detection",
    "auroc": ".detection",
    "precision_at_k": ".detection",
    "run_detection": ".detection",
    "run_lds": ".lds",
    "bootstrap_ci": ".lds_report",
    "goal_checks": ".lds_report",
    "paired_delta": ".lds_report",
    "per_example_of": ".lds_report",
    "scored_row": ".lds_report",
    "lds_scores": ".lds_report",
    "spearman_rows": ".lds_report",
    "LdsSettings": ".lds_settings",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DetectSettings",
    "LdsSettings",
    "auroc",
    "bootstrap_ci",
    "goal_checks",
    "paired_delta",
    "per_example_of",
    "scored_row",
    "lds_scores",
    "precision_at_k",
    "run_detection",
    "run_lds",
    "spearman_rows",
]
