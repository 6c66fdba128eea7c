"""``traceprop audit``, ``verify`` and ``rank``: record a query as an audit trail, re-hash a run
against its manifest, rank training examples without a query."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..flags import add_field_flag, add_preconditioner_flag, choices, positive_int


def add_audit(sub) -> None:
    p = sub.add_parser(
        "audit",
        help="write an audit trail (JSON and/or CSV) for a query",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Answer a query and record it: query, run id, model fingerprint, data-manifest hash, time, "
        "software versions, and every influencer (example id, source file, row, content sha256, score, rank). "
        "See docs/audit.md for what a trail proves and what it does not.",
    )
    p.add_argument("run", help="run directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--eval-example", type=int)
    p.add_argument("--completion")
    p.add_argument("--label")
    p.add_argument("--top-k", type=positive_int, default=20)
    add_preconditioner_flag(p)
    p.add_argument("--out", required=True, help="trail JSON path")
    p.add_argument("--csv", help="also write the influencers as CSV")
    p.set_defaults(func=_cmd_audit)


def _cmd_audit(a) -> int:
    from ..attribution import audit_rows, audit_trail, open_run, write_csv
    from ..settings import IndexSettings

    run = open_run(a.run)
    res = run.query(
        a.prompt,
        a.completion,
        eval_example=a.eval_example,
        label=a.label,
        top_k=a.top_k,
        opponents=True,
        settings=IndexSettings(preconditioner=a.preconditioner),
    )
    trail = audit_trail(run, res)
    Path(a.out).write_text(json.dumps(trail, indent=2, ensure_ascii=False, default=str))
    if a.csv:
        write_csv(audit_rows(trail), a.csv)
    print(
        f"audit trail: {a.out} ({len(trail['influencers'])} influencers, model {str(trail['model_fingerprint'])[:12]}…)"
    )
    return 0


def add_verify(sub) -> None:
    v = sub.add_parser(
        "verify",
        help="re-hash a run's data files and model against its manifest (exit 3 on any change)",
        description="Re-hash every training and eval data file and the saved model weights of RUN and compare "
        "them with the hashes recorded in RUN/run.json at training time. Prints ok/changed/missing per file; "
        "exit status 0 when nothing changed, 3 on any mismatch.",
    )
    v.add_argument("run", help="run directory")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_cmd_verify)


def _cmd_verify(a) -> int:
    from ..verify import verify_run

    rep = verify_run(a.run)
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        _print_verify(rep)
    return 0 if rep["ok"] else 3


def _print_verify(rep: dict) -> None:
    for key, root in rep["roots"].items():
        print(f"hashed   data files under {root} ({key})")
    for f in rep["files"]:
        print(f"{f['status']:<8} {f['file']}")
    print(f"{rep['model']['status']:<8} model {rep['model'].get('dir', '')}")
    st = rep["store"]
    for c in st.get("files", []):
        note = f" ({c['detail']})" if c.get("detail") else ""
        print(f"{c['status']:<8} store {c['file']}{note}")
    if "files" not in st:
        print(f"{st['status']:<8} store {st.get('detail', '')}")
    for p in rep["problems"]:
        print(f"problem: {p}", file=sys.stderr)
    older = any(c.get("digest_version") == 1 for c in st.get("files", []))
    print(
        "verified: nothing changed"
        + (" in what the store's older digest covers (see its line above)" if older else "")
        if rep["ok"]
        else "NOT VERIFIED: this run cannot be vouched for (see the lines above)"
    )


def add_rank(sub) -> None:
    from ..attribution import RankBy
    from ..settings import IndexSettings

    r = sub.add_parser(
        "rank",
        help="rank training examples without a query: self-influence, gradient norm, training loss",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Query-independent rankings used by audits (e.g. to look for mislabelled or odd "
        "examples): self-influence tau(i, i) = |H^-1/2 S_i|^2 under the chosen preconditioner, the raw "
        "sketch norm (a gradient-norm proxy), or the example's last recorded training loss. Highest first. "
        "See benchmarks/EVAL.md for how well each finds planted problems.",
    )
    r.add_argument("run", help="run directory")
    r.add_argument("--by", default=RankBy.SELF_INFLUENCE.value, choices=choices(RankBy))
    add_preconditioner_flag(r)
    add_field_flag(r, IndexSettings, "records")  # all: the trajectory, for self-influence audits
    add_field_flag(r, IndexSettings, "weighting")
    add_field_flag(r, IndexSettings, "statistics")
    r.add_argument("--top-k", type=positive_int, default=20)
    r.add_argument("--csv", help="write the full ranking as CSV")
    r.set_defaults(func=_cmd_rank)


def _cmd_rank(a) -> int:
    from ..attribution import RankBy, open_run, rank_examples
    from ..settings import IndexSettings

    run = open_run(a.run)
    by = RankBy(a.by)
    s = IndexSettings(
        preconditioner=a.preconditioner,
        records=a.records,
        weighting=a.weighting,
        statistics=a.statistics,
    )
    df = rank_examples(run, by, s)
    col = by.column
    for n in run.notes:
        print(f"note: {n}", file=sys.stderr)
    print(f"{'rank':>4} {col:>15}  {'source:row':<28} text")
    for row in df.head(a.top_k).iter_rows(named=True):
        text = " ".join(str(row["text"]).split())[:60]
        print(
            f"{row['rank']:>4} {row[col]:>15.6g}  {row['source'] + ':' + str(row['row']):<28} {text}"
        )
    if a.csv:
        from ..attribution import write_csv

        write_csv(df, a.csv)
    return 0
