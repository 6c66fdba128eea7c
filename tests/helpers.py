"""Shared test helpers: a tiny, fast training configuration on generated data."""

from __future__ import annotations

from pathlib import Path

from traceprop_engine.samples.data import generate_sample_data
from traceprop_engine.settings import TrackSettings, TrainSettings

FAST = dict(
    epochs=1, batch_size=8, max_length=48, tiny_layers=1, tiny_width=32, tiny_vocab=300, threads=1
)


def facts_data(root: Path) -> Path:
    generate_sample_data(root, seed=0, n_entities=8)
    return root


def fast_settings(data: Path, out: Path, **kw) -> TrainSettings:
    track = kw.pop("track", TrackSettings(k_in=4, k_out=4))
    return TrainSettings(
        data=str(data / "train"),
        eval_data=str(data / "eval"),
        out=str(out),
        track=track,
        **{**FAST, **kw},
    )
