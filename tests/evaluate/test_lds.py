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
from traceprop_engine.evaluate.hard_data import (
    HARD_EVAL_FILE,
    HARD_TRAIN_FILE,
    HARD_TRUTH_FILE,
    generate_hard_facts,
)
from traceprop_engine.evaluate.lds import run_lds
from traceprop_engine.evaluate.lds_report import (
    GOALS,
    bootstrap_ci,
    goal_checks,
    lds_scores,
    paired_delta,
    spearman_rows,
)
from traceprop_engine.evaluate.lds_retrain import draw_subsets
from traceprop_engine.evaluate.lds_scoring import bm25_scores
from traceprop_engine.evaluate.lds_settings import LdsSettings, parse_config_spec
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


def test_paired_delta_cancels_what_two_rows_share_and_drops_nan():
    rng = np.random.default_rng(3)
    shared = rng.uniform(-0.5, 0.9, 80)  # what both rows get right or wrong per eval example
    x, y = shared + 0.02, shared.copy()
    x[5], y[9] = np.nan, np.nan
    p = paired_delta(x, y)
    assert p["delta"] == pytest.approx(0.02, abs=1e-12) and p["verdict"] == "above"
    assert p["ci"][0] == pytest.approx(0.02, abs=1e-12) and p["ci"][1] == pytest.approx(
        0.02, abs=1e-12
    )
    # unpaired, the two rows' own intervals overlap: the pairing is what tells them apart
    assert bootstrap_ci(x)[0] < bootstrap_ci(y)[1]
    assert paired_delta(x, y, plus=0.05)["verdict"] == "below"
    noisy = paired_delta(shared + rng.normal(0, 0.3, 80), shared)
    assert noisy["verdict"] == "tie" and noisy["ci"][0] < 0 < noisy["ci"][1]


def test_goal_checks_take_the_main_k_default_and_each_bar_present():
    base = np.linspace(0.0, 0.8, 30)

    def row(method, values, k=None):
        return {"method": method, "k": k, "per_example": [float(v) for v in values]}

    table = [
        row("default", base + 0.5, k=32),  # another k's default row: not the one checked
        row("default", base + 0.01, k=126),
        row("full-gradient cosine", base),
        row("bm25", base - 0.10),
    ]
    goals = {g["ref"]: g for g in goal_checks(table, main_k=126)}
    assert set(goals) == {"full-gradient cosine", "bm25"}  # no same-label row: no such bar
    assert goals["full-gradient cosine"]["delta"] == pytest.approx(0.01, abs=1e-12)
    assert goals["bm25"]["plus"] == dict(GOALS)["bm25"] == 0.05
    assert goals["bm25"]["delta"] == pytest.approx(0.01 + 0.10 - 0.05, abs=1e-12)
    assert goal_checks(table[2:], main_k=126) == []


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
        exact=kw.pop("exact", False),
        bm25=kw.pop("bm25", False),
        bootstrap=200,
        **kw,
    )


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- the hard data set, BM25, the exact row and extra tracking configurations -------------------
def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hard_facts_deterministic_and_eval_format_absent_from_training(tmp_path):
    truth = generate_hard_facts(tmp_path / "a", seed=3, n_entities=60)
    generate_hard_facts(tmp_path / "b", seed=3, n_entities=60)
    generate_hard_facts(tmp_path / "c", seed=4, n_entities=60)
    for f in (HARD_TRAIN_FILE, HARD_EVAL_FILE, HARD_TRUTH_FILE):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a" / HARD_TRAIN_FILE).read_bytes() != (
        tmp_path / "c" / HARD_TRAIN_FILE
    ).read_bytes()
    train = _jsonl(tmp_path / "a" / HARD_TRAIN_FILE)
    ev = _jsonl(tmp_path / "a" / HARD_EVAL_FILE)
    assert len(train) == 180 and len(ev) == 60
    # the eval format (a terse question ending in "?") never appears in training
    assert all(e["prompt"].endswith(" ?") for e in ev)
    assert not any("?" in r["prompt"] or "?" in r["completion"] for r in train)
    train_prompts = {r["prompt"] for r in train}
    assert not train_prompts & {e["prompt"] for e in ev}
    # each fact: two training statements in two phrasings with its answer, one distractor row
    # about the same entity with another attribute
    for e, t in zip(ev, truth["eval"], strict=True):
        assert e["completion"] == " " + t["answer"]
        sup = [train[r["row"] - 1] for r in t["supporting"]]
        assert len(sup) == 2 and sup[0]["prompt"] != sup[1]["prompt"]
        assert all(
            r["completion"] == e["completion"] and t["entity"] in r["prompt"].split() for r in sup
        )
        (dis,) = [train[r["row"] - 1] for r in t["distractor"]]
        assert t["entity"] in dis["prompt"].split() and t["attribute"] not in dis["prompt"].split()
    with pytest.raises(ConfigError, match="n_entities"):
        generate_hard_facts(tmp_path / "d", n_entities=1)


