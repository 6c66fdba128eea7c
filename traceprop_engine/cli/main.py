"""The ``traceprop`` command line. Every subcommand's ``--help`` documents its flags.

Exit status: 0 on success, 1 on a user-facing error (message on stderr, no traceback),
2 on bad usage (argparse), 3 when ``verify`` finds a mismatch, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .. import constants as C
from ..errors import TracepropError

log = logging.getLogger("traceprop")


# -- train ----------------------------------------------------------------------------------------


def _track_flags(p) -> None:
    """--k-in, --k-out, --rank, --factor-dtype with TrackSettings' defaults (one source)."""
    from ..settings import FactorDtype, FactorSpace, TrackSettings

    d = TrackSettings()
    p.add_argument(
        "--k-in",
        type=int,
        default=d.k_in,
        help="input-side projection size per layer (clamped to the layer width)",
    )
    p.add_argument(
        "--k-out", type=int, default=d.k_out, help="output-side projection size per layer"
    )
    p.add_argument(
        "--rank",
        type=int,
        default=d.rank,
        help="store each record as rank-r factors computed inline (0 = the full k_out x k_in "
        "sketch); see benchmarks/EVAL.md for the quality per byte",
    )
    p.add_argument(
        "--factor-dtype",
        default=d.factor_dtype.value,
        choices=[e.value for e in FactorDtype],
        help="storage type of the factors",
    )
    p.add_argument(
        "--factor-space",
        default=d.factor_space.value,
        choices=[e.value for e in FactorSpace],
        help="full: factors of the full per-example gradient by power iteration (per-token "
        "cost independent of k); sketch: project every token, factor the k x k sketch",
    )
    p.add_argument(
        "--power-iters", type=int, default=d.power_iters, help="power iterations (full space)"
    )
    p.add_argument(
        "--covariance-stride",
        type=int,
        default=d.covariance_stride,
        help="K-FAC statistics over every n-th token (full-space factors)",
    )


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="run a tracked fine-tune and write a run directory (store.h5, model/, run.json)",
        description="Fine-tune a model while recording per-example gradient sketches and K-FAC "
        "covariance into RUN/store.h5. Data: a .jsonl/.csv/.parquet/.txt file or a directory of them "
        "(fields prompt+completion, text, or text+label). Progress: RUN/progress.jsonl and a bar on stderr.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", required=True, help="training data file or directory")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument(
        "--eval-data", help="separate eval data (otherwise --eval-fraction of --data is held out)"
    )
    p.add_argument(
        "--eval-fraction", type=float, default=0.1, help="held-out fraction when no --eval-data"
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (GPT-NeoX built from a config), 'minilm' (packaged encoder), or a local Hugging Face directory",
    )
    p.add_argument(
        "--task",
        default="causal-lm",
        choices=["causal-lm", "classification"],
        help="training objective",
    )
    p.add_argument("--epochs", type=int, default=2, help="passes over the training data")
    p.add_argument(
        "--lr", type=float, default=3e-3, help="peak learning rate (AdamW, linear decay to 10%%)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="examples per step")
    p.add_argument(
        "--max-length", type=int, default=128, help="tokens per example (longer ones are truncated)"
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA rank via peft (0 = full fine-tune); the LoRA layers are tracked",
    )
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        help="peft target modules: 'all-linear' or comma-separated names",
    )
    p.add_argument(
        "--scope",
        default="all",
        help="tracked layers: 'all', 'last-block', or a regex on module names",
    )
    _track_flags(p)
    p.add_argument(
        "--sketch",
        default="factored",
        choices=["factored", "dense"],
        help="factored (P_out g)(P_in a)^T or dense sparse-JL of the full gradient",
    )
    p.add_argument("--dense-k", type=int, default=512, help="dense sketch size")
    p.add_argument(
        "--no-covariance",
        action="store_true",
        help="do not accumulate K-FAC statistics (identity preconditioning only)",
    )
    p.add_argument(
        "--no-track", action="store_true", help="the same loop with nothing recorded (baseline)"
    )
    p.add_argument(
        "--buffer-records",
        type=int,
        default=2048,
        help="records held on the device between host transfers",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of data order, model init and projections"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="under torchrun: DistributedDataParallel, or FSDP2 fully_shard (docs/scaling.md)",
    )
    p.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps (0 = all epochs)"
    )
    p.add_argument("--tiny-layers", type=int, default=4, help="layers of the tiny model")
    p.add_argument("--tiny-width", type=int, default=256, help="width of the tiny model")
    p.add_argument(
        "--tiny-vocab", type=int, default=1024, help="tokenizer vocabulary of the tiny model"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing (finished) run in --out"
    )
    p.set_defaults(func=_cmd_train)


