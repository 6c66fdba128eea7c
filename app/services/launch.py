"""The Launch page's data: a tracked fine-tune as the form describes it, and the measured quality
of tracking configurations."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from traceprop_engine.errors import ConfigError
from traceprop_engine.settings import TrackSettings, TrainSettings

_TRACK_DEFAULTS = TrackSettings()


@dataclass(frozen=True)
class LaunchSpec:
    """A tracked fine-tune, as the Launch form describes it."""

    data: Path
    eval_data: Path | None = None
    model: str = "tiny"
    task: str = "causal-lm"
    lora_rank: int = 0
    epochs: int = 1
    lr: float = 3e-3
    batch_size: int = 8
    max_length: int = 64
    scope: str = "all"
    k_in: int = _TRACK_DEFAULTS.k_in
    k_out: int = _TRACK_DEFAULTS.k_out
    rank: int = _TRACK_DEFAULTS.rank
    sketch: str = "factored"
    covariance: bool = True
    seed: int = 0
    tiny_layers: int = 2
    tiny_width: int = 64
    extra: tuple[str, ...] = field(default_factory=tuple)

    def errors(self) -> list[str]:
        """Every problem with the spec, each a sentence saying how to fix it (empty: valid).

        The bounds of the numbers are those of :class:`TrainSettings` and :class:`TrackSettings`
        (their ConfigError messages, as ``traceprop train`` would report them); this adds what
        only the app knows: the data must exist and the packaged models train one task each.
        """
        e = []
        if not Path(self.data).exists():
            e.append(f"the training data {self.data} does not exist")
        if self.eval_data is not None and not Path(self.eval_data).exists():
            e.append(f"the eval data {self.eval_data} does not exist")
        if self.model == "minilm" and self.task != "classification":
            e.append(
                "the minilm encoder only trains the classification task: pick task 'classification'"
            )
        if self.model == "tiny" and self.task == "classification":
            e.append(
                "the tiny model is a causal LM: use minilm (or a local classifier directory) for classification"
            )
        for build in (self._track_settings, self._train_settings):
            try:
                build()
            except ConfigError as ex:
                e.append(str(ex))
        return e

    def _track_settings(self) -> TrackSettings:
        return TrackSettings(
            scope=self.scope,
            k_in=self.k_in,
            k_out=self.k_out,
            rank=self.rank,
            sketch=self.sketch,
            covariance=self.covariance,
            seed=self.seed,  # traceprop train seeds the projections with --seed
        )

    def _train_settings(self, out: str | Path = "", track: TrackSettings | None = None):
        # out is chosen at start (new_run_dir); the tracking settings are checked on their own
        tiny = {"tiny_layers": self.tiny_layers, "tiny_width": self.tiny_width}
        return TrainSettings(
            data=str(self.data),
            out=str(out),
            model=self.model,
            task=self.task,
            eval_data=None if self.eval_data is None else str(self.eval_data),
            epochs=self.epochs,
            lr=self.lr,
            batch_size=self.batch_size,
            max_length=self.max_length,
            lora_rank=self.lora_rank,
            seed=self.seed,
            track=track,
            **(tiny if self.model == "tiny" else {}),
        )

    def command(self, run_dir: Path) -> list[str]:
        """The ``traceprop train`` command line of this spec (written from its settings)."""
        from traceprop_engine.training.command import train_argv

        settings = self._train_settings(run_dir, self._track_settings())
        return train_argv(settings) + list(self.extra)


def measured_configurations() -> pl.DataFrame:
    """The measured quality, overhead and bytes of the tracking configurations (empty when the
    table is absent), with the Pareto front marked: what the Launch page shows before a run."""
    from traceprop_engine.evaluate.pareto import front, load_measured

    try:
        sets, rows = load_measured()
    except ConfigError:
        return pl.DataFrame()
    on_front = {r.name for r in front(rows)}
    return pl.DataFrame(
        [
            {
                "configuration": r.name + (" (default)" if r.default else ""),
                **{f"LDS {d}": round(r.lds[d], 3) for d in sets},
                "mean LDS": round(r.lds_mean, 3),
                "overhead %": round(r.overhead_pct, 1),
                "bytes / example": int(r.bytes_per_example),
                "on the front": r.name in on_front,
            }
            for r in sorted(rows, key=lambda r: -r.lds_mean)
        ]
    )


def assess_configuration(spec: LaunchSpec) -> str:
    """One sentence on the measured quality of a Launch configuration (or that it was not
    measured), saying when another measured configuration dominates it."""
    from traceprop_engine.evaluate.pareto import assess

    track = {**TrackSettings().to_dict(), "k_in": spec.k_in, "k_out": spec.k_out}
    track["rank"] = spec.rank
    hit = assess(track)
    if hit is None:
        return (
            f"k_in={spec.k_in}, k_out={spec.k_out}, rank={spec.rank}: not measured "
            "(benchmarks/EVAL.md lists the measured configurations)"
        )
    m = hit["measured"]
    text = (
        f"{m.name}: mean LDS {m.lds_mean:.2f}, overhead {m.overhead_pct:+.1f} %, "
        f"{m.bytes_per_example:.0f} bytes per example (measured, benchmarks/EVAL.md)"
    )
    if hit["dominated_by"]:
        text += ". Dominated by: " + ", ".join(hit["dominated_by"])
    return text


DATA_LABELS = {
    "facts": "the bundled generated facts set",
    "classification": "the bundled generated classification set",
    "upload": "the uploaded files",
    "path": "the data path",
}


def choose_data(kind: str, uploaded: list[str], path_typed: str = "") -> tuple[str, str]:
    """Which data the Launch form trains on, and a sentence saying so (shown when it starts).

    Uploaded files are never ignored: with a bundled set chosen they are used instead (a user who
    uploads files means them) and the sentence says so.

    Raises:
        ConfigError: files were uploaded and a data path was chosen too (say which one).
    """
    if uploaded and kind == "path":
        raise ConfigError(
            f"{len(uploaded)} file(s) uploaded and 'A path' chosen with {path_typed!r}: "
            "choose 'Upload files' to train on the uploads, or remove them to use the path"
        )
    if uploaded and kind != "upload":
        names = ", ".join(uploaded[:3]) + (", …" if len(uploaded) > 3 else "")
        return "upload", (
            f"Training on the {len(uploaded)} uploaded file(s) ({names}), "
            f"not on {DATA_LABELS.get(kind, kind)}: uploaded files are always used"
        )
    if kind == "upload":
        return kind, f"Training on the {len(uploaded)} uploaded file(s)"
    return kind, f"Training on {DATA_LABELS.get(kind, kind)}" + (
        f" {path_typed!r}" if kind == "path" else ""
    )


def check_data(data: Path, task: str, *, what: str = "training data") -> int:
    """Read the training (or eval) data the way the job will, before the job starts, so a
    malformed file is refused on the form (naming its file and line) instead of ~10 s into a
    job. Returns the number of examples.

    Raises:
        DataError: the engine's reading error (file, line and what is wrong), prefixed by
            ``what``.
    """
    from traceprop_engine.errors import DataError
    from traceprop_engine.training.data import load_examples

    try:
        examples, _ = load_examples(data, task=task)
    except DataError as e:
        raise DataError(f"{what}: {e}") from None
    return len(examples)


def help_for(name: str) -> str:
    """The Launch form's help for a setting: the field's own help text (``TrainSettings``
    first, then ``TrackSettings``; the one description the CLI's ``--help`` shows too)."""
    from traceprop_engine.settings import field_help

    for cls in (TrainSettings, TrackSettings):
        if name in cls.__dataclass_fields__:
            return field_help(cls, name)
    raise KeyError(name)
