"""Two answers to the same query side by side: how much their rankings overlap and how each
example's rank changed (two preconditioners on one run, or two runs).

Both inputs are the ``rows`` of a :class:`~traceprop_engine.attribution.query.QueryResult`
(``rank``, ``kind``, ``score``, ``example_id``, ``source``, ``row``, ``text``). Examples are
matched by ``source`` and ``row`` (their lineage), so two runs trained on the same files compare
even when their example ids differ; rows without lineage fall back to the example id.
"""

from __future__ import annotations

import polars as pl

KINDS = ("proponent", "opponent")


def _keyed(rows: pl.DataFrame) -> pl.DataFrame:
    has_lineage = (pl.col("source") != "") & pl.col("source").is_not_null()
    key = (
        pl.when(has_lineage)
        .then(pl.col("source") + ":" + pl.col("row").cast(pl.Utf8))
        .otherwise(pl.lit("#") + pl.col("example_id").cast(pl.Utf8))
    )
    return rows.with_columns(key.alias("key"))


def overlap(a: pl.DataFrame, b: pl.DataFrame, k: int | None = None) -> pl.DataFrame:
    """Per kind (proponent, opponent) the overlap of the top ``k`` of ``a`` and of ``b``.

    Returns:
        ``kind, k, in_a, in_b, shared, jaccard, overlap_at_k`` where ``shared`` counts examples
        in both top-k lists, ``jaccard = shared / |A ∪ B|`` and ``overlap_at_k = shared / k``
        (``k`` defaults to the longer list of that kind; NaN when both lists are empty).

    Raises:
        ValueError: ``k`` < 1.
    """
    if k is not None and k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    a, b = _keyed(a), _keyed(b)
    out = []
    for kind in KINDS:
        ra = a.filter(pl.col("kind") == kind).sort("rank")
        rb = b.filter(pl.col("kind") == kind).sort("rank")
        kk = k if k is not None else max(ra.height, rb.height)
        sa = set(ra["key"].head(kk).to_list())
        sb = set(rb["key"].head(kk).to_list())
        union = len(sa | sb)
        shared = len(sa & sb)
        out.append(
            {
                "kind": kind,
                "k": kk,
                "in_a": len(sa),
                "in_b": len(sb),
                "shared": shared,
                "jaccard": shared / union if union else float("nan"),
                "overlap_at_k": shared / kk if kk else float("nan"),
            }
        )
    return pl.DataFrame(out)


def rank_changes(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Every example in either answer with its kind, rank and score in each, and the change.

    Returns:
        ``source, row, text, kind_a, rank_a, score_a, kind_b, rank_b, score_b, rank_change,
        status``: ``rank_change = rank_a - rank_b`` (> 0: ranked higher in ``b``) when the
        example is of the same kind in both, else null; ``status`` is ``both``, ``only a``,
        ``only b`` or ``flipped`` (a proponent in one, an opponent in the other). Sorted by
        the best rank in ``a``, then in ``b``.
    """
    cols = ["key", "kind", "rank", "score"]
    ka, kb = _keyed(a), _keyed(b)
    info = pl.concat(
        [
            ka.select("key", "source", "row", "text"),
            kb.select("key", "source", "row", "text"),
        ]
    ).unique("key", keep="first", maintain_order=True)
    sa = ka.select(cols).rename({c: f"{c}_a" for c in cols[1:]})
    sb = kb.select(cols).rename({c: f"{c}_b" for c in cols[1:]})
    df = info.join(sa, on="key", how="left").join(sb, on="key", how="left")
    same = pl.col("kind_a") == pl.col("kind_b")
    status = (
        pl.when(pl.col("kind_b").is_null())
        .then(pl.lit("only a"))
        .when(pl.col("kind_a").is_null())
        .then(pl.lit("only b"))
        .when(same)
        .then(pl.lit("both"))
        .otherwise(pl.lit("flipped"))
    )
    df = df.with_columns(
        pl.when(same).then(pl.col("rank_a") - pl.col("rank_b")).alias("rank_change"),
        status.alias("status"),
    )
    return df.sort(["rank_a", "rank_b"], nulls_last=True).select(
        "source",
        "row",
        "text",
        "kind_a",
        "rank_a",
        "score_a",
        "kind_b",
        "rank_b",
        "score_b",
        "rank_change",
        "status",
    )
