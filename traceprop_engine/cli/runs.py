"""Subcommands for audit, verification and the bundled sample run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import constants as C


def register(sub) -> None:
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
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument(
        "--preconditioner", default=C.DEFAULT_PRECONDITIONER, choices=["identity", "kfac", "ekfac"]
    )
    p.add_argument("--out", required=True, help="trail JSON path")
    p.add_argument("--csv", help="also write the influencers as CSV")
    p.set_defaults(func=_cmd_audit)

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

    c = sub.add_parser(
        "compact",
        help="write rank-c factors of every sketch (LoRIF-style compact storage)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Stream RUN/store.h5 and write RUN/factors-c{RANK}.h5: per layer and record the "
        "rank-c truncated SVD factors U (k_out x c, singular values folded in) and V (k_in x c), "
        "so that the sketch is about U V^T; storage per layer drops from k_out*k_in to c*(k_out+k_in) "
        "numbers. See benchmarks/compact.md for the measured score error.",
    )
    c.add_argument("run", help="run directory")
    c.add_argument("--rank", type=int, default=2, help="factors kept per sketch (c)")
    c.add_argument("--out", help="output file (default RUN/factors-c{rank}.h5)")
    c.set_defaults(func=_cmd_compact)

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
    r.add_argument(
        "--by", default="self-influence", choices=["self-influence", "gradient-norm", "loss"]
    )
    r.add_argument(
        "--preconditioner", default=C.DEFAULT_PRECONDITIONER, choices=["identity", "kfac", "ekfac"]
    )
    r.add_argument("--top-k", type=int, default=20)
    r.add_argument("--csv", help="write the full ranking as CSV")
    r.set_defaults(func=_cmd_rank)

    s = sub.add_parser(
        "sample",
        help="regenerate the bundled sample data and run deterministically",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Regenerate sample_runs/facts-data (invented facts with ground truth) and sample_runs/facts "
        "(a tracked tiny GPT-NeoX fine-tune on it, indexed with kfac, identity and ekfac). Seeded; one torch thread.",
    )
    s.add_argument(
        "--out", default=None, help="sample_runs folder (default: the repository's sample_runs/)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_sample)


def _cmd_audit(a) -> int:
    from ..attribution.audit import audit_rows, audit_trail
    from ..attribution.export import write_csv
    from ..attribution.query import open_run
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


def _cmd_verify(a) -> int:
    from ..verify import verify_run

    rep = verify_run(a.run)
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
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
        print(
            "verified: nothing changed"
            if rep["ok"]
            else "NOT VERIFIED: this run cannot be vouched for (see the lines above)"
        )
    return 0 if rep["ok"] else 3


def _cmd_rank(a) -> int:
    import numpy as np
    import polars as pl

    from ..attribution.query import open_run
    from ..settings import IndexSettings

    run = open_run(a.run)
    if a.by == "loss":
        rec = run.store.records()
        df = pl.DataFrame(
            {"example_id": rec["example_index"], "step": rec["step"], "loss": rec["loss"]}
        )
        df = df.sort("step").group_by("example_id").agg(pl.col("loss").last())
        col = "loss"
    else:
        df = run.self_influence(IndexSettings(preconditioner=a.preconditioner))
        col = "self_influence" if a.by == "self-influence" else "gradient_norm"
    ex = run.examples().select("example_id", "source", "row", "sha256", "text")
    df = df.join(ex, on="example_id", how="left").sort(col, descending=True, nulls_last=True)
    df = df.with_columns(pl.Series("rank", np.arange(1, df.height + 1)))
    for n in run.notes:
        print(f"note: {n}", file=sys.stderr)
    print(f"{'rank':>4} {col:>15}  {'source:row':<28} text")
    for row in df.head(a.top_k).iter_rows(named=True):
        text = " ".join(str(row["text"]).split())[:60]
        print(
            f"{row['rank']:>4} {row[col]:>15.6g}  {row['source'] + ':' + str(row['row']):<28} {text}"
        )
    if a.csv:
        from ..attribution.export import write_csv

        write_csv(df, a.csv)
    return 0


def _cmd_compact(a) -> int:
    from ..attribution.query import open_run
    from ..store.compact import compact_store

    run = open_run(a.run)  # validates the run; a DDP run's shards are read as one store
    out = compact_store(run.store, a.rank, a.out or Path(a.run) / f"factors-c{a.rank}.h5")
    full = sum(layer.dim for layer in run.store.layers) * 4
    fact = (
        sum(
            min(a.rank, layer.k_out, layer.k_in) * (layer.k_out + layer.k_in)
            for layer in run.store.layers
        )
        * 4
    )
    print(
        f"factors written to {out}: {fact} bytes/record vs {full} for full sketches ({full / fact:.1f}x smaller)"
    )
    return 0


def _cmd_sample(a) -> int:
    from ..samples.run import build_sample_run

    out = build_sample_run(Path(a.out) if a.out else None, seed=a.seed)
    print(f"sample run written to {out}", file=sys.stderr)
    return 0
