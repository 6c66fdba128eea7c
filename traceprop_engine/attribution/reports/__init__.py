"""What is made from a run or a query's result for a reader: no scoring of its own.

``export.py`` (CSV / JSON, formula-safe cells), ``audit.py`` (audit trails), ``compare.py`` (two
rankings side by side), ``distributions.py`` (score histograms), ``outliers.py``
(query-independent rankings: self-influence, gradient norm, loss).
"""
