"""``traceprop compact``: rewrite a run's store as rank-c factors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_compact(sub) -> None:
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


def _cmd_compact(a) -> int:
    from ..attribution import open_run
    from ..errors import ConfigError
    from ..store.compact import compact_store
    from ..store.sizes import describe_compaction

    run = open_run(a.run)  # validates the run; a DDP run's shards are read as one store
    widest = max((min(layer.k_out, layer.k_in) for layer in run.store.layers), default=0)
    if a.rank > widest:  # the API clamps c per layer; asked here, a larger c is a mistake
        raise ConfigError(
            f"--rank {a.rank} is above min(k_out, k_in) of every layer of {a.run} (at most "
            f"{widest}); --rank {widest} already keeps every sketch exactly"
        )
    out = compact_store(run.store, a.rank, a.out or Path(a.run) / f"factors-c{a.rank}.h5")
    first, *notes = describe_compaction(run.store.layers, a.rank)
    print(f"factors written to {out}: {first}")
    for n in notes:
        print(n, file=sys.stderr)
    return 0
