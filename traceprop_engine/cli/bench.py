"""``traceprop bench overhead`` and ``traceprop bench query``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import constants as C
from ..flags import add_dense_k_flag, add_sketch_flag, add_track_flags, field_defaults
from ..settings import INDEX_DIMS

E2E_QUERIES = 40
"""``bench query``'s queries per size: the base run's own examples, eval first."""
VECTOR_QUERIES = 200
"""``bench query --vectors-only``'s generated queries per size."""


def add_bench(sub) -> None:
    from ..settings import TrackSettings, TrainSettings

    d = field_defaults(TrainSettings)  # the bench measures the default tiny training shape
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
    o.add_argument("--layers", type=int, default=d["tiny_layers"])
    o.add_argument("--width", type=int, default=d["tiny_width"])
    o.add_argument("--vocab", type=int, default=d["tiny_vocab"])
    o.add_argument("--batch", type=int, default=d["batch_size"])
    o.add_argument("--seq", type=int, default=d["max_length"])
    o.add_argument("--scope", default=field_defaults(TrackSettings)["scope"])
    add_sketch_flag(o)
    add_track_flags(
        o,
        default=0,
        help="the bench's batch is free text (every token a target), where a default run's "
        "records take rank 16 (TrackSettings.free_text_rank); 0 times the rank-1 records that "
        "answers and labels get, 16 the free-text default",
    )
    add_dense_k_flag(o)
    o.add_argument(
        "--repeats", type=int, default=40, help="interleaved rounds (each: one step of every arm)"
    )
    o.add_argument("--threads", type=int, default=1)
    o.add_argument(
        "--rss-data",
        help="also compare peak RSS of 'traceprop train' tracked vs --no-track on this data",
    )
    o.set_defaults(func=_cmd_bench_overhead)
    _add_bench_query(bs)


def _add_bench_query(bs) -> None:
    q = bs.add_parser(
        "query",
        help="whole-query latency and recall@10 at several N (index build included)",
        description="Time the whole ranking path of AttributionRun.rank (FAISS candidates, the "
        "factor lists, the exact re-rank from the stored records) on synthetic stores of N "
        "examples resampled from --run's records, with its real queries, and check recall@10 "
        "of proponents and opponents against brute-force exact scores. --vectors-only times "
        "FAISS alone over generated index vectors instead (recall against exact search in "
        "vector space: the former default, which leaves out the re-rank every query pays).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    q.add_argument("--json", help="write the result rows here")
    q.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated N")
    mode = q.add_mutually_exclusive_group()
    mode.add_argument(
        "--end-to-end",
        action="store_true",
        help="the whole ranking path (the default; kept for older scripts)",
    )
    mode.add_argument(
        "--vectors-only",
        action="store_true",
        help="FAISS alone over vectors generated like --run's index vectors",
    )
    q.add_argument(
        "--dim", type=int, default=1024, help="--vectors-only: width of the fallback generator"
    )
    q.add_argument(
        "--index-dims",
        type=int,
        default=INDEX_DIMS,
        help="--vectors-only: index the vectors reduced to their top this many principal "
        "directions, as the index of a run with more examples than dimensions holds them "
        "(0: full width)",
    )
    q.add_argument(
        "--queries",
        type=int,
        default=None,
        help="queries timed (default: 40 of the run's own, eval first; --vectors-only: 200 "
        "generated)",
    )
    q.add_argument(
        "--run",
        help="the run whose records (or, --vectors-only, index vectors) seed the synthetic "
        "stores (default: the sample run)",
    )
    q.add_argument("--work-dir", default=None, help="where the stores are written")
    q.add_argument(
        "--recall-queries",
        type=int,
        default=None,
        help="queries checked against brute force (default: all)",
    )
    q.add_argument(
        "--lists",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="the index's factor lists (IndexSettings.lists: auto builds them "
        "from 200k examples on); both measures the default and the same store without them",
    )
    q.add_argument(
        "--preconditioners",
        default=C.DEFAULT_PRECONDITIONER,
        help="comma-separated preconditioners, each measured on the same store "
        "(e.g. kfac,identity: the default against identity in one run)",
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
            share_k=a.share_k,
            vocab_rows=a.vocab_rows,
            projection=a.projection,
            factor_space=a.factor_space,
            power_iters=a.power_iters,
            free_text_rank=a.free_text_rank,
            half_step_start=a.half_step_start,
            covariance_stride=a.covariance_stride,
            covariance_tokens=a.covariance_tokens,
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
    from ..bench.query import run_base_vectors, run_query_bench
    from ..samples.run import default_root

    sizes = tuple(int(x) for x in a.sizes.split(","))
    if not a.vectors_only:
        import tempfile

        from ..bench.query_e2e import run_end_to_end
        from ..settings import IndexSettings

        if a.work_dir:  # a folder that does not exist yet is made, as for every other output
            Path(a.work_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=a.work_dir, prefix="traceprop-e2e-") as work:
            rows = run_end_to_end(
                a.run or default_root() / "facts",
                sizes,
                work,
                n_queries=a.queries or E2E_QUERIES,  # the base run's examples, eval first
                progress=lambda m: print(m, flush=True),
                recall_queries=a.recall_queries,
                settings=[
                    IndexSettings(preconditioner=p, lists=lists)
                    for p in a.preconditioners.split(",")
                    for lists in {
                        "auto": [None],
                        "on": [True],
                        "off": [False],
                        "both": [None, False],
                    }[a.lists]
                ],
            )
    else:
        base = run_base_vectors(a.run or default_root() / "facts")
        rows = run_query_bench(
            sizes=sizes,
            dim=a.dim,
            n_queries=a.queries or VECTOR_QUERIES,
            base_vectors=base,
            index_dims=a.index_dims,
        )
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0
