"""The model's own answer to a query: its loss on the queried output and its greedy answer.

An attribution explains the output the user asked about. When the model does not produce that
output itself (its greedy answer differs), the ranking explains a failure: the training examples
that state the queried output can then rank as opponents. The app shows both beside the
influencers and warns on a mismatch.
"""

from __future__ import annotations

import numpy as np
import torch

from ...training.losses import example_losses
from ...training.models import collate, model_inputs
from ..result import ModelAnswer
from .encode import pad_id

__all__ = ["ModelAnswer", "model_answer"]


def _decode(tok, ids) -> str:
    ids = [int(i) for i in ids]
    return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))


@torch.no_grad()
def model_answer(
    run, prompt=None, completion=None, *, eval_example=None, label=None
) -> ModelAnswer:
    """The model's loss on the query and its greedy answer (causal LM: greedy decoding from the
    prompt for as many tokens as the queried completion has; classification: the argmax label).

    ``run`` is an :class:`~traceprop_engine.attribution.query.AttributionRun`; the query is given
    as to :meth:`AttributionRun.query` (text or ``eval_example``).

    Raises:
        QueryError: the query is empty or malformed (the same checks as a query).
    """
    enc, _, _ = run.encode(prompt, completion, eval_example=eval_example, label=label)
    loaded = run.model()
    model, task = loaded.model, run.task
    dev = run.device
    batch = collate([enc], pad_id(loaded), task, dev)
    was_training = model.training
    model.eval()
    try:
        out = model(**model_inputs(batch))
        loss = float(example_losses(out, batch, task)[0])
        if task == "classification":
            names = loaded.labels or []
            pred = int(out.logits[0].argmax())
            return ModelAnswer(
                loss=loss,
                queried=names[enc.label] if 0 <= enc.label < len(names) else str(enc.label),
                greedy=names[pred] if pred < len(names) else str(pred),
                matches=pred == enc.label,
                queried_ids=(int(enc.label),),
                greedy_ids=(pred,),
            )
        ids = np.asarray(enc.ids, dtype=np.int64)
        targets = np.flatnonzero(np.asarray(enc.loss_mask) > 0)
        start = int(targets[0]) if targets.size else len(ids)
        queried = ids[targets]
        cur = torch.as_tensor(ids[:start], device=dev)[None]
        greedy: list[int] = []
        for _ in range(len(queried)):
            nxt = int(model(input_ids=cur).logits[0, -1].argmax())
            greedy.append(nxt)
            cur = torch.cat([cur, torch.tensor([[nxt]], device=dev)], dim=1)
    finally:
        model.train(was_training)
    return ModelAnswer(
        loss=loss,
        queried=_decode(loaded.tokenizer, queried),
        greedy=_decode(loaded.tokenizer, greedy),
        matches=[int(i) for i in queried] == greedy,
        queried_ids=tuple(int(i) for i in queried),
        greedy_ids=tuple(greedy),
    )
