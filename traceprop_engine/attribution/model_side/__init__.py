"""The model's half of a query: the only part of ``attribution/`` that imports torch.

``encode.py`` (:class:`QueryEncoder`: rebuild the run's model, tokenize a query, its sketches
from one backward with the capture hooks), ``test_side.py`` (the methods
:class:`~traceprop_engine.attribution.query.AttributionRun` gets from it), ``answer.py`` (the
model's loss and greedy answer), ``tokens.py`` (the per-token split of one example's score),
``worker.py`` (:class:`QueryWorker`: all of it in a process of its own, as the app runs it).
Everything here returns the plain data of :mod:`traceprop_engine.attribution.result`.
"""
