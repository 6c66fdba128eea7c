"""The settings as command-line flags: the flags shared by several command groups (the CLI's, and
the ``traceprop train`` command line of :mod:`traceprop_engine.training.command`), their defaults
and choices read from the settings.

A default lives in one place, the settings dataclass (``TrackSettings``, ``TrainSettings``,
``IndexSettings``); the parser reads it from there, so changing it there changes ``--help`` and
the behaviour of every command together.
"""

from __future__ import annotations

import argparse
import dataclasses
from enum import Enum


def field_defaults(cls) -> dict:
    """``{field name: default}`` of a dataclass (fields without a plain default are left out)."""
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def help_of(cls, name: str, suffix: str = "") -> str:
    """The field's one help text (``settings.field_help``), escaped for argparse, plus ``suffix``
    (what only the command line adds)."""
    from .settings import field_help

    return (field_help(cls, name) + suffix).replace("%", "%%")


def from_namespace(cls, a, **given):
    """A settings dataclass from parsed flags: every field whose name is a flag's ``dest`` takes
    that value, ``given`` overrides (fields the flags spell otherwise, e.g. ``--no-covariance``),
    the rest keep their defaults. No field-by-field copy to keep in step with the dataclass."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {n: getattr(a, n) for n in names if hasattr(a, n) and n not in given}
    return cls(**values, **given)


def plain(value):
    """An enum member's value (what argparse shows and parses), anything else as is."""
    return value.value if isinstance(value, Enum) else value


def choices(enum: type[Enum]) -> list[str]:
    return [e.value for e in enum]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--top-k -5`` would otherwise list all but 5 rows)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers (``4,8,16``)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 4,8,16, got {text!r}"
        ) from None


def add_track_flags(p) -> None:
    """--k-in, --k-out, --rank, --factor-dtype, ... with TrackSettings' defaults."""
    from .settings import FactorDtype, FactorSpace, ProjectionKind, TrackSettings

    d = field_defaults(TrackSettings)
    p.add_argument(
        "--k-in",
        type=int,
        default=d["k_in"],
        help=help_of(TrackSettings, "k_in"),
    )
    p.add_argument("--k-out", type=int, default=d["k_out"], help=help_of(TrackSettings, "k_out"))
    p.add_argument(
        "--projection",
        default=plain(d["projection"]),
        choices=choices(ProjectionKind),
        help=help_of(TrackSettings, "projection"),
    )
    p.add_argument(
        "--no-share-k",
        dest="share_k",
        action="store_false",
        default=d["share_k"],
        help="turn off share_k: " + help_of(TrackSettings, "share_k"),
    )
    p.add_argument(
        "--rank",
        type=int,
        default=d["rank"],
        help=help_of(TrackSettings, "rank"),
    )
    p.add_argument(
        "--factor-dtype",
        default=plain(d["factor_dtype"]),
        choices=choices(FactorDtype),
        help=help_of(TrackSettings, "factor_dtype"),
    )
    p.add_argument(
        "--factor-space",
        default=plain(d["factor_space"]),
        choices=choices(FactorSpace),
        help=help_of(TrackSettings, "factor_space"),
    )
    p.add_argument(
        "--power-iters",
        type=int,
        default=d["power_iters"],
        help=help_of(TrackSettings, "power_iters"),
    )
    p.add_argument(
        "--covariance-stride",
        type=int,
        default=d["covariance_stride"],
        help=help_of(TrackSettings, "covariance_stride"),
    )
    p.add_argument(
        "--covariance-tokens",
        type=int,
        default=d["covariance_tokens"],
        help=help_of(TrackSettings, "covariance_tokens"),
    )


def add_sketch_flag(p, help: str | None = None) -> None:
    """--sketch with TrackSettings' default."""
    from .settings import SketchKind, TrackSettings

    d = field_defaults(TrackSettings)
    p.add_argument("--sketch", default=plain(d["sketch"]), choices=choices(SketchKind), help=help)


def add_dense_k_flag(p, help: str | None = None) -> None:
    """--dense-k with TrackSettings' default."""
    from .settings import TrackSettings

    p.add_argument(
        "--dense-k", type=int, default=field_defaults(TrackSettings)["dense_k"], help=help
    )


def add_preconditioner_flag(p, help: str | None = None) -> None:
    """--preconditioner with IndexSettings' default."""
    from .settings import IndexSettings, PreconditionerKind

    d = field_defaults(IndexSettings)
    p.add_argument(
        "--preconditioner",
        default=plain(d["preconditioner"]),
        choices=choices(PreconditionerKind),
        help=help,
    )


def add_index_flags(p) -> None:
    """The flags of :class:`IndexSettings` (index, query), with its defaults."""
    from .settings import DEFAULT_DAMPING, IndexKind, IndexSettings

    d = field_defaults(IndexSettings)
    add_preconditioner_flag(p, help=help_of(IndexSettings, "preconditioner"))
    p.add_argument(
        "--damping",
        type=float,
        default=d["damping"],
        help=help_of(IndexSettings, "damping", f" = {DEFAULT_DAMPING:g}"),
    )
    p.add_argument(
        "--cosine",
        action=argparse.BooleanOptionalAction,
        default=d["cosine"],
        help=help_of(IndexSettings, "cosine"),
    )
    p.add_argument(
        "--per-record",
        action="store_true",
        help=help_of(IndexSettings, "per_record"),
    )
    p.add_argument(
        "--index-kind",
        default=plain(d["kind"]),
        choices=choices(IndexKind),
        help=help_of(IndexSettings, "kind"),
    )
    p.add_argument(
        "--lists",
        action=argparse.BooleanOptionalAction,
        default=d["lists"],
        help=help_of(IndexSettings, "lists"),
    )


def index_settings(a):
    """The :class:`IndexSettings` of parsed :func:`add_index_flags` flags."""
    from .settings import IndexSettings

    return IndexSettings(
        preconditioner=a.preconditioner,
        damping=a.damping,
        cosine=a.cosine,
        per_record=a.per_record,
        kind=a.index_kind,
        lists=getattr(a, "lists", None),
    )
