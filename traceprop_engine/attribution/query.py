"""Queries: the test-side sketch on the final model, preconditioned, searched in the index.

``AttributionRun`` is the Python API the CLI and the app share::

    run = AttributionRun("runs/my-run")
    result = run.query(prompt="Q: What colour is the planet Velmora?\\nA:", completion=" teal", top_k=10)
    result.rows          # polars DataFrame: rank, score, kind, example_id, source, row, sha256, text, ...

Scores: ``τ(test, i) = Σ_layers ⟨Ŝ_test, H⁻¹ Ŝ_i⟩`` with ``Ŝ_i`` the learning-rate-weighted sum
of example ``i``'s records (TracIn along the real trajectory). Positive = proponent: the example
pushed the model toward the test output (up-weighting it lowers the test loss); negative =
opponent.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from .. import constants as C
from ..errors import QueryError, RunError
from ..run import RunManifest
from ..settings import IndexSettings, StatisticsSource
from ..store.sharded import open_run_store
from .column_choice import resolve_columns
from .index.candidates import candidates
from .index.run_indexes import Progress, RunIndexes
from .index.vector_index import VectorIndex
from .model_side.test_side import TestSideMixin, query_targets
from .overview import resolve_settings, run_notes
from .precondition.preconditioner import Preconditioner
from .precondition.vectors import fit_preconditioner, gradient_norms
from .query_input import Query
from .query_terms import QueryTermsMixin
from .result import QueryResult, TestSide
from .score.blas_threads import one_blas_thread
from .score.ranking import example_table, hit_rows, signed_hits, source_influence
from .score.rerank import rerank_candidates

if TYPE_CHECKING:
    from .model_side.encode import QueryEncoder

__all__ = ["AttributionRun", "QueryResult", "TestSide", "open_run"]


class AttributionRun(TestSideMixin, QueryTermsMixin):
    """One run opened for attribution: its store, manifest, saved model and indexes.

    The facade the CLI and the app share; the work is done by the run's
    :class:`~traceprop_engine.attribution.index.run_indexes.RunIndexes` (training side: indexes and
    exact scorers) and :class:`~traceprop_engine.attribution.model_side.encode.QueryEncoder` (test
    side: the saved model and the query's sketches), and ranked by
    :mod:`traceprop_engine.attribution.score.ranking`.

    Raises:
        RunError: not a run directory.
        StoreError / SchemaVersionError: the store cannot be used.
    """

    def __init__(self, run_dir: str | os.PathLike, device: str = "cpu") -> None:
        self.dir = Path(run_dir)
        self.manifest = RunManifest.load(self.dir)
        if not (self.dir / C.STORE_FILE).exists() and not self.manifest.shards:
            raise RunError(
                f"{self.dir} has no {C.STORE_FILE}: it was trained with --no-track, or it failed before tracking began"
            )
        # a Store, or a ShardedStore for a multi-process run
        self.store = open_run_store(self.dir, self.manifest.shards)
        self.device = device
        self.indexes = RunIndexes(self.dir, self.store)
        self.indexes.statistics = self.statistics
        self._encoder: QueryEncoder | None = None  # the model side (torch), made on first use
        self._examples: pl.DataFrame | None = None
        self._notes_extra: list[str] = []
        self._zero_lr: bool | None = None  # every record's learning rate is 0 (made on first use)
        self._classes: tuple | None = None  # (index ids, their RowClasses)
        # each index build's scorer -> its HeadBias (query_terms.py): a free-text run's two
        # record views (first column, every column) each keep theirs
        self._head_bias: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._labelled: bool | None = None  # the examples have two labels or more

    # -- description --------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return str(self.manifest.run_id or self.dir.name)

    @property
    def task(self) -> str:
        return self.manifest.task

    @property
    def notes(self) -> list[str]:
        """What every query of this run should say (:func:`~.overview.run_notes`)."""
        return run_notes(self)

    def examples(self) -> pl.DataFrame:
        """The example table: example_id, source, row, sha256, split, text, prompt, completion, label."""
        if self._examples is None:
            self._examples, self._notes_extra = example_table(self.store)
        return self._examples

    def eval_examples(self) -> pl.DataFrame:
        return self.examples().filter(pl.col("split") == C.SPLIT_EVAL)

    # -- index (training side) ----------------------------------------------------------------
    def settings(self, s: IndexSettings | None = None) -> IndexSettings:
        """``s`` (default: ``IndexSettings()``, K-FAC cosine) as this run answers it: identity
        where the run has no K-FAC statistics, ``weighting`` resolved for this run
        (:func:`~.overview.resolve_settings`)."""
        return resolve_settings(self.indexes.store, s, self.task)

    def index_dir(self, s: IndexSettings | None = None) -> Path:
        """The folder of the index ``s`` (default settings) of this run; it may not exist yet."""
        return self.indexes.dir(self.settings(s))

    def fit_preconditioner(
        self, s: IndexSettings, progress: Callable[[int, int], None] | None = None
    ) -> Preconditioner:
        """Fit from the statistics ``s`` names (EK-FAC streams the sketches once for its
        eigenvalues)."""
        s = self.settings(s)
        store = self.indexes.store_for(s)
        return fit_preconditioner(store, s, progress, self.statistics(s, self.index_root(s)))

    def index_root(self, s: IndexSettings | None = None) -> Path:
        """The folder holding the index ``s`` (and the final model's statistics):
        ``RUN/index``, or the user's cache for a run that cannot be written."""
        return self.index_dir(s).parent

    def statistics(
        self,
        s: IndexSettings,
        root: Path,
        progress: Callable[[int, int], None] | None = None,
    ) -> list | None:
        """The K-FAC statistics ``s`` (resolved) whitens with: None for the store's own (inline),
        the final model's (cached under ``root``), or the mean of both
        (:mod:`~.model_side.statistics`)."""
        if not s.uses_final_statistics:
            return None
        from .model_side.statistics import final_statistics, mean_statistics

        final = final_statistics(self, root, progress)
        if s.statistics is StatisticsSource.FINAL:
            return final
        return mean_statistics([self.store.covariance(li) for li in range(len(final))], final)

    def build_index(
        self,
        s: IndexSettings | None = None,
        progress: Progress | None = None,
        *,
        reuse: bool = False,
    ) -> VectorIndex:
        """Build and persist the index for ``s`` (default settings): :meth:`RunIndexes.build`."""
        return self.indexes.build(self.settings(s), progress, reuse=reuse)

    def index(
        self, s: IndexSettings | None = None, *, rebuild: bool = False, progress=None
    ) -> tuple[VectorIndex, np.ndarray, Preconditioner]:
        """The persisted index for ``s``; built when missing, rebuilt when stale or damaged (never
        used stale, half-written or changed after its build)."""
        return self.indexes.get(self.settings(s), rebuild=rebuild, progress=progress)

    # -- query --------------------------------------------------------------------------------
    def query(
        self,
        prompt: Query | str | None = None,
        completion: str | None = None,
        *,
        top_k: int = 10,
        opponents: bool = True,
        settings: IndexSettings | None = None,
        test_side: TestSide | None = None,
        **query,
    ) -> QueryResult:
        """Rank training examples by influence on the query's loss.

        The query is a :class:`~traceprop_engine.attribution.query_input.Query` or its fields
        (``prompt``/``completion``, ``eval_example``, ``input_ids`` with ``labels`` or
        ``loss_mask``, ``label``); or its :meth:`test_side`, computed already (e.g. by a query
        worker), in which case no torch is needed here.

        Raises:
            QueryError: empty prompt, unknown example, bad top_k, bad token ids, text on a run
                without a tokenizer.
        """
        if top_k < 1:
            raise QueryError(f"top_k must be at least 1, got {top_k}")
        t0 = time.perf_counter()
        ts = test_side or self.test_side(Query.of(prompt, completion, **query))
        s, cols = resolve_columns(self, self.settings(settings), ts.n_targets, ts.sketches)
        encode_ms = ts.elapsed_ms if test_side is not None else 0.0
        rows, sign_notes = self.rank(ts.sketches, s, top_k, opponents)
        index, _, pre = self.index(s)
        q = {
            **ts.query,
            "run_id": self.run_id,
            "query_loss": ts.loss,
            "top_k": top_k,
            **s.to_dict(),
            "weighting": s.weighting.value,  # resolved (recorded / fisher), also where omitted
            "statistics": s.statistics.value,  # resolved (inline / final / both)
            "class_prior": s.class_prior,  # resolved (0: the records alone)
            "lm_bias": s.lm_bias,  # resolved (0: the records alone)
            "columns": s.columns,  # resolved for this query (0: every column)
            "n_vectors": int(index.n),
        }
        term = self.term_layer(ts.sketches, s)  # a class prior or LM-bias term, or None
        return QueryResult(
            rows,
            q,
            notes=self.notes + list(ts.notes) + sign_notes + ([cols] if cols else []),
            layer_names=pre.layer_names + ([term] if term else []),
            elapsed_ms=encode_ms + (time.perf_counter() - t0) * 1e3,
            sketches=ts.sketches,
            model_fingerprint=ts.model_fingerprint,
        )

    def for_query(
        self, s: IndexSettings | None, n_targets: int | None, sketches: list | None = None
    ) -> IndexSettings:
        """``s`` resolved for a query of ``n_targets`` answer tokens (None: free text, or not
        known; :func:`~.model_side.test_side.query_targets`) and, where they decide, its
        ``sketches``: its ``auto`` choices (:meth:`settings`) and the record columns it scores
        against (``columns=None``: :func:`~.column_choice.resolve_columns`)."""
        return resolve_columns(self, self.settings(s), n_targets, sketches)[0]

    def rank(
        self, sketches: list[np.ndarray], s: IndexSettings, top_k: int = 10, opponents: bool = True
    ) -> tuple[pl.DataFrame, list[str]]:
        """The ranked rows of a query's sketches, with notes on the signs and on the index: FAISS
        proposes candidates from both ends, every returned score is recomputed exactly."""
        s = self.settings(s)
        index, ids, pre = self.index(s)
        with one_blas_thread():  # small products: a second BLAS thread only waits (blas_threads)
            scorer = self.indexes.scorer(s)
            # FAISS, the factor lists and a query-time term (a class prior: the label's rows;
            # the LM-bias term: its ends) propose candidates
            qv, (sides, bias) = pre.apply(sketches), self.term_candidates(sketches, s, opponents)
            cand, prepared = candidates(index, scorer, qv, sketches, top_k, opponents, sides, bias)
            # exact scores of the candidates (the re-rank), split by layer for the rows
            # layer by layer, dropping the rows that cannot place (rerank.py), or every layer;
            # a query-time term (class prior, LM bias) is one more row of the split
            term = self.term_scores(sketches, s, cand)
            hit = rerank_candidates(
                self.indexes, s, sketches, cand, top_k, opponents, prepared, offset=term
            )
            cand, per_layer = hit or (
                cand,
                self.exact_scores(sketches, s, rows=cand, per_layer=True)[0],
            )
        hits, notes = signed_hits(cand, per_layer, top_k, opponents)
        rec = self.store.records() if s.per_record else None
        rows = hit_rows(hits, ids, pre, self.examples(), rec, self.term_layer(sketches, s))
        return rows, notes + self.indexes.notes(s)

    def exact_scores(
        self,
        sketches: list[np.ndarray],
        s: IndexSettings,
        rows: np.ndarray | None = None,
        per_layer: bool = False,
    ) -> np.ndarray:
        """Exact scores of query sketches against index rows, from the stored records.

        Args:
            sketches: per layer the query's (q, *record_shape) sketches (``query_sketches``).
            s: which index (preconditioner, cosine, per-record).
            rows: index rows to score (default: all), in this order.
            per_layer: split every score by layer.

        Returns:
            (q, n) or (q, L, n) float64; cosine divides by both vectors' exact norms. A
            query-time term (a class prior or the LM-bias term, :meth:`term_scores`) is added
            after that, and with ``per_layer`` it is one more "layer", the last: (q, L + 1, n).
        """
        s = self.settings(s)
        scorer = self.indexes.scorer(s)
        with one_blas_thread():  # per-layer products of at most k × k: see blas_threads
            pb = scorer.pullbacks(sketches)  # once, for the scores and the query's norm
            out = scorer.scores(sketches, rows=rows, per_layer=per_layer, pullbacks=pb)
            if s.cosine:
                qn = np.sqrt(np.maximum(scorer.query_sq_norm(sketches, pb), 1e-60))  # (q,)
                xn = self.indexes.row_norms(s, rows)
                out = out / (qn[:, None, None] if per_layer else qn[:, None]) / xn
        term = self.term_scores(sketches, s, rows)
        if term is None:
            return out
        if per_layer:
            return np.concatenate([out, np.broadcast_to(term, (len(out), 1, len(term)))], 1)
        return out + term

    def all_scores(self, sketches, s: IndexSettings) -> np.ndarray:
        """Exact scores of one query against every index row (example-id order of ``ids``).

        Args:
            sketches: the query's per-layer sketches (``query_sketches``). A (1, D) index
                vector (``pre.apply(sketches)``, the older call) is still accepted and scored
                against ``vectors.npy``: exact only when the index has no index projection.
        """
        s = self.settings(s)
        if isinstance(sketches, list):  # a QuerySketches as it is: its factors and label
            return self.exact_scores(sketches, s)[0]
        if isinstance(sketches, tuple):
            return self.exact_scores(list(sketches), s)[0]
        qv = sketches
        vectors = self.indexes.vectors(s)
        q = qv[0].astype(np.float32)
        if s.cosine:
            q = q / max(np.linalg.norm(q), 1e-30)
        out = np.empty(len(vectors), np.float32)
        for i in range(0, len(vectors), 65536):
            x = np.asarray(vectors[i : i + 65536])
            if s.cosine:
                x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
            out[i : i + len(x)] = x @ q
        return out

    def scores(
        self,
        prompt: Query | str | list[str] | None = None,
        completion: str | list[str] | None = None,
        *,
        settings: IndexSettings | None = None,
        **query,
    ) -> np.ndarray:
        """Scores of every training example, in example-id order (exact: no index search).

        One query (a string, or 1-D ``input_ids``) gives a ``(n_examples,)`` array; a batch (a
        list of strings, a list of id sequences or a 2-D ``input_ids``, with ``labels`` /
        ``loss_mask`` of the same form) gives ``(n_queries, n_examples)``. Entry ``i`` is the
        same score ``query()`` reports for example ``i``; an example with no record scores 0.

        Raises:
            QueryError: as for :meth:`query`; ``per_record`` settings (scores are per example).
        """
        s = self.settings(settings)
        if s.per_record:
            raise QueryError(
                "scores() gives one score per example: use settings with per_record=False"
            )
        queries, batched = Query.of(prompt, completion, **query).split()
        out = None
        for qi, one in enumerate(queries):
            enc, _, _ = self.encode(one)  # torch: the queries run through the model
            ids, row = self.query_scores(self.query_sketches(enc)[0], query_targets(enc), s)
            if out is None:
                n = max(self.examples().height, int(ids.max()) + 1 if len(ids) else 0)
                out = np.zeros((len(queries), n), np.float64)
            out[qi, ids] = row
        return out if batched else out[0]

    def query_scores(self, sketches, n_targets: int | None, s: IndexSettings | None = None):
        """``(ids, scores)``: one query's exact scores of every index row, under ``s`` resolved
        for its ``n_targets`` answer tokens and sketches (:meth:`for_query`: the record columns)."""
        sq = self.for_query(s, n_targets, sketches)
        return self.index(sq)[1], self.all_scores(sketches, sq)

    def influence_by_source(
        self, result: QueryResult, settings: IndexSettings | None = None
    ) -> pl.DataFrame:
        """Total, positive and negative influence of every source file on the query (all examples)."""
        table = self.example_scores(result, settings)
        return source_influence(table["score"].to_numpy(), table["source"].to_numpy())

    def example_scores(
        self, result: QueryResult, settings: IndexSettings | None = None
    ) -> pl.DataFrame:
        """``example_id, source, row, score``: the exact score of every indexed training example
        for the query of ``result`` (what by-source totals and score histograms are made of).
        Where ``settings`` leaves them to auto, the query-time terms' weights are the result's."""
        s = settings or IndexSettings()
        for term in ("class_prior", "lm_bias"):  # as the result was ranked (none recorded: auto)
            if getattr(s, term) is None and result.query.get(term) is not None:
                s = dataclasses.replace(s, **{term: float(result.query[term])})
        s = self.settings(s)
        if s.columns is None:  # the columns the result was ranked with (none recorded: every one)
            s = dataclasses.replace(s, columns=int(result.query.get("columns") or 0))
        sk = result.sketches
        if sk is None:  # a result rebuilt from its description (e.g. an audit trail)
            enc, _, _ = self.encode(Query.from_description(result.query))
            sk, _ = self.query_sketches(enc)
        _, ids, _ = self.index(s)
        scores = self.all_scores(sk, s)
        ex = self.examples().select("example_id", "source", "row")
        df = pl.DataFrame({"example_id": ids.astype(np.int64), "score": scores.astype(np.float64)})
        return df.join(ex, on="example_id", how="left").select(
            "example_id", "source", "row", "score"
        )

    # -- baselines for audits -------------------------------------------------------------------
    def self_influence(self, settings: IndexSettings | None = None) -> pl.DataFrame:
        """``τ(i, i) = ‖v_i‖²`` of every indexed example, and the raw sketch norm (gradient norm)."""
        s = dataclasses.replace(self.settings(settings), cosine=False)  # ‖v‖² = 1 under cosine
        _, ids, _ = self.index(s)
        si = self.indexes.row_sq_norms(s)
        return pl.DataFrame({"example_id": ids.astype(np.int64), "self_influence": si}).join(
            self.gradient_norms(), on="example_id", how="left"
        )

    def gradient_norms(self) -> pl.DataFrame:
        """Mean over an example's records of the raw (unpreconditioned) sketch norm."""
        return gradient_norms(self.store)

    def close(self) -> None:
        self.store.close()


def open_run(run_dir: str | os.PathLike, device: str = "cpu") -> AttributionRun:
    """Open a run for attribution (see :class:`AttributionRun`)."""
    return AttributionRun(run_dir, device)
