"""The ``traceprop train`` command line: its flags (defaults from the settings) and the argv that
runs it.

:func:`add_train_arguments` is the one definition of the flags (``cli/train.py`` registers them);
:func:`train_argv` is the one place that writes a ``traceprop train`` command line (the app's
Launch page, the overhead benchmark and the tests run training in a child process through it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from enum import Enum

from ..flags import (
    add_dense_k_flag,
    add_field_flag,
    add_field_flags,
    add_sketch_flag,
    add_track_flags,
    field_defaults,
    help_of,
    plain,
)

__all__ = ["add_train_arguments", "settings_flags", "train_argv", "train_flags"]


def add_train_arguments(p) -> None:
    """Every flag of ``traceprop train``: one per settings field (default, type or choices and
    help from the field), the switches ``--no-covariance``, ``--no-track``, ``--overwrite``."""
    from ..settings import TrackSettings as tk
    from ..settings import TrainSettings as tr

    for name in ("data", "out"):
        add_field_flag(p, tr, name, help=help_of(tr, name, " (required unless --resume)"))
    add_field_flags(p, tr, "eval_data", "eval_fraction", "model", "task", "epochs", "lr")
    add_field_flags(p, tr, "batch_size", "max_length", "lora_rank", "lora_targets")
    add_field_flag(p, tk, "scope")
    add_track_flags(p)
    add_sketch_flag(p)
    add_dense_k_flag(p)
    p.add_argument(
        "--no-covariance",
        action="store_true",
        help="turn off covariance (identity preconditioning only): " + help_of(tk, "covariance"),
    )
    p.add_argument(
        "--no-track", action="store_true", help="the same loop with nothing recorded (baseline)"
    )
    add_field_flag(p, tk, "buffer_records")
    add_field_flags(p, tr, "seed", "threads", "device", "max_steps")
    add_field_flags(p, tr, "tiny_layers", "tiny_width", "tiny_vocab")
    add_field_flag(p, tr, "parallel", choices=("ddp", "fsdp"))
    add_field_flag(p, tr, "checkpoint_every")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing (finished) run in --out"
    )


def train_flags() -> dict[str, argparse.Action]:
    """``{dest: action}`` of every ``traceprop train`` flag (the parser is the one source)."""
    p = argparse.ArgumentParser(add_help=False)
    add_train_arguments(p)
    return {a.dest: a for a in p._actions if a.option_strings}


def settings_flags(settings) -> dict[str, object]:
    """The flag values (``{dest: value}``) that make ``traceprop train`` run ``settings``
    (a :class:`TrainSettings`): ``--data`` and ``--out``, then every value that differs from its
    default.

    Raises:
        ConfigError: a setting the command line cannot express (e.g. ``weight_decay``).
    """
    from ..errors import ConfigError
    from ..settings import TrackSettings, TrainSettings

    flags = train_flags()
    values = {"data": settings.data, "out": settings.out}
    changed = {
        k: v
        for k, v in settings.to_dict().items()
        if k not in ("data", "out", "track") and v != plain(field_defaults(TrainSettings).get(k))
    }
    if settings.track is None:
        changed["no_track"] = True
    else:
        t = settings.track.to_dict()
        td = {k: plain(v) for k, v in field_defaults(TrackSettings).items()}
        if t.pop("seed") != settings.seed:
            raise ConfigError("'traceprop train' seeds the projections with --seed (track.seed)")
        if not t.pop("covariance"):
            changed["no_covariance"] = True
        changed.update({k: v for k, v in t.items() if v != td[k]})
    unknown = sorted(k for k in changed if k not in flags)
    if unknown:
        raise ConfigError(f"'traceprop train' has no flag for {', '.join(unknown)}")
    return {**values, **changed}


def train_argv(
    values: Mapping[str, object] | object,
    *,
    launcher: Sequence[str] = (sys.executable,),
) -> list[str]:
    """``[*launcher, "-m", "traceprop_engine", "train", *flags]`` for a child process.

    Args:
        values: a :class:`TrainSettings`, or ``{dest: value}`` of ``traceprop train`` flags
            (``"k_in": 4``, ``"no_covariance": True``), written in the mapping's order. A
            ``None`` value leaves its flag out; a switch is written when its value is not the
            switch's default (``True`` for ``--no-covariance``, ``False`` for
            ``--no-share-k``, whose ``dest`` is ``share_k``).
        launcher: what runs the module, e.g. ``(sys.executable, "-m", "torch.distributed.run",
            "--nproc_per_node", "2")`` for a DDP run.

    Raises:
        ConfigError: a name that is no ``traceprop train`` flag, or settings it cannot express.
    """
    from ..errors import ConfigError

    if not isinstance(values, Mapping):
        values = settings_flags(values)
    flags = train_flags()
    argv = [*launcher, "-m", "traceprop_engine", "train"]
    for name, v in values.items():
        action = flags.get(name)
        if action is None:
            raise ConfigError(f"'traceprop train' has no flag for {name!r}")
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch: store_true (given when True), store_false (when False)
            if v is not None and bool(v) is not bool(action.default):
                argv.append(flag)
            continue
        if v is not None and v is not False:
            argv += [flag, str(v.value if isinstance(v, Enum) else v)]
    return argv
