"""Exact scores from the stored records, and the signed ranking built on them.

``scoring.py`` (:class:`ExactScorer`: a query against the rows of an index), ``factor_scores.py``
(scores from stored factors, in the factors' own space), ``record_cache.py`` (a run's records in
the re-rank's layout), ``rerank.py`` (the candidates' exact re-rank, layer by layer, dropping rows
whose per-layer norm bounds cannot place), ``ranking.py`` (proponents / opponents, by-source
totals), ``blas_threads.py`` (one BLAS thread for concurrent queries).
"""
