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
    add_sketch_flag,
    add_track_flags,
    choices,
    field_defaults,
    help_of,
    plain,
)

__all__ = ["add_train_arguments", "settings_flags", "train_argv", "train_flags"]


# long: one add_argument per flag of traceprop train; a flat list reads best
def add_train_arguments(p) -> None:
    """Every flag of ``traceprop train``, defaults from TrainSettings and TrackSettings."""
    from ..settings import Task, TrackSettings, TrainSettings

    d = field_defaults(TrainSettings)
    t = field_defaults(TrackSettings)
    tr, tk = TrainSettings, TrackSettings
    p.add_argument("--data", help=help_of(tr, "data", " (required unless --resume)"))
    p.add_argument("--out", help=help_of(tr, "out", " (required unless --resume)"))
    p.add_argument("--eval-data", help=help_of(tr, "eval_data"))
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=d["eval_fraction"],
        help=help_of(tr, "eval_fraction"),
    )
    p.add_argument(
        "--model",
        default=d["model"],
        help=help_of(tr, "model"),
    )
    p.add_argument(
        "--task", default=plain(d["task"]), choices=choices(Task), help=help_of(tr, "task")
    )
    p.add_argument("--epochs", type=int, default=d["epochs"], help=help_of(tr, "epochs"))
    p.add_argument("--lr", type=float, default=d["lr"], help=help_of(tr, "lr"))
    p.add_argument(
        "--batch-size", type=int, default=d["batch_size"], help=help_of(tr, "batch_size")
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=d["max_length"],
        help=help_of(tr, "max_length"),
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=d["lora_rank"],
        help=help_of(tr, "lora_rank"),
    )
    p.add_argument(
        "--lora-targets",
        default=d["lora_targets"],
        help=help_of(tr, "lora_targets"),
    )
    p.add_argument(
        "--scope",
        default=t["scope"],
        help=help_of(tk, "scope"),
    )
    add_track_flags(p)
    add_sketch_flag(p, help_of(tk, "sketch"))
    add_dense_k_flag(p, help_of(tk, "dense_k"))
    p.add_argument(
        "--no-covariance",
        action="store_true",
        help="turn off covariance (identity preconditioning only): " + help_of(tk, "covariance"),
    )
    p.add_argument(
        "--no-track", action="store_true", help="the same loop with nothing recorded (baseline)"
    )
    p.add_argument(
        "--buffer-records",
        type=int,
        default=t["buffer_records"],
        help=help_of(tk, "buffer_records"),
    )
    p.add_argument("--seed", type=int, default=d["seed"], help=help_of(tr, "seed"))
    p.add_argument("--threads", type=int, default=d["threads"], help=help_of(tr, "threads"))
    p.add_argument("--device", default=d["device"], help=help_of(tr, "device"))
    p.add_argument(
        "--max-steps",
        type=int,
        default=d["max_steps"],
        help=help_of(tr, "max_steps"),
    )
    p.add_argument(
        "--tiny-layers", type=int, default=d["tiny_layers"], help=help_of(tr, "tiny_layers")
    )
    p.add_argument(
        "--tiny-width", type=int, default=d["tiny_width"], help=help_of(tr, "tiny_width")
    )
    p.add_argument(
        "--tiny-vocab",
        type=int,
        default=d["tiny_vocab"],
        help=help_of(tr, "tiny_vocab"),
    )
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default=d["parallel"],
        help=help_of(tr, "parallel"),
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d["checkpoint_every"],
        help=help_of(tr, "checkpoint_every"),
    )
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
            ``None`` or ``False`` value leaves its flag out; ``True`` writes a switch.
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
        if v is None or v is False:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch (store_true)
            argv.append(flag)
        else:
            argv += [flag, str(v.value if isinstance(v, Enum) else v)]
    return argv
