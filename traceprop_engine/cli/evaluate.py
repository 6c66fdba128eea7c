"""``traceprop eval lds`` and ``traceprop eval detect``: attribution-quality benchmarks."""

from __future__ import annotations

import argparse
import logging
import math

from ..flags import choices, field_defaults, int_list, plain


def _add_train_flags(p) -> None:
    p.add_argument(
        "--model", default="tiny", help="'tiny', 'minilm' or a local Hugging Face directory"
    )
    p.add_argument(
        "--epochs", type=int, default=6, help="passes over the training data (every run)"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--batch-size", type=int, default=8, help="examples per step")
    p.add_argument("--max-length", type=int, default=48, help="tokens per example")
    p.add_argument("--tiny-layers", type=int, default=1, help="layers of the tiny model")
    p.add_argument("--tiny-width", type=int, default=64, help="width of the tiny model")
    p.add_argument(
        "--tiny-vocab", type=int, default=512, help="tokenizer vocabulary of the tiny model"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of model init, data order, projections and subsets",
    )


# long: one add_argument per flag of eval lds and eval detect; a flat list reads best
def register(sub) -> None:
    """Add ``eval`` with its ``lds`` and ``detect`` subcommands to an argparse subparsers object."""
    from ..evaluate.lds_sets import SETS
    from ..settings import Task, TrackSettings, TrainSettings

    train_defaults = field_defaults(TrainSettings)
    ev = sub.add_parser(
        "eval", help="attribution-quality benchmarks (LDS, detection of planted problems)"
    )
    es = ev.add_subparsers(dest="eval_command", required=True)

    p = es.add_parser(
        "lds",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="linear datamodeling score: retrain on random subsets, correlate with predicted influence",
        description="Train the tracked run(s), retrain untracked on --subsets random subsets of --alpha of the "
        "training set, and report per method the mean Spearman correlation between the summed influence "
        "of a subset and the (sign-flipped) test loss of the model retrained on it, with a bootstrap 95%% "
        "interval. Resumable: rerun the same command to continue a killed evaluation.",
    )
    p.add_argument("--data", help="training data file or directory (or --set)")
    p.add_argument(
        "--set",
        choices=SETS,
        help="generate a named benchmark set of benchmarks/EVAL.md into OUT-data and use it "
        "as --data/--eval-data (docs8 also sets --task classification)",
    )
    p.add_argument(
        "--eval-data", help="eval data (otherwise --eval-fraction of --data is held out)"
    )
    p.add_argument("--eval-fraction", type=float, default=train_defaults["eval_fraction"])
    p.add_argument("--task", default=plain(train_defaults["task"]), choices=choices(Task))
    p.add_argument("--out", required=True, help="evaluation directory (EVAL_DIR)")
    _add_train_flags(p)
    p.add_argument("--scope", default="all", help="tracked layers of the factored runs")
    p.add_argument(
        "--lora-rank", type=int, default=0, help="peft LoRA rank of every run (0 = no LoRA)"
    )
    p.add_argument(
        "--lora-targets", default="all-linear", help="LoRA target modules (comma-separated)"
    )
    p.add_argument("--subsets", type=int, default=32, help="m, number of retrained subsets")
    p.add_argument(
        "--alpha", type=float, default=0.5, help="fraction of the training set per subset"
    )
    p.add_argument(
        "--k-sweep",
        type=int_list,
        default="4,8,16,32",
        help="k_in = k_out values, one tracked run each (comma-separated)",
    )
    p.add_argument("--main-k", type=int, default=8, help="k of the main table")
    p.add_argument("--no-dense", action="store_true", help="skip the dense-sketch run")
    p.add_argument("--dense-k", type=int, default=512)
    p.add_argument(
        "--no-exact",
        action="store_true",
        help="skip the exact run (k >= every layer width: unsketched per-example gradients)",
    )
    p.add_argument(
        "--retrain-seeds",
        type=int,
        default=1,
        help="models retrained per subset (other data orders); the target is their mean loss, "
        "and with 2 or more the split-half noise ceiling and the attainable LDS (Spearman-Brown) "
        "are reported",
    )
    p.add_argument("--no-bm25", action="store_true", help="skip the BM25 text baseline")
    p.add_argument(
        "--no-levers",
        action="store_true",
        help="skip the lever rows (other record weightings, per-layer normalisation)",
    )
    p.add_argument(
        "--no-final-grad",
        action="store_true",
        help="skip full-gradient dot/cosine on the final model (post-hoc, every trainable parameter)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="an extra tracked configuration, e.g. 'k64:k_in=64,k_out=64' (keys: TrackSettings "
        "fields; repeatable). Trained as runs/NAME and scored with every preconditioner; adding "
        "one to an existing --out reuses its subset losses, and a later call keeps the ones earlier "
        "calls added",
    )
    p.add_argument(
        "--workers", type=int, default=1, choices=[1, 2], help="parallel retrain processes"
    )
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--damping", type=float, default=None)
    p.add_argument(
        "--max-new-subsets",
        type=int,
        default=None,
        help="retrain at most this many subsets now (resume later)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start over when EVAL_DIR holds other settings"
    )
    p.set_defaults(func=_cmd_lds)

    d = es.add_parser(
        "detect",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="detect planted mislabels and a planted backdoor; AUROC and precision@k per method",
        description="Generate data with planted problems (mislabelled reviews framed as causal LM with a label "
        "completion; a rare trigger phrase paired with a fixed completion in a few examples), train a tracked "
        "tiny model per seed, and rank training examples by self-influence, influence on trigger queries, "
        "gradient norm, representation similarity and training loss.",
    )
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument(
        "--tasks", default="mislabel,backdoor", help="comma-separated: mislabel, backdoor"
    )
    d.add_argument(
        "--seeds",
        type=int_list,
        default="0,1,2",
        help="comma-separated seeds (one data set + run each)",
    )
    _add_train_flags(d)
    d.add_argument(
        "--k",
        type=int,
        default=TrackSettings().k_in,
        help="k_in = k_out of the tracked runs (the other tracking settings are the defaults)",
    )
    d.add_argument("--n-train", type=int, default=160, help="training examples per data set")
    d.add_argument("--n-planted", type=int, default=8, help="planted examples per data set")
    d.add_argument("--overwrite", action="store_true")
    d.set_defaults(func=_cmd_detect)


def _fmt(v) -> str:
    return "   nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.3f}"


def _resolve_lds_data(a) -> None:
    """``--set`` writes a named benchmark's data beside ``--out`` and points ``a`` at it."""
    from ..errors import ConfigError

    if a.set:
        from ..evaluate.lds_sets import CLASSIFICATION_SETS, make_set

        if a.data or a.eval_data:
            raise ConfigError("--set generates the data: pass either --set or --data/--eval-data")
        a.data, a.eval_data = make_set(a.set, a.out, a.seed)
        if a.set in CLASSIFICATION_SETS:
            a.task = "classification"
    elif not a.data:
        raise ConfigError("pass --data (and --eval-data), or a named benchmark set with --set")


def _cmd_lds(a) -> int:
    from ..evaluate.lds import run_lds
    from ..evaluate.lds_settings import LdsSettings, parse_config_spec
    from ..settings import TrackSettings, TrainSettings

    logging.getLogger("traceprop_engine").setLevel(logging.INFO)
    _resolve_lds_data(a)
    t = TrainSettings(
        data=a.data,
        eval_data=a.eval_data,
        eval_fraction=a.eval_fraction,
        out="-",
        model=a.model,
        task=a.task,
        epochs=a.epochs,
        lr=a.lr,
        batch_size=a.batch_size,
        max_length=a.max_length,
        seed=a.seed,
        tiny_layers=a.tiny_layers,
        tiny_width=a.tiny_width,
        tiny_vocab=a.tiny_vocab,
        threads=1,
        lora_rank=a.lora_rank,
        lora_targets=a.lora_targets,
        track=TrackSettings(scope=a.scope),
    )
    s = LdsSettings(
        train=t,
        out=a.out,
        n_subsets=a.subsets,
        alpha=a.alpha,
        seed=a.seed,
        k_values=a.k_sweep,
        main_k=a.main_k,
        dense=not a.no_dense,
        dense_k=a.dense_k,
        workers=a.workers,
        bootstrap=a.bootstrap,
        damping=a.damping,
        exact=not a.no_exact,
        bm25=not a.no_bm25,
        levers=not a.no_levers,
        final_grad=not a.no_final_grad,
        configs=tuple(parse_config_spec(c) for c in a.config),
        retrain_seeds=a.retrain_seeds,
    )
    r = run_lds(s, overwrite=a.overwrite, max_new_subsets=a.max_new_subsets)
    if not r.complete:
        print(
            f"stopped: {len(r.skipped) + len(r.retrained)}/{s.n_subsets} subsets done; rerun the command to resume"
        )
        return 130
    print(
        "LDS (mean Spearman over eval examples, 95% bootstrap CI); positive = influence predicts retrained loss"
    )
    for row in r.rows:
        note = f"  ({row['error']})" if row.get("error") else ""
        print(
            f"  {row['method']:<36} k={row['k']!s:<4} {_fmt(row['lds'])}  [{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}]{note}"
        )
    if r.noise_ceiling:
        nc = r.noise_ceiling
        print(
            f"  split-half noise ceiling (Spearman between the even and the odd retrain seeds' "
            f"mean losses, {nc['halves'][0]} vs {nc['halves'][1]}): "
            f"{nc['split_half_spearman']:.3f} [{nc['ci'][0]:.3f}, {nc['ci'][1]:.3f}]"
        )
        if "attainable_lds" in nc:  # results written before stop 49 lack it
            print(
                "  attainable LDS (Spearman–Brown from the split half: the best any method can "
                f"expect against these retrains' mean loss): {nc['attainable_lds']:.3f}"
            )
    _print_goals(r.goals)
    print(
        f"results: {r.out / 'results.csv'}, {r.out / 'results.json'}, figure {r.out / 'figure.json'}"
    )
    return 0


def _print_goals(goals: list[dict]) -> None:
    """The default against issue 26's bars, paired per eval example (``LdsResult.goals``, the
    same as results.json's 'goals')."""
    if goals:
        print("the default against each bar, paired per eval example (mean difference, 95% CI):")
    for g in goals:
        bar = g["ref"] + (f" + {g['plus']:g}" if g["plus"] else "")
        lo, hi = g["ci"]
        print(f"  >= {bar:<30} {_fmt(g['delta'])}  [{_fmt(lo)}, {_fmt(hi)}]  {g['verdict']}")


def _cmd_detect(a) -> int:
    from ..evaluate.detection import DetectSettings, run_detection

    logging.getLogger("traceprop_engine").setLevel(logging.INFO)
    s = DetectSettings(
        out=a.out,
        tasks=tuple(t.strip() for t in a.tasks.split(",") if t.strip()),
        seeds=a.seeds,
        model=a.model,
        epochs=a.epochs,
        lr=a.lr,
        batch_size=a.batch_size,
        max_length=a.max_length,
        tiny_layers=a.tiny_layers,
        tiny_width=a.tiny_width,
        tiny_vocab=a.tiny_vocab,
        k=a.k,
        n_train=a.n_train,
        n_planted=a.n_planted,
    )
    summary = run_detection(s, overwrite=a.overwrite)
    print("detection: AUROC and precision@k (k = number planted), mean ± sd over seeds")
    for row in summary:
        print(
            f"  {row['task']:<9} {row['method']:<40} AUROC {row['auroc_mean']:.3f} ± {row['auroc_sd']:.3f}   "
            f"P@k {row['p_at_k_mean']:.3f} ± {row['p_at_k_sd']:.3f}"
        )
    print(f"results: {a.out}/detection.csv, {a.out}/detection.json")
    return 0
