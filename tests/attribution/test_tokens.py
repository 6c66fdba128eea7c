"""Per-token contributions sum to the example's exact (recomputed) score."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from traceprop_engine.attribution.model_side.tokens import example_score, token_contributions
from traceprop_engine.attribution.query import open_run
from traceprop_engine.errors import QueryError
from traceprop_engine.settings import IndexSettings

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Q: Is Ethmor a planet, an inventor, a river or a guild?\nA:"
# float32 sketches summed over <= 64 tokens against float64 pullbacks: relative error ~1e-7
SUM_RTOL = 1e-5


@pytest.fixture(scope="module")
def run():
    r = open_run(REPO / "sample_runs" / "facts")
    yield r
    r.close()


@pytest.mark.parametrize(
    "settings",
    [IndexSettings(), IndexSettings(preconditioner="kfac", cosine=False)],
    ids=["identity-cosine", "kfac-dot"],
)
def test_token_contributions_sum_to_the_exact_score(run, settings):
    res = run.query(PROMPT, " a planet", top_k=3, settings=settings)
    for kind in ("proponent", "opponent"):
        eid = int(res.rows.filter(res.rows["kind"] == kind)["example_id"][0])
        tc = token_contributions(run, res.sketches, eid, settings)
        ref = example_score(run, res.sketches, eid, settings)
        assert tc.score == pytest.approx(ref, rel=SUM_RTOL, abs=1e-9)
        assert tc.contributions.sum() == pytest.approx(ref, rel=SUM_RTOL, abs=1e-9)
        # tokens without a loss (the prompt) carry nothing; some target token carries something
        assert np.all(tc.contributions[tc.loss_mask == 0] == 0)
        assert np.abs(tc.contributions).max() > 0
        # the ranking's score comes from the stored records of this example
        row = res.rows.filter(res.rows["example_id"] == eid)
        assert tc.stored_score == pytest.approx(float(row["score"][0]), rel=1e-6)


def test_top_proponent_points_the_same_way(run):
    # the top proponent of " a planet" is a training copy of the question: its score on the final
    # model has the ranking's sign, carried by the completion's tokens
    res = run.query(PROMPT, " a planet", top_k=1)
    eid = int(res.proponents["example_id"][0])
    tc = token_contributions(run, res.sketches, eid)
    assert tc.score > 0 and tc.stored_score > 0


def test_bad_example_is_refused(run):
    res = run.query(PROMPT, " a planet", top_k=1)
    with pytest.raises(QueryError, match="does not exist"):
        token_contributions(run, res.sketches, 10**6)
