"""Scoring methods of an LDS evaluation: every method's ``(n_eval, n_train)`` attribution scores.

Traceprop's own methods come from the tracked runs (each k of the sweep, the dense and exact
runs, extra ``--config`` runs) under every preconditioner, plus compact-storage (rank-c factor)
methods; the baselines (representation similarity, gradient norm, BM25, random) need no
preconditioner. A method the engine cannot fit is yielded with ``scores=None`` and the reason.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .lds_levers import final_model_methods, lever_methods, same_label_scores
from .lds_settings import (
    BM25_B,
    BM25_K1,
    COMPACT_FAMILY,
    DEFAULT_METHOD,
    DENSE_RUN,
    EXACT_RUN,
    PRECONDITIONERS,
    LdsSettings,
)

log = logging.getLogger(__name__)


def _factor_file(store, rank: int, run_dir: Path) -> Path:
    """``run_dir/factors-c{rank}.h5``, built from the run's store unless a valid one is there."""
    from ..errors import IndexStaleError, StoreError
    from ..store.compact import compact_store
    from ..store.factor_file import FactorStore, factor_file_name

    path = run_dir / factor_file_name(rank)
    if path.exists():
        try:
            with FactorStore(path) as fs:
                fs.check_source(store)
                if fs.n_records == store.n_records:
                    return path
        except (StoreError, IndexStaleError) as e:
            log.warning("%s cannot be reused (%s); rebuilding it", path, e)
    log.info("compacting %s to rank %d", run_dir.name, rank)
    return compact_store(store, rank, out=path)


def _compact_methods(
    s: LdsSettings,
    run_dir: Path,
    k: int,
    entries: Sequence[tuple[str, int]],
    eval_ids: list[int],
    n_train: int,
):
    """Compact-storage methods of one factored run: rank-c factor files scored by ``factor_scores``.

    The test side is the same as the full-sketch method's (the run's query sketches, the
    preconditioner of the run's persisted index for that kind), so at ``c = min(k_out, k_in)``
    the scores equal the full-sketch scores up to float32 storage round-off.
    """
    from ..attribution import factor_scores, open_run
    from ..settings import IndexSettings
    from ..store.factor_file import FactorStore

    run = open_run(run_dir)
    try:
        sketches = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]
        n_layers = len(sketches[0])
        tests = [np.concatenate([sk[li] for sk in sketches]) for li in range(n_layers)]
        for p, c in entries:
            row = {
                "method": f"{p} c={c}",
                "family": COMPACT_FAMILY,
                "k": k,
                "preconditioner": p,
                "c": c,
            }
            try:
                pre = None
                if p != "identity":
                    _, _, pre = run.index(IndexSettings(preconditioner=p, damping=s.damping))
                with FactorStore(_factor_file(run.store, c, run_dir)) as fs:
                    es = factor_scores(  # the same records as the full-sketch default row
                        tests,
                        fs,
                        pre,
                        dtype=np.float64,
                        with_bound=False,
                        records=IndexSettings().records,
                    )
                    row["factor_bytes_per_record"] = fs.nbytes_per_record()
                    row["lossless"] = fs.lossless
                    row["relative_residual"] = [layer.relative_residual for layer in fs.layers]
            except Exception as e:  # noqa: BLE001 - a method that cannot be scored is reported, not fatal
                log.warning("%s/%s c=%d cannot be scored: %s", run_dir.name, p, c, e)
                yield {**row, "scores": None, "error": f"{type(e).__name__}: {e}"}
                continue
            scores = np.zeros((len(eval_ids), n_train), np.float64)
            scores[:, es.example_ids] = es.scores
            row["full_bytes_per_record"] = 4 * sum(
                int(np.prod(layer.record_shape)) for layer in run.store.layers
            )
            yield {**row, "scores": scores}
    finally:
        run.close()


def score_methods(
    s: LdsSettings, run_dirs: dict[str, Path], eval_ids: list[int], n_train: int, progress
):
    """Yield ``{method, family, k, preconditioner, scores (n_eval, n_train)}`` for every method."""
    config_names = {c["name"]: c for c in s.configs}
    for name, rd in run_dirs.items():
        if name == DENSE_RUN:
            yield from _attribution(s, rd, "dense", s.dense_k, eval_ids, n_train)
        elif name == EXACT_RUN:
            yield from _attribution(s, rd, "exact", None, eval_ids, n_train)
        elif name in config_names:
            c = config_names[name]
            k = c.get("k_in") if c.get("k_in") == c.get("k_out") else None
            for m in _attribution(s, rd, "config", k, eval_ids, n_train):
                m["method"] = f"{name} {m['preconditioner']}"
                m["config"] = name
                yield m
        else:
            k = int(name[1:])
            for m in _attribution(s, rd, "factored", k, eval_ids, n_train):
                m["family"] = "factored" if k == s.main_k else "k-sweep"
                yield m
            entries = [(p, c) for kk, p, c in s.compact if kk == k]
            if entries:
                yield from _compact_methods(s, rd, k, entries, eval_ids, n_train)
        if progress:
            progress("scoring", list(run_dirs).index(name) + 1, len(run_dirs))
    main = run_dirs[f"k{s.main_k}"]
    if s.levers:
        yield from _guarded("levers", lever_methods, main, eval_ids, n_train, s.main_k)
    if s.final_grad:
        yield from _guarded("final-model gradients", final_model_methods, main, eval_ids, n_train)
    yield from _baselines(s, main, eval_ids, n_train)


def _guarded(what: str, fn, *args):
    """The rows of ``fn(*args)``; one row with the error if it fails (the table goes on)."""
    try:
        yield from list(fn(*args))
    except Exception as e:  # noqa: BLE001 - a method that cannot be scored is reported, not fatal
        log.warning("%s cannot be scored: %s", what, e)
        yield {
            "method": what,
            "family": "lever" if what == "levers" else "final-model",
            "k": None,
            "preconditioner": None,
            "scores": None,
            "error": f"{type(e).__name__}: {e}",
        }


