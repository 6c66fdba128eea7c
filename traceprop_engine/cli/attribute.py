"""``traceprop index`` and ``traceprop query``: build a run's index, rank training examples by
influence on a prompt."""

from __future__ import annotations

import argparse
import json
import sys

from ..flags import add_index_flags, index_settings


def add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="fit the preconditioner and build the FAISS index of a run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Build RUN/index/<name>/ (preconditioner.npz, vectors.npy, index.faiss) from "
        "RUN/store.h5. A fresh index is reused; a stale one (store changed) is rebuilt.",
    )
    p.add_argument("run", help="run directory")
    add_index_flags(p)
    p.add_argument("--rebuild", action="store_true", help="rebuild even when a fresh index exists")
    p.set_defaults(func=_cmd_index)


_UNITS = {
    "statistics": "ex",
    "preconditioner": "rec",
    "vectors": "rec",
    "records": "layer",
    "lists": "rec",
    "index": "vec",
}
"""What each stage of an index build counts (``RunIndexes.build``'s progress)."""


def _bar_progress():
    from tqdm.auto import tqdm

    bars = {}

    def cb(stage, done, total):
        b = bars.get(stage)
        if b is None:
            unit = _UNITS.get(stage, "it")
            b = bars[stage] = tqdm(total=total, desc=stage, unit=unit, leave=False)
        b.n = done
        b.refresh()

    return cb


def _cmd_index(a) -> int:
    from ..attribution import open_run

    run = open_run(a.run)
    for n in run.notes:
        print(f"note: {n}", file=sys.stderr)
    s = run.settings(index_settings(a))
    index, ids, pre = run.index(s, rebuild=a.rebuild, progress=_bar_progress())
    for n in run.indexes.notes(s):  # reused as an earlier release built it
        print(f"note: {n}", file=sys.stderr)
    print(
        f"index {s.name}: {index.n} vectors x {pre.dim} dims ({index.kind.value}) in {run.indexes.dir(s)}"
    )
    return 0


def add_query(sub) -> None:
    p = sub.add_parser(
        "query",
        help="rank training examples by influence on a prompt (+ completion)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Compute the query's sketch on the run's final model, precondition it and search "
        "the index. score > 0: proponent (pushed the model toward this output); score < 0: opponent.",
    )
    p.add_argument("run", help="run directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="the test prompt (causal LM) or text (classification)")
    g.add_argument(
        "--eval-example",
        type=int,
        help="use stored example N (its exact training tokens) as the query",
    )
    p.add_argument("--completion", help="the completion whose origin to explain (causal LM)")
    p.add_argument("--label", help="the label to explain (classification)")
    p.add_argument("--top-k", type=int, default=10, help="rows per kind")
    p.add_argument(
        "--opponents", action="store_true", help="also list opponents (most negative scores)"
    )
    p.add_argument("--csv", help="write the full rows as CSV")
    p.add_argument("--json", help="write the full rows as JSON (a list of objects)")
    p.add_argument(
        "--by-source", action="store_true", help="also print influence aggregated by source file"
    )
    add_index_flags(p, query=True)
    p.set_defaults(func=_cmd_query)


def _cmd_query(a) -> int:
    from ..attribution import open_run, rows_for_export, write_rows

    run = open_run(a.run)
    s = run.settings(index_settings(a))
    res = run.query(
        a.prompt,
        a.completion,
        eval_example=a.eval_example,
        label=a.label,
        top_k=a.top_k,
        opponents=a.opponents,
        settings=s,
    )
    for n in res.notes:
        print(f"note: {n}", file=sys.stderr)
    print(
        f"query: {json.dumps({k: res.query.get(k) for k in ('prompt', 'completion', 'label', 'eval_example') if res.query.get(k) is not None})}"
    )
    print(
        f"{res.sign_note}\npreconditioner {s.preconditioner.value}, {res.query['n_vectors']} vectors, {res.elapsed_ms:.0f} ms"
    )
    _print_table(res.rows)
    if a.by_source:
        print("\ninfluence by source file:")
        print(run.influence_by_source(res, s))
    out = rows_for_export(res)
    if a.csv:
        write_rows(out, a.csv, "csv")
    if a.json:
        write_rows(out, a.json, "json")
    return 0


def _print_table(rows) -> None:
    if rows.height == 0:
        print("(no rows)")
        return
    width = 60
    print(f"{'kind':<10} {'rank':>4} {'score':>11}  {'source:row':<28} text")
    for r in rows.iter_rows(named=True):
        text = " ".join(str(r["text"]).split())
        text = text if len(text) <= width else text[: width - 1] + "…"
        print(
            f"{r['kind']:<10} {r['rank']:>4} {r['score']:>11.4g}  {r['source'] + ':' + str(r['row']):<28} {text}"
        )
