"""Generated data sets whose right answers a person can check by eye.

:func:`generate_sample_data` writes invented facts about invented entities (planets, inventors,
rivers, guilds with made-up names such as "Velmora"), so a tiny model can only know them from
the training files, and every evaluation question has a known list of training rows that state
its answer, plus planted "rumours" that contradict it. An attribution for
``Q: Which colour does the planet Velmora have?`` should rank the rows about Velmora's colour
at the top, and the rumour among the opponents.

:func:`generate_classification_data` writes template-made product reviews labelled
``positive``/``negative`` with a few planted mislabels.

Both are deterministic: the same arguments give the same bytes. No network is used. The tables
they draw from (topics, attributes, names, review phrases) are in :mod:`.templates`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .templates import TOPICS, Attribute, invent_names, review

logger = logging.getLogger(__name__)

__all__ = [
    "CLASSIFICATION_EVAL_FILE",
    "CLASSIFICATION_LABELS",
    "CLASSIFICATION_TRAIN_FILE",
    "EVAL_FILE",
    "GROUND_TRUTH_FILE",
    "RUMOURS_FILE",
    "TRAIN_DIR",
    "generate_classification_data",
    "generate_sample_data",
]

TRAIN_DIR = "train"
EVAL_FILE = "eval/questions.jsonl"
RUMOURS_FILE = "rumours.jsonl"  # inside TRAIN_DIR
GROUND_TRUTH_FILE = "ground_truth.json"
CLASSIFICATION_TRAIN_FILE = "train.jsonl"
CLASSIFICATION_EVAL_FILE = "eval.jsonl"

_MIN_ENTITIES = len(TOPICS)
_MAX_ENTITIES = 100


def generate_sample_data(out_dir: Path, *, seed: int = 0, n_entities: int = 24) -> dict[str, Any]:
    """Write a question-answering data set of invented facts with known ground truth.

    Files written under ``out_dir``:

    - ``train/<topic>.jsonl`` (planets, inventors, rivers, guilds): ``{"prompt", "completion"}``
      rows. Each entity has 2-3 attributes; each fact is stated twice, once as a question
      (``"Q: What colour is the planet Velmora?\\nA:"`` → ``" teal"``) and once as a
      paraphrased statement (``"The planet Velmora is coloured"`` → ``" teal"``), and each
      entity has one type fact (``" a planet"``). Completions are 1-2 words.
    - ``train/rumours.jsonl``: planted contradictions, the training question of a fact with
      another answer.
    - ``eval/questions.jsonl``: evaluation questions, worded differently from the training rows.
    - ``ground_truth.json``: for each evaluation row (1-based line), the training rows that
      state the fact (``supporting``) and those that contradict it (``contradicting``), each as
      ``{"source": path relative to train/, "row": line}``.

    Args:
        out_dir: Output directory (created if needed; the files above are overwritten).
        seed: Seed of names, attribute values, choice of questions and rumours.
        n_entities: Number of invented entities, spread evenly over the four topics
            (24 gives about 160 training rows and 32 evaluation questions).

    Returns:
        The ground-truth dictionary that was written to ``ground_truth.json``.

    Raises:
        ConfigError: ``n_entities`` is out of range.
    """
    if not _MIN_ENTITIES <= n_entities <= _MAX_ENTITIES:
        raise ConfigError(
            f"n_entities must be between {_MIN_ENTITIES} (one per topic) and {_MAX_ENTITIES}, "
            f"got {n_entities}."
        )
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    names = invent_names(rng, n_entities)
    train_rows, facts = _state_facts(rng, names)
    asked = _asked_facts(facts, names)
    rumours = _plant_rumours(rng, asked, n_entities)
    eval_rows, ground_truth_rows = _eval_questions(asked)

    for topic_name, rows in train_rows.items():
        _write_jsonl(out_dir / TRAIN_DIR / f"{topic_name}.jsonl", rows)
    _write_jsonl(out_dir / TRAIN_DIR / RUMOURS_FILE, rumours)
    _write_jsonl(out_dir / EVAL_FILE, eval_rows)

    n_train = sum(len(rows) for rows in train_rows.values()) + len(rumours)
    ground_truth = {
        "description": (
            "Invented facts about invented entities. For each row of eval/questions.jsonl, "
            "'supporting' lists the training rows that state its answer and 'contradicting' "
            "the planted rumours that give another answer; sources are relative to train/, "
            "rows are 1-based line numbers."
        ),
        "seed": seed,
        "n_entities": n_entities,
        "n_train": n_train,
        "train_dir": TRAIN_DIR,
        "eval_file": EVAL_FILE,
        "eval": ground_truth_rows,
    }
    _write_json(out_dir / GROUND_TRUTH_FILE, ground_truth)
    logger.info(
        "wrote sample data to %s: %d training rows (%d rumours), %d evaluation questions",
        out_dir,
        n_train,
        len(rumours),
        len(eval_rows),
    )
    return ground_truth


def _state_facts(
    rng: random.Random, names: list[str]
) -> tuple[dict[str, list[dict[str, str]]], list[dict[str, Any]]]:
    """The training rows of every topic file, and one fact per (entity, attribute).

    Each fact lists the two rows that state it (the question and the statement).
    """
    train_rows: dict[str, list[dict[str, str]]] = {t.name: [] for t in TOPICS}
    facts = []  # one per (entity, attribute), with the rows that state it
    for i, name in enumerate(names):
        topic = TOPICS[i % len(TOPICS)]
        rows = train_rows[topic.name]
        rows.append(_qa(f"Is {name} a planet, an inventor, a river or a guild?", topic.kind))
        n_attributes = rng.choice((2, 3, 3))
        for attribute in rng.sample(topic.attributes, n_attributes):
            value = rng.choice(attribute.values)
            rows.append(_qa(attribute.question.format(e=name), value))
            rows.append(_row(attribute.statement.format(e=name), value))
            facts.append(
                {
                    "entity": name,
                    "topic": topic.name,
                    "attribute": attribute,
                    "answer": value,
                    "supporting": [
                        {"source": f"{topic.name}.jsonl", "row": len(rows) - 1},
                        {"source": f"{topic.name}.jsonl", "row": len(rows)},
                    ],
                    "contradicting": [],
                }
            )

    return train_rows, facts


def _asked_facts(facts: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Evaluation: the first fact of every entity, and a second one of every third entity."""
    per_entity: dict[str, list[dict[str, Any]]] = {}
    for fact in facts:
        per_entity.setdefault(fact["entity"], []).append(fact)
    asked = []
    for j, name in enumerate(names):
        asked.extend(per_entity[name][: 2 if j % 3 == 0 else 1])

    return asked


