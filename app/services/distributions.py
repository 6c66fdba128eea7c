"""The Distributions views' data: a query's scores over every training example, and the
query-independent rankings of ``traceprop rank`` (self-influence, gradient norm, loss)."""

from __future__ import annotations

import os

import polars as pl
import streamlit as st

from traceprop_engine.attribution import score_histogram

from .queries import open_cached

__all__ = ["RANK_BY", "all_scores", "cached_rank_by", "rank_by", "score_histogram"]

RANK_BY = ("self-influence", "gradient-norm", "loss")
RANK_HELP = {
    "self-influence": "τ(i, i): how much an example influences its own loss under the "
    "preconditioner. High values: examples the model finds hard or atypical (mislabelled, "
    "rare, or duplicated text).",
    "gradient-norm": "the norm of the example's recorded gradient sketch (no preconditioner).",
    "loss": "the example's training loss at the last step that recorded it.",
}


def all_scores(run_dir: str | os.PathLike, result, preconditioner: str) -> pl.DataFrame:
    """``example_id, source, row, score`` of every indexed training example for the query of
    ``result`` (:meth:`~traceprop_engine.attribution.query.AttributionRun.example_scores`); the
    Influencers page gets the same table from its query (``run_query_and_scores``)."""
    from traceprop_engine.settings import IndexSettings

    run, lock = open_cached(run_dir)
    with lock:
        return run.example_scores(result, IndexSettings(preconditioner=preconditioner))


def rank_by(run_dir: str | os.PathLike, by: str, preconditioner: str) -> pl.DataFrame:
    """:func:`~traceprop_engine.attribution.reports.outliers.rank_examples` of a run
    (``traceprop rank``).

    Raises:
        TracepropError: the run cannot be opened or lacks what ``by`` needs.
        ConfigError: an unknown ``by``.
    """
    from traceprop_engine.attribution import rank_examples
    from traceprop_engine.settings import IndexSettings

    run, lock = open_cached(run_dir)
    with lock:
        return rank_examples(run, by, IndexSettings(preconditioner=preconditioner))


@st.cache_data(max_entries=16, show_spinner=False)
def cached_rank_by(run_dir: str, mtime: float, by: str, preconditioner: str) -> pl.DataFrame:
    """:func:`rank_by` cached per run path + manifest mtime (paging and filtering rerun the page)."""
    return rank_by(run_dir, by, preconditioner)
