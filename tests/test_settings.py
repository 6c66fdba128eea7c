"""settings.py on its own: every bound of TrackSettings and TrainSettings raises a ConfigError
that names the setting, the value and what is allowed; both round-trip through to_dict and JSON
(the run manifest keeps them that way)."""

from __future__ import annotations

import json
import math

import pytest

from traceprop_engine.errors import ConfigError
from traceprop_engine.settings import (
    FactorDtype,
    FactorSpace,
    HalfStepStart,
    IndexSettings,
    SketchKind,
    Task,
    TrackSettings,
    TrainSettings,
)

TRAIN = {"data": "d", "out": "o"}


# -- TrackSettings -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field",
    ["k_in", "k_out", "dense_k", "dense_nnz", "buffer_records", "covariance_stride"],
)
@pytest.mark.parametrize("value", [0, -3, 2.5, "8"])
def test_positive_integers(field, value):
    with pytest.raises(ConfigError) as e:
        TrackSettings(**{field: value})
    assert str(e.value) == f"{field} must be a positive integer, got {value!r}"
    assert getattr(TrackSettings(**{field: 1}), field) == 1  # the bound itself is allowed


@pytest.mark.parametrize(
    "field, what",
    [
        ("rank", "0 = store full sketches"),
        ("power_iters", "0 = half a step"),
        ("covariance_tokens", "0 = every token"),
    ],
)
@pytest.mark.parametrize("value", [-1, 1.0, True, "1"])
def test_non_negative_integers(field, what, value):
    with pytest.raises(ConfigError) as e:
        TrackSettings(**{field: value})
    assert str(e.value) == f"{field} must be a non-negative integer ({what}), got {value!r}"
    assert getattr(TrackSettings(**{field: 0}), field) == 0


@pytest.mark.parametrize(
    "field, enum",
    [
        ("sketch", SketchKind),
        ("factor_dtype", FactorDtype),
        ("factor_space", FactorSpace),
        ("half_step_start", HalfStepStart),
    ],
)
def test_choices_list_what_is_allowed(field, enum):
    with pytest.raises(ConfigError) as e:
        TrackSettings(**{field: "nope"})
    allowed = ", ".join(repr(x.value) for x in enum)
    assert str(e.value) == f"{field} must be one of {allowed}, got 'nope'"
    for x in enum:  # the values and the members are both accepted, stored as the member
        assert getattr(TrackSettings(**{field: x.value}), field) is x
        assert getattr(TrackSettings(**{field: x}), field) is x


def test_scope_is_all_last_block_or_a_regular_expression():
    with pytest.raises(ConfigError, match=r"scope must be 'all', 'last-block' or a valid") as e:
        TrackSettings(scope="layers.(0")
    assert "'layers.(0' does not compile" in str(e.value)
    for scope in ("all", "last-block", r"layers\.[01]\.mlp"):
        assert TrackSettings(scope=scope).scope == scope


def test_track_settings_round_trip_through_to_dict_and_json():
    s = TrackSettings(
        scope=r"^lin$",
        k_in=7,
        k_out=9,
        sketch="dense",
        dense_k=64,
        dense_nnz=3,
        covariance=False,
        rank=2,
        factor_dtype="bfloat16",
        factor_space="sketch",
        power_iters=3,
        covariance_stride=4,
        covariance_tokens=100,
        seed=11,
        buffer_records=16,
    )
    d = s.to_dict()
    assert (
        d["sketch"] == "dense" and d["factor_dtype"] == "bfloat16" and d["factor_space"] == "sketch"
    )
    assert TrackSettings(**json.loads(json.dumps(d))) == s
    assert TrackSettings(**TrackSettings().to_dict()) == TrackSettings()


# -- TrainSettings -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, bad, good, bound",
    [
        ("epochs", 0, 1, "epochs/batch_size >= 1"),
        ("batch_size", 0, 1, "epochs/batch_size >= 1"),
        ("max_length", 1, 2, "max_length >= 2"),
        ("lora_rank", -1, 0, "lora_rank >= 0"),
        ("lr", -1e-3, 0.0, "lr a finite number >= 0"),
        ("lr", math.nan, 1e-3, "lr a finite number >= 0"),
        ("lr", math.inf, 1e-3, "lr a finite number >= 0"),
        ("eval_fraction", -0.1, 0.0, "0 <= eval_fraction < 1"),
        ("eval_fraction", 1.0, 0.99, "0 <= eval_fraction < 1"),
        ("tiny_layers", 0, 1, "tiny_layers >= 1"),
        ("tiny_width", 4, 8, "tiny_width >= 8 and a multiple of 4"),
        ("tiny_width", 30, 32, "tiny_width >= 8 and a multiple of 4"),
        ("tiny_vocab", 299, 300, "tiny_vocab >= 300"),
        ("max_steps", -1, 0, "max_steps >= 0"),
    ],
)
def test_each_training_bound_names_the_setting_and_the_rule(field, bad, good, bound):
    with pytest.raises(ConfigError) as e:
        TrainSettings(**TRAIN, **{field: bad})
    msg = str(e.value)
    assert msg.startswith(f"invalid training settings: {field}={bad!r} (")
    assert bound in msg
    assert getattr(TrainSettings(**TRAIN, **{field: good}), field) == good


