"""A locally pretrained causal LM for the "pretrained + LoRA" LDS benchmarks (issue 26).

The named LM sets (``hard60``, ``lexical48``, ...) train the tiny GPT-NeoX from scratch. Users
fine-tune a *pretrained* model, often with LoRA, and no pretrained causal LM may be downloaded
here. This script makes one: it writes a corpus of the same kind of text as the sets, from
data seeds the evaluations never use (the statements *and* the questions of ``hard60`` /
``lexical48`` with seeds 11–16, so the model knows the language, the templates and the question
format, but none of the evaluated entities' facts), and trains the tiny model on it untracked.
``OUT/model`` is then a local Hugging Face directory (weights and tokenizer) for

    traceprop eval lds --set hard60 --seed 0 --model OUT/model --lora-rank 8 ...

where LoRA must learn the evaluated set's new entity facts on top of a model that already
speaks its language: the regime of a user's LoRA fine-tune, at a size this machine can retrain.

``--corpus prose`` pretrains on real technical prose instead: the first paragraphs of the
standard library's docstrings (``prose_data.stdlib_docstrings``, about 1500 texts), for a LoRA
fine-tune on the installed libraries' docstrings, which it never saw (EVAL.md §1x):

    traceprop eval lds --set pkgdocslm6 --seed 0 --model OUT/model --lora-rank 8 ...

Usage: ``python benchmarks/pretrain_tiny.py OUT [--corpus facts|prose] [--epochs 20] [--layers 2
--width 64 --vocab 1024]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from traceprop_engine.evaluate.hard_data import generate_hard_facts
from traceprop_engine.evaluate.prose_data import (
    PACKAGE_FAMILIES,
    collect_docstrings,
    stdlib_docstrings,
)

SEEDS = (11, 12, 13, 14, 15, 16)
"""Data seeds of the corpus: disjoint from every evaluation seed used in EVAL.md (0, 1)."""
EVAL_SEEDS = (0, 1)
"""Rows naming an entity of these seeds' hard60 / hard160 / lexical48 are left out of the corpus
(the name pool is shared, so a few names recur across seeds)."""


def evaluated_entities(tmp: Path) -> set[str]:
    """The entity names of every evaluated hard set (the first word of each question)."""
    names = set()
    for seed in EVAL_SEEDS:
        for variant, n in (("basic", 60), ("basic", 160), ("lexical", 48)):
            d = tmp / f"eval-{variant}-{n}-{seed}"
            generate_hard_facts(d, seed=seed, n_entities=n, variant=variant)
            for line in (d / "eval" / "questions.jsonl").read_text().splitlines():
                names.add(json.loads(line)["prompt"].split()[0])
    return names


def write_corpus(path: Path) -> int:
    """The statements and questions of hard60 and lexical48 at :data:`SEEDS` as one JSONL, less
    every row that names an evaluated entity."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="traceprop-pretrain-") as tmp:
        held_out = evaluated_entities(Path(tmp))
        for seed in SEEDS:
            for variant, n in (("basic", 60), ("lexical", 48)):
                d = Path(tmp) / f"{variant}-{seed}"
                generate_hard_facts(d, seed=seed, n_entities=n, variant=variant)
                for f in sorted((d / "train").glob("*.jsonl")) + sorted(
                    (d / "eval").glob("*.jsonl")
                ):
                    for line in f.read_text().splitlines():
                        row = json.loads(line)
                        if not held_out & set(row["prompt"].split()):
                            rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def write_prose_corpus(path: Path) -> int:
    """The standard library's docstrings (first paragraphs) as one JSONL of ``{"text"}`` rows,
    less every text of the installed libraries' families (``pkgdocslm6`` is fine-tuned on them)."""
    package = [t for texts in collect_docstrings(PACKAGE_FAMILIES).values() for t in texts]
    rows = stdlib_docstrings(exclude=package)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="run directory to create; the model lands in OUT/model")
    p.add_argument(
        "--corpus",
        choices=("facts", "prose"),
        default="facts",
        help="facts: the hard sets' language at unused seeds; prose: standard-library docstrings",
    )
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    corpus = a.out.with_name(a.out.name + "-corpus") / "corpus.jsonl"
    n = (write_prose_corpus if a.corpus == "prose" else write_corpus)(corpus)
    print(f"corpus: {n} rows in {corpus}", flush=True)
    cmd = [
        sys.executable, "-m", "traceprop_engine", "train", "--data", str(corpus),
        "--out", str(a.out), "--no-track", "--epochs", str(a.epochs), "--lr", str(a.lr),
        "--max-length", "48", "--eval-fraction", "0.05", "--tiny-layers", str(a.layers),
        "--tiny-width", str(a.width), "--tiny-vocab", str(a.vocab), "--threads", str(a.threads),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    print(f"model: {a.out / 'model'}")


if __name__ == "__main__":
    main()
