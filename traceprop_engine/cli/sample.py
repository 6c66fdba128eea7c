"""``traceprop sample``: regenerate the bundled sample data and run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_sample(sub) -> None:
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


def _cmd_sample(a) -> int:
    from ..samples.run import build_sample_run

    out = build_sample_run(Path(a.out) if a.out else None, seed=a.seed)
    print(f"sample run written to {out}", file=sys.stderr)
    return 0
