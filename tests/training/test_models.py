"""Training from local Hugging Face directories: GPT-2 (Conv1D layers) and the packaged MiniLM
encoder for classification. No hub access: everything is saved and loaded from disk."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import facts_data, fast_settings, tiny_gpt2

from traceprop_engine import ConfigError, Store
from traceprop_engine.attribution.query import open_run
from traceprop_engine.run import read_manifest
from traceprop_engine.samples.data import generate_classification_data
from traceprop_engine.settings import TrackSettings, TrainSettings
from traceprop_engine.training.loop import train
from traceprop_engine.training.models import resolve_model_path, train_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("data"))


def test_local_gpt2_directory_trains_tracks_conv1d_and_queries(data, tmp_path):
    from traceprop_engine.training.data import load_examples

    examples, _ = load_examples(data / "train")
    tok = train_tokenizer([e.full_text() for e in examples], 300)
    model_dir = tmp_path / "gpt2-tiny"
    tiny_gpt2(len(tok), layers=1, heads=2, pad_token_id=tok.pad_token_id).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    run = train(
        fast_settings(
            data,
            tmp_path / "run",
            model=str(model_dir),
            track=TrackSettings(k_in=4, k_out=4, scope=r"^transformer\."),
        )
    )
    m = read_manifest(run)
    assert m["status"] == "completed" and m["model"]["source"] == str(model_dir.resolve())
    assert {layer["kind"] for layer in m["tracking"]["layers"]} == {"conv1d"}
    res = open_run(run).query("Q: What colour is the planet X?\nA:", " teal", top_k=3)
    assert res.proponents.height == 3


@pytest.mark.slow
def test_minilm_classification_run(tmp_path):
    generate_classification_data(tmp_path / "cls", seed=0, n=48)
    s = TrainSettings(
        data=str(tmp_path / "cls" / "train.jsonl"),
        eval_data=str(tmp_path / "cls" / "eval.jsonl"),
        out=str(tmp_path / "run"),
        model="minilm",
        task="classification",
        epochs=1,
        batch_size=8,
        max_length=32,
        max_steps=2,
        threads=1,
        track=TrackSettings(k_in=4, k_out=4, scope="classifier|layer\\.5\\.output"),
    )
    run = train(s)
    m = read_manifest(run)
    assert m["status"] == "completed" and m["model"]["labels"] == ["negative", "positive"]
    store = Store(run / "store.h5")
    assert store.n_records == 16 and any(layer.name == "classifier" for layer in store.layers)
    assert np.all(np.isfinite(store.sketches(0)))
    r = open_run(run)
    ev = int(r.eval_examples()["example_id"][0])
    assert r.query(eval_example=ev, top_k=2).proponents.height == 2
    with pytest.raises(Exception, match="needs a label"):
        r.query("great product", None)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="never downloads"):
        resolve_model_path("EleutherAI/pythia-70m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
