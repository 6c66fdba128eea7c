"""A harder LDS data set: facts learnt from statements, asked as questions never seen in training.

:func:`generate_hard_facts` invents entities ("Kavo", "Mirtu") with invented attribute values
from a small word vocabulary. Each entity has one *asked* fact, stated twice in training in two
different declarative phrasings (``"kavo likes the colour"`` → ``" red"``, ``"the favourite
colour of kavo is"`` → ``" red"``), plus one *distractor* row about the same entity and another
attribute. The evaluation asks each asked fact in a terse question format that no training row
uses (``"kavo colour ?"`` → ``" red"``): a model can only answer
by generalising from the statements, so attribution has to find the two statement rows among
rows that share the entity name (the distractor) or the attribute word (every other entity's
rows). Unlike :func:`traceprop_engine.samples.data.generate_sample_data`, whose training set holds
question-format rows, the eval format here is absent from training.

Everything is lower case and separated by spaces (word-level, about 110 distinct words plus the
names), so a tiny model whose tokenizer is trained on the run's own texts (``--tiny-vocab 1024``)
sees about one token per word. Measured: a 2-layer, width-64 tiny model (12 epochs, lr 3e-3,
batch 8) ranks the right value first among the attribute's 6 values for 46 (seed 0) and 35
(seed 1) of 60 eval questions (chance: 10).
Deterministic: the same arguments give the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["HARD_EVAL_FILE", "HARD_TRAIN_FILE", "HARD_TRUTH_FILE", "generate_hard_facts"]

HARD_TRAIN_FILE = "train/facts.jsonl"
HARD_EVAL_FILE = "eval/questions.jsonl"
HARD_TRUTH_FILE = "ground_truth.json"
EVAL_MARKER = "?"  # every eval prompt ends with it; no training row contains it

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

# attribute: (values, statement A, statement B); "{e}" = the entity. The attribute word (the
# key) appears in both statements and in the eval question.
_ATTRIBUTES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "colour": (
        ("red", "blue", "green", "amber", "violet", "grey"),
        "{e} likes the colour",
        "the favourite colour of {e} is",
    ),
    "food": (
        ("bread", "rice", "plums", "cheese", "soup", "figs"),
        "{e} mostly eats the food",
        "the usual food of {e} is",
    ),
    "pet": (
        ("cat", "dog", "owl", "goat", "crow", "frog"),
        "{e} keeps the pet",
        "the pet living with {e} is a",
    ),
    "town": (
        ("oslo", "lima", "cairo", "quito", "dakar", "hanoi"),
        "{e} was born in the town",
        "the home town of {e} is",
    ),
    "tool": (
        ("hammer", "saw", "drill", "chisel", "rake", "spade"),
        "{e} works with the tool",
        "the tool owned by {e} is a",
    ),
    "instrument": (
        ("harp", "drum", "flute", "horn", "lute", "bell"),
        "{e} plays the instrument",
        "the instrument of {e} is the",
    ),
}
QUESTION = "{e} {a} ?"  # the eval format (a terse question); no training row has a "?"
# variant "lexical" adds two rows per entity that share words with its question and answer
# but state another fact: a *contrast* row (the entity and the asked attribute word, another
# value of that attribute) and an *echo* row (the entity and the answer word, in an unrelated
# relation). Keyword overlap then points at rows that do not support the answer.
CONTRAST = "{e} never wanted the {a}"
ECHO = "{e} wrote a short song called"
VARIANTS = ("basic", "lexical")
_MIN_ENTITIES, _MAX_ENTITIES = 2, 400


def _invent_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct two-syllable names (consonant-vowel-consonant-vowel), e.g. ``kavo``."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2))
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def _facts_and_rows(
    rng: random.Random, names: list[str], variant: str = "basic"
) -> tuple[list[tuple[dict[str, str], int, str]], list[dict[str, Any]]]:
    """The shuffled training rows ``(row, entity index, role)`` and one asked fact per entity.

    Each fact lists the rows that state it (``supporting``) and its entity's distractor row.
    """
    attrs = sorted(_ATTRIBUTES)
    rows: list[tuple[dict[str, str], int, str]] = []  # (row, entity index, role)
    facts = []
    for i, name in enumerate(names):
        asked, other = rng.sample(attrs, 2)
        values, st_a, st_b = _ATTRIBUTES[asked]
        answer = rng.choice(values)
        o_values, o_a, o_b = _ATTRIBUTES[other]
        o_stmt = rng.choice((o_a, o_b))
        rows.append(({"prompt": st_a.format(e=name), "completion": " " + answer}, i, "supporting"))
        rows.append(({"prompt": st_b.format(e=name), "completion": " " + answer}, i, "supporting"))
        rows.append(
            (
                {"prompt": o_stmt.format(e=name), "completion": " " + rng.choice(o_values)},
                i,
                "distractor",
            )
        )
        if variant == "lexical":
            wrong = rng.choice([v for v in values if v != answer])
            rows.append(
                (
                    {"prompt": CONTRAST.format(e=name, a=asked), "completion": " " + wrong},
                    i,
                    "contrast",
                )
            )
            rows.append(({"prompt": ECHO.format(e=name), "completion": " " + answer}, i, "echo"))
        facts.append(
            {
                "entity": name,
                "attribute": asked,
                "answer": answer,
                "question": QUESTION.format(a=asked, e=name),
            }
        )
    rng.shuffle(rows)
    for f in facts:
        f["supporting"], f["distractor"] = [], []
        if variant == "lexical":
            f["contrast"], f["echo"] = [], []
    for line, (_, i, role) in enumerate(rows, start=1):
        facts[i][role].append({"source": "facts.jsonl", "row": line})
    return rows, facts


def generate_hard_facts(
    out_dir: Path, *, seed: int = 0, n_entities: int = 60, variant: str = "basic"
) -> dict[str, Any]:
    """Write the hard fact-tracing data set (statements in training, questions in eval).

    Files written under ``out_dir``:

    - ``train/facts.jsonl``: ``3 * n_entities`` rows ``{"prompt", "completion"}`` (per entity:
      the asked fact in phrasing A and in phrasing B, one distractor fact), shuffled.
    - ``eval/questions.jsonl``: ``n_entities`` rows, the asked fact as a question
      (``"kavo colour ?"``, a format absent from training) → ``" value"``.
    - ``ground_truth.json``: per eval row (1-based line) the entity, attribute, answer, the
      training rows that state it (``supporting``) and the distractor row (``distractor``),
      each as ``{"source": "facts.jsonl", "row": line}``.

    Args:
        out_dir: output directory (created if needed; the files above are overwritten).
        seed: seed of names, attributes, values and row order.
        n_entities: entities, one eval question each (60 gives 180 training rows).
        variant: ``"basic"`` (the rows above) or ``"lexical"``: per entity two more rows that
            share words with its question but do not support the answer, a *contrast* row
            (``"kavo never wanted the colour"`` → another colour) and an *echo* row (``"kavo
            wrote a short song called"`` → the answer word): ``5 * n_entities`` training rows;
            the ground truth lists them as ``contrast`` and ``echo``. ``"basic"`` writes the same
            bytes as before the variant existed.

    Returns:
        The ground-truth dictionary that was written.

    Raises:
        ConfigError: ``n_entities`` is out of range.
    """
    if variant not in VARIANTS:
        raise ConfigError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not _MIN_ENTITIES <= n_entities <= _MAX_ENTITIES:
        raise ConfigError(
            f"n_entities must be between {_MIN_ENTITIES} and {_MAX_ENTITIES}, got {n_entities}"
        )
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    rows, facts = _facts_and_rows(rng, _invent_names(rng, n_entities), variant)

    train_path, eval_path = out_dir / HARD_TRAIN_FILE, out_dir / HARD_EVAL_FILE
    train_path.parent.mkdir(parents=True, exist_ok=True)
    eval_path.parent.mkdir(parents=True, exist_ok=True)
    train_path.write_text("".join(json.dumps(r) + "\n" for r, _, _ in rows))
    eval_path.write_text(
        "".join(
            json.dumps({"prompt": f["question"], "completion": " " + f["answer"]}) + "\n"
            for f in facts
        )
    )
    truth = {
        "generator": "traceprop_engine.evaluate.hard_data.generate_hard_facts",
        "seed": seed,
        "n_entities": n_entities,
        "eval_marker": EVAL_MARKER,
        "eval": [{"eval_row": j + 1, **f} for j, f in enumerate(facts)],
    }
    if variant != "basic":
        truth["variant"] = variant
    (out_dir / HARD_TRUTH_FILE).write_text(json.dumps(truth, indent=1))
    return truth