def _attribution(s: LdsSettings, run_dir: Path, family: str, k, eval_ids: list[int], n_train: int):
    """One tracked run's methods: its eval sketches scored under every preconditioner."""
    from ..attribution import open_run, query_targets
    from ..settings import IndexSettings

    run = open_run(run_dir)
    encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    sketches = [run.query_sketches(enc)[0] for enc in encs]
    targets = [query_targets(enc) for enc in encs]  # which record columns each query scores
    # each preconditioner scores the records alone; the default row (family factored) is
    # IndexSettings() as the run resolves it: its preconditioner, a classifier's class prior, a
    # text-trained LM's LM bias
    rows = [
        (
            p,
            IndexSettings(
                preconditioner="identity" if p == "cosine" else p.removesuffix("-cos"),
                cosine=p == "cosine" or p.endswith("-cos"),
                damping=s.damping,
                class_prior=0.0,
                lm_bias=0.0,
            ),
        )
        for p in PRECONDITIONERS
    ]
    if family == "factored":
        rows.append((DEFAULT_METHOD, IndexSettings(damping=s.damping)))
    for p, ix in rows:
        try:
            _, ids, pre = run.index(run.for_query(ix, targets[0] if targets else None))
        except Exception as e:  # noqa: BLE001 - a method that cannot be fitted is reported, not fatal
            log.warning("%s/%s cannot be scored: %s", run_dir.name, p, e)
            yield {
                "method": f"{family} {p}" if family != "factored" else p,
                "family": family,
                "k": k,
                "preconditioner": p,
                "scores": None,
                "error": f"{type(e).__name__}: {e}",
            }
            continue
        scores = np.zeros((len(eval_ids), n_train), np.float64)
        for r, sk in enumerate(sketches):
            ids, row = run.query_scores(sk, targets[r], ix)  # the record columns it scores
            scores[r, ids] = row
        yield {
            "method": f"{family} {p}" if family != "factored" else p,
            "family": family,
            "k": k,
            "preconditioner": p,
            "scores": scores,
        }
    run.close()


def _baselines(s: LdsSettings, main: Path, eval_ids: list[int], n_train: int):
    """Methods without a preconditioner, on the main run's final model (and a random floor)."""
    from ..attribution import open_run

    run = open_run(main)
    train_encs = [run.encode(eval_example=i)[0] for i in range(n_train)]
    eval_encs = [run.encode(eval_example=e)[0] for e in eval_ids]
    h_tr, h_ev = run.representations(train_encs), run.representations(eval_encs)
    h_tr = h_tr / np.maximum(np.linalg.norm(h_tr, axis=1, keepdims=True), 1e-30)
    h_ev = h_ev / np.maximum(np.linalg.norm(h_ev, axis=1, keepdims=True), 1e-30)
    yield {
        "method": "representation similarity",
        "family": "baseline",
        "k": None,
        "preconditioner": None,
        "scores": (h_ev @ h_tr.T).astype(np.float64),
    }
    gn = run.gradient_norms().sort("example_id")
    g = np.zeros(n_train)
    g[gn["example_id"].to_numpy()] = gn["gradient_norm"].to_numpy()
    yield {
        "method": "gradient norm (query-independent)",
        "family": "baseline",
        "k": s.main_k,
        "preconditioner": None,
        "scores": np.broadcast_to(g, (len(eval_ids), n_train)).copy(),
    }
    ex = run.examples()
    if run.task == "classification" and "label" in ex.columns:
        labels = ex["label"].to_list()
        yield {
            "method": "same label",
            "family": "baseline",
            "k": None,
            "preconditioner": None,
            "scores": same_label_scores(labels[:n_train], [labels[e] for e in eval_ids]),
        }
    if s.bm25:
        texts = [_example_text(r) for r in ex.iter_rows(named=True)]
        yield {
            "method": "bm25",
            "family": "baseline",
            "k": None,
            "preconditioner": None,
            "scores": bm25_scores([texts[e] for e in eval_ids], texts[:n_train]),
        }
    run.close()
    yield {
        "method": "random",
        "family": "baseline",
        "k": None,
        "preconditioner": None,
        "scores": np.random.default_rng(s.seed).standard_normal((len(eval_ids), n_train)),
    }


def _example_text(row: dict) -> str:
    if row.get("completion"):
        return (row.get("prompt") or "") + row["completion"]
    return row.get("text") or ""


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def bm25_scores(
    queries: Sequence[str], docs: Sequence[str], k1: float = BM25_K1, b: float = BM25_B
) -> np.ndarray:
    """Okapi BM25 of every document for every query (``(n_queries, n_docs)``).

    Words are lower-cased ``\\w+`` runs; ``idf = log(1 + (N - df + 0.5) / (df + 0.5))`` (never
    negative); a query word counts once per occurrence in the query.
    """
    from collections import Counter

    tfs = [Counter(_words(d)) for d in docs]
    lens = np.array([sum(t.values()) for t in tfs], np.float64)
    avg = max(float(lens.mean()), 1e-12) if len(lens) else 1.0
    df = Counter(w for t in tfs for w in t)
    n = len(docs)
    norm = k1 * (1 - b + b * lens / avg)  # (n_docs,)
    out = np.zeros((len(queries), n), np.float64)
    for qi, q in enumerate(queries):
        for w in _words(q):
            if w not in df:
                continue
            idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
            tf = np.array([t.get(w, 0) for t in tfs], np.float64)
            out[qi] += idf * tf * (k1 + 1) / (tf + norm)
    return out
