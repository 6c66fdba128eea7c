"""Per-token view of one influencer: which of its tokens carry its score against a query.

A training example's loss is the mean of its target tokens' cross-entropies,
``L = (1/T) Σ_t ℓ_t``, so its gradient is ``g = (1/T) Σ_t ∇ℓ_t`` and its score against a query
``q`` (the query's sketches pulled back through the run's preconditioner, ``q' = H⁻¹ q``) splits
exactly over its tokens::

    score = ⟨q', S g⟩ = Σ_t (1/T) ⟨q', S ∇ℓ_t⟩ = Σ_t c_t

``S`` is the store's sketch (linear in the gradient). ``∇ℓ_t`` is recomputed for that one example
on the run's final model with the same capture hooks the query uses (one backward over ``T``
copies of the example, each taking the loss of one token). With a cosine index every ``c_t`` is
divided by the norms of the query and of the recomputed example vector, so the ``c_t`` still sum
to the recomputed score.

The recomputed score is the example's score on the *final* model; the ranking's score sums the
example's records over the training steps that saw it (``stored_score``, shown beside it).
"""

from __future__ import annotations

import numpy as np
import torch

from ...capture.hooks import Capture
from ...errors import QueryError
from ...settings import IndexSettings
from ...training.losses import example_losses
from ...training.models import Encoded, collate, model_inputs
from ..result import TokenContributions
from .encode import pad_id

MAX_TOKENS_PER_BATCH = 64  # per-token copies backpropagated at once


def _target_positions(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Positions whose token has a loss (causal LM: the first token is never predicted)."""
    pos = np.nonzero(mask.astype(bool))[0]
    return pos[pos >= 1]


def _token_sketches(run, ids: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
    """Per layer ``(T, *record_shape)``: the sketch of ``∇ℓ_t`` for every target position."""
    loaded = run.model()
    layers = run.tracked_layers()
    out = [[] for _ in run.store.layers]
    for start in range(0, len(positions), MAX_TOKENS_PER_BATCH):
        chunk = positions[start : start + MAX_TOKENS_PER_BATCH]
        encs = []
        for p in chunk:
            m = np.zeros(len(ids), np.uint8)
            m[p] = 1
            encs.append(Encoded(ids.astype(np.int32), m, -1))
        batch = collate(encs, pad_id(loaded), "causal-lm", run.encoder.device)
        device = batch["input_ids"].device  # the hooks write where the model computes
        slots = [
            torch.zeros(len(encs), *info.record_shape, device=device) for info in run.store.layers
        ]
        with (
            torch.enable_grad(),
            Capture(loaded.model, layers, covariance=False) as cap,
            cap.batch(slots, token_mask=batch["attention_mask"], loss_scale=1.0),
        ):
            loss = example_losses(loaded.model(**model_inputs(batch)), batch, "causal-lm")
            loss.sum().backward()
        loaded.model.zero_grad(set_to_none=True)
        for li, s in enumerate(slots):
            out[li].append(s.cpu().numpy())
    return [np.concatenate(x) for x in out]


def token_contributions(
    run,
    query_sketches: list[np.ndarray],
    example_id: int,
    settings: IndexSettings | None = None,
) -> TokenContributions:
    """Per-token contributions of training example ``example_id`` to its score against a query.

    Args:
        run: an :class:`~traceprop_engine.attribution.query.AttributionRun`.
        query_sketches: the query's per-layer ``(1, *record_shape)`` sketches
            (``QueryResult.sketches`` or ``run.query_sketches``).
        example_id: the training example.
        settings: the index (preconditioner, cosine) whose score is split.

    Raises:
        QueryError: a classification run (one loss per example: nothing to split), an unknown
            example, or an example without target tokens.
    """
    s = run.settings(settings)
    if run.task != "causal-lm":
        raise QueryError(
            "the per-token view needs a causal-LM run (a classifier has one loss per example)"
        )
    n = run.examples().height
    if not 0 <= int(example_id) < n:
        raise QueryError(f"example {example_id} does not exist (the run has examples 0..{n - 1})")
    ids, mask = run.store.tokens(int(example_id))
    ids, mask = np.asarray(ids), np.asarray(mask)
    pos = _target_positions(ids, mask)
    if len(pos) == 0:
        raise QueryError(f"example {example_id} has no target token: nothing to split")
    scorer = run.indexes.scorer(s)
    pb = scorer.pullbacks(query_sketches)  # per layer (1, *shape)
    per_tok = _token_sketches(run, ids, pos)
    c = sum(
        np.einsum("ti,i->t", x.reshape(len(x), -1).astype(np.float64), p.reshape(-1))
        for x, p in zip(per_tok, pb, strict=True)
    ) / len(pos)
    if s.cosine:
        full = [x.mean(0, keepdims=True) for x in per_tok]  # S g = (1/T) Σ_t S ∇ℓ_t
        qn = float(np.sqrt(max(scorer.query_sq_norm(query_sketches, pb)[0], 1e-60)))
        xn = float(np.sqrt(max(scorer.query_sq_norm(full)[0], 1e-60)))
        c = c / (qn * xn)
    contributions = np.zeros(len(ids), np.float64)
    contributions[pos] = c
    rows = np.nonzero(np.asarray(scorer.ids) == int(example_id))[0]
    stored = float(run.exact_scores(query_sketches, s, rows=rows[:1])[0, 0]) if len(rows) else None
    return TokenContributions(
        example_id=int(example_id),
        token_ids=ids,
        loss_mask=mask,
        contributions=contributions,
        score=float(c.sum()),
        stored_score=stored,
        cosine=s.cosine,
    )


def example_score(run, query_sketches: list[np.ndarray], example_id: int, settings=None) -> float:
    """The example's score from its whole recomputed gradient in one backward (no per-token
    split): the reference the per-token contributions must sum to."""
    s = run.settings(settings)
    ids, mask = run.store.tokens(int(example_id))
    sk, _ = run.query_sketches(Encoded(np.asarray(ids, np.int32), np.asarray(mask, np.uint8), -1))
    scorer = run.indexes.scorer(s)
    pb = scorer.pullbacks(query_sketches)
    dot = sum(
        float(x.reshape(-1).astype(np.float64) @ p.reshape(-1)) for x, p in zip(sk, pb, strict=True)
    )
    if not s.cosine:
        return dot
    qn = np.sqrt(max(scorer.query_sq_norm(query_sketches, pb)[0], 1e-60))
    xn = np.sqrt(max(scorer.query_sq_norm(sk)[0], 1e-60))
    return float(dot / (qn * xn))
