"""The nprobe of an IVF index: the smallest whose recall on calibration queries reaches a
target (:func:`tune_nprobe`, called by ``build.py`` when an index is built)."""

from __future__ import annotations

import numpy as np

from traceprop_engine.errors import ConfigError

from .vector_index import VectorIndex, _ivf_of


def tune_nprobe(
    vindex: VectorIndex,
    queries: np.ndarray,
    exact_ids: np.ndarray,
    target_recall: float = 0.95,
    exclude: np.ndarray | None = None,
    groups: np.ndarray | None = None,
) -> tuple[int, float]:
    """Smallest nprobe whose recall@k on ``queries`` reaches ``target_recall``.

    Args:
        queries: (q, dim) calibration queries.
        exact_ids: (q, k) exact top-k ids of those queries (or top-(k+1) with ``exclude``).
        target_recall: mean recall@k to reach.
        exclude: (q,) one id per query dropped from both answers (leave-one-out queries
            taken from the indexed vectors).
        groups: (q,) a group label per query (e.g. proponent and opponent searches); the
            recall that must reach the target is then the lowest of the groups' mean
            recalls, so one kind of search cannot carry the other.

    Returns:
        ``(nprobe, recall)``; ``vindex`` is left set to that nprobe.
    """
    ivf = _ivf_of(vindex.index)
    if ivf is None:
        raise ConfigError(f"nprobe applies to ivf/ivfpq indexes, this one is {vindex.kind.value}")
    q = vindex._prep(queries)
    k_search = exact_ids.shape[1]
    k = k_search - (exclude is not None)
    exact = _drop(exact_ids, exclude, k)

    def recall_at(p: int) -> float:
        vindex.set_nprobe(p)
        got = _drop(vindex._search_prepped(q, k_search)[1], exclude, k)
        if groups is None:
            return _recall(got, exact)
        return min(_recall(got[groups == g], exact[groups == g]) for g in np.unique(groups))

    # double until the target is reached, then bisect between the last two powers of two
    lo, hi = 0, 1
    rec_hi = recall_at(hi)
    while rec_hi < target_recall and hi < ivf.nlist:
        lo, hi = hi, min(hi * 2, ivf.nlist)
        rec_hi = recall_at(hi)
    while hi - lo > 1 and rec_hi >= target_recall:
        mid = (lo + hi) // 2
        rec_mid = recall_at(mid)
        if rec_mid >= target_recall:
            hi, rec_hi = mid, rec_mid
        else:
            lo = mid
    vindex.set_nprobe(hi)
    vindex.tuned_recall = rec_hi
    return hi, rec_hi


def _drop(ids: np.ndarray, exclude: np.ndarray | None, k: int) -> np.ndarray:
    if exclude is None:
        return ids[:, :k]
    return np.stack([row[row != ex][:k] for row, ex in zip(ids, exclude, strict=True)])


def _recall(got: np.ndarray, exact: np.ndarray) -> float:
    hits = [
        len(set(g[g >= 0]) & set(e[e >= 0])) / max(1, (e >= 0).sum())
        for g, e in zip(got, exact, strict=True)
    ]
    return float(np.mean(hits))