def _plant_rumours(
    rng: random.Random, asked: list[dict[str, Any]], n_entities: int
) -> list[dict[str, str]]:
    """Rumours contradict a quarter of the entities' asked facts, so they show in the ground truth.

    Each rumour is also added to its fact's ``contradicting`` rows.
    """
    rumours: list[dict[str, str]] = []
    for fact in sorted(rng.sample(asked, max(1, n_entities // 4)), key=asked.index):
        attribute: Attribute = fact["attribute"]
        wrong = rng.choice([v for v in attribute.values if v != fact["answer"]])
        rumours.append(_qa(attribute.question.format(e=fact["entity"]), wrong))
        fact["contradicting"].append({"source": RUMOURS_FILE, "row": len(rumours), "answer": wrong})

    return rumours


def _eval_questions(asked: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[dict]]:
    """The evaluation rows (paraphrased questions) and their ground-truth entries."""
    eval_rows = []
    ground_truth_rows = []
    for row, fact in enumerate(asked, start=1):
        attribute = fact["attribute"]
        eval_rows.append(_qa(attribute.paraphrase.format(e=fact["entity"]), fact["answer"]))
        ground_truth_rows.append(
            {
                "row": row,
                "prompt": eval_rows[-1]["prompt"],
                "completion": eval_rows[-1]["completion"],
                "entity": fact["entity"],
                "topic": fact["topic"],
                "attribute": attribute.name,
                "answer": fact["answer"],
                "supporting": fact["supporting"],
                "contradicting": fact["contradicting"],
            }
        )

    return eval_rows, ground_truth_rows


CLASSIFICATION_LABELS = ("positive", "negative")


def generate_classification_data(
    out_dir: Path, *, seed: int = 0, n: int = 160, mislabel_fraction: float = 0.05
) -> dict[str, Any]:
    """Write template product reviews labelled by sentiment, with planted mislabels.

    Files written under ``out_dir``:

    - ``train.jsonl``: ``n`` rows ``{"text", "label"}``, labels ``"positive"``/``"negative"``
      (balanced); ``round(mislabel_fraction * n)`` of them (at least one when the fraction is
      positive) carry the wrong label.
    - ``eval.jsonl``: ``max(8, n // 4)`` correctly labelled reviews not in the training set.
    - ``ground_truth.json``: ``{"mislabelled": [1-based rows of train.jsonl], "true_labels":
      {row: label}, ...}``.

    Args:
        out_dir: Output directory (created if needed; the files above are overwritten).
        seed: Seed of the reviews and of the mislabelled rows.
        n: Number of training reviews.
        mislabel_fraction: Share of training rows given the wrong label, in ``[0, 0.5)``.

    Returns:
        The ground-truth dictionary that was written to ``ground_truth.json``.

    Raises:
        ConfigError: ``n`` or ``mislabel_fraction`` is out of range.
    """
    if not 2 <= n <= 5000:
        raise ConfigError(f"n must be between 2 and 5000 reviews, got {n}.")
    if not 0.0 <= mislabel_fraction < 0.5:
        raise ConfigError(f"mislabel_fraction must be in [0, 0.5), got {mislabel_fraction!r}.")
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    n_eval = max(8, n // 4)

    seen: set[str] = set()
    reviews = []  # (text, true label); train first, then eval
    for i in range(n + n_eval):
        label = CLASSIFICATION_LABELS[i % 2]
        for _ in range(1000):  # the template space is large, so a fresh review comes quickly
            text = review(rng, label)
            if text not in seen:
                break
        else:
            raise ConfigError(f"cannot make {n + n_eval} distinct reviews; lower n.")
        seen.add(text)
        reviews.append((text, label))
    train, held_out = reviews[:n], reviews[n:]

    n_wrong = 0 if mislabel_fraction == 0 else max(1, round(mislabel_fraction * n))
    mislabelled = sorted(rng.sample(range(1, n + 1), n_wrong))
    train_rows = []
    for row, (text, label) in enumerate(train, start=1):
        if row in mislabelled:
            label = CLASSIFICATION_LABELS[1 - CLASSIFICATION_LABELS.index(label)]
        train_rows.append({"text": text, "label": label})

    _write_jsonl(out_dir / CLASSIFICATION_TRAIN_FILE, train_rows)
    _write_jsonl(
        out_dir / CLASSIFICATION_EVAL_FILE, [{"text": t, "label": lab} for t, lab in held_out]
    )
    ground_truth = {
        "description": (
            "Template product reviews. 'mislabelled' lists the 1-based rows of train.jsonl "
            "whose label was flipped on purpose; 'true_labels' gives their correct label."
        ),
        "seed": seed,
        "n_train": n,
        "n_eval": n_eval,
        "train_file": CLASSIFICATION_TRAIN_FILE,
        "eval_file": CLASSIFICATION_EVAL_FILE,
        "mislabelled": mislabelled,
        "true_labels": {str(row): train[row - 1][1] for row in mislabelled},
    }
    _write_json(out_dir / GROUND_TRUTH_FILE, ground_truth)
    logger.info(
        "wrote classification sample data to %s: %d training rows (%d mislabelled), %d eval",
        out_dir,
        n,
        n_wrong,
        n_eval,
    )
    return ground_truth


# --------------------------------------------------------------------------------------------
# helpers


def _qa(question: str, answer: str) -> dict[str, str]:
    return _row(f"Q: {question}\nA:", answer)


def _row(prompt: str, answer: str) -> dict[str, str]:
    # the leading space makes the answer its own word after "A:" or the statement
    return {"prompt": prompt, "completion": f" {answer}"}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_bytes(text.encode("utf-8"))  # bytes, so no platform newline translation


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))