def test_bm25_scores_match_the_formula():
    docs = ["the red cat", "the blue dog sat", "a red red fox"]
    got = bm25_scores(["red cat", "zebra"], docs)
    k1, b, n = 1.5, 0.75, 3
    avg = (3 + 4 + 4) / 3

    def term(tf, dl, df):
        idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
        return idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avg))

    want = [term(1, 3, 2) + term(1, 3, 1), 0.0, term(2, 4, 2)]
    np.testing.assert_allclose(got[0], want, rtol=1e-12)
    np.testing.assert_array_equal(got[1], 0.0)  # no query word in any document


def test_parse_config_spec_types_and_errors():
    c = parse_config_spec("k64:k_in=64,k_out=64,covariance=false,scope=last-block")
    assert c == {"name": "k64", "k_in": 64, "k_out": 64, "covariance": False, "scope": "last-block"}
    assert isinstance(c["k_in"], int)
    assert parse_config_spec("plain:") == {"name": "plain"}
    with pytest.raises(ConfigError, match=r"write NAME:KEY=VALUE.*'bad:' for the default"):
        parse_config_spec("bad")  # a typo, not silently the default settings under that name
    assert parse_config_spec("d:sketch=dense,dense_k=32")["dense_k"] == 32
    with pytest.raises(ConfigError, match=r"unknown key 'kin'; allowed keys: scope, k_in, k_out"):
        parse_config_spec("x:kin=64")
    with pytest.raises(ConfigError, match="k_in='sixty' is not a valid int"):
        parse_config_spec("x:k_in=sixty")
    with pytest.raises(ConfigError, match="not key=value"):
        parse_config_spec("x:k_in")
    with pytest.raises(ConfigError, match="give a name"):
        parse_config_spec(":k_in=4")
    with pytest.raises(ConfigError, match="k_in must be a positive integer"):
        parse_config_spec("x:k_in=0")
    with pytest.raises(ConfigError, match="sketch must be one of"):
        parse_config_spec("x:sketch=fancy")
    t = fast_settings(Path("/nonexistent"), Path("/tmp/x"))
    with pytest.raises(ConfigError, match="allowed keys"):
        LdsSettings(train=t, out="/tmp/x", configs=({"name": "a", "kk": 1},))
    with pytest.raises(ConfigError, match="config name 'k8'"):  # clashes with the k sweep's run
        LdsSettings(train=t, out="/tmp/x", configs=({"name": "k8", "k_in": 2},))
    with pytest.raises(ConfigError, match="config name 'a'"):
        LdsSettings(train=t, out="/tmp/x", configs=({"name": "a"}, {"name": "a"}))


