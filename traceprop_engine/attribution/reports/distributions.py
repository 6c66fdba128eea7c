"""How a query's influence is spread over all training examples: a histogram of the exact
scores with shared bins for proponents (> 0) and opponents (< 0)."""

from __future__ import annotations

import numpy as np
import polars as pl


def score_histogram(scores: np.ndarray, bins: int = 40) -> pl.DataFrame:
    """Counts of ``scores`` in ``bins`` equal-width bins, split by sign.

    When the scores have both signs, 0 is a bin edge (the bins on each side share one width as
    far as ``bins`` allows), so no bin mixes proponents and opponents.

    Returns:
        ``left, right, center, proponents, opponents, zero`` per bin: ``proponents`` counts
        scores > 0, ``opponents`` scores < 0 and ``zero`` exact zeros in that bin; the counts
        of all bins add up to ``len(scores)`` (the last bin includes its right edge).

    Raises:
        ValueError: no scores, a non-finite score, or ``bins`` < 1.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    if s.size == 0:
        raise ValueError("no scores to histogram")
    if not np.isfinite(s).all():
        raise ValueError(f"{int((~np.isfinite(s)).sum())} scores are not finite")
    lo, hi = float(s.min()), float(s.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    edges = _edges(lo, hi, bins)
    pos, _ = np.histogram(s[s > 0], edges)
    neg, _ = np.histogram(s[s < 0], edges)
    zero, _ = np.histogram(s[s == 0], edges)
    return pl.DataFrame(
        {
            "left": edges[:-1],
            "right": edges[1:],
            "center": (edges[:-1] + edges[1:]) / 2,
            "proponents": pos.astype(np.int64),
            "opponents": neg.astype(np.int64),
            "zero": zero.astype(np.int64),
        }
    )


def _edges(lo: float, hi: float, bins: int) -> np.ndarray:
    if not lo < 0 < hi or bins < 2:
        return np.linspace(lo, hi, bins + 1)
    n_neg = min(max(1, round(bins * -lo / (hi - lo))), bins - 1)
    return np.concatenate([np.linspace(lo, 0, n_neg + 1), np.linspace(0, hi, bins - n_neg + 1)[1:]])
