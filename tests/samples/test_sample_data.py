"""Tests of traceprop_engine.samples.data: determinism, loadability, ground truth that holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from traceprop_engine.errors import ConfigError
from traceprop_engine.samples.data import (
    CLASSIFICATION_LABELS,
    generate_classification_data,
    generate_sample_data,
)
from traceprop_engine.training.data import load_examples


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_sample_data_is_byte_identical_for_a_seed(tmp_path):
    generate_sample_data(tmp_path / "a", seed=7)
    generate_sample_data(tmp_path / "b", seed=7)
    generate_sample_data(tmp_path / "c", seed=8)

    a = read_tree(tmp_path / "a")
    assert set(a) == {
        "train/planets.jsonl",
        "train/inventors.jsonl",
        "train/rivers.jsonl",
        "train/guilds.jsonl",
        "train/rumours.jsonl",
        "eval/questions.jsonl",
        "ground_truth.json",
    }
    assert a == read_tree(tmp_path / "b")
    assert a != read_tree(tmp_path / "c")


def test_sample_data_loads_and_ground_truth_points_at_the_fact(tmp_path):
    returned = generate_sample_data(tmp_path, seed=0, n_entities=24)

    train, root = load_examples(tmp_path / "train")
    evaluation, _ = load_examples(tmp_path / "eval" / "questions.jsonl")
    truth = json.loads((tmp_path / "ground_truth.json").read_text(encoding="utf-8"))

    assert truth == returned
    assert root == tmp_path / "train"
    assert 150 <= len(train) <= 250
    assert truth["n_train"] == len(train)
    assert 24 <= len(evaluation) <= 40
    assert len(truth["eval"]) == len(evaluation)
    by_key = {e.key: e for e in train}
    assert all(len(e.completion.split()) <= 2 for e in train + evaluation)

    n_contradicted = 0
    for question, fact in zip(evaluation, truth["eval"], strict=True):
        assert question.row == fact["row"]
        assert question.completion == f" {fact['answer']}"
        assert fact["entity"] in question.prompt
        assert 1 <= len(fact["supporting"]) <= 2
        for ref in fact["supporting"]:
            example = by_key[f"{ref['source']}:{ref['row']}"]
            assert fact["entity"] in example.prompt
            assert example.completion == f" {fact['answer']}"
            assert example.prompt != question.prompt  # evaluation questions are paraphrases
        for ref in fact["contradicting"]:
            example = by_key[f"{ref['source']}:{ref['row']}"]
            assert ref["source"] == "rumours.jsonl"
            assert fact["entity"] in example.prompt
            assert example.completion == f" {ref['answer']}" != question.completion
            # a rumour asks the very training question of the fact it contradicts
            first = fact["supporting"][0]
            assert example.prompt == by_key[f"{first['source']}:{first['row']}"].prompt
            n_contradicted += 1
    assert n_contradicted == len([e for e in train if e.source == "rumours.jsonl"]) >= 1

    # every other training row that names the entity with the same answer is listed as support
    for fact in truth["eval"]:
        listed = {f"{r['source']}:{r['row']}" for r in fact["supporting"]}
        (question,) = [by_key[k].prompt for k in listed if by_key[k].prompt.startswith("Q: ")]
        same = {e.key for e in train if e.prompt == question and e.source != "rumours.jsonl"}
        assert same <= listed


def test_entity_names_are_unique_and_not_substrings(tmp_path):
    truth = generate_sample_data(tmp_path, seed=3, n_entities=40)
    train, _ = load_examples(tmp_path / "train")

    type_rows = [e for e in train if e.prompt.startswith("Q: Is ")]
    names = [e.prompt.split()[2] for e in type_rows]
    assert len(names) == len(set(names)) == 40
    for name in names:
        assert not any(name in other for other in names if other != name)
    assert {f["entity"] for f in truth["eval"]} <= set(names)


def test_sample_data_rejects_too_few_entities(tmp_path):
    with pytest.raises(ConfigError, match="n_entities must be between 4"):
        generate_sample_data(tmp_path, n_entities=3)


def test_classification_data_is_deterministic_and_mislabels_are_real(tmp_path):
    truth = generate_classification_data(tmp_path / "a", seed=1, n=160, mislabel_fraction=0.05)
    generate_classification_data(tmp_path / "b", seed=1, n=160, mislabel_fraction=0.05)
    assert read_tree(tmp_path / "a") == read_tree(tmp_path / "b")

    train, _ = load_examples(tmp_path / "a" / "train.jsonl", task="classification")
    evaluation, _ = load_examples(tmp_path / "a" / "eval.jsonl", task="classification")

    assert len(train) == 160
    assert len(evaluation) == 40
    assert {e.label for e in train} == set(CLASSIFICATION_LABELS)
    assert not {e.text for e in train} & {e.text for e in evaluation}
    assert len(truth["mislabelled"]) == 8  # round(0.05 * 160)

    # the templates end with a closing that gives the sentiment away; use it as the oracle
    positive_closings = ("Highly recommended.", "I would buy it again.", "Five stars.", "Love it.")

    def true_label(text: str) -> str:
        return "positive" if text.endswith(positive_closings) else "negative"

    wrong = [e.row for e in train if e.label != true_label(e.text)]
    assert wrong == truth["mislabelled"]
    for row in truth["mislabelled"]:
        assert truth["true_labels"][str(row)] == true_label(train[row - 1].text)
    assert all(e.label == true_label(e.text) for e in evaluation)


def test_classification_without_mislabels(tmp_path):
    truth = generate_classification_data(tmp_path, n=20, mislabel_fraction=0.0)

    assert truth["mislabelled"] == []
