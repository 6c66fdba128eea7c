"""The named LDS data sets of benchmarks/EVAL.md, generated on demand (``traceprop eval lds --set``).

Each set writes ``train/`` and ``eval/`` under a folder beside the evaluation directory
(``OUT-data``, so ``--overwrite`` of ``OUT`` keeps it), deterministically from its seed:

- ``facts24``: :func:`~traceprop_engine.samples.data.generate_sample_data`, 24 entities (data
  seed 0 for every evaluation seed, as in EVAL.md §1).
- ``hard60``: :func:`~.hard_data.generate_hard_facts`, 60 entities (data seed = seed).
- ``hard160``: the same generator with 160 entities (480 training rows, 160 questions): a
  larger, noisier set of the same kind.
- ``lexical48``: the same, ``variant="lexical"``, 48 entities (5 rows each; data seed = seed).
- ``docs8``: :func:`~.prose_data.generate_docstring_classes`, 20 training and 6 eval docstrings
  of each of 8 standard-library families (classification; data seed = seed).
- ``pkgdocs6``: the same generator over :data:`~.prose_data.PACKAGE_FAMILIES`, 24 training and
  6 eval docstrings of each of six installed libraries (numpy, polars, torch, h5py,
  transformers, plotly), labelled by library: a second classification set of real prose, by
  other authors, added in stop 46 and not looked at before (classification; data seed = seed).
- ``docslm8``: docs8's draw without labels, a causal LM set of real prose (every token of a
  docstring a target; 160 training and 48 eval texts; data seed = seed).
- ``pkgdocslm6``: pkgdocs6's families without labels, 24 training and 8 eval docstrings of
  each library (144 / 48; data seed = seed). Its texts are disjoint from the standard library's,
  so a model pretrained on those (``benchmarks/pretrain_tiny.py --corpus prose``) can be
  fine-tuned on it with LoRA: real text on a pretrained base (EVAL.md §1x).
- ``hard60text``, ``lexical48text``: hard60's / lexical48's draw with each training row one
  text, prompt and completion joined (the loss on every token of the fact, not only on its
  answer); the same eval questions (EVAL.md §1y).
- ``hard60doc``: hard60's training rows three at a time, joined into one text (60 texts of
  three unrelated facts, every token a target; more than 16 tokens each): long training texts
  asked about with short answers (EVAL.md §1y).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError

SETS = (
    "facts24",
    "hard60",
    "hard160",
    "lexical48",
    "docs8",
    "pkgdocs6",
    "docslm8",
    "pkgdocslm6",
    "hard60text",
    "lexical48text",
    "hard60doc",
)
CLASSIFICATION_SETS = ("docs8", "pkgdocs6")
_DOCSTRING_SETS = {  # name: (the installed libraries' families?, train / eval per family, labelled)
    "docs8": (False, 20, 6, True),
    "pkgdocs6": (True, 24, 6, True),
    "docslm8": (False, 20, 6, False),
    "pkgdocslm6": (True, 24, 8, False),
}


_TEXT_SETS = {  # name: (base set, facts per training text)
    "hard60text": ("hard60", 1),
    "lexical48text": ("lexical48", 1),
    "hard60doc": ("hard60", 3),
}


def set_data_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + "-data")


def facts_as_texts(train: Path, per_text: int) -> int:
    """Rewrite the prompt/completion rows of every ``train/*.jsonl`` as ``{"text"}`` rows of
    ``per_text`` facts each (prompt and completion joined, facts joined by ". "); returns the
    number of texts written."""
    n = 0
    for path in sorted(Path(train).glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        facts = [r["prompt"] + r["completion"] for r in rows]
        texts = [". ".join(facts[i : i + per_text]) for i in range(0, len(facts), per_text)]
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        n += len(texts)
    return n


def make_set(name: str, out: str | Path, seed: int) -> tuple[str, str]:
    """Write set ``name`` for evaluation directory ``out``; returns ``(train dir, eval dir)``."""
    d = set_data_dir(out)
    if name in _TEXT_SETS:  # the base set, its training rows as texts (every token a target)
        base, per_text = _TEXT_SETS[name]
        make_set(base, out, seed)
        facts_as_texts(d / "train", per_text)
        return str(d / "train"), str(d / "eval")
    if name == "facts24":
        from ..samples.data import generate_sample_data

        generate_sample_data(d, seed=0, n_entities=24)
    elif name in ("hard60", "hard160", "lexical48"):
        from .hard_data import generate_hard_facts

        lexical = name == "lexical48"
        generate_hard_facts(
            d,
            seed=seed,
            n_entities=48 if lexical else 160 if name == "hard160" else 60,
            variant="lexical" if lexical else "basic",
        )
    elif name in _DOCSTRING_SETS:
        from .prose_data import PACKAGE_FAMILIES, generate_docstring_classes

        packages, n_train, n_eval, labelled = _DOCSTRING_SETS[name]
        generate_docstring_classes(
            d,
            seed=seed,
            n_train_per_class=n_train,
            n_eval_per_class=n_eval,
            families=PACKAGE_FAMILIES if packages else None,
            labelled=labelled,
        )
    else:
        raise ConfigError(f"unknown LDS set {name!r}; one of {', '.join(SETS)}")
    return str(d / "train"), str(d / "eval")
