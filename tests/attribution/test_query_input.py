"""``Query``: the one owner of a query's arguments and of the rules between them (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from traceprop_engine.attribution import Query
from traceprop_engine.errors import QueryError


def test_token_ids_exclude_text_and_examples():
    for other in ({"prompt": "Q"}, {"completion": " A"}, {"eval_example": 3}):
        with pytest.raises(QueryError, match="not several"):
            Query(input_ids=[1, 2, 3], **other)
    with pytest.raises(QueryError, match="go with input_ids"):
        Query(prompt="Q", labels=[1, 2])
    with pytest.raises(QueryError, match="go with input_ids"):
        Query(eval_example=1, loss_mask=[0, 1])


def test_of_takes_a_query_or_its_fields():
    q = Query("Q:", " A")
    assert Query.of(q) is q
    assert Query.of("Q:", " A", label="x").given() == {
        "prompt": "Q:",
        "completion": " A",
        "label": "x",
    }
    assert Query.of(eval_example=4).given() == {"eval_example": 4}
    with pytest.raises(QueryError, match="not both"):
        Query.of(q, eval_example=1)


def test_split_gives_the_single_queries_of_a_batch():
    single = Query("Q")
    assert single.split() == ([single], False)
    qs, batched = Query(["a", "b"], " c", label=["x", "y"]).split()
    assert batched and [q.given() for q in qs] == [
        {"prompt": "a", "completion": " c", "label": "x"},
        {"prompt": "b", "completion": " c", "label": "y"},
    ]
    qs, batched = Query(eval_example=[1, 2]).split()
    assert batched and [q.eval_example for q in qs] == [1, 2]
    ids = np.arange(6).reshape(2, 3)
    qs, batched = Query(input_ids=ids, loss_mask=[[0, 1, 1], [1, 1, 1]]).split()
    assert batched and [q.input_ids.tolist() for q in qs] == [[0, 1, 2], [3, 4, 5]]
    assert qs[1].loss_mask == [1, 1, 1]
    one, batched = Query(input_ids=[1, 2, 3]).split()
    assert not batched and one[0].input_ids == [1, 2, 3]
    with pytest.raises(QueryError, match="1 rows for 2 queries"):
        Query(input_ids=ids, labels=[[1, 2, 3]]).split()
    with pytest.raises(QueryError, match="one entry per prompt"):
        Query(["a", "b"], [" c"]).split()


def test_from_description_rebuilds_what_a_result_answers():
    ex = Query.from_description(
        {"eval_example": 7, "prompt": "Q", "completion": " A", "label": None}
    )
    assert ex.given() == {"eval_example": 7}
    ids = Query.from_description({"prompt": None, "input_ids": [1, 2], "loss_mask": [0, 1]})
    assert ids.given() == {"input_ids": [1, 2], "loss_mask": [0, 1]}
    text = Query.from_description({"prompt": "Q", "completion": " A"})
    assert text.given() == {"prompt": "Q", "completion": " A"}
