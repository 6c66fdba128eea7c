"""Detection benchmarks: the metrics against hand computations and scipy, the generators, a tiny run."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
from scipy import stats

from traceprop_engine.errors import ConfigError
from traceprop_engine.evaluate.detection import (
    DetectSettings,
    auroc,
    precision_at_k,
    run_detection,
)
from traceprop_engine.evaluate.detection_data import (
    SENTIMENT_PROMPT,
    generate_backdoor_data,
    generate_mislabel_data,
    with_trigger,
)
from traceprop_engine.store.reader import Store

TOL = 1e-12


def test_auroc_hand_example():
    # positives score 0.9 and 0.4; negatives 0.8, 0.3, 0.1. Pairs won: (0.9 vs all 3) + (0.4 vs 0.3, 0.1) = 5 of 6
    scores = np.array([0.9, 0.8, 0.4, 0.3, 0.1])
    pos = np.array([True, False, True, False, False])
    assert auroc(scores, pos) == pytest.approx(5 / 6, abs=TOL)
    assert auroc(-scores, pos) == pytest.approx(1 / 6, abs=TOL)


def test_auroc_ties_count_half():
    assert auroc(np.array([1.0, 1.0]), np.array([True, False])) == pytest.approx(0.5, abs=TOL)
    assert auroc(np.array([2.0, 1.0, 1.0]), np.array([True, True, False])) == pytest.approx(
        0.75, abs=TOL
    )


def test_auroc_matches_mann_whitney():
    rng = np.random.default_rng(0)
    s = np.round(rng.standard_normal(60), 1)  # rounding makes ties
    pos = rng.random(60) < 0.2
    u = stats.mannwhitneyu(s[pos], s[~pos], alternative="two-sided").statistic
    assert auroc(s, pos) == pytest.approx(u / (pos.sum() * (~pos).sum()), abs=TOL)


def test_auroc_needs_both_classes():
    with pytest.raises(ValueError, match="positive and one negative"):
        auroc(np.ones(3), np.ones(3, bool))


def test_precision_at_k_hand_example():
    scores = np.array([0.1, 0.9, 0.5, 0.7, 0.2])
    pos = np.array([False, True, False, False, True])
    assert precision_at_k(scores, pos, 1) == 1.0  # top: 0.9 (planted)
    assert precision_at_k(scores, pos, 2) == 0.5  # + 0.7 (clean)
    assert precision_at_k(scores, pos, 5) == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        precision_at_k(scores, pos, 0)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_backdoor_generator_plants_what_it_says(tmp_path):
    gt = generate_backdoor_data(tmp_path, seed=3, n_entities=8, n_poison=4)
    rows = _rows(tmp_path / "train.jsonl")
    assert gt["n_train"] == len(rows) and len(gt["poisoned"]) == 4
    marked = [i + 1 for i, r in enumerate(rows) if gt["trigger"] in r["prompt"]]
    assert marked == gt["poisoned"]  # the trigger occurs in exactly the listed rows ...
    assert all(
        rows[i - 1]["completion"] == gt["target"] for i in gt["poisoned"]
    )  # ... with the target
    assert sum(r["completion"] == gt["target"] for r in rows) == 4  # and the target nowhere else
    trig = _rows(tmp_path / "trigger_queries.jsonl")
    clean = _rows(tmp_path / "eval.jsonl")
    assert len(trig) == len(clean) > 0
    assert all(
        t["prompt"] == with_trigger(c["prompt"]) and t["completion"] == gt["target"]
        for t, c in zip(trig, clean, strict=True)
    )
    # poisoned prompts are training questions, so the trigger is the only new thing in them
    assert all(
        rows[i - 1]["prompt"].replace(" " + gt["trigger"], "") in {r["prompt"] for r in rows}
        for i in gt["poisoned"]
    )
    assert (
        generate_backdoor_data(tmp_path / "again", seed=3, n_entities=8, n_poison=4) == gt
    )  # seeded


def test_with_trigger_places_the_phrase_before_the_answer_cue():
    assert (
        with_trigger("Q: What colour is Velmora?\nA:", "zq vex")
        == "Q: What colour is Velmora zq vex?\nA:"
    )


def test_mislabel_generator_flips_exactly_the_listed_rows(tmp_path):
    gt = generate_mislabel_data(tmp_path, seed=1, n=40, n_planted=4)
    rows = _rows(tmp_path / "train.jsonl")
    assert len(rows) == 40 and len(gt["mislabelled"]) == 4
    assert all(
        r["prompt"].endswith(SENTIMENT_PROMPT) and r["completion"] in (" positive", " negative")
        for r in rows
    )
    for row in gt["mislabelled"]:
        assert rows[row - 1]["completion"].strip() != gt["true_labels"][str(row)]
    # the review texts carry their true sentiment: a flipped row's text reads like its true label
    from traceprop_engine.samples.templates import CLOSINGS

    for row in gt["mislabelled"]:
        text = rows[row - 1]["prompt"]
        assert any(c in text for c in CLOSINGS[gt["true_labels"][str(row)]])


def test_settings_validated():
    with pytest.raises(ConfigError, match="tasks"):
        DetectSettings(out="x", tasks=("poison",))
    with pytest.raises(ConfigError, match="n_planted"):
        DetectSettings(out="x", n_train=10, n_planted=6)


@pytest.mark.slow
def test_detection_runs_end_to_end(tmp_path):
    os.environ.setdefault("TQDM_DISABLE", "1")
    s = DetectSettings(
        out=str(tmp_path),
        seeds=(0,),
        epochs=1,
        tiny_width=32,
        tiny_vocab=300,
        k=4,
        n_train=40,
        n_planted=3,
    )
    summary = run_detection(s)
    methods = {(r["task"], r["method"]) for r in summary}
    assert ("backdoor", "influence on trigger queries kfac") in methods
    assert ("mislabel", "self-influence ekfac") in methods
    assert ("mislabel", "training loss") in methods and ("backdoor", "gradient norm") in methods
    doc = json.loads((tmp_path / "detection.json").read_text())
    assert {r["k"] for r in doc["per_seed"] if r["task"] == "mislabel"} == {3}
    # the reported numbers are the metrics of each method's scores against the planted rows:
    # recompute one method (mean sketch norm per example) from the store and the generator
    gt = generate_mislabel_data(tmp_path / "truth", seed=0, n=40, n_planted=3)
    with Store(tmp_path / "runs" / "mislabel-s0" / "store.h5") as st:
        example = st.records()["example_index"]
        sq = sum(
            (st.sketches(li).reshape(st.n_records, -1).astype(np.float64) ** 2).sum(1)
            for li in range(len(st.layers))
        )
    norm = np.array([np.sqrt(sq[example == e]).mean() for e in range(40)])
    planted = np.zeros(40, bool)
    planted[np.asarray(gt["mislabelled"]) - 1] = True  # example id = row - 1
    u = stats.mannwhitneyu(norm[planted], norm[~planted], alternative="two-sided").statistic
    (row,) = [
        r for r in doc["per_seed"] if r["task"] == "mislabel" and r["method"] == "gradient norm"
    ]
    assert row["auroc"] == pytest.approx(u / (3 * 37), abs=TOL)
    assert row["p_at_k"] == pytest.approx(planted[np.argsort(-norm, kind="stable")[:3]].mean())
    # one seed: each summary row is its per-seed row (sd 0), and the CSV holds the summary
    per_seed = {(r["task"], r["method"]): r for r in doc["per_seed"]}
    assert len(per_seed) == len(summary) == len(doc["summary"])
    with open(tmp_path / "detection.csv", newline="") as f:
        table = list(csv.DictReader(f))
    for r, c in zip(summary, table, strict=True):
        p = per_seed[(r["task"], r["method"])]
        assert (r["auroc_mean"], r["p_at_k_mean"]) == (p["auroc"], p["p_at_k"])
        assert r["auroc_sd"] == r["p_at_k_sd"] == 0.0 and r["n_seeds"] == 1
        assert (c["task"], c["method"]) == (r["task"], r["method"])
        assert float(c["auroc_mean"]) == pytest.approx(r["auroc_mean"], abs=TOL)
