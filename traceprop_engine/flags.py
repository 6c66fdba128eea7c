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


def add_field_flag(p, cls, name: str, *flags: str, **kw) -> None:
    """One flag of field ``name`` of a settings dataclass: ``--name-with-dashes`` (or
    ``flags``), its default, its choices (an enum) or type (an int or float default) and its
    help text, all read from the field; ``kw`` adds to or overrides them."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = None if f.default is dataclasses.MISSING else f.default
    kw.setdefault("default", plain(default))
    if isinstance(default, Enum):
        kw.setdefault("choices", choices(type(default)))
    elif type(default) in (int, float) and "action" not in kw:
        kw.setdefault("type", type(default))
    kw.setdefault("help", help_of(cls, name))
    p.add_argument(*(flags or ("--" + name.replace("_", "-"),)), **kw)


def add_field_flags(p, cls, *names: str) -> None:
    """:func:`add_field_flag` for each of ``names``, in order."""
    for name in names:
        add_field_flag(p, cls, name)


class GivenStore(argparse.Action):
    """``store`` that also notes its ``dest`` in the namespace's ``given`` set: what a command
    needs to tell a flag given at its default value from one left out (see :func:`given`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def given(a) -> set[str]:
    """The ``dest`` of every :class:`GivenStore` flag given on the command line."""
    return set(getattr(a, "given", ()))


def add_track_flags(p, **free_text_rank) -> None:
    """--k-in, --k-out, --rank, --factor-dtype, ... with TrackSettings' defaults
    (``free_text_rank``: overrides of --free-text-rank's ``default`` and ``help``)."""
    from .settings import TrackSettings as T

    add_field_flags(p, T, "k_in", "k_out", "projection", "embedding")
    for name in ("share_k", "vocab_rows"):  # on by default: a --no-... switch turns it off
        add_field_flag(
            p,
            T,
            name,
            "--no-" + name.replace("_", "-"),
            dest=name,
            action="store_false",
            help=f"turn off {name}: " + help_of(T, name),
        )
    # an explicit --rank (1 included) is the rank the records take: free text does not change it
    add_field_flag(
        p,
        T,
        "rank",
        action=GivenStore,
        type=int,
        help=help_of(T, "rank", "; given here, free text keeps it (as --free-text-rank 0 does)"),
    )
    add_field_flag(p, T, "free_text_rank", action=GivenStore, type=int, **free_text_rank)
    add_field_flags(
        p,
        T,
        "factor_dtype",
        "factor_space",
        "power_iters",
        "half_step_start",
        "covariance_stride",
    )
    add_field_flag(p, T, "covariance_tokens")


def _given_help(help: str | None) -> dict:
    return {} if help is None else {"help": help}


def add_sketch_flag(p, help: str | None = None) -> None:
    """--sketch with TrackSettings' default (and its help unless ``help`` is given)."""
    from .settings import TrackSettings

    add_field_flag(p, TrackSettings, "sketch", **_given_help(help))


def add_dense_k_flag(p, help: str | None = None) -> None:
    """--dense-k with TrackSettings' default (and its help unless ``help`` is given)."""
    from .settings import TrackSettings

    add_field_flag(p, TrackSettings, "dense_k", **_given_help(help))


def add_preconditioner_flag(p, help: str | None = None) -> None:
    """--preconditioner with IndexSettings' default (and its help unless ``help`` is given)."""
    from .settings import IndexSettings

    add_field_flag(p, IndexSettings, "preconditioner", **_given_help(help))


def add_index_flags(p, query: bool = False) -> None:
    """The flags of :class:`IndexSettings` (index, query), with its defaults; ``query``: also
    the query-time ones (``--class-prior``), which change no index."""
    from .index_settings import ADAPTER_CLASS_PRIOR, DEFAULT_CLASS_PRIOR, DEFAULT_LM_BIAS
    from .settings import DEFAULT_DAMPING
    from .settings import IndexSettings as S

    add_preconditioner_flag(p)
    add_field_flag(
        p, S, "damping", type=float, help=help_of(S, "damping", f" = {DEFAULT_DAMPING:g}")
    )
    add_field_flag(p, S, "cosine", action=argparse.BooleanOptionalAction)
    add_field_flag(p, S, "per_record", action="store_true")
    add_field_flag(p, S, "records")
    add_field_flag(p, S, "weighting")
    add_field_flag(p, S, "statistics")
    add_field_flag(p, S, "kind", "--index-kind")
    add_field_flag(p, S, "lists", action=argparse.BooleanOptionalAction)
    add_field_flag(p, S, "columns", type=int)
    if not query:
        return
    add_field_flag(
        p,
        S,
        "class_prior",
        type=float,
        help=help_of(
            S,
            "class_prior",
            f"; DEFAULT_CLASS_PRIOR = {DEFAULT_CLASS_PRIOR:g}, "
            f"ADAPTER_CLASS_PRIOR = {ADAPTER_CLASS_PRIOR:g}",
        ),
    )
    add_field_flag(
        p,
        S,
        "lm_bias",
        type=float,
        help=help_of(S, "lm_bias", f"; DEFAULT_LM_BIAS = {DEFAULT_LM_BIAS:g}"),
    )


def index_settings(a):
    """The :class:`IndexSettings` of parsed :func:`add_index_flags` flags."""
    from .settings import IndexSettings

    return IndexSettings(
        preconditioner=a.preconditioner,
        damping=a.damping,
        cosine=a.cosine,
        per_record=a.per_record,
        records=a.records,
        weighting=getattr(a, "weighting", "auto"),
        statistics=getattr(a, "statistics", "auto"),
        kind=a.index_kind,
        lists=getattr(a, "lists", None),
        columns=getattr(a, "columns", None),
        class_prior=getattr(a, "class_prior", None),
        lm_bias=getattr(a, "lm_bias", None),
    )
