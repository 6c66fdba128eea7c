"""Evaluation of attribution quality: linear datamodeling score (LDS) and detection benchmarks.

- :mod:`.lds`: retrain on random subsets, correlate predicted influence sums with the
  retrained models' test losses (``traceprop eval lds``); its parts are :mod:`.lds_settings`
  (settings, ``--config`` specs, file names), :mod:`.lds_retrain` (subsets and their retrains),
  :mod:`.lds_scoring` (every method's scores) and :mod:`.lds_report` (the statistic, results).
- :mod:`.detection`: planted mislabels and a planted backdoor with known ground truth,
  ranked by attribution scores and by simple baselines (``traceprop eval detect``).
"""

from __future__ import annotations

from .detection import DetectSettings, auroc, precision_at_k, run_detection
from .lds import run_lds
from .lds_report import bootstrap_ci, lds_scores, spearman_rows
from .lds_settings import LdsSettings

__all__ = [
    "DetectSettings",
    "LdsSettings",
    "auroc",
    "bootstrap_ci",
    "lds_scores",
    "precision_at_k",
    "run_detection",
    "run_lds",
    "spearman_rows",
]
