"""The Influencers page labels rows by the sign of their score (issue 10, item 3): the app takes
its rows from the engine's query, so a top k larger than the signed scores cannot mislabel."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import services

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "facts"


def test_influencers_rows_follow_the_sign_at_a_large_top_k(app_env):
    from traceprop_engine.attribution.query import open_run

    ev = int(open_run(SAMPLE).eval_examples()["example_id"][0])
    res, _ = services.run_query(SAMPLE, eval_example=ev, top_k=1000)
    rows = services.shown_rows(res)
    pro = rows.filter(rows["kind"] == "proponent")
    opp = rows.filter(rows["kind"] == "opponent")
    assert pro.height > 0 and opp.height > 0
    assert (pro["score"] > 0).all() and (opp["score"] < 0).all()
    assert not set(pro["example_id"]) & set(opp["example_id"])
    # every example is in at most one list, so fewer rows than asked, and a note says so
    assert pro.height + opp.height <= res.query["n_vectors"] < 1000
    assert sum("of the 1000 asked" in n for n in res.notes) == 2
    # the downloaded CSV carries the same labels
    for r in csv.DictReader(io.StringIO(services.export_bytes(res, "csv").decode())):
        assert (float(r["score"]) > 0) == (r["kind"] == "proponent")
