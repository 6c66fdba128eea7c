"""The model's own loss and greedy answer for a query (shown beside the influencers)."""

from __future__ import annotations

import os

from . import model_worker
from .queries import in_process


def model_answer(run_dir: str | os.PathLike, **query):
    """:func:`traceprop_engine.attribution.model_side.answer.model_answer` on the run's model: in
    the query worker, or here under the cached run's lock when there is none.

    ``query``: ``prompt``, ``completion``, ``eval_example``, ``label`` as for a query.

    Raises:
        TracepropError: the run cannot be opened, or the query is malformed.
    """
    try:
        return model_worker.call("model_answer", run_dir, **query)
    except model_worker.WorkerUnavailable:
        from traceprop_engine.attribution import model_answer as answer

        run, lock = in_process(run_dir)
        with lock:
            return answer(run, **query)


def answer_warning(ans) -> str | None:
    """The warning shown when the model does not itself produce the queried output."""
    if ans.matches:
        return None
    return (
        f"The model does not produce the queried output: asked about {ans.queried.strip()!r}, its "
        f"own greedy answer is {ans.greedy.strip()!r}. The ranking then explains an output the "
        "model fails to give: the training examples that state it can even rank as opponents."
    )
