"""``traceprop train``: its flags, the settings they make, and the argv that runs it.

:func:`train_argv` is the one place that writes a ``traceprop train`` command line (the app's
Launch page, the RSS benchmark and the tests run training in a child process through it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from enum import Enum

from .flags import (
    add_dense_k_flag,
    add_sketch_flag,
    add_track_flags,
    choices,
    field_defaults,
    plain,
)


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


def add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="run a tracked fine-tune and write a run directory (store.h5, model/, run.json)",
        description="Fine-tune a model while recording per-example gradient sketches and K-FAC "
        "covariance into RUN/store.h5. Data: a .jsonl/.csv/.parquet/.txt file or a directory of them "
        "(fields prompt+completion, text, or text+label). Progress: RUN/progress.jsonl and a bar on stderr.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_train_arguments(p)
    p.add_argument(
        "--resume",
        metavar="RUN",
        help="continue the killed, failed or cancelled run RUN from its last checkpoint with "
        "its own settings (no other flags); launch it as the run was launched: a DDP run under "
        "'torchrun --nproc-per-node N' with its N (FSDP runs cannot be resumed yet)",
    )
    p.set_defaults(func=_cmd_train, parser=p)


def train_settings(a):
    """The :class:`TrainSettings` of parsed ``traceprop train`` flags."""
    from ..settings import TrackSettings, TrainSettings

    track = None
    if not a.no_track:
        track = TrackSettings(
            scope=a.scope,
            k_in=a.k_in,
            k_out=a.k_out,
            share_k=a.share_k,
            projection=a.projection,
            rank=a.rank,
            factor_dtype=a.factor_dtype,
            factor_space=a.factor_space,
            power_iters=a.power_iters,
            covariance_stride=a.covariance_stride,
            covariance_tokens=a.covariance_tokens,
            sketch=a.sketch,
            dense_k=a.dense_k,
            covariance=not a.no_covariance,
            seed=a.seed,
            buffer_records=a.buffer_records,
        )
    return TrainSettings(
        data=a.data,
        out=a.out,
        model=a.model,
        task=a.task,
        eval_data=a.eval_data,
        eval_fraction=a.eval_fraction,
        epochs=a.epochs,
        lr=a.lr,
        batch_size=a.batch_size,
        max_length=a.max_length,
        lora_rank=a.lora_rank,
        lora_targets=a.lora_targets,
        seed=a.seed,
        track=track,
        threads=a.threads,
        device=a.device,
        max_steps=a.max_steps,
        tiny_layers=a.tiny_layers,
        tiny_width=a.tiny_width,
        tiny_vocab=a.tiny_vocab,
        parallel=a.parallel,
        checkpoint_every=a.checkpoint_every,
    )


def _cmd_train(a) -> int:
    from ..run import RunManifest
    from ..training.loop import resume, train

    if a.resume is not None:
        given = _flags_given(a)
        if given:
            a.parser.error(
                f"--resume continues RUN with the settings in RUN/run.json; drop {', '.join(given)}"
            )
        run_dir = resume(a.resume)
    else:
        missing = [f"--{n}" for n in ("data", "out") if getattr(a, n) is None]
        if missing:
            a.parser.error(f"the following arguments are required: {', '.join(missing)}")
        run_dir = train(train_settings(a), overwrite=a.overwrite)
    m = RunManifest.load(run_dir)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if m.completed else 130
    print(
        f"{m.status}: {run_dir}  ({m.store.n_records or 0} records, eval loss {m.metrics.get('eval_loss')})"
    )
    return 0 if m.completed else 130


def _flags_given(a) -> list[str]:
    """The ``traceprop train`` flags whose value differs from their default (given by the user)."""
    return [
        action.option_strings[0]
        for dest, action in _train_flags().items()
        if getattr(a, dest, action.default) != action.default
    ]


# -- the argv of a `traceprop train` child process -------------------------------------------------
def _train_flags() -> dict[str, argparse.Action]:
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

    flags = _train_flags()
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
    flags = _train_flags()
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