def _cmd_train(a) -> int:
    from ..settings import TrackSettings, TrainSettings
    from ..training.loop import train

    track = None
    if not a.no_track:
        track = TrackSettings(
            scope=a.scope,
            k_in=a.k_in,
            k_out=a.k_out,
            rank=a.rank,
            factor_dtype=a.factor_dtype,
            factor_space=a.factor_space,
            power_iters=a.power_iters,
            covariance_stride=a.covariance_stride,
            sketch=a.sketch,
            dense_k=a.dense_k,
            covariance=not a.no_covariance,
            seed=a.seed,
            buffer_records=a.buffer_records,
        )
    s = TrainSettings(
        data=a.data,
        out=a.out,
        model=a.model,
        task=a.task,
        eval_data=a.eval_data,
        eval_fraction=a.eval_fraction,
        epochs=a.epochs,
        lr=a.lr,
        batch_size=a.batch_size,
        max_length=a.max_length,
        lora_rank=a.lora_rank,
        lora_targets=a.lora_targets,
        seed=a.seed,
        track=track,
        threads=a.threads,
        device=a.device,
        parallel=a.parallel,
        max_steps=a.max_steps,
        tiny_layers=a.tiny_layers,
        tiny_width=a.tiny_width,
        tiny_vocab=a.tiny_vocab,
    )
    run_dir = train(s, overwrite=a.overwrite)
    from ..run import read_manifest

    m = read_manifest(run_dir)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if m["status"] == C.STATUS_COMPLETED else 130
    print(
        f"{m['status']}: {run_dir}  ({m.get('store', {}).get('n_records', 0)} records, eval loss {m.get('metrics', {}).get('eval_loss')})"
    )
    return 0 if m["status"] == C.STATUS_COMPLETED else 130


# -- index / query ----------------------------------------------------------------------------------
def _add_index_flags(p) -> None:
    p.add_argument(
        "--preconditioner",
        default=C.DEFAULT_PRECONDITIONER,
        choices=["identity", "kfac", "ekfac"],
        help="H^-1 approximation",
    )
    p.add_argument(
        "--damping",
        type=float,
        default=None,
        help="damping as a fraction of each factor's mean eigenvalue (default 0.1)",
    )
    p.add_argument(
        "--cosine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cosine scores (normalised vectors; the default) or raw inner products",
    )
    p.add_argument(
        "--per-record",
        action="store_true",
        help="one vector per record (example x epoch) instead of per example",
    )
    p.add_argument(
        "--index-kind",
        default="auto",
        choices=["auto", "flat", "ivf", "ivfpq", "hnsw"],
        help="FAISS index (auto: exact up to 200k vectors)",
    )


def _index_settings(a):
    from ..settings import IndexSettings

    return IndexSettings(
        preconditioner=a.preconditioner,
        damping=a.damping,
        cosine=a.cosine,
        per_record=a.per_record,
        kind=a.index_kind,
    )


def _add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="fit the preconditioner and build the FAISS index of a run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Build RUN/index/<name>/ (preconditioner.npz, vectors.npy, index.faiss) from "
        "RUN/store.h5. A fresh index is reused; a stale one (store changed) is rebuilt.",
    )
    p.add_argument("run", help="run directory")
    _add_index_flags(p)
    p.add_argument("--rebuild", action="store_true", help="rebuild even when a fresh index exists")
    p.set_defaults(func=_cmd_index)


