"""Ranking: FAISS candidates re-scored exactly, split by sign, and shown as example rows.

Positive score = proponent (the example pushed the model toward the test output; up-weighting
it lowers the test loss), negative = opponent. FAISS only proposes candidates from both ends
of the ranking; every returned score is the exact one from the store.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl

from ... import constants as C
from ..precondition.preconditioner import Preconditioner

SIGN_NOTE = (
    "score > 0: proponent (the example pushed the model toward this output; up-weighting it "
    "lowers the test loss); score < 0: opponent (it pushed the model away)"
)
CLASS_PRIOR_LAYER = "class prior"
"""The name of a classification query's class prior among a hit's per-layer scores (the last
entry of ``layer_scores``; ``AttributionRun.class_prior_scores``)."""
LM_BIAS_LAYER = "LM bias"
"""The name of a causal-LM query's LM-bias term among a hit's per-layer scores (the last entry
of ``layer_scores``; ``AttributionRun.lm_bias_scores``)."""
CANDIDATES = 4
"""FAISS returns at least ``CANDIDATES · top_k`` rows per side for the exact re-rank."""
MIN_CANDIDATES = 1000
"""... and at least this many, and ``n / CANDIDATE_FRACTION`` on large indexes (up to
``MAX_CANDIDATES``): the index holds a compressed projection of each example's vector, so the
true top 10 can rank far down its list (recall per candidate count: ``traceprop bench query
--end-to-end``, benchmarks/README.md §2b)."""
CANDIDATE_FRACTION = 30
MAX_CANDIDATES = 4000

_EMPTY_ROWS = {
    "rank": pl.Int64,
    "kind": pl.Utf8,
    "score": pl.Float64,
    "example_id": pl.Int64,
    "source": pl.Utf8,
    "row": pl.Int64,
    "sha256": pl.Utf8,
    "text": pl.Utf8,
    "label": pl.Utf8,
    "layer_scores": pl.Utf8,
}


def n_candidates(top_k: int, n: int, lists: bool = False) -> int:
    """How many rows per side FAISS proposes for the exact re-rank of ``top_k`` (of ``n``).

    With factor lists (``index/lists.py``) beside it, FAISS proposes no more than
    ``MIN_CANDIDATES``: the lists find what more FAISS candidates would, for less time."""
    grow = 0 if lists else min(n // CANDIDATE_FRACTION, MAX_CANDIDATES)
    want = max(CANDIDATES * top_k, MIN_CANDIDATES, grow)
    return min(want, n)


ALL_ZERO_NOTE = (
    "every training example scores exactly 0 for this query, so none supports or opposes it: "
    "the query's loss has no gradient at the tracked layers, or the run's learning rate was 0 "
    "(scores are weighted by the learning rate of each step)"
)
ZERO_LR_NOTE = (
    "every step of this run was recorded with learning rate 0 (e.g. --lr 0): the model did not "
    "learn from any example, and every learning-rate-weighted score is 0"
)


def signed_hits(
    cand: np.ndarray, per_layer: np.ndarray, top_k: int, opponents: bool
) -> tuple[list[tuple], list[str]]:
    """``(kind, rank, vector row, score, per-layer scores)`` of the re-ranked candidates, by sign.

    ``cand`` are the index rows FAISS proposed (both ends of the ranking) and ``per_layer`` their
    exact (L, n) scores. A proponent has score > 0 and an opponent score < 0, so an example is
    in at most one list and a zero score in none; a note says when a list is shorter than
    ``top_k``.
    """
    exact = per_layer.sum(0)
    if exact.size and not np.any(exact):
        return [], [ALL_ZERO_NOTE]
    kinds = [("proponent", np.argsort(-exact, kind="stable"), 1.0, "positive")]
    if opponents:
        kinds.append(("opponent", np.argsort(exact, kind="stable"), -1.0, "negative"))
    hits, notes = [], []
    for kind, order, sign, word in kinds:
        keep = [int(j) for j in order[sign * exact[order] > 0][:top_k]]
        hits += [
            (kind, rank, int(cand[j]), float(exact[j]), per_layer[:, j])
            for rank, j in enumerate(keep, start=1)
        ]
        if len(keep) < top_k:
            notes.append(
                f"{len(keep)} {kind}{'s' if len(keep) != 1 else ''} of the {top_k} asked: no "
                f"other indexed training example has a {word} score"
            )
    return hits, notes


def hit_rows(
    hits: list[tuple],
    ids: np.ndarray,
    pre: Preconditioner,
    examples: pl.DataFrame,
    records: dict | None = None,
    term: str | None = CLASS_PRIOR_LAYER,
) -> pl.DataFrame:
    """The result table of :func:`signed_hits`: one row per hit with its example's lineage and
    per-layer score shares (and a query-time term's, named ``term``, after them: a class prior,
    :data:`CLASS_PRIOR_LAYER`, or the LM-bias term, :data:`LM_BIAS_LAYER`); with ``records`` (a
    per-record index) the record, step and epoch."""
    out = []
    for kind, rank, v, score, layer_scores in hits:
        e = int(ids[v])
        r = examples.row(e, named=True)
        names = pre.layer_names
        if len(layer_scores) == len(names) + 1:  # the query-time term, scored after the layers
            names = [*names, term or CLASS_PRIOR_LAYER]
        shares = {name: float(x) for name, x in zip(names, layer_scores, strict=True)}
        row = {
            "rank": rank,
            "kind": kind,
            "score": score,
            "example_id": e,
            "source": r["source"],
            "row": r["row"],
            "sha256": r["sha256"],
            "text": r["text"],
            "label": r["label"],
            "layer_scores": json.dumps(shares),
        }
        if records is not None:
            row["record"] = v
            row["step"] = int(records[C.REC_STEP][v])
            row["epoch"] = int(records[C.REC_EPOCH][v])
        out.append(row)
    if not out:
        return pl.DataFrame(schema=_EMPTY_ROWS)
    return pl.DataFrame(out)


def source_influence(scores: np.ndarray, sources: np.ndarray) -> pl.DataFrame:
    """Total, positive and negative influence and example count per source file, by total."""
    df = pl.DataFrame({"source": sources, "score": scores})
    return (
        df.group_by("source")
        .agg(
            pl.col("score").sum().alias("total"),
            pl.col("score").clip(lower_bound=0).sum().alias("positive"),
            pl.col("score").clip(upper_bound=0).sum().alias("negative"),
            pl.len().alias("examples"),
        )
        .sort("total", descending=True)
    )


def example_table(store) -> tuple[pl.DataFrame, list[str]]:
    """The run's example table (example_id, source, row, sha256, split, text, prompt,
    completion, label) and a note when the store has none (rows then show ids only)."""
    notes: list[str] = []
    ex = store.examples()
    if not ex:  # a store written without an example table (Tracker used without lineage)
        n = int(store.records()[C.REC_EXAMPLE].max()) + 1 if store.n_records else 0
        empty = np.array([""] * n, dtype=object)
        ex = {
            C.EX_SOURCE: empty,
            C.EX_ROW: np.zeros(n, np.int64),
            C.EX_SHA256: empty,
            C.EX_SPLIT: np.array([C.SPLIT_TRAIN] * n, dtype=object),
            C.EX_TEXT: empty,
            C.EX_PROMPT: empty,
            C.EX_COMPLETION: empty,
            C.EX_LABEL: empty,
        }
        notes = ["this store has no example table (no lineage): rows show example ids only"]
    n = len(ex[C.EX_SOURCE])
    text = [
        (p + c) if p or c else t
        for p, c, t in zip(ex[C.EX_PROMPT], ex[C.EX_COMPLETION], ex[C.EX_TEXT], strict=True)
    ]
    table = pl.DataFrame(
        {
            "example_id": np.arange(n, dtype=np.int64),
            "source": ex[C.EX_SOURCE],
            "row": ex[C.EX_ROW],
            "sha256": ex[C.EX_SHA256],
            "split": ex[C.EX_SPLIT],
            "text": text,
            "prompt": ex[C.EX_PROMPT],
            "completion": ex[C.EX_COMPLETION],
            "label": ex[C.EX_LABEL],
        }
    )
    return table, notes
