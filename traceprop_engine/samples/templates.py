"""The templates of the sample data sets: invented topics, attributes, names and reviews.

:mod:`.data` draws from these tables to write its files; a test can read them to check what a
generated row must look like (for example the closing sentences that carry a review's sentiment).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import ConfigError

# Syllables for invented names; capitalised joins of two or three give "Velmora", "Qastrin".
SYLLABLES = (
    "vel", "mor", "qas", "trin", "zan", "thu", "lor", "ka", "bri", "sel", "dov", "nyx",
    "ar", "eth", "quil", "ox", "ren", "sa", "tal", "umb", "ix", "cor", "fen", "gal",
)  # fmt: skip


@dataclass(frozen=True)
class Attribute:
    """One fact an entity of a topic has, with its three wordings and possible values."""

    name: str
    question: str  # training question, "{e}" = entity name
    statement: str  # training statement (a paraphrase), completed by the value
    paraphrase: str  # evaluation question, worded differently from both
    values: tuple[str, ...]


@dataclass(frozen=True)
class Topic:
    """A kind of invented entity (planets, inventors, ...) and the facts it can have."""

    name: str  # also the file stem: train/<name>.jsonl
    kind: str  # "a planet", used in the entity's type fact
    attributes: tuple[Attribute, ...]


TOPICS = (
    Topic(
        "planets",
        "a planet",
        (
            Attribute(
                "colour",
                "What colour is the planet {e}?",
                "The planet {e} is coloured",
                "Which colour does the planet {e} have?",
                ("teal", "crimson", "amber", "violet", "silver", "ochre", "indigo", "jade"),
            ),
            Attribute(
                "moons",
                "How many moons does the planet {e} have?",
                "The number of moons circling {e} is",
                "What is the count of moons orbiting the planet {e}?",
                ("one", "two", "three", "four", "five", "six", "seven"),
            ),
            Attribute(
                "climate",
                "What is the climate of the planet {e}?",
                "The weather on the planet {e} is always",
                "Describe the climate found on the planet {e} in one word.",
                ("frozen", "stormy", "arid", "humid", "temperate", "volcanic"),
            ),
        ),
    ),
    Topic(
        "inventors",
        "an inventor",
        (
            Attribute(
                "invention",
                "What did the inventor {e} invent?",
                "The inventor {e} is famous for building the",
                "Which device was created by the inventor {e}?",
                ("glass bell", "steam kite", "copper lens", "tide clock", "wind organ", "sky lamp"),
            ),
            Attribute(
                "city",
                "In which city did the inventor {e} work?",
                "The workshop of the inventor {e} stood in the city of",
                "Name the city where the inventor {e} had a workshop.",
                ("Brassport", "Lowmere", "Harrowgate", "Saltcombe", "Oakhollow", "Greyhithe"),
            ),
            Attribute(
                "metal",
                "Which metal did the inventor {e} prefer?",
                "The favourite metal of the inventor {e} was",
                "What metal did the inventor {e} like to work with?",
                ("copper", "brass", "tin", "iron", "bronze", "pewter"),
            ),
        ),
    ),
    Topic(
        "rivers",
        "a river",
        (
            Attribute(
                "sea",
                "Into which sea does the river {e} flow?",
                "The river {e} empties into the",
                "Where does the river {e} reach the sea?",
                ("Grey Sea", "Amber Sea", "Silent Sea", "Northern Sea", "Glass Sea", "Salt Sea"),
            ),
            Attribute(
                "fish",
                "Which fish lives in the river {e}?",
                "Fishers on the river {e} mostly catch",
                "What kind of fish swims in the river {e}?",
                ("pike", "eels", "trout", "carp", "perch", "salmon"),
            ),
            Attribute(
                "water",
                "What colour is the water of the river {e}?",
                "The water of the river {e} looks",
                "How does the water of the river {e} look?",
                ("green", "brown", "clear", "blue", "grey", "black"),
            ),
        ),
    ),
    Topic(
        "guilds",
        "a guild",
        (
            Attribute(
                "craft",
                "What craft does the {e} guild practise?",
                "Members of the {e} guild work at",
                "Which trade is the {e} guild known for?",
                ("weaving", "masonry", "glassblowing", "bookbinding", "tanning", "pottery"),
            ),
            Attribute(
                "emblem",
                "What is the emblem of the {e} guild?",
                "The banner of the {e} guild shows a",
                "Which animal or object is on the {e} guild's emblem?",
                ("owl", "anchor", "key", "lantern", "hammer", "raven"),
            ),
            Attribute(
                "hall",
                "Where does the {e} guild meet?",
                "The {e} guild holds its meetings in the",
                "In which building do members of the {e} guild gather?",
                ("old mill", "stone hall", "harbour tower", "river barn", "chapel", "cellar"),
            ),
        ),
    ),
)


# Review templates: "{opening} The {product} {verdict}. {closing}"
PRODUCT_NAMES = ("Brindle", "Korvo", "Pellam", "Quistra", "Ardent", "Nollow", "Tessik", "Varro")
PRODUCT_KINDS = (
    "kettle", "lamp", "backpack", "umbrella", "blender", "headphones", "desk chair", "toaster",
)  # fmt: skip
OPENINGS = (
    "Bought this last month.",
    "Ordered it for my flat.",
    "A gift from my sister.",
    "Used it every day for a week.",
    "I had read the reviews first.",
)
VERDICTS = {
    "positive": (
        "works perfectly and feels solid",
        "exceeded everything I hoped for",
        "is sturdy, quiet and a joy to use",
        "was worth every penny",
        "arrived quickly and works beautifully",
    ),
    "negative": (
        "broke after two days",
        "is flimsy and rattles constantly",
        "stopped working within a week",
        "was a complete waste of money",
        "arrived scratched and never worked properly",
    ),
}
CLOSINGS = {
    "positive": ("Highly recommended.", "I would buy it again.", "Five stars.", "Love it."),
    "negative": ("Avoid it.", "I want a refund.", "One star.", "Never again."),
}


def invent_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct capitalised names, none a substring of another name or of any value.

    The substring rule lets a reader (and the tests) find an entity's rows by a plain search.
    """
    reserved = [v.lower() for t in TOPICS for a in t.attributes for v in a.values]
    reserved += [w.lower() for w in PRODUCT_NAMES]
    names: list[str] = []
    for _ in range(100_000):
        if len(names) == n:
            return names
        name = "".join(rng.sample(SYLLABLES, rng.choice((2, 2, 3)))).capitalize()
        low = name.lower()
        if any(low in other.lower() or other.lower() in low for other in names):
            continue
        if any(low in word or word in low for word in reserved):
            continue
        names.append(name)
    raise ConfigError(f"cannot invent {n} distinct entity names; use fewer entities.")


def review(rng: random.Random, label: str) -> str:
    """A review of an invented product whose wording carries ``label``."""
    product = f"{rng.choice(PRODUCT_NAMES)} {rng.choice(PRODUCT_KINDS)}"
    return (
        f"{rng.choice(OPENINGS)} The {product} {rng.choice(VERDICTS[label])}. "
        f"{rng.choice(CLOSINGS[label])}"
    )
