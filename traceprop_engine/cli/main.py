"""The ``traceprop`` command line: the parser and the dispatch. Every subcommand's ``--help``
documents its flags; each command group lives in its own module of this package and calls
engine functions only.

Exit status: 0 on success, 1 on a user-facing error (message on stderr, no traceback),
2 on bad usage (argparse), 3 when ``verify`` finds a mismatch, 130 when interrupted, 141 when
the reader of the output went away (``traceprop runs | head -1``: SIGPIPE's status, silently).

Arguments are text in UTF-8: argv bytes that are not UTF-8 (which Python hands over as lone
surrogates) are refused here, for every command, before anything reads or writes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import ConfigError, TracepropError
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


def _flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{dest: how the user wrote it}`` over the parser and every subcommand's parser."""
    names: dict[str, str] = {}
    for action in parser._actions:  # argparse has no public walk over its actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names.update(_flag_names(sub))
        else:
            names.setdefault(
                action.dest, max(action.option_strings, key=len, default=action.dest.upper())
            )
    return names


def refuse_undecodable(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Raise :class:`ConfigError` when an argument holds bytes that are not UTF-8.

    Python decodes argv with ``surrogateescape``: such bytes arrive as lone surrogates, which
    no UTF-8 writer (tokenizer, HDF5, JSON file) accepts, so each command would fail later
    with a ``UnicodeEncodeError`` of its own.
    """
    names = _flag_names(parser)
    for dest, value in vars(a).items():
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, str):
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(
                    f"{names.get(dest, dest)} holds bytes that are not valid UTF-8 "
                    f"({os.fsencode(v)!r}); pass the text in UTF-8 (for a path: rename the "
                    "file or folder)"
                ) from None


def _quiet_broken_pipe() -> int:
    # the reader closed the pipe (``| head -1``): stop without a traceback, and keep Python's
    # flush of stdout at exit from failing again
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if a.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        refuse_undecodable(parser, a)
        rc = int(a.func(a) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return rc
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except TracepropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a file the user named cannot be read or written (not found, EIO...)
        log.debug("the error's traceback (-v):", exc_info=True)
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
