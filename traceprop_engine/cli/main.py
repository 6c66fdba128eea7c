"""The ``traceprop`` command line: the parser and the dispatch. Every subcommand's ``--help``
documents its flags; each command group lives in its own module of this package and calls
engine functions only.

Exit status: 0 on success, 1 on a user-facing error (message on stderr, no traceback),
2 on bad usage (argparse), 3 when ``verify`` finds a mismatch, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import TracepropError
from . import (
    attribute,
    audit,
    bench,
    counterfactual,
    curate,
    evaluate,
    runs,
    sample,
    store,
    train,
)

log = logging.getLogger("traceprop")

# in the order ``traceprop --help`` lists them
_COMMANDS = (
    train.add_train,
    attribute.add_index,
    attribute.add_query,
    runs.add_info,
    runs.add_runs,
    bench.add_bench,
    audit.add_audit,
    audit.add_verify,
    store.add_compact,
    audit.add_rank,
    sample.add_sample,
    evaluate.register,
    counterfactual.register,
    curate.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceprop",
        description="Training-data attribution recorded inside the training backward pass.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
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