def _bar_progress():
    from tqdm.auto import tqdm

    bars = {}

    def cb(stage, done, total):
        b = bars.get(stage)
        if b is None:
            b = bars[stage] = tqdm(total=total, desc=stage, unit="vec", leave=False)
        b.n = done
        b.refresh()

    return cb


def _cmd_index(a) -> int:
    from ..attribution.query import open_run

    run = open_run(a.run)
    for n in run.notes:
        print(f"note: {n}", file=sys.stderr)
    s = _index_settings(a)
    index, ids, pre = run.index(s, rebuild=a.rebuild, progress=_bar_progress())
    print(
        f"index {s.name}: {index.n} vectors x {pre.dim} dims ({index.kind.value}) in {run.dir / C.INDEX_DIR / s.name}"
    )
    return 0


def _add_query(sub) -> None:
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
    _add_index_flags(p)
    p.set_defaults(func=_cmd_query)


def _cmd_query(a) -> int:
    from ..attribution.export import rows_for_export, write_rows
    from ..attribution.query import open_run
    from ..errors import QueryError

    for flag in ("prompt", "completion", "label"):
        v = getattr(a, flag)
        try:
            v is None or v.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise QueryError(
                f"--{flag} holds bytes that are not valid UTF-8; pass the text in UTF-8"
            ) from None
    run = open_run(a.run)
    s = _index_settings(a)
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


# -- runs / info ------------------------------------------------------------------------------------
def _add_info(sub) -> None:
    p = sub.add_parser(
        "info",
        help="describe a run: status, data, model, tracked layers, store",
        description="Print a run's status, data (files, counts), model, tracked layers and store summary; "
        "a partial store (cancelled or failed run) is reported as such. --json prints the whole manifest.",
    )
    p.add_argument("run", help="run directory")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=_cmd_info)


def _cmd_info(a) -> int:
    from ..run import read_manifest
    from ..store.sharded import open_run_store

    m = read_manifest(a.run)
    if a.json:
        print(json.dumps(m, indent=2, default=str))
        return 0
    print(f"run {m.get('run_id')}  status {m.get('status')}  created {m.get('created')}")
    d = m.get("data", {})
    print(
        f"data {d.get('root')}  ({d.get('n_train')} train / {d.get('n_eval')} eval, {len(d.get('files', {}))} files)"
    )
    mo = m.get("model", {})
    print(
        f"model {mo.get('source')}  task {mo.get('task')}  params {mo.get('parameters')} (trainable {mo.get('trainable')})"
    )
    if (Path(a.run) / C.STORE_FILE).exists() or m.get("shards"):
        with open_run_store(a.run, m) as st:
            size = sum(p.stat().st_size for p in Path(a.run).glob("store*.h5"))
            shards = f", {len(m['shards'])} shards" if m.get("shards") else ""
            print(
                f"store ({size / 1e6:.2f} MB{shards}): {st.n_records} records, {len(st.layers)} layers, dim {st.dim}, status {st.status}"
            )
            if st.is_partial:
                print(f"note: {st.describe_partial()}")
    from ..evaluate.pareto import describe

    cfg = m.get("config") or {}
    print(describe(cfg.get("track") if isinstance(cfg, dict) else None))
    if m.get("error"):
        print(f"error: {m['error']}")
    return 0


def _add_runs(sub) -> None:
    p = sub.add_parser(
        "runs",
        help="list the runs under a folder",
        description="List run directories (folders with a run.json) under ROOT, newest first, with their status "
        "and model. A run whose process died without updating its status is shown as failed.",
    )
    p.add_argument("root", nargs="?", default="runs", help="folder holding run directories")
    p.set_defaults(func=_cmd_runs)


def _cmd_runs(a) -> int:
    from ..run import list_runs, read_manifest

    runs = list_runs(a.root)
    if not runs:
        print(f"no runs under {a.root}")
        return 0
    for r in runs:
        try:
            m = read_manifest(r)
        except TracepropError as e:  # one damaged run.json must not hide the others
            print(f"{r.name:<32} {'unreadable':<10} {e}")
            continue
        model = m.get("model") if isinstance(m.get("model"), dict) else {}
        print(f"{r.name:<32} {str(m.get('status', '?')):<10} {model.get('source', '?')}")
    return 0


