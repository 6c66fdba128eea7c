"""A query's candidates for the exact re-rank (``AttributionRun.rank``).

Three searches propose rows, side by side on the query's threads (``score/two_hands.py``):
FAISS's two ends over the index vectors; the factor lists' scans of the dominant layers'
records (``lists.py``); for a classification query scored with a class prior
(``score/class_prior.py``), FAISS again among the queried label's rows for proponents and among
the other labels' rows for opponents; and for a causal-LM query scored with the LM-bias term
(``score/lm_bias.py``), the rows of its largest and smallest terms (a product over the rows'
bias directions, ``k_out`` numbers a row). The prior moves a whole class up or down, so with a large
prior the top proponents are the queried label's best rows even where other labels' rows
outscore them on the records alone: the label searches find those rows in an index of any size.
Every candidate is then scored exactly; the searches only decide which rows are looked at.
"""

from __future__ import annotations

import numpy as np

from ..score.ranking import n_candidates
from ..score.two_hands import both
from .lists import list_jobs, sorted_unique


def candidates(
    index, scorer, qv: np.ndarray, sketches, top_k: int, opponents: bool, sides=None, bias=None
) -> tuple[np.ndarray, object]:
    """``(rows, prepared)``: the sorted candidate rows of one query (index vector ``qv`` (1, D),
    per-layer ``sketches``) and the query's ``scorer.prepared_lazily(...)`` when the lists made it
    (the re-rank reuses its pullbacks and factored ``T'``), else None. ``sides``: the
    ``(same label, other labels)`` row masks of a classification query with a class prior
    (``RowClasses.sides``), or None. ``bias``: a causal-LM query's LM-bias term's candidates,
    a function of how many rows a side (``HeadBias.ends``), or None."""
    lists = scorer.lists is not None
    k = n_candidates(top_k, index.n, lists)
    prepared = scorer.prepared_lazily(sketches) if lists else None
    scans = list_jobs(scorer, sketches, opponents, prepared) if lists else []
    ends, join = index.search_ends(qv, k)
    labelled = []
    if sides is not None and k < index.n:  # all rows are candidates otherwise
        same, other = sides
        labelled.append(lambda: index.search_among(qv, k, same, 1.0)[1][0])
        if opponents:
            labelled.append(lambda: index.search_among(qv, k, other, -1.0)[1][0])
    if bias is not None and k < index.n:
        labelled.append(lambda: bias(k))
    got = both(*ends, *labelled, *scans)  # FAISS's jobs first: the longest
    res = join(got[: len(ends)])
    found = got[len(ends) :]
    cand = [res.proponent_ids[0], res.opponent_ids[0] if opponents else [], *found[: len(labelled)]]
    cand = np.concatenate(cand)
    return sorted_unique(cand[cand >= 0], *found[len(labelled) :]), prepared
