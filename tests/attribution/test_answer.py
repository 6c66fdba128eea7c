"""The model's own loss and greedy answer for a query, against Hugging Face generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from traceprop_engine.attribution.model_side.answer import model_answer
from traceprop_engine.attribution.query import open_run
from traceprop_engine.errors import QueryError

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "facts"
PROMPT = "Q: Which colour does the planet Ethmor have?\nA:"


@pytest.fixture(scope="module")
def run():
    r = open_run(SAMPLE)
    yield r
    r.close()


def _hf_greedy(run, prompt: str, n: int) -> list[int]:
    loaded = run.model()
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def test_loss_equals_the_query_loss_and_greedy_equals_generate(run):
    for completion in (" violet", " green"):
        a = model_answer(run, PROMPT, completion)
        res = run.query(PROMPT, completion, top_k=2)
        assert a.loss == pytest.approx(res.query["query_loss"], rel=1e-6)
        assert list(a.greedy_ids) == _hf_greedy(run, PROMPT, len(a.queried_ids))
    right, wrong = model_answer(run, PROMPT, " violet"), model_answer(run, PROMPT, " green")
    assert right.matches and right.greedy.strip() == "violet" and right.queried.strip() == "violet"
    assert (
        not wrong.matches and wrong.greedy.strip() == "violet" and wrong.queried.strip() == "green"
    )
    assert wrong.loss > right.loss


def test_eval_example_answer(run):
    ex = run.examples()
    first = ex.filter(ex["split"] == "eval").row(0, named=True)
    a = model_answer(run, eval_example=first["example_id"])
    b = model_answer(run, first["prompt"], first["completion"])
    assert a.loss == pytest.approx(run.query(eval_example=first["example_id"]).query["query_loss"])
    assert a.queried_ids == b.queried_ids and a.greedy_ids == b.greedy_ids


def test_empty_query_is_refused(run):
    with pytest.raises(QueryError, match="empty"):
        model_answer(run, "", "")