# -- bench ----------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: overhead (tracked vs plain steps), query (index latency/recall)",
        description="Benchmarks print medians of interleaved repeats and ratios against a baseline measured in the same run.",
    )
    bs = p.add_subparsers(dest="bench", required=True)
    o = bs.add_parser(
        "overhead",
        help="plain vs tracked training steps, interleaved",
        description="Time plain, logging and tracked training steps of one model in "
        "interleaved rounds; report the median overhead, CPU time and store bytes per example.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    o.add_argument("--json", help="write the result JSON here")
    o.add_argument("--layers", type=int, default=4)
    o.add_argument("--width", type=int, default=256)
    o.add_argument("--vocab", type=int, default=1024)
    o.add_argument("--batch", type=int, default=8)
    o.add_argument("--seq", type=int, default=128)
    o.add_argument("--scope", default="all")
    o.add_argument("--sketch", default="factored", choices=["factored", "dense"])
    _track_flags(o)
    o.add_argument("--dense-k", type=int, default=512)
    o.add_argument(
        "--repeats", type=int, default=40, help="interleaved rounds (each: one step of every arm)"
    )
    o.add_argument("--threads", type=int, default=1)
    o.add_argument(
        "--rss-data",
        help="also compare peak RSS of 'traceprop train' tracked vs --no-track on this data",
    )
    o.set_defaults(func=_cmd_bench_overhead)
    q = bs.add_parser(
        "query",
        help="index build time, query latency and recall at several N",
        description="Build each index kind over N vectors shaped like preconditioned sketches "
        "for several N; report build time, single-query latency and recall@10 against exact "
        "search.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    q.add_argument("--json", help="write the result rows here")
    q.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated N")
    q.add_argument("--dim", type=int, default=1024)
    q.add_argument("--queries", type=int, default=200)
    q.add_argument(
        "--run",
        help="a run whose preconditioned vectors seed the generator (default: the sample run)",
    )
    q.set_defaults(func=_cmd_bench_query)


def _cmd_bench_overhead(a) -> int:
    from ..bench.overhead import run_overhead_bench, run_rss_bench, summarize

    r = run_overhead_bench(
        layers=a.layers,
        width=a.width,
        vocab=a.vocab,
        batch=a.batch,
        seq=a.seq,
        scope=a.scope,
        sketch=a.sketch,
        k_in=a.k_in,
        k_out=a.k_out,
        rank=a.rank,
        factor_dtype=a.factor_dtype,
        track_extra=dict(
            factor_space=a.factor_space,
            power_iters=a.power_iters,
            covariance_stride=a.covariance_stride,
        ),
        dense_k=a.dense_k,
        repeats=a.repeats,
        threads=a.threads,
    )
    if a.rss_data:
        r.update(run_rss_bench(a.rss_data))
    print(summarize(r))
    if "rss_ratio" in r:
        print(f"peak RSS       tracked/plain = {r['rss_ratio']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))
    return 0


def _cmd_bench_query(a) -> int:
    import numpy as np

    from ..bench.query import run_query_bench

    base = None
    run_dir = a.run or str(_sample_run_dir())
    if Path(run_dir).exists():
        from ..attribution.query import open_run

        run = open_run(run_dir)
        _, _, pre = run.index()
        from ..attribution.index_store import VECTORS_FILE

        base = np.load(run.index_dir() / VECTORS_FILE)
    sizes = tuple(int(x) for x in a.sizes.split(","))
    rows = run_query_bench(sizes=sizes, dim=a.dim, n_queries=a.queries, base_vectors=base)
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


def _sample_run_dir() -> Path:
    from ..samples.run import default_root

    return default_root() / "facts"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="traceprop",
        description="Training-data attribution recorded inside the training backward pass.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_index, _add_query, _add_info, _add_runs, _add_bench):
        add(sub)
    from . import evaluate as cli_eval
    from . import runs as cli_more

    cli_more.register(sub)
    cli_eval.register(sub)
    a = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if a.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(a.func(a) or 0)
    except TracepropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
