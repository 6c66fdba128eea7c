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
        for dest, action in train_flags().items()
        if getattr(a, dest, action.default) != action.default
    ]