def test_every_bad_training_setting_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        TrainSettings(**TRAIN, epochs=0, max_steps=-2, tiny_vocab=10)
    assert str(e.value).startswith(
        "invalid training settings: epochs=0, tiny_vocab=10, max_steps=-2 ("
    )


def test_task_choices():
    with pytest.raises(ConfigError) as e:
        TrainSettings(**TRAIN, task="regression")
    assert str(e.value) == "task must be one of 'causal-lm', 'classification', got 'regression'"
    assert TrainSettings(**TRAIN, task="classification").task is Task.CLASSIFICATION


def _train_from_dict(d: dict) -> TrainSettings:
    """A TrainSettings from its to_dict() (the tracking section is a nested dict or None)."""
    track = None if d["track"] is None else TrackSettings(**d["track"])
    return TrainSettings(**{**d, "track": track})


@pytest.mark.parametrize("track", [TrackSettings(k_in=8, k_out=4, sketch="dense"), None])
def test_train_settings_round_trip_through_to_dict_and_json(track):
    s = TrainSettings(
        data="data/train",
        out="runs/r",
        model="EleutherAI/pythia-14m",
        task="classification",
        eval_data="data/eval",
        eval_fraction=0.2,
        epochs=3,
        lr=1e-4,
        weight_decay=0.01,
        warmup_steps=5,
        batch_size=4,
        max_length=64,
        lora_rank=8,
        lora_targets="query_key_value",
        seed=3,
        track=track,
        tiny_layers=2,
        tiny_width=64,
        tiny_vocab=512,
        threads=2,
        device="cpu",
        max_steps=10,
    )
    d = json.loads(json.dumps(s.to_dict()))
    assert d["task"] == "classification"
    assert d["track"] == (None if track is None else track.to_dict())
    assert _train_from_dict(d) == s
    default = TrainSettings(**TRAIN)
    assert _train_from_dict(default.to_dict()) == default
    assert default.track == TrackSettings()  # tracking is on by default


@pytest.mark.parametrize("bad", [-1, 2.5, True, "256"])
def test_index_dims_must_be_a_non_negative_integer(bad):
    with pytest.raises(ConfigError, match="index_dims"):
        IndexSettings(index_dims=bad)


def test_non_default_index_shapes_get_their_own_index_names():
    names = {
        IndexSettings().name,
        IndexSettings(index_side=8).name,
        IndexSettings(index_dims=0).name,
        IndexSettings(index_side=8, index_dims=0).name,
    }
    assert len(names) == 4 and IndexSettings().name == "kfac-cos"


@pytest.mark.parametrize(
    "d_in,d_out,want",
    [
        (64, 512, (64, 188)),  # a narrow model's LM head: the input side's spare rows go out
        (512, 64, (188, 64)),
        (64, 64, (64, 64)),  # both sides narrow: exact, nothing to share
        (100, 150, (100, 150)),  # 26 spare rows, the output side takes 24 of them
        (256, 1024, (126, 126)),  # wide on both sides: as without sharing
    ],
)
def test_share_k_gives_a_clamped_sides_rows_to_the_other(d_in, d_out, want):
    assert TrackSettings().layer_k(d_in, d_out) == want
    assert TrackSettings(share_k=False).layer_k(d_in, d_out) == (min(126, d_in), min(126, d_out))
    # full sketches cost k_out·k_in bytes, so nothing is shared there
    assert TrackSettings(rank=0).layer_k(d_in, d_out) == (min(126, d_in), min(126, d_out))


def test_share_k_must_be_a_bool_and_old_records_read_as_unshared():
    with pytest.raises(ConfigError, match="share_k"):
        TrackSettings(share_k=1)
    old = TrackSettings(k_in=8, k_out=8).to_dict()
    del old["share_k"], old["projection"]  # a run.json written before the settings existed
    assert TrackSettings.from_dict({**old, "unknown": 1}) == TrackSettings(
        k_in=8, k_out=8, share_k=False, projection="gaussian"
    )
    with pytest.raises(ConfigError, match="projection"):
        TrackSettings(projection="hadamard")
    assert TrackSettings.from_dict(TrackSettings().to_dict()) == TrackSettings()


def test_runs_recorded_before_covariance_tokens_read_as_every_token():
    old = TrackSettings().to_dict()
    del old["covariance_tokens"]  # a run.json written before the setting existed
    assert TrackSettings.from_dict(old) == TrackSettings(covariance_tokens=0)


