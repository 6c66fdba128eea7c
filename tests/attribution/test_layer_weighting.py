"""``IndexSettings.weighting``: what the Tracker says a run trained (``model_origin``), how
``auto`` resolves from it (fisher for a pretrained causal LM fine-tuned in full, recorded
otherwise), and that a resolved fisher index is its own index with its own scores."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from helpers import tiny_neox, train_own_loop
from peft import LoraConfig, get_peft_model
from transformers import GPTNeoXForCausalLM

from traceprop_engine import TrackSettings
from traceprop_engine import constants as C
from traceprop_engine.attribution.overview import resolve_settings
from traceprop_engine.attribution.query import open_run
from traceprop_engine.capture.layers import model_origin
from traceprop_engine.cli.main import main
from traceprop_engine.errors import ConfigError
from traceprop_engine.settings import IndexSettings, LayerWeighting

ROWS = [torch.randint(1, 97, (6,), generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _saved_and_loaded(tmp_path) -> GPTNeoXForCausalLM:
    tiny_neox().save_pretrained(tmp_path / "pretrained")
    return GPTNeoXForCausalLM.from_pretrained(tmp_path / "pretrained").train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """A run from scratch and one of the same architecture loaded from saved weights."""
    tmp = tmp_path_factory.mktemp("weighting")
    settings = TrackSettings(k_in=8, k_out=8, covariance_stride=1)
    torch.manual_seed(0)
    scratch = train_own_loop(tiny_neox().train(), tmp / "scratch", settings, ROWS)
    full = train_own_loop(_saved_and_loaded(tmp), tmp / "full", settings, ROWS)
    return {"scratch": scratch, "full": full}


def test_model_origin_tells_scratch_pretrained_and_adapter_apart(tmp_path):
    assert model_origin(tiny_neox()) == C.ORIGIN_SCRATCH
    loaded = _saved_and_loaded(tmp_path)
    assert model_origin(loaded) == C.ORIGIN_PRETRAINED_FULL
    lora = get_peft_model(loaded, LoraConfig(r=2, target_modules=["query_key_value"]))
    assert model_origin(lora) == C.ORIGIN_ADAPTER


def test_the_lds_harness_initialisation_trains_a_model_from_scratch(tmp_path):
    """``traceprop eval lds`` saves the tiny model's shared initialisation and trains every run
    from that directory: those runs train a model from scratch (``model_origin`` scratch, so
    ``auto`` picks what a user's ``--model tiny`` run gets), not a pretrained one. A folder saved
    before the marker existed gets it on its next use."""
    import json
    import types

    from traceprop_engine.evaluate.lds import _base_model
    from traceprop_engine.training.models import UNTRAINED_KEY, build_model, save_model

    data = tmp_path / "train.txt"
    data.write_text("\n".join(f"fact {i} is the number {i * 7}" for i in range(12)) + "\n")
    train = types.SimpleNamespace(
        model="tiny",
        task=types.SimpleNamespace(value="causal-lm"),
        data=str(data),
        eval_data=str(data),
        eval_fraction=0.1,
        seed=0,
        tiny_vocab=300,
        tiny_width=16,
        tiny_layers=1,
        max_length=16,
    )
    base = _base_model(types.SimpleNamespace(train=train), tmp_path / "ev")
    info = json.loads((tmp_path / "ev" / "base_model" / "traceprop_model.json").read_text())
    assert info[UNTRAINED_KEY] is True
    assert model_origin(build_model(base, "causal-lm", []).model) == C.ORIGIN_SCRATCH
    # a model saved after training is a pretrained one when trained again
    trained = build_model(base, "causal-lm", [])
    save_model(trained, tmp_path / "trained")
    assert model_origin(build_model(str(tmp_path / "trained"), "causal-lm", []).model) == (
        C.ORIGIN_PRETRAINED_FULL
    )
    # an evaluation folder from before the marker: upgraded in place
    info.pop(UNTRAINED_KEY)
    (tmp_path / "ev" / "base_model" / "traceprop_model.json").write_text(json.dumps(info))
    assert model_origin(build_model(base, "causal-lm", []).model) == C.ORIGIN_PRETRAINED_FULL
    base = _base_model(types.SimpleNamespace(train=train), tmp_path / "ev")
    assert model_origin(build_model(base, "causal-lm", []).model) == C.ORIGIN_SCRATCH


def test_auto_resolves_per_run_and_a_fisher_index_is_its_own(runs, capsys):
    scratch, full = open_run(runs["scratch"]), open_run(runs["full"])
    assert scratch.store.model_origin == C.ORIGIN_SCRATCH
    assert full.store.model_origin == C.ORIGIN_PRETRAINED_FULL
    assert scratch.settings().weighting is LayerWeighting.RECORDED
    assert scratch.settings().name == "kfac-cos"  # the default index of a run from scratch
    assert full.settings().weighting is LayerWeighting.FISHER
    assert full.settings().name == "kfac-cos-fisher"
    # a pretrained classifier fine-tuned in full stays recorded (fisher lowered LDS there)
    classifier = resolve_settings(full.store, None, "classification")
    assert classifier.weighting is LayerWeighting.RECORDED
    # identity whitens nothing: always recorded, whatever was asked
    ident = IndexSettings(preconditioner="identity", weighting="fisher")
    assert full.settings(ident).weighting is LayerWeighting.RECORDED
    query = ROWS[1].tolist()
    default = full.scores(input_ids=query)
    fisher = full.scores(input_ids=query, settings=IndexSettings(weighting="fisher"))
    recorded = full.scores(input_ids=query, settings=IndexSettings(weighting="recorded"))
    np.testing.assert_array_equal(default, fisher)  # the same index, the same code path
    assert not np.allclose(fisher, recorded, rtol=1e-3)  # the head whitened, scales kept
    # the query's top answer carries the index it came from
    res = full.query(input_ids=query, top_k=2)
    assert (res.query["preconditioner"], res.query["weighting"]) == ("kfac", "fisher")
    assert scratch.query(input_ids=query, top_k=2).query["weighting"] == "recorded"
    assert main(["index", str(runs["full"]), "--weighting", "recorded"]) == 0
    assert "index kfac-cos:" in capsys.readouterr().out
    assert main(["index", str(runs["full"])]) == 0
    assert "index kfac-cos-fisher:" in capsys.readouterr().out
    # rank's self-influence under either weighting: every example ranked, either way
    assert main(["rank", str(runs["full"]), "--weighting", "recorded", "--top-k", "6"]) == 0
    recorded_rank = capsys.readouterr().out
    assert main(["rank", str(runs["full"]), "--top-k", "6"]) == 0
    fisher_rank = capsys.readouterr().out
    assert recorded_rank.count("\n") == fisher_rank.count("\n") == 7  # header + 6 rows


def test_a_store_written_before_model_origin_reads_it_from_its_layers(runs, tmp_path):
    """No ``model_origin`` attribute: an input embedding among the tracked layers (recorded by
    ``embedding='auto'`` only for a pretrained model fine-tuned in full) means fisher."""
    import shutil

    for name, want in (("full", LayerWeighting.FISHER), ("scratch", LayerWeighting.RECORDED)):
        old = shutil.copytree(runs[name], tmp_path / name, ignore=shutil.ignore_patterns("index"))
        with h5py.File(old / C.STORE_FILE, "r+") as f:
            del f.attrs[C.MODEL_ORIGIN]
        run = open_run(old)
        assert run.store.model_origin == ""
        assert run.settings().weighting is want


def test_bad_weighting_is_a_clear_error():
    with pytest.raises(ConfigError, match="weighting must be one of"):
        IndexSettings(weighting="kronfluence")
    assert "weighting" not in IndexSettings().to_dict()  # every default index built before
    assert IndexSettings(weighting="fisher").to_dict()["weighting"] == "fisher"


def _classifier_run(folder, loaded: bool, covariance: bool = True):
    """A tiny BERT classifier, fine-tuned in full by an own loop: from saved weights
    (``loaded``, a pretrained classifier) or as built from its config."""
    from helpers import tiny_bert_classifier
    from transformers import BertForSequenceClassification

    model = tiny_bert_classifier()
    if loaded:
        model.save_pretrained(folder / "pretrained")
        model = BertForSequenceClassification.from_pretrained(folder / "pretrained")
    settings = TrackSettings(k_in=8, k_out=8, covariance_stride=1, covariance=covariance)
    return train_own_loop(
        model.train(),
        folder / "run",
        settings,
        ROWS,
        class_ids=[0, 1, 2, 0, 1, 2],
        task="classification",
        labels=["a", "b", "c"],
    )


def test_a_pretrained_classifier_fine_tuned_in_full_is_answered_with_ekfac(tmp_path):
    """The default preconditioner (auto) of a pretrained classifier fine-tuned in full resolves
    to EK-FAC, and the run says so; an explicit kfac is K-FAC; a classifier built from its
    config (and every causal LM) is answered with K-FAC."""
    from traceprop_engine.attribution.overview import (
        CLASSIFIER_FULL_NOTE,
        NO_STATISTICS_NOTE,
        describe,
    )

    full = open_run(_classifier_run(tmp_path / "loaded", loaded=True))
    scratch = open_run(_classifier_run(tmp_path / "built", loaded=False))
    assert full.task == "classification" and full.store.model_origin == C.ORIGIN_PRETRAINED_FULL
    assert full.settings().name == "ekfac-cos"
    assert CLASSIFIER_FULL_NOTE in full.notes and NO_STATISTICS_NOTE not in full.notes
    query = {"input_ids": ROWS[1].tolist(), "label": "b"}
    ekfac = full.scores(**query, settings=IndexSettings(preconditioner="ekfac"))
    np.testing.assert_array_equal(full.scores(**query), ekfac)  # the same index
    kfac = full.scores(**query, settings=IndexSettings(preconditioner="kfac"))
    assert not np.allclose(kfac, ekfac, rtol=1e-3)  # K-FAC when it is asked for
    assert full.settings(IndexSettings(preconditioner="kfac")).name == "kfac-cos"
    assert describe(full).preconditioners == ("ekfac", "kfac", "identity")  # the app's default
    res = full.query(**query, top_k=2)
    assert res.query["preconditioner"] == "ekfac" and CLASSIFIER_FULL_NOTE in res.notes
    # from a config: K-FAC as before, no note
    assert scratch.store.model_origin == C.ORIGIN_SCRATCH
    assert scratch.settings().name == "kfac-cos" and CLASSIFIER_FULL_NOTE not in scratch.notes
    assert describe(scratch).preconditioners == ("kfac", "identity", "ekfac")
    # the same store read as a causal LM's (the rule is the classifier's only)
    assert resolve_settings(full.store, None, "causal-lm").preconditioner.value == "kfac"
    # without statistics the default is identity, whichever kind auto would pick
    no_stats = open_run(_classifier_run(tmp_path / "nostats", loaded=True, covariance=False))
    assert no_stats.settings().name == "identity-cos" and NO_STATISTICS_NOTE in no_stats.notes
    assert CLASSIFIER_FULL_NOTE not in no_stats.notes
