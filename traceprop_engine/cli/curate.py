"""``traceprop curate``: remove a query's top proponents (or opponents), a ranking's top or
hand-picked rows from a run's training data, write the cleaned copy, and (``--retrain``) retrain
with the run's settings and compare the two runs."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from .. import constants as C


def register(sub) -> None:
    p = sub.add_parser(
        "curate",
        help="write a cleaned copy of a run's training data without selected examples; "
        "optionally retrain on it and compare",
        description="Select training examples of RUN (the top-k proponents, or with --opponents "
        "opponents, of one or more queries; the top of --by self-influence|loss|gradient-norm; "
        "rows by hand with --remove-ids), write the run's data files without them to --out (same "
        "files and formats, kept rows byte for byte, plus curate.json listing every removed "
        "row's source, row, sha256 and why). --retrain trains a tracked run on the copy with "
        "RUN's settings and compares both runs on the queries and the eval set (proof.json).",
    )
    p.add_argument("run", help="the completed run whose training data is curated")
    p.add_argument("--prompt", action="append", default=[], help="a query's prompt (repeatable)")
    p.add_argument(
        "--completion",
        action="append",
        default=[],
        help="the completion of the --prompt at the same position (repeatable)",
    )
    p.add_argument(
        "--label", action="append", default=[], help="classification runs: the query's label"
    )
    p.add_argument(
        "--eval-example",
        type=int,
        action="append",
        default=[],
        help="an eval example id as a query",
    )
    p.add_argument(
        "--remove-top-k", type=int, default=0, help="how many per query (or from --by) to remove"
    )
    p.add_argument(
        "--opponents", action="store_true", help="remove each query's top opponents instead"
    )
    p.add_argument(
        "--by",
        choices=("self-influence", "loss", "gradient-norm"),
        help="remove the top --remove-top-k of this query-independent ranking",
    )
    p.add_argument(
        "--remove-ids",
        action="append",
        default=[],
        help="rows picked by hand: example ids or source:row, comma-separated (repeatable)",
    )
    p.add_argument(
        "--preconditioner",
        default=C.DEFAULT_PRECONDITIONER,
        help=f"the ranking the selection uses (default {C.DEFAULT_PRECONDITIONER})",
    )
    p.add_argument("--out", required=True, help="the folder for the cleaned copy (new or empty)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace a cleaned copy already in --out"
    )
    p.add_argument("--retrain", action="store_true", help="retrain on the copy and compare")
    p.add_argument("--retrain-out", help="the retrained run's folder (default: OUT-run)")
    p.add_argument(
        "--threads", type=int, help="torch CPU threads of the retrain (default: the run's own)"
    )
    p.add_argument(
        "--compare-top-k", type=int, default=10, help="influencers compared per query (default 10)"
    )
    p.add_argument("--json", action="store_true", help="print the manifest (and proof) as JSON")
    p.set_defaults(func=_cmd, parser=p)


def _selection(a):
    from ..curate import CurateQuery, Selection

    if a.completion and a.label:
        a.parser.error("give --completion (causal LM) or --label (classification), not both")
    answers = a.completion or a.label
    if len(answers) != len(a.prompt):
        a.parser.error(
            f"{len(a.prompt)} --prompt but {len(answers)} --completion/--label: give one per prompt"
        )
    queries = [
        CurateQuery(p, completion=c) if a.completion else CurateQuery(p, label=c)
        for p, c in zip(a.prompt, answers, strict=True)
    ] + [CurateQuery(eval_example=i) for i in a.eval_example]
    ids = [t for chunk in a.remove_ids for t in chunk.split(",")]
    return Selection(
        queries=tuple(queries),
        top_k=a.remove_top_k,
        opponents=a.opponents,
        by=a.by,
        ids=tuple(ids),
        preconditioner=a.preconditioner,
    )


def format_manifest(doc: dict, out: Path) -> str:
    lines = [f"removed {len(doc['removed'])} training example(s); cleaned copy: {out}"]
    for r in doc["removed"][:20]:
        lines.append(f"  {r['source']}:{r['row']}  {r['why']}")
    if len(doc["removed"]) > 20:
        lines.append(f"  … and {len(doc['removed']) - 20} more (see {out / 'curate.json'})")
    return "\n".join(lines)


def format_proof(proof: dict) -> str:
    lines = []
    for i, q in enumerate(proof["queries"], start=1):
        b, a = q["before"], q["after"]
        lines.append(
            f"query {i}: loss {b['loss']:.4f} -> {a['loss']:.4f} ({q['loss_change']:+.4f}); "
            f"answer {b['answer']!r} -> {a['answer']!r} (queried {b['queried']!r})"
        )
        for o in q["overlap"]:
            lines.append(f"  top-{o['k']} {o['kind']}s shared before/after: {o['shared']}")
        gone = sum(1 for c in q["changes"] if c["status"] == "removed")
        lines.append(f"  {gone} of the influencers before were removed")
    ev = proof["eval"]
    if ev["eval_loss_before"] is not None:
        lines.append(
            f"eval loss {ev['eval_loss_before']:.4f} -> {ev['eval_loss_after']:.4f} "
            f"({ev['n_eval'][0]} / {ev['n_eval'][1]} eval examples)"
        )
    return "\n".join(lines)


def _cmd(a) -> int:
    from ..curate import curate, prove, retrain
    from ..training.loop import StopFlag

    out = Path(a.out)
    doc = curate(a.run, _selection(a), out, overwrite=a.overwrite)
    print(format_manifest(doc, out.resolve()), file=sys.stderr if a.json else sys.stdout)
    if not a.retrain:
        if a.json:
            print(json.dumps(doc, indent=1, ensure_ascii=False))
        return 0
    run_out = Path(a.retrain_out) if a.retrain_out else out.parent / f"{out.name}-run"
    print(f"retraining with {a.run}'s settings into {run_out}", file=sys.stderr, flush=True)
    stop = StopFlag()
    old = signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "requested", True))
    try:
        run = retrain(out, run_out, stop=stop, threads=a.threads)
    finally:
        signal.signal(signal.SIGTERM, old)
    print("comparing the two runs on the queries and the eval set", file=sys.stderr, flush=True)
    proof = prove(out, top_k=max(a.compare_top_k, 1))
    if a.json:
        print(json.dumps({"manifest": doc, "proof": proof}, indent=1, ensure_ascii=False))
    else:
        print(f"retrained: {run}")
        print(format_proof(proof))
        print(f"saved: {out.resolve() / 'proof.json'}")
    return 0
