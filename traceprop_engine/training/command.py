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
    plain,
)

__all__ = ["add_train_arguments", "settings_flags", "train_argv", "train_flags"]


# long: one add_argument per flag of traceprop train; a flat list reads best
def add_train_arguments(p) -> None:
    """Every flag of ``traceprop train``, defaults from TrainSettings and TrackSettings."""
    from ..settings import Task, TrackSettings, TrainSettings

    d = field_defaults(TrainSettings)
    t = field_defaults(TrackSettings)
    p.add_argument("--data", help="training data file or directory (required unless --resume)")
    p.add_argument("--out", help="run directory to create (required unless --resume)")
    p.add_argument(
        "--eval-data", help="separate eval data (otherwise --eval-fraction of --data is held out)"
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=d["eval_fraction"],
        help="held-out fraction when no --eval-data",
    )
    p.add_argument(
        "--model",
        default=d["model"],
        help="'tiny' (GPT-NeoX built from a config), 'minilm' (packaged encoder), or a local Hugging Face directory",
    )
    p.add_argument(
        "--task", default=plain(d["task"]), choices=choices(Task), help="training objective"
    )
    p.add_argument("--epochs", type=int, default=d["epochs"], help="passes over the training data")
    p.add_argument(
        "--lr", type=float, default=d["lr"], help="peak learning rate (AdamW, linear decay to 10%%)"
    )
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="examples per step")
    p.add_argument(
        "--max-length",
        type=int,
        default=d["max_length"],
        help="tokens per example (longer ones are truncated)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=d["lora_rank"],
        help="LoRA rank via peft (0 = full fine-tune); the LoRA layers are tracked",
    )
    p.add_argument(
        "--lora-targets",
        default=d["lora_targets"],
        help="peft target modules: 'all-linear' or comma-separated names",
    )
    p.add_argument(
        "--scope",
        default=t["scope"],
        help="tracked layers: 'all', 'last-block', or a regex on module names",
    )
    add_track_flags(p)
    add_sketch_flag(p, "factored (P_out g)(P_in a)^T or dense sparse-JL of the full gradient")
    add_dense_k_flag(p, "dense sketch size")
    p.add_argument(
        "--no-covariance",
        action="store_true",
        help="do not accumulate K-FAC statistics (identity preconditioning only)",
    )
    p.add_argument(
        "--no-track", action="store_true", help="the same loop with nothing recorded (baseline)"
    )
    p.add_argument(
        "--buffer-records",
        type=int,
        default=t["buffer_records"],
        help="records held on the device between host transfers",
    )
    p.add_argument(
        "--seed", type=int, default=d["seed"], help="seed of data order, model init and projections"
    )
    p.add_argument(
        "--threads", type=int, default=d["threads"], help="torch CPU threads (0 = torch default)"
    )
    p.add_argument("--device", default=d["device"], help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--max-steps",
        type=int,
        default=d["max_steps"],
        help="stop after this many steps (0 = all epochs)",
    )
    p.add_argument(
        "--tiny-layers", type=int, default=d["tiny_layers"], help="layers of the tiny model"
    )
    p.add_argument(
        "--tiny-width", type=int, default=d["tiny_width"], help="width of the tiny model"
    )
    p.add_argument(
        "--tiny-vocab",
        type=int,
        default=d["tiny_vocab"],
        help="tokenizer vocabulary of the tiny model",
    )
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default=d["parallel"],
        help="under torchrun: DistributedDataParallel, or FSDP2 fully_shard (docs/scaling.md)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d["checkpoint_every"],
        help="steps between checkpoints that --resume continues from (also on SIGTERM/Ctrl-C; "
        "0 = none; one-process and DDP runs, not FSDP)",
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
