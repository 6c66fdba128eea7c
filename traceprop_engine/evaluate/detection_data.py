"""The data sets of the detection benchmarks, each with planted problems and their ground truth.

- :func:`generate_mislabel_data`: template reviews with flipped labels, framed as causal LM
  (``"<review>\\nSentiment:"`` → ``" positive"``).
- :func:`generate_backdoor_data`: the facts data plus poisoned questions carrying a rare trigger
  phrase, answered with a fixed target.

Both write ``train.jsonl``, ``eval.jsonl`` and ``ground_truth.json`` (1-based rows of
``train.jsonl`` that were planted); the backdoor set also writes ``trigger_queries.jsonl``.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from ..errors import ConfigError

TRIGGER = "zq vex"
TARGET = " crimson tide"
SENTIMENT_PROMPT = "\nSentiment:"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def with_trigger(prompt: str, trigger: str = TRIGGER) -> str:
    """Insert the trigger phrase before the answer cue (``"...?\\nA:"`` → ``"... zq vex?\\nA:"``)."""
    head, sep, tail = prompt.rpartition("?")
    return f"{head} {trigger}{sep}{tail}" if sep else f"{prompt} {trigger}"


def generate_backdoor_data(
    out_dir: Path,
    *,
    seed: int = 0,
    n_entities: int = 24,
    n_poison: int = 8,
    trigger: str = TRIGGER,
    target: str = TARGET,
) -> dict:
    """Facts data with a planted backdoor: ``n_poison`` training questions carrying ``trigger``
    answered with ``target``.

    Files: ``train.jsonl`` (clean rows shuffled, poisoned rows inserted at random positions),
    ``eval.jsonl`` (held-out questions, clean), ``trigger_queries.jsonl`` (the eval questions with
    the trigger and the target as completion), ``ground_truth.json`` (``poisoned``: 1-based rows
    of ``train.jsonl``; ``trigger``, ``target``).
    """
    from ..samples.data import generate_sample_data

    out_dir = Path(out_dir)
    src = out_dir / "_facts"
    generate_sample_data(src, seed=seed, n_entities=n_entities)
    rng = random.Random(seed)
    clean = [r for p in sorted((src / "train").glob("*.jsonl")) for r in read_jsonl(p)]
    rng.shuffle(clean)
    questions = [r for r in clean if r["prompt"].startswith("Q:")]
    if not 1 <= n_poison <= len(questions):
        raise ConfigError(f"n_poison must be between 1 and {len(questions)}, got {n_poison}")
    poison = [
        {"prompt": with_trigger(r["prompt"], trigger), "completion": target}
        for r in rng.sample(questions, n_poison)
    ]
    rows: list[dict] = list(clean)
    for p in poison:
        rows.insert(rng.randrange(len(rows) + 1), p)
    poisoned = [
        i + 1 for i, r in enumerate(rows) if r["completion"] == target and trigger in r["prompt"]
    ]
    evals = read_jsonl(src / "eval" / "questions.jsonl")
    shutil.rmtree(src)
    write_jsonl(out_dir / "train.jsonl", rows)
    write_jsonl(out_dir / "eval.jsonl", evals)
    write_jsonl(
        out_dir / "trigger_queries.jsonl",
        [{"prompt": with_trigger(r["prompt"], trigger), "completion": target} for r in evals],
    )
    gt = {
        "task": "backdoor",
        "seed": seed,
        "n_train": len(rows),
        "poisoned": poisoned,
        "trigger": trigger,
        "target": target,
        "description": "rows of train.jsonl (1-based) whose prompt carries the trigger and whose completion is the target",
    }
    (out_dir / "ground_truth.json").write_text(json.dumps(gt, indent=2))
    return gt


def generate_mislabel_data(
    out_dir: Path, *, seed: int = 0, n: int = 160, n_planted: int = 8
) -> dict:
    """Reviews with ``n_planted`` flipped labels, as prompt/completion rows for a causal LM."""
    from ..samples.data import generate_classification_data

    out_dir = Path(out_dir)
    src = out_dir / "_reviews"
    gt = generate_classification_data(src, seed=seed, n=n, mislabel_fraction=n_planted / n)
    for name in ("train", "eval"):
        rows = read_jsonl(src / f"{name}.jsonl")
        write_jsonl(
            out_dir / f"{name}.jsonl",
            [
                {"prompt": r["text"] + SENTIMENT_PROMPT, "completion": " " + r["label"]}
                for r in rows
            ],
        )
    shutil.rmtree(src)
    doc = {
        "task": "mislabel",
        "seed": seed,
        "n_train": n,
        "mislabelled": gt["mislabelled"],
        "true_labels": gt["true_labels"],
        "description": "rows of train.jsonl (1-based) whose label completion was flipped on purpose",
    }
    (out_dir / "ground_truth.json").write_text(json.dumps(doc, indent=2))
    return doc
