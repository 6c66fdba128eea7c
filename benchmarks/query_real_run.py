"""Whole-query latency and recall@10 on a REAL run of many distinct examples (not resampled).

    python benchmarks/query_real_run.py --n 100000 --work-dir /tmp/qrr [--index 16/256,8/0]

1. Writes ``n`` distinct training rows of invented facts (the sample's topic templates, random
   syllable names: two wordings per fact, every row a different entity or attribute) and 200
   held-out questions in the sample's evaluation wording.
2. Trains the default tiny model (2 layers, width 128, the sample's settings) for one epoch with
   the default tracking: one record per example, as at scale.
3. For each index configuration ``m/dims[/lists|/nolists]`` (``IndexSettings(index_side=m,
   index_dims=dims, lists=...)``; the default first), builds the index and times ``AttributionRun.rank`` (candidate search +
   exact re-rank, not the query's own forward/backward) for ``--queries`` held-out questions,
   and measures recall@10 of the returned proponents / opponents against brute-force exact
   scores over every example.

Steps 1-2 are skipped when ``--work-dir`` already holds the run. Prints one line per index.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution.index import lists as index_lists
from traceprop_engine.attribution.score import ranking
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.samples.templates import SYLLABLES, TOPICS
from traceprop_engine.settings import IndexSettings


def write_data(out: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < n // 5 + 1:
        names.add("".join(rng.sample(SYLLABLES, rng.choice((2, 3, 3, 4)))).capitalize())
    order = sorted(names)
    rng.shuffle(order)
    rows, evals = [], []
    for i, e in enumerate(order):
        topic = TOPICS[i % len(TOPICS)]
        for a in topic.attributes:
            v = rng.choice(a.values)
            rows.append({"prompt": f"Q: {a.question.format(e=e)}\nA:", "completion": f" {v}"})
            rows.append({"prompt": a.statement.format(e=e), "completion": f" {v}"})
            if len(evals) < 200 and rng.random() < 0.01:
                q = f"Q: {a.paraphrase.format(e=e)}\nA:"
                evals.append({"prompt": q, "completion": f" {v}"})
    for sub, data in (("train", rows[:n]), ("eval", evals)):
        (out / sub).mkdir(parents=True, exist_ok=True)
        name = "facts.jsonl" if sub == "train" else "questions.jsonl"
        (out / sub / name).write_text("".join(json.dumps(r) + "\n" for r in data))


def _measure(run, s, queries, exact, ids) -> dict:
    """p50 / p90 of ``run.rank`` and recall@10 of both ends against the brute-force ``exact``."""
    lat, rp, ro, share = [], [], [], ([], [])
    for j, q in enumerate(queries):
        t = time.perf_counter()
        r, _ = run.rank(q, s, 10, True)
        lat.append(time.perf_counter() - t)
        for side, (kind, sign, acc) in enumerate((("proponent", 1, rp), ("opponent", -1, ro))):
            top = np.argsort(-sign * exact[j], kind="stable")[:10]
            ref = ids[top[sign * exact[j][top] > 0]]
            mine = r.filter(r["kind"] == kind)
            if len(ref):
                acc.append(len(set(mine["example_id"].to_list()) & set(ref.tolist())) / len(ref))
                # how much of the true top 10's score the returned 10 hold (1: only near-ties missed)
                share[side].append(float(abs(mine["score"].sum()) / abs(exact[j][top].sum())))
    return {
        "p50_ms": round(float(np.median(lat)) * 1e3, 1),
        "p90_ms": round(float(np.percentile(lat, 90)) * 1e3, 1),
        "recall_proponents": round(float(np.mean(rp)), 3),
        "recall_opponents": round(float(np.mean(ro)), 3),
        "score_share_proponents": round(float(np.mean(share[0])), 4),
        "score_share_opponents": round(float(np.mean(share[1])), 4),
        "score_share_min": round(float(min(min(share[0]), min(share[1]))), 4),
    }


def _scan(spec: str) -> tuple[float, float]:
    """``0.02`` -> (0.02, 0.02); ``0.01/0.03`` -> (0.01, 0.03)."""
    p, _, o = spec.partition("/")
    return float(p), float(o or p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the data, the model and its training"
    )
    ap.add_argument("--work-dir", default="/tmp/traceprop-query-real")
    ap.add_argument(
        "--index",
        default="16/256,8/0",
        help="m/dims pairs, comma-separated; m/dims/lists or m/dims/nolists sets "
        "IndexSettings.lists (default: auto)",
    )
    ap.add_argument("--queries", type=int, default=48)
    ap.add_argument(
        "--candidates",
        default="",
        help="candidate counts per side to compare (comma-separated; default: the default rule)",
    )
    ap.add_argument(
        "--nprobe", default="", help="IVF lists probed, comma-separated (default: tuned)"
    )
    ap.add_argument(
        "--scan",
        default="",
        help="factor lists: shares of the entries scanned to compare, comma-separated, each one "
        "share for both sides or PROPONENTS/OPPONENTS (0: the same index without its lists; "
        "default: index_lists.SCAN_FRACTION)",
    )
    ap.add_argument(
        "--list-candidates",
        default="",
        help="factor lists: rows proposed per side to compare, comma-separated "
        "(default: index_lists.CANDIDATES)",
    )
    ap.add_argument("--json", help="write the result rows here")
    a = ap.parse_args()
    work = Path(a.work_dir)
    run_dir = work / "run"
    if not (run_dir / "store.h5").exists():
        write_data(work / "data", a.n, a.seed)
        cmd = [sys.executable, "-m", "traceprop_engine", "train", "--data", str(work / "data/train"),
               "--eval-data", str(work / "data/eval"), "--out", str(run_dir), "--epochs", "1",
               "--batch-size", "32", "--lr", "0.003", "--tiny-layers", "2", "--tiny-width", "128",
               "--tiny-vocab", "768", "--max-length", "64", "--threads", "1",
               "--seed", str(a.seed)]  # fmt: skip
        subprocess.run(cmd, check=True)
    queries = e2e.real_queries(run_dir, a.queries)  # eval questions first
    run = AttributionRun(run_dir)
    out, exact = [], None
    default_scan, default_lcand = index_lists.SCAN_FRACTION, index_lists.CANDIDATES
    for spec in a.index.split(","):
        m, dims, *rest = spec.split("/")
        m, dims = int(m), int(dims)
        lists = {"": None, "lists": True, "nolists": False}[rest[0] if rest else ""]
        s = IndexSettings(index_side=m, index_dims=dims, lists=lists)
        t = time.perf_counter()
        index, ids, pre = run.index(s)  # built once, then loaded (build_s of the first call)
        build_s = time.perf_counter() - t
        if exact is None:  # the same for every index shape (exact scores never use the index)
            t = time.perf_counter()
            exact = np.concatenate(
                [
                    run.exact_scores(
                        [np.concatenate([q[li] for q in b]) for li in range(len(b[0]))], s
                    )
                    for b in (queries[i : i + 12] for i in range(0, len(queries), 12))
                ]
            )
            print(f"brute force: {time.perf_counter() - t:.0f} s", flush=True)
        e2e.with_layer_norms(run, s)  # an index built before layer_norms.npy
        run.rank(queries[0], s, 10, True)  # warm: page cache, first-call costs
        default = (ranking.MIN_CANDIDATES, ranking.MAX_CANDIDATES)
        tuned = index.nprobe
        for nprobe in [int(p) for p in a.nprobe.split(",") if p] or [tuned]:
            if nprobe:
                index.set_nprobe(nprobe)
            scorer = run.indexes.scorer(s)
            built = scorer.lists
            scans = [_scan(f) for f in a.scan.split(",") if f] or [index_lists.SCAN_FRACTION]
            lcands = [int(c) for c in a.list_candidates.split(",") if c] or [default_lcand]
            for scan, lcand, cand in itertools.product(
                scans, lcands, [int(c) for c in a.candidates.split(",") if c] or [0]
            ):
                # 0: FAISS alone on the same index (its lists set aside)
                scorer.lists = built if any(scan) else None
                index_lists.SCAN_FRACTION = scan if any(scan) else default_scan
                index_lists.CANDIDATES = lcand
                ranking.MIN_CANDIDATES, ranking.MAX_CANDIDATES = (cand, cand) if cand else default
                row = _measure(run, s, queries, exact, ids)
                row.update(
                    n=int(index.n), index_side=m, index_dims=dims, dim=int(pre.dim),
                    lists=scorer.lists is not None,
                    scan_fraction=index_lists.SCAN_FRACTION if scorer.lists else None,
                    list_candidates=index_lists.CANDIDATES if scorer.lists else None,
                    kind=index.kind.value, nprobe=index.nprobe, build_s=round(build_s, 1),
                    candidates=ranking.n_candidates(10, int(index.n), scorer.lists is not None),
                )  # fmt: skip
                out.append(row)
                print(json.dumps(row), flush=True)
            scorer.lists = built
            index_lists.SCAN_FRACTION, index_lists.CANDIDATES = default_scan, default_lcand
        ranking.MIN_CANDIDATES, ranking.MAX_CANDIDATES = default
        if tuned:
            index.set_nprobe(tuned)
    run.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
