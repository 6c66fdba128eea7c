"""The held-out answer sets of EVAL.md §1aa, made after the column choice was fitted on §1z's.

    python benchmarks/heldout_sets.py OUT

writes, under ``OUT``:

- ``lexical48x3-s0-data``, ``lexical48x3-s1-data``: lexical48's draw (seeds 0, 1) with its
  training rows three at a time joined into one text (80 texts of three facts, every token a
  target), its eval questions unchanged: like ``hard60doc``, on the lexical variant;
- ``hard160x4-s3-data``: hard160's draw (seed 3), four facts a text (120 texts);
- ``docslm8-s2-data`` / ``pkgdocslm6-s2-data`` (seed 2) and beside them ``docslm8-s2-ans6`` /
  ``pkgdocslm6-s2-ans6``: their eval texts as a prompt of the first six words and a completion of
  the next 1–12 (texts of at most six words left out): continuations of prose after a longer
  prompt than §1z's three words.

Then ``traceprop eval lds --data OUT/NAME-data/train --eval-data OUT/NAME-data/eval --task
causal-lm ...`` (or ``--eval-data OUT/NAME-ans6``), EVAL.md §1aa's commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from traceprop_engine.evaluate.lds_sets import facts_as_texts, make_set

FACT_DOCS = [("lexical48", 3, 0), ("lexical48", 3, 1), ("hard160", 4, 3)]


def fact_docs(root: Path, base: str, per: int, seed: int) -> None:
    train, _ = make_set(base, root / f"{base}x{per}-s{seed}", seed)
    print(f"{train}: {facts_as_texts(Path(train), per)} texts of {per} facts")


def prose_answers(root: Path, name: str, seed: int = 2, words: int = 6) -> None:
    _, ev = make_set(name, root / f"{name}-s{seed}", seed)
    rng = np.random.default_rng(300)
    rows = [json.loads(x) for x in (Path(ev) / "docs.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for r in rows:
        w, m = r["text"].split(), int(rng.integers(1, 13))
        if len(w) > words:
            out.append({"prompt": " ".join(w[:words]), "completion": " " + " ".join(w[words:][:m])})
    dst = root / f"{name}-s{seed}-ans{words}"
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in out))
    print(f"{dst}: {len(out)} prompts with completions")


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    root = Path(argv[0])
    for base, per, seed in FACT_DOCS:
        fact_docs(root, base, per, seed)
    for name in ("docslm8", "pkgdocslm6"):
        prose_answers(root, name)


if __name__ == "__main__":
    main(sys.argv[1:])
