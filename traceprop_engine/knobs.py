"""The machinery of the settings dataclasses (:mod:`traceprop_engine.settings`): a field with
its one help text, reading that text back, choices parsed into enums, and the checks several
settings share."""

from __future__ import annotations

import math
from dataclasses import MISSING, field, fields
from enum import Enum

from .errors import ConfigError


def parse_choice(enum: type[Enum], value: object, what: str) -> Enum:
    """``enum(value)``, or a ConfigError that lists the allowed values."""
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(e.value) for e in enum)
        raise ConfigError(f"{what} must be one of {allowed}, got {value!r}") from None


def knob(default=MISSING, *, help: str, default_factory=MISSING):
    """A settings field with its one help text (``field(metadata={"help": ...})``): the class
    docstring, the CLI's ``--help`` and the app's help read it from here (:func:`field_help`)."""
    return field(default=default, default_factory=default_factory, metadata={"help": help})


def field_help(cls, name: str) -> str:
    """The help text of field ``name`` of a settings dataclass.

    Raises:
        KeyError: no such field, or it has no help text.
    """
    return cls.__dataclass_fields__[name].metadata["help"]


def document_fields(cls):
    """Append each field's help to the class docstring (an ``Args:`` section)."""
    lines = [f"        {f.name}: {f.metadata['help']}" for f in fields(cls) if "help" in f.metadata]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Args:\n" + "\n".join(lines) + "\n"
    return cls


MAX_SEED = 2**32 - 1
"""Seeds run from 0 to this (what every generator of the run, numpy's and torch's, accepts)."""


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")


def check_damping(damping) -> None:
    """ConfigError unless ``damping`` is None (the default) or a finite number >= 0."""
    if damping is None:
        return
    try:
        d = float(damping)
    except (TypeError, ValueError):
        d = math.nan
    if isinstance(damping, bool) or not math.isfinite(d) or d < 0:
        raise ConfigError(
            f"damping must be a finite number >= 0 (a fraction of each factor's mean "
            f"eigenvalue), got {damping!r}; leave it out for the default"
        )