@pytest.mark.slow
def test_exact_bm25_and_configs_in_results_and_added_on_resume(data, tmp_path):
    os.environ.setdefault("TQDM_DISABLE", "1")
    from traceprop_engine.attribution.query import open_run

    out = tmp_path / "ev"
    r = run_lds(_settings(data, out, exact=True, bm25=True))
    assert r.complete and sorted(r.retrained) == [0, 1, 2, 3]
    rows = {row["method"]: row for row in r.rows}
    for m in ("exact identity", "exact cosine", "exact kfac", "exact ekfac", "bm25"):
        assert rows[m].get("error") is None, rows[m].get("error")
        assert -1 <= rows[m]["lds"] <= 1 and rows[m]["n_valid"] > 0
        assert rows[m]["ci_low"] <= rows[m]["lds"] <= rows[m]["ci_high"]
    assert rows["exact kfac"]["family"] == "exact" and rows["bm25"]["family"] == "baseline"
    # the exact run records the unprojected per-example gradient of every layer
    run = open_run(out / "runs" / "exact")
    assert all((li.k_out, li.k_in) == (li.d_out, li.d_in) for li in run.store.layers)
    run.close()
    csv = (out / "results.csv").read_text()
    assert "exact kfac,exact,," in csv and "\nbm25,baseline,," in csv
    # the model every run trained from, by content (a base pretrained again differs)
    from traceprop_engine.training.fingerprint import model_fingerprint

    doc = json.loads((out / "results.json").read_text())
    base = out / "base_model"
    assert doc["base_model"] == {"path": str(base.resolve()), "sha256": model_fingerprint(base)}
    assert len(doc["base_model"]["sha256"]) == 64
    # the default against each bar, paired per eval example, in results.json
    goals = {g["ref"]: g for g in doc["goals"]}
    d = np.array(rows["default"]["per_example"], dtype=float)
    b = np.array(rows["bm25"]["per_example"], dtype=float) + 0.05
    ok = ~np.isnan(d - b)
    assert goals["bm25"]["delta"] == pytest.approx(float((d - b)[ok].mean()), abs=1e-9)
    lo, hi = goals["bm25"]["ci"]
    assert lo <= goals["bm25"]["delta"] <= hi
    assert goals["bm25"]["verdict"] == ("above" if lo > 0 else "below" if hi < 0 else "tie")
    fig = json.loads((out / "figure.json").read_text())
    assert {"exact kfac", "bm25"} <= set(fig["data"][0]["x"])
    assert {"exact kfac", "bm25"} <= {t.get("name") for t in fig["data"]}  # k-sweep reference lines

    # adding a tracked configuration to the same --out retrains no subset and scores it
    subset_mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "losses").glob("subset_*.npy")}
    cfg = parse_config_spec("k2:k_in=2,k_out=2")
    r2 = run_lds(_settings(data, out, exact=True, bm25=True, configs=(cfg,)))
    assert r2.complete and r2.retrained == [] and r2.skipped == [0, 1, 2, 3]
    rows2 = {row["method"]: row for row in r2.rows}
    assert rows2["k2 kfac"]["family"] == "config" and rows2["k2 kfac"]["config"] == "k2"
    assert rows2["k2 kfac"]["k"] == 2 and -1 <= rows2["k2 kfac"]["lds"] <= 1
    assert rows2["exact kfac"]["lds"] == pytest.approx(rows["exact kfac"]["lds"], abs=TOL)
    assert json.loads((out / "runs" / "k2" / "lds_track.json").read_text())["k_in"] == 2
    assert {
        p.name: p.stat().st_mtime_ns for p in (out / "losses").glob("subset_*.npy")
    } == subset_mtimes
    import csv

    with open(out / "results.csv") as f:
        by_method = {row["method"]: row for row in csv.DictReader(f)}
    assert by_method["k2 kfac"]["config"] == "k2" and by_method["k2 kfac"]["family"] == "config"
    assert float(by_method["k2 kfac"]["lds"]) == pytest.approx(rows2["k2 kfac"]["lds"], abs=1e-9)
    # a later call that does not name k2 keeps its run and its rows (nothing retrained)
    k2_mtime = (out / "runs" / "k2" / "lds_track.json").stat().st_mtime_ns
    r3 = run_lds(_settings(data, out, exact=True, bm25=True))
    rows3 = {row["method"]: row for row in r3.rows}
    assert r3.complete and r3.retrained == [] and rows3["k2 kfac"]["config"] == "k2"
    assert rows3["k2 kfac"]["lds"] == pytest.approx(rows2["k2 kfac"]["lds"], abs=1e-9)
    assert (out / "runs" / "k2" / "lds_track.json").stat().st_mtime_ns == k2_mtime


