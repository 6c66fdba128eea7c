"""``traceprop train``: the command, and the settings its flags make (the flags and the argv
that runs it: :mod:`traceprop_engine.training.command`)."""

from __future__ import annotations

import argparse
import os

from ..training.command import add_train_arguments, train_flags


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
    """The :class:`TrainSettings` of parsed ``traceprop train`` flags (each flag's ``dest`` is
    its field's name; ``--no-track`` and ``--no-covariance`` are the two spelled otherwise)."""
    from ..flags import from_namespace, given
    from ..settings import TrackSettings, TrainSettings

    if a.rank == 1 and "rank" in given(a) and "free_text_rank" not in given(a):
        a.free_text_rank = 0  # an explicit --rank 1 is kept on free text too (any other rank is)
    track = None if a.no_track else from_namespace(TrackSettings, a, covariance=not a.no_covariance)
    return from_namespace(TrainSettings, a, track=track)


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
        for dest, action in train_flags().items()
        if getattr(a, dest, action.default) != action.default
    ]
