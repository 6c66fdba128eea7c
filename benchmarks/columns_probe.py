"""Which record columns should score a query? (EVAL.md §1z)

A free-text run records rank-16 factors whose first column is the rank-1 record
(``IndexSettings.columns``). This probe asks, per eval example, whether a query scores better
against that first column or against every column: by the query's number of loss tokens for
free-text queries (``make``, ``score``), and for a classifier's records of a higher rank
(``runs``).

``make SRC DST SEED``: a copy of the eval texts of a prose set's data folder ``SRC`` (``SRC/eval/
docs.jsonl``, written by ``traceprop eval lds --set docslm8|pkgdocslm6``) cut to their first 2–16
words (uniform, seeded), into ``DST/docs.jsonl``: free-text queries of about 3–47 tokens. Then
``traceprop eval lds --data SRC/train --eval-data DST --task causal-lm ...`` evaluates them
(new retrains: the losses are on the new eval texts).

``make-answers SRC DST SEED``: the same eval texts as a prompt (their first 3 words) and a
completion (the next 1–14 words): answers of free text after a prompt, of about 2–40 loss tokens.

``score DIR ...``: for each finished evaluation, the LDS per eval example of the main run
(``runs/k126``) scored against the first column and against every column, and the folder's
default, full-gradient cosine and BM25 rows, in bins of the query's loss tokens; then pooled
over the folders, every column minus the first column per bin with a 95 % bootstrap interval.

``runs DIR ...``: every tracked run of each evaluation (``runs/*``: the main run and the
``--config`` runs, e.g. ``--config r8:rank=8``) scored by the default, K-FAC-cosine and
cosine (no class prior for the last two), against the first column and against every column.

``blend DIR ...``: the main run scored against the first column, every column, and blends of
the two (each query's score rows standardised, then ``(1 − w)·first + w·every``).

``tails DIR ...``: the main run's answers (at most 16 loss tokens) scored against the first
column, every column, and the view whose scores have the heavier tails (the default since
EVAL.md §1aa, :mod:`traceprop_engine.attribution.column_choice`), with stop 54's rule (the first
column) beside it and the median excess kurtosis of each view's score rows.

Usage::

    python benchmarks/columns_probe.py make /tmp/q/docslm8-s1-data /tmp/mid/s1-eval 1
    python benchmarks/columns_probe.py score /tmp/mid/docs-s0 /tmp/mid/docs-s1 ...
    python benchmarks/columns_probe.py runs /tmp/cls/lora-docs8-s0 ...
    python benchmarks/columns_probe.py blend /tmp/ev/h60d-s0 /tmp/mid/ans-docs-s0 ...
    python benchmarks/columns_probe.py tails /tmp/ev/h60d-s0 /tmp/mid/ans-docs-s0 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from gap_probe import subset_data
from records_probe import eval_sketches, index_lds

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_report import lds_scores
from traceprop_engine.settings import IndexSettings

BINS = [(0, 8), (9, 16), (17, 24), (25, 10_000)]
REFERENCES = ("default", "full-gradient cosine", "bm25")


def make(src: Path, dst: Path, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    lines = (src / "eval" / "docs.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    cut = [" ".join(r["text"].split()[: int(rng.integers(2, 17))]) for r in rows]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in cut))
    print(f"{dst}: {len(cut)} texts, median {np.median([len(t.split()) for t in cut])} words")


def make_answers(src: Path, dst: Path, seed: int) -> None:
    """The eval texts as prompts of their first 3 words and completions of the next 1–14 (uniform,
    seeded): answers of free text after a prompt, of about 2–40 loss tokens."""
    rng = np.random.default_rng(200 + seed)
    lines = (src / "eval" / "docs.jsonl").read_text().splitlines()
    out = []
    for line in lines:
        if line.strip():
            w = json.loads(line)["text"].split()
            m = int(rng.integers(1, 15))
            out.append({"prompt": " ".join(w[:3]), "completion": " " + " ".join(w[3 : 3 + m])})
    out = [r for r in out if r["completion"].strip()]  # a text of three words has no answer
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    print(f"{dst}: {len(out)} prompts with completions")


def eval_queries(run) -> tuple[np.ndarray, list]:
    """The run's eval queries: their loss tokens and their sketches, in example order."""
    ex = run.examples()
    eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    return np.array([int(e.loss_mask.sum()) for e in encs]), [
        run.query_sketches(e)[0] for e in encs
    ]