@pytest.mark.slow
def test_retrain_seeds_average_the_losses_and_report_the_noise_ceiling(data, tmp_path):
    os.environ.setdefault("TQDM_DISABLE", "1")
    out = tmp_path / "ev"
    first = run_lds(_settings(data, out, compact=()))
    assert first.complete and first.noise_ceiling is None
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "losses").glob("subset_*.npy")}
    assert len(mtimes) == 4
    # a resume with two retrain seeds trains only the second replicate of each subset
    r = run_lds(_settings(data, out, retrain_seeds=2, compact=()))
    assert r.complete and sorted(r.retrained) == [0, 1, 2, 3]
    assert {n: (out / "losses" / n).stat().st_mtime_ns for n in mtimes} == mtimes
    rep0 = np.stack([np.load(out / "losses" / f"subset_{j:03d}.npy") for j in range(4)])
    rep1 = np.stack([np.load(out / "losses" / f"subset_{j:03d}_r1.npy") for j in range(4)])
    assert not np.allclose(rep0, rep1)  # another data order gives another model
    np.testing.assert_allclose(np.load(out / "losses.npy"), (rep0 + rep1) / 2, rtol=1e-12)
    want = np.nanmean(spearman_rows(rep0.T, rep1.T))
    doc = json.loads((out / "results.json").read_text())
    assert doc["retrain_seeds"] == 2
    assert doc["noise_ceiling"]["split_half_spearman"] == pytest.approx(want, abs=TOL)
    assert r.noise_ceiling["split_half_spearman"] == pytest.approx(want, abs=TOL)
    # Spearman–Brown, per eval example: the mean of all replicates has reliability 2ρ/(1+ρ)
    rho = np.clip(spearman_rows(rep0.T, rep1.T), 0, None)
    attainable = np.nanmean(np.sqrt(2 * rho / (1 + rho)))
    assert 0 <= attainable <= 1
    assert doc["noise_ceiling"]["attainable_lds"] == pytest.approx(attainable, abs=TOL)
    with pytest.raises(ConfigError, match="retrain_seeds"):
        _settings(data, out, retrain_seeds=0)


def test_cli_config_flag_errors_name_the_allowed_keys(data, tmp_path, capsys):
    from traceprop_engine.cli.main import main

    base = [
        "eval", "lds", "--data", str(data / "train"), "--eval-data", str(data / "eval"),
        "--out", str(tmp_path / "ev"),
    ]  # fmt: skip
    assert main([*base, "--config", "k64:k_in=64,kout=64"]) == 1
    err = capsys.readouterr().err
    assert "unknown key 'kout'" in err and "allowed keys: scope, k_in, k_out" in err
    assert main([*base, "--config", "k64:k_in=big"]) == 1
    assert "k_in='big' is not a valid int" in capsys.readouterr().err
    assert not (tmp_path / "ev").exists()  # refused before anything was written


def test_a_run_recorded_as_pretrained_from_the_untrained_base_is_trained_again(data, tmp_path):
    """An evaluation folder from before stop 49: its tiny runs were trained from the untrained
    ``base_model`` but recorded ``model_origin`` pretrained-full. The next use marks the base and
    trains such a run again (recorded as scratch); a run recorded right is reused as it is."""
    import h5py

    from traceprop_engine import constants as C
    from traceprop_engine.evaluate.lds import _base_model, _ensure_run

    s = _settings(data, tmp_path / "ev")
    base = _base_model(s, tmp_path / "ev")
    track = TrackSettings(k_in=4, k_out=4)
    run = _ensure_run("k4", track, s, base, tmp_path / "ev")
    store = run / C.STORE_FILE
    with h5py.File(store, "r") as f:
        assert f.attrs[C.MODEL_ORIGIN] == C.ORIGIN_SCRATCH
    first = store.stat().st_mtime_ns
    assert _ensure_run("k4", track, s, base, tmp_path / "ev") == run
    assert store.stat().st_mtime_ns == first  # recorded right: reused
    with h5py.File(store, "r+") as f:  # as a run of an older harness recorded it
        f.attrs[C.MODEL_ORIGIN] = C.ORIGIN_PRETRAINED_FULL
    _ensure_run("k4", track, s, base, tmp_path / "ev")
    with h5py.File(store, "r") as f:
        assert f.attrs[C.MODEL_ORIGIN] == C.ORIGIN_SCRATCH  # trained again


def test_the_cli_prints_each_bar_with_its_verdict(capsys):
    from traceprop_engine.cli.evaluate import _print_goals

    base = np.linspace(0.0, 0.8, 30)
    table = [
        {"method": "default", "k": 126, "per_example": list(base + 0.02)},
        {"method": "same label", "k": None, "per_example": list(base)},
    ]
    _print_goals(goal_checks(table, main_k=126, n_boot=200))
    out = capsys.readouterr().out
    assert "paired per eval example" in out
    assert ">= same label + 0.05" in out and "-0.030  [-0.030, -0.030]  below" in out