def test_share_k_changes_nothing_on_the_default_tiny_model():
    """The overhead and bytes of ``traceprop bench overhead`` (default tiny model) are the same
    with and without sharing: every layer is at least 126 wide on both sides."""
    from transformers import GPTNeoXForCausalLM

    from traceprop_engine.capture.layers import build_layers
    from traceprop_engine.training.models import tiny_config

    t = TrainSettings(data="-", out="-")
    model = GPTNeoXForCausalLM(
        tiny_config(vocab_size=t.tiny_vocab, width=t.tiny_width, layers=t.tiny_layers)
    )
    shared = [(x.k_in, x.k_out) for x in build_layers(model, TrackSettings())]
    assert shared == [(x.k_in, x.k_out) for x in build_layers(model, TrackSettings(share_k=False))]
    assert set(shared) == {(126, 126)}


def test_every_settings_field_has_one_help_text_and_the_docstring_lists_it():
    """Issue 28 item 3: each knob is described once, in its field (the CLI and the app read it
    from there); the class docstring's Args section is made from the same texts."""
    import dataclasses

    from traceprop_engine.settings import IndexSettings, TrackSettings, TrainSettings, field_help

    for cls in (TrackSettings, TrainSettings, IndexSettings):
        for f in dataclasses.fields(cls):
            text = field_help(cls, f.name)
            assert len(text) > 10 and not text.endswith("."), (cls.__name__, f.name)
            assert f"        {f.name}: {text}" in cls.__doc__


def test_the_cli_shows_each_settings_field_s_own_help():
    """Issue 28 item 3: ``traceprop train``/``index`` flags named like a settings field show
    that field's help text (written once, in the dataclass)."""
    import argparse

    from traceprop_engine.cli.main import build_parser
    from traceprop_engine.settings import IndexSettings, TrackSettings, TrainSettings, field_help

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for command, classes in (
        ("train", (TrainSettings, TrackSettings)),
        ("index", (IndexSettings,)),
    ):
        for action in sub.choices[command]._actions:
            dest = {"index_kind": "kind"}.get(action.dest, action.dest)
            cls = next((c for c in classes if dest in c.__dataclass_fields__), None)
            if cls is None or action.dest in ("no_covariance",):
                continue
            assert field_help(cls, dest) in action.help.replace("%%", "%"), (command, dest)
            checked += 1
    assert checked >= 30


@pytest.mark.parametrize(
    "settings",
    [
        TrainSettings(data="d", out="o"),
        TrainSettings(
            data="d",
            out="o",
            lr=0.01,
            epochs=3,
            seed=7,
            tiny_layers=1,
            eval_data="e",
            track=TrackSettings(k_in=8, rank=0, covariance=False, seed=7, projection="gaussian"),
        ),
        TrainSettings(data="d", out="o", track=None, model="minilm", task="classification"),
        # the two store_false switches (--no-share-k, --no-vocab-rows) are written when False
        TrainSettings(data="d", out="o", track=TrackSettings(share_k=False, vocab_rows=False)),
        # the records' rank: another rank, or the free-text rank off or another
        TrainSettings(data="d", out="o", track=TrackSettings(rank=4)),
        TrainSettings(data="d", out="o", track=TrackSettings(free_text_rank=0)),
        TrainSettings(data="d", out="o", track=TrackSettings(free_text_rank=8)),
    ],
)
def test_train_settings_survive_the_command_line(settings):
    """Issue 28 item 3: ``traceprop train``'s settings are read from its flags by field name (no
    field-by-field copy): the argv written for settings parses back to the same settings."""
    from traceprop_engine.cli.main import build_parser
    from traceprop_engine.cli.train import train_settings
    from traceprop_engine.training.command import train_argv

    argv = train_argv(settings)
    args = build_parser().parse_args(argv[argv.index("train") :])
    assert train_settings(args) == settings


@pytest.mark.parametrize(
    "flags, rank, free_text_rank, on_free_text",
    [
        ([], 1, 16, 16),  # the default: the data decide
        (["--rank", "1"], 1, 0, 1),  # asked for: rank 1 on free text too
        (["--rank", "1", "--free-text-rank", "8"], 1, 8, 8),
        (["--rank", "4"], 4, 16, 4),  # the free-text rank applies to rank 1 only
        (["--free-text-rank", "0"], 1, 0, 1),
    ],
)
def test_an_explicit_rank_1_is_kept_on_free_text(flags, rank, free_text_rank, on_free_text):
    """``--rank 1`` given on the command line keeps rank-1 records where the examples are free
    text (the default value of the field, so the settings alone cannot tell it apart)."""
    from traceprop_engine.capture.free_text import rank_for
    from traceprop_engine.cli.main import build_parser
    from traceprop_engine.cli.train import train_settings

    args = build_parser().parse_args(["train", "--data", "d", "--out", "o", *flags])
    track = train_settings(args).track
    assert (track.rank, track.free_text_rank) == (rank, free_text_rank)
    assert rank_for(track, median_targets=40).rank == on_free_text