def view_scores(run, sketches: list, n_train: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scores (q, n_train), index rows' example ids)``: every query's exact scores against
    the first ``cols`` record columns (0: every one)."""
    ix = run.settings(IndexSettings(columns=cols))
    _, ids, _ = run.index(ix)
    m = np.zeros((len(sketches), n_train))
    for r, sk in enumerate(sketches):
        m[r, ids] = run.all_scores(sk, ix)
    return m, ids


def per_example(ev: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The eval queries' loss tokens, and each method's Spearman per eval example."""
    masks, losses, _ = subset_data(ev)
    run = open_run(ev / "runs" / "k126")
    try:
        n_tokens, sketches = eval_queries(run)
        out = {}
        for cols, name in ((1, "first column"), (0, "every column")):
            scores, _ = view_scores(run, sketches, masks.shape[1], cols)
            out[name] = lds_scores(scores, masks, losses)
    finally:
        run.close()
    rows = json.loads((ev / "results.json").read_text())["rows"]
    for row in rows:
        if row["method"] in REFERENCES and row.get("per_example") is not None:
            out[row["method"]] = np.array(row["per_example"], dtype=float)
    return n_tokens, out


def score(dirs: list[Path]) -> None:
    pooled = []
    for ev in dirs:
        n, per = per_example(ev)
        print(f"== {ev.name}: loss tokens median {np.median(n):.0f}, {n.min()}-{n.max()}")
        for lo, hi in [*BINS, (0, 10_000)]:
            m = (n >= lo) & (n <= hi)
            if m.any():
                what = "all" if (lo, hi) == (0, 10_000) else f"{lo}-{min(hi, 99)}"
                vals = " ".join(f"{k}={np.nanmean(v[m]):.3f}" for k, v in per.items())
                print(f"  tokens {what:>6s} n={m.sum():3d} {vals}")
        pooled.append((n, per["every column"] - per["first column"]))
    n = np.concatenate([p[0] for p in pooled])
    d = np.concatenate([p[1] for p in pooled])
    print("== pooled: every column minus the first column, per eval example")
    rng = np.random.default_rng(0)
    for lo, hi in BINS:
        x = d[(n >= lo) & (n <= hi) & ~np.isnan(d)]
        if len(x):
            boot = [rng.choice(x, len(x)).mean() for _ in range(2000)]
            lo_ci, hi_ci = np.percentile(boot, [2.5, 97.5])
            print(
                f"  tokens {lo:2d}-{min(hi, 99):2d} n={len(x):3d} "
                f"{x.mean():+.3f} [{lo_ci:+.3f}, {hi_ci:+.3f}]"
            )


def runs(dirs: list[Path]) -> None:
    rows = {
        "default": {},
        "kfac-cos": {"preconditioner": "kfac", "cosine": True, "class_prior": 0.0},
        "cosine": {"preconditioner": "identity", "cosine": True, "class_prior": 0.0},
    }
    for ev in dirs:
        masks, losses, _ = subset_data(ev)
        for rd in sorted(p for p in (ev / "runs").iterdir() if (p / "store.h5").exists()):
            run = open_run(rd)
            try:
                sketches = eval_sketches(run)
                got = []
                for cols, tag in ((1, "first column"), (0, "every column")):
                    for name, kw in rows.items():
                        ix = run.settings(IndexSettings(columns=cols, **kw))
                        got.append(
                            f"{name} {tag}={index_lds(run, ix, sketches, masks, losses):.3f}"
                        )
                ranks = sorted({info.rank for info in run.store.layers})
            finally:
                run.close()
            print(f"{ev.name} {rd.name} (ranks {ranks}): " + ", ".join(got), flush=True)


def blend(dirs: list[Path]) -> None:
    """The main run's scores against the first column, every column, and blends of the two
    (each query's two score rows standardised, weighted ``1 − w`` and ``w``)."""
    for ev in dirs:
        masks, losses, _ = subset_data(ev)
        run = open_run(ev / "runs" / "k126")
        try:
            sketches = eval_sketches(run)
            by_cols = {c: view_scores(run, sketches, masks.shape[1], c)[0] for c in (1, 0)}
        finally:
            run.close()

        def z(m: np.ndarray) -> np.ndarray:
            return (m - m.mean(1, keepdims=True)) / (m.std(1, keepdims=True) + 1e-30)

        rows = {"first column": by_cols[1], "every column": by_cols[0]}
        for w in (0.25, 0.5, 0.75):
            rows[f"blend w={w}"] = (1 - w) * z(by_cols[1]) + w * z(by_cols[0])
        lds = {k: float(np.nanmean(lds_scores(v, masks, losses))) for k, v in rows.items()}
        print(ev.name, ", ".join(f"{k} {v:.3f}" for k, v in lds.items()), flush=True)


def tails(dirs: list[Path]) -> None:
    """Per folder: the LDS of the first column, every column, stop 54's rule and the heavier
    tails' choice (answers of at most 16 loss tokens by tails, longer ones every column)."""
    from traceprop_engine.attribution import excess_kurtosis

    for ev in dirs:
        masks, losses, _ = subset_data(ev)
        run = open_run(ev / "runs" / "k126")
        try:
            n, sketches = eval_queries(run)
            by_cols = {}
            for cols in (1, 0):
                m, ids = view_scores(run, sketches, masks.shape[1], cols)
                by_cols[cols] = (m, np.array([excess_kurtosis(row[ids]) for row in m]))
        finally:
            run.close()
        (s1, k1), (s0, k0) = by_cols[1], by_cols[0]
        short = (n <= C.FREE_TEXT_TARGETS)[:, None]
        rows = {
            "first column": s1,
            "every column": s0,
            "stop 54 (first up to 16)": np.where(short, s1, s0),
            "heavier tails (default)": np.where(short & ~(k0 > k1)[:, None], s1, s0),
        }
        lds = {k: float(np.nanmean(lds_scores(v, masks, losses))) for k, v in rows.items()}
        print(
            f"{ev.name}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in lds.items())
            + f"; median kurtosis first {np.median(k1):.1f}, every {np.median(k0):.1f}; "
            f"every column chosen for {np.mean(~short[:, 0] | (k0 > k1)):.0%} of the queries",
            flush=True,
        )


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] in ("make", "make-answers"):
        maker = make if argv[0] == "make" else make_answers
        maker(Path(argv[1]), Path(argv[2]), int(argv[3]))
    elif len(argv) >= 2 and argv[0] == "score":
        score([Path(d) for d in argv[1:]])
    elif len(argv) >= 2 and argv[0] == "runs":
        runs([Path(d) for d in argv[1:]])
    elif len(argv) >= 2 and argv[0] == "blend":
        blend([Path(d) for d in argv[1:]])
    elif len(argv) >= 2 and argv[0] == "tails":
        tails([Path(d) for d in argv[1:]])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
