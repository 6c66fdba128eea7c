"""The counterfactual check on a copy of the bundled sample run: real retrains, real files."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from traceprop_engine.cli.main import main
from traceprop_engine.errors import ConfigError, QueryError, RunError
from traceprop_engine.evaluate import counterfactual as cf

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Q: Is Ethmor a planet, an inventor, a river or a guild?\nA:"
# the retrain of the full set with the run's own seed reproduces the run's model: the same
# loss on the CPU kind the sample was trained on (Intel Xeon: within 1e-5), within float
# rounding of other kernels elsewhere (AMD EPYC: 9.9e-5 on a loss of 0.50), far below the
# effects the check measures (removing the top 10: +3.9)
SAME_RECIPE_TOL = 1e-3


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cf")
    for name in ("facts", "facts-data"):
        shutil.copytree(REPO / "sample_runs" / name, root / name)
    shutil.rmtree(root / "facts" / cf.CF_DIR, ignore_errors=True)
    return root / "facts"


@pytest.fixture(scope="module")
def result(sample_run) -> dict:
    spec = cf.CounterfactualSpec(PROMPT, " a planet", top_k=10, seeds=2)
    seen = []
    doc = cf.run_counterfactual(sample_run, spec, progress=lambda d, t, m: seen.append((d, t)))
    assert seen[-1] == (7, 7) and [d for d, _ in seen] == list(range(1, 8))
    return doc


@pytest.mark.slow
def test_result_has_both_arms_with_spread(sample_run, result):
    spec = cf.CounterfactualSpec(PROMPT, " a planet", top_k=10, seeds=2)
    on_disk = json.loads(cf.result_path(sample_run, spec).read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert cf.load_result(sample_run, spec) == on_disk
    for arm in ("top_k", "random"):
        c = result["change"][arm]
        assert len(c["delta"]) == 2 and c["std"] >= 0 and c["sem"] >= 0
        assert c["mean"] == pytest.approx(sum(c["delta"]) / 2)
    assert len(result["removed"]["top_k"]) == 10
    assert all(s > 0 for s in result["removed"]["top_k_scores"])  # proponents only
    for rnd in result["removed"]["random"]:
        assert len(rnd) == 10 and not set(rnd) & set(result["removed"]["top_k"])
    assert not (sample_run / cf.CF_DIR / f"{spec.key()}.work").exists()  # work dir removed


@pytest.mark.slow
def test_same_recipe_reproduces_the_run(result):
    # seed 0 on all examples is the run's own training: the query loss is the run's
    assert abs(result["losses"]["full"][0] - result["original_loss"]) < SAME_RECIPE_TOL


@pytest.mark.slow
def test_removing_top_proponents_hurts_more_than_random(result):
    top, rnd = result["change"]["top_k"], result["change"]["random"]
    # measured on the sample run: about +3.9 vs -0.03 (see the module's report)
    assert top["mean"] > 1.0, top
    assert abs(rnd["mean"]) < 0.5, rnd
    assert min(top["delta"]) > max(rnd["delta"])


@pytest.mark.slow
def test_cli_prints_the_saved_result_without_retraining(sample_run, result, capsys):
    t0 = time.perf_counter()
    args = ["counterfactual", str(sample_run), "--prompt", PROMPT, "--completion", " a planet"]
    assert main([*args, "--top-k", "10", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert time.perf_counter() - t0 < 10  # read back, not retrained
    assert f"{result['change']['top_k']['mean']:+.4f}" in out
    assert "without 10 random examples" in out and "saved:" in out
    st = cf.job_state(sample_run, cf.CounterfactualSpec(PROMPT, " a planet", 10, 2))
    assert st["status"] == "completed"


def test_bad_input_is_refused(sample_run, monkeypatch):
    with pytest.raises(QueryError, match="needs a query"):
        cf.CounterfactualSpec("", "", 10, 1)
    with pytest.raises(ConfigError, match="--seeds"):
        cf.CounterfactualSpec(PROMPT, " a planet", 10, 0)
    with pytest.raises(ConfigError, match="too many"):
        cf.plan(sample_run, cf.CounterfactualSpec(PROMPT, " a planet", 100, 1))
    monkeypatch.setattr(cf, "MAX_ESTIMATED_S", 5.0)
    with pytest.raises(RunError, match="too big for the counterfactual check"):
        cf.plan(sample_run, cf.CounterfactualSpec(PROMPT, " a planet", 10, 3))
    assert (
        main(
            [
                "counterfactual",
                str(sample_run),
                "--prompt",
                PROMPT,
                "--completion",
                "x",
                "--seeds",
                "3",
            ]
        )
        == 1
    )
    assert cf.job_state(sample_run, cf.CounterfactualSpec(PROMPT, "x", 10, 3))["status"] == "none"


def test_summarize_by_hand():
    one = cf.summarize({"full": [1.0], "top_k": [2.0], "random": [1.1]})
    assert one["top_k"] == {"delta": [1.0], "mean": 1.0, "std": None, "sem": None}
    three = cf.summarize({"full": [1.0, 1.0, 1.0], "top_k": [2.0, 3.0, 4.0], "random": [1, 1, 1]})
    assert three["top_k"]["mean"] == pytest.approx(2.0)
    assert three["top_k"]["std"] == pytest.approx(1.0)  # sample std of 1, 2, 3
    assert three["top_k"]["sem"] == pytest.approx(1 / 3**0.5)
    assert three["top_k_minus_random"] == pytest.approx(2.0)
