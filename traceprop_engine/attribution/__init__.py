"""Attribution: which training examples made a trained run's model produce a given output.

This module is the front door: code outside ``attribution/`` (the other engine packages, the
CLI, the app, benchmarks) imports from here only (``tests/test_layout.py`` checks it). Open a
run with :func:`open_run` and ask :meth:`AttributionRun.query` (a :class:`Query` or its
fields); the rest are what a query returns, the model's half in a process of its own
(:class:`QueryWorker`), and the reports built on a run or a result. Every name is imported on
first use: ``import traceprop_engine.attribution`` loads no torch, FAISS or polars, and opening
a run and ranking load no torch either (only the model's half, ``model_side/``, imports torch).

Inside, one sub-package per concept (``docs/architecture.md``): ``precondition/`` (``H^{-1/2}``
per layer, the index vectors), ``index/`` (FAISS candidates, locked atomic builds, staleness),
``score/`` (exact scores from the stored records, the re-rank, the signed ranking),
``model_side/`` (the model's half of a query), ``reports/`` (exports, audit trails, comparisons,
distributions, query-independent rankings), and the facade at the top (``query.py``,
``query_input.py``, ``result.py``, ``overview.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr

# name -> the module (relative to this package) that owns it
_LAZY = {
    # the facade: open a run, query it, what a query returns
    "open_run": ".query",
    "AttributionRun": ".query",
    "Query": ".query_input",
    "QueryResult": ".result",
    "TestSide": ".result",
    "ModelAnswer": ".result",
    "TokenContributions": ".result",
    "IndexSettings": "traceprop_engine.settings",
    "RunOverview": ".overview",
    "describe": ".overview",
    "example_tokens": ".overview",
    # the model's half (torch), here or in a process of its own
    "QueryWorker": ".model_side.worker",
    "WorkerUnavailable": ".model_side.worker",
    "model_answer": ".model_side.answer",
    "token_contributions": ".model_side.tokens",
    "query_targets": ".model_side.test_side",
    "excess_kurtosis": ".column_choice",  # how peaked a query's scores are (its record columns)
    # the fitted preconditioner (H^-1/2 per layer) every index and score of a run goes through
    "Preconditioner": ".precondition.preconditioner",
    # scores beyond one query
    "factor_scores": ".score.factor_scores",
    "HeadBias": ".score.lm_bias",  # the index rows' LM-bias directions (IndexSettings.lm_bias)
    "source_influence": ".score.ranking",
    # reports on a run or a result
    "rows_for_export": ".reports.export",
    "write_rows": ".reports.export",
    "write_csv": ".reports.export",
    "csv_bytes": ".reports.export",
    "export_with_query": ".reports.export",
    "audit_trail": ".reports.audit",
    "audit_rows": ".reports.audit",
    "overlap": ".reports.compare",
    "rank_changes": ".reports.compare",
    "score_histogram": ".reports.distributions",
    "RankBy": ".reports.outliers",
    "rank_examples": ".reports.outliers",
}

__all__ = [
    "AttributionRun",
    "HeadBias",
    "IndexSettings",
    "ModelAnswer",
    "Preconditioner",
    "Query",
    "QueryResult",
    "QueryWorker",
    "RankBy",
    "RunOverview",
    "TestSide",
    "TokenContributions",
    "WorkerUnavailable",
    "audit_rows",
    "audit_trail",
    "csv_bytes",
    "describe",
    "example_tokens",
    "excess_kurtosis",
    "export_with_query",
    "factor_scores",
    "model_answer",
    "open_run",
    "overlap",
    "query_targets",
    "rank_changes",
    "rank_examples",
    "rows_for_export",
    "score_histogram",
    "source_influence",
    "token_contributions",
    "write_csv",
    "write_rows",
]  # the names of _LAZY (tests/test_layout.py checks they agree)

if TYPE_CHECKING:
    from traceprop_engine.settings import IndexSettings

    from .column_choice import excess_kurtosis
    from .model_side.answer import model_answer
    from .model_side.test_side import query_targets
    from .model_side.tokens import token_contributions
    from .model_side.worker import QueryWorker, WorkerUnavailable
    from .overview import RunOverview, describe, example_tokens
    from .precondition.preconditioner import Preconditioner
    from .query import AttributionRun, open_run
    from .query_input import Query
    from .reports.audit import audit_rows, audit_trail
    from .reports.compare import overlap, rank_changes
    from .reports.distributions import score_histogram
    from .reports.export import csv_bytes, export_with_query, rows_for_export, write_csv, write_rows
    from .reports.outliers import RankBy, rank_examples
    from .result import ModelAnswer, QueryResult, TestSide, TokenContributions
    from .score.factor_scores import factor_scores
    from .score.lm_bias import HeadBias
    from .score.ranking import source_influence


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
