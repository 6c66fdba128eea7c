"""The result table of a ranking (``score/ranking.py: hit_rows``): every hit's lineage is its own
example's, whatever order the hits come in, with the per-layer shares (and a class prior after
them) and, for a per-record index, the record's step and epoch; checked row by row against the
example table."""

from __future__ import annotations

import json
import types

import numpy as np
import polars as pl

from traceprop_engine import constants as C
from traceprop_engine.attribution.score.ranking import _EMPTY_ROWS, CLASS_PRIOR_LAYER, hit_rows

N = 50
LAYERS = ["a.dense", "b.dense", "head"]


def _examples() -> pl.DataFrame:
    rng = np.random.default_rng(0)
    return pl.DataFrame(
        {
            "example_id": np.arange(N, dtype=np.int64),
            "source": [f"file{i % 3}.jsonl" for i in range(N)],
            "row": rng.permutation(N).astype(np.int64),
            "sha256": [f"{i:064x}" for i in range(N)],
            "split": ["train"] * N,
            "text": [f"text {i}" for i in range(N)],
            "prompt": [""] * N,
            "completion": [""] * N,
            "label": ["" if i % 5 else "x" for i in range(N)],
        }
    )


def _hits(vector_rows, n_shares):
    rng = np.random.default_rng(1)
    return [
        (
            "proponent" if j % 2 == 0 else "opponent",
            j // 2 + 1,
            int(v),
            float(rng.normal()),
            rng.normal(size=n_shares),
        )
        for j, v in enumerate(vector_rows)
    ]


def _check(out: pl.DataFrame, hits, ids, examples, names) -> None:
    assert out.height == len(hits)
    for got, (kind, rank, v, score, shares) in zip(out.iter_rows(named=True), hits, strict=True):
        e = int(ids[v])
        want = examples.row(e, named=True)
        assert (got["kind"], got["rank"], got["example_id"]) == (kind, rank, e)
        assert got["score"] == score
        for col in ("source", "row", "sha256", "text", "label"):
            assert got[col] == want[col], col
        assert json.loads(got["layer_scores"]) == dict(zip(names, map(float, shares), strict=True))


def test_hit_rows_carry_each_hits_own_lineage_in_order():
    ex = _examples()
    ids = np.random.default_rng(2).permutation(N)  # index row -> example id, shuffled
    pre = types.SimpleNamespace(layer_names=LAYERS)
    hits = _hits([7, 3, 41, 0, 19], len(LAYERS))
    out = hit_rows(hits, ids, pre, ex)
    assert dict(out.schema) == _EMPTY_ROWS
    _check(out, hits, ids, ex, LAYERS)
    # a classification query's class prior comes after the layers, as its own share
    hits = _hits([5, 9], len(LAYERS) + 1)
    _check(hit_rows(hits, ids, pre, ex), hits, ids, ex, [*LAYERS, CLASS_PRIOR_LAYER])
    # no hits: the empty table with the same columns
    assert dict(hit_rows([], ids, pre, ex).schema) == _EMPTY_ROWS


def test_hit_rows_of_a_per_record_index_add_the_records_step_and_epoch():
    ex = _examples()
    n_rec = 2 * N
    ids = np.arange(n_rec) % N  # row = record, two records an example
    records = {C.REC_STEP: np.arange(n_rec) * 3, C.REC_EPOCH: np.arange(n_rec) // N}
    hits = _hits([60, 2, 99], len(LAYERS))
    out = hit_rows(hits, ids, types.SimpleNamespace(layer_names=LAYERS), ex, records)
    _check(out, hits, ids, ex, LAYERS)
    assert out["record"].to_list() == [60, 2, 99]
    assert out["step"].to_list() == [180, 6, 297]
    assert out["epoch"].to_list() == [1, 0, 1]
    assert out.schema["step"] == pl.Int64 and out.schema["record"] == pl.Int64
