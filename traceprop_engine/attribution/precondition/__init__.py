"""Preconditioning: one linear map ``H^{-1/2}`` per layer, so that a score is the inner product of
the mapped training and test sketches.

``layer.py`` (:class:`LayerPreconditioner`: one layer's map, ``apply`` / ``pullback``, saved as
plain arrays; :class:`LayerStats`, :class:`EkfacMoments`: what fits it), ``kfac.py`` (fitting one
layer: identity, K-FAC, EK-FAC, dense), ``preconditioner.py`` (:class:`Preconditioner`: every
layer's map, the formulas), ``vectors.py`` (fitting a run's preconditioner from its store, the
lr-weighted index vectors), ``woodbury.py`` (a low-rank alternative, measured by
``benchmarks/bench_compact.py``; no engine path uses it).
"""
