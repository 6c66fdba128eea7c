"""LDS: the statistics against scipy and known answers, resumption, and the pipeline end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import facts_data, fast_settings
from scipy import stats

from traceprop_engine.errors import ConfigError
from traceprop_engine.evaluate.lds import (
    LdsSettings,
    bootstrap_ci,
    draw_subsets,
    lds_scores,
    run_lds,
    spearman_rows,
)
from traceprop_engine.settings import TrackSettings

TOL = 1e-12  # Spearman is exact arithmetic on ranks
CI_TOL = 0.03  # two percentile bootstraps of 4000 resamples agree to about this on n = 200


def test_spearman_rows_matches_scipy_with_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(6, 20)).astype(float)  # many ties
    y = rng.standard_normal((6, 20))
    got = spearman_rows(x, y)
    want = [stats.spearmanr(x[i], y[i]).statistic for i in range(6)]
    np.testing.assert_allclose(got, want, atol=TOL)


def test_spearman_rows_constant_row_is_nan():
    got = spearman_rows(
        np.array([[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]]), np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    )
    assert np.isnan(got[0]) and got[1] == pytest.approx(-1.0)


def test_bootstrap_ci_matches_scipy_percentile():
    v = np.random.default_rng(1).normal(0.3, 0.2, 200)
    lo, hi = bootstrap_ci(v, n_boot=4000, seed=0)
    ref = stats.bootstrap(
        (v,), np.mean, n_resamples=4000, method="percentile", rng=np.random.default_rng(5)
    ).confidence_interval
    assert lo < v.mean() < hi
    assert lo == pytest.approx(ref.low, abs=CI_TOL) and hi == pytest.approx(ref.high, abs=CI_TOL)
    # and the textbook normal interval of a mean
    se = v.std(ddof=1) / np.sqrt(len(v))
    assert lo == pytest.approx(v.mean() - 1.96 * se, abs=CI_TOL)


def _linear_datamodel(n_train=40, n_eval=10, m=30, seed=0):
    """Losses that are an exact linear function of subset membership: loss_j(e) = c_e - Σ_{i∈S_j} τ(e,i)."""
    rng = np.random.default_rng(seed)
    tau = rng.standard_normal((n_eval, n_train))
    masks = np.zeros((m, n_train), bool)
    for j, s in enumerate(draw_subsets(n_train, m, 0.5, seed)):
        masks[j, s] = True
    losses = 5.0 - masks.astype(float) @ tau.T  # (m, n_eval)
    return tau, masks, losses


def test_lds_of_exact_linear_influence_is_one():
    tau, masks, losses = _linear_datamodel()
    per = lds_scores(tau, masks, losses)
    np.testing.assert_allclose(per, 1.0, atol=TOL)
    # any strictly increasing function of the predicted sum keeps LDS at 1 (ranks only)
    per_exp = lds_scores(tau, masks, np.log1p(np.exp(losses)))
    np.testing.assert_allclose(per_exp, 1.0, atol=TOL)
    # and the opposite sign convention gives -1
    np.testing.assert_allclose(lds_scores(-tau, masks, losses), -1.0, atol=TOL)


def test_lds_of_random_scores_is_near_zero():
    tau, masks, losses = _linear_datamodel(n_eval=200, m=40)
    rand = np.random.default_rng(9).standard_normal(tau.shape)
    per = lds_scores(rand, masks, losses)
    # one correlation over 40 subsets has sd ~ 1/sqrt(39) = 0.16; the mean of 200 ~ 0.011 (the
    # examples share the subsets, so allow a wide margin); an informative method sits far above
    assert abs(per.mean()) < 0.05
    assert lds_scores(tau + 0.5 * rand, masks, losses).mean() > 0.5


def test_draw_subsets_seeded_and_sized():
    a, b = draw_subsets(50, 5, 0.5, 3), draw_subsets(50, 5, 0.5, 3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(len(x) == 25 and len(set(x)) == 25 for x in a)
    assert not np.array_equal(a[0], a[1])


def test_settings_validated():
    t = fast_settings(Path("/nonexistent"), Path("/tmp/x"))
    with pytest.raises(ConfigError, match="alpha"):
        LdsSettings(train=t, out="/tmp/x", alpha=1.0)
    with pytest.raises(ConfigError, match="workers"):
        LdsSettings(train=t, out="/tmp/x", workers=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("facts"))


def _settings(data, out, **kw):
    t = fast_settings(data, out / "unused", track=TrackSettings(k_in=4, k_out=4))
    return LdsSettings(
        train=t,
        out=str(out),
        n_subsets=4,
        k_values=(4,),
        main_k=4,
        dense=kw.pop("dense", False),
        dense_k=64,
        bootstrap=200,
        **kw,
    )


def test_pipeline_end_to_end(data, tmp_path):
    os.environ.setdefault("TQDM_DISABLE", "1")
    r = run_lds(_settings(data, tmp_path / "ev", dense=True))
    assert r.complete and sorted(r.retrained) == [0, 1, 2, 3]
    out = tmp_path / "ev"
    losses = np.load(out / "losses.npy")
    n_eval = losses.shape[1]
    assert losses.shape == (4, n_eval) and np.isfinite(losses).all() and n_eval > 0
    subsets = json.loads((out / "subsets.json").read_text())
    assert [s["seed"] for s in subsets["subsets"]] == [[0, j] for j in range(4)]
    assert all(
        len(s["members"]) == len(s["sha256"]) == round(0.5 * subsets["n_train"])
        for s in subsets["subsets"]
    )
    methods = {row["method"] for row in r.rows}
    assert {
        "identity",
        "cosine",
        "kfac",
        "ekfac",
        "dense identity",
        "representation similarity",
        "gradient norm (query-independent)",
        "random",
    } <= methods
    for row in r.rows:
        if row.get("error") is None:
            assert -1 <= row["lds"] <= 1 and row["ci_low"] <= row["lds"] <= row["ci_high"]
    csv = (out / "results.csv").read_text().splitlines()
    assert csv[0].startswith("method,family,k") and len(csv) == len(r.rows) + 1
    fig = json.loads((out / "figure.json").read_text())
    assert fig["data"] and fig["layout"]["title"]["text"] == "Linear datamodeling score"
    # different subsets give different retrained models
    assert not np.allclose(losses[0], losses[1])


def test_resume_retrains_nothing_twice_and_matches_a_straight_run(data, tmp_path):
    os.environ.setdefault("TQDM_DISABLE", "1")
    straight = run_lds(_settings(data, tmp_path / "straight"))
    s = _settings(data, tmp_path / "resumed")
    first = run_lds(s, max_new_subsets=2)  # "killed" after two subsets
    assert not first.complete and first.retrained == [0, 1]
    assert not (tmp_path / "resumed" / "losses.npy").exists()
    mtimes = {
        j: (tmp_path / "resumed" / "losses" / f"subset_{j:03d}.npy").stat().st_mtime_ns
        for j in (0, 1)
    }
    second = run_lds(s)
    assert second.complete and second.skipped == [0, 1] and sorted(second.retrained) == [2, 3]
    assert {
        j: (tmp_path / "resumed" / "losses" / f"subset_{j:03d}.npy").stat().st_mtime_ns
        for j in (0, 1)
    } == mtimes
    np.testing.assert_array_equal(
        np.load(tmp_path / "resumed" / "losses.npy"), np.load(tmp_path / "straight" / "losses.npy")
    )
    got = {r["method"]: r["lds"] for r in second.rows}
    want = {r["method"]: r["lds"] for r in straight.rows}
    assert got == pytest.approx(want, nan_ok=True)
    # a resume with other settings is refused instead of mixing two evaluations
    with pytest.raises(ConfigError, match="other settings"):
        run_lds(_settings(data, tmp_path / "resumed", alpha=0.25))


def test_lossless_compact_method_has_the_full_sketch_lds(data, tmp_path):
    """At c = min(k_out, k_in) the factored (compact-storage) scores are the full-sketch scores,
    so every eval example's Spearman correlation, and the LDS, are the same."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    s = _settings(
        data, tmp_path / "ev", compact=((4, "kfac", 4), (4, "identity", 4), (4, "kfac", 1))
    )
    r = run_lds(s)
    rows = {(row["family"], row["method"]): row for row in r.rows}
    for p in ("kfac", "identity"):
        full, fac = rows[("factored", p)], rows[("factored-c", f"{p} c=4")]
        assert fac.get("error") is None, fac.get("error")
        assert fac["k"] == 4 and fac["c"] == 4 and fac["lossless"]
        np.testing.assert_allclose(fac["per_example"], full["per_example"], atol=TOL)
        assert fac["lds"] == pytest.approx(full["lds"], abs=TOL)
    lossy = rows[("factored-c", "kfac c=1")]
    assert not lossy["lossless"] and -1 <= lossy["lds"] <= 1
    assert (tmp_path / "ev" / "runs" / "k4" / "factors-c4.h5").exists()
    csv = (tmp_path / "ev" / "results.csv").read_text()
    assert "kfac c=4,factored-c,4,kfac,4," in csv
    fig = json.loads((tmp_path / "ev" / "figure.json").read_text())
    assert "kfac c=4 (k=4)" in fig["data"][0]["x"]
