"""The default preconditioner: K-FAC with cosine scores where the run has K-FAC statistics,
identity (with a note saying so) where it has none; an explicit EK-FAC there stays an error."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from helpers import engine_neox, train_own_loop

from traceprop_engine import TrackSettings
from traceprop_engine.attribution.overview import NO_STATISTICS_NOTE, usable_preconditioners
from traceprop_engine.attribution.query import open_run
from traceprop_engine.capture.step_checks import few_statistics
from traceprop_engine.cli.main import main
from traceprop_engine.errors import StoreError
from traceprop_engine.settings import IndexSettings, PreconditionerKind

TEXTS = ["the cat sat", "the dog ran", "a cat ran", "the bird sang", "a dog sat", "the cat ran"]
VOCAB = {w: i + 1 for i, w in enumerate(sorted({w for t in TEXTS for w in t.split()}))}
EXAMPLES = [[VOCAB[w] for w in t.split()] + [0] for t in TEXTS]
QUERY = {"input_ids": [VOCAB["the"], VOCAB["cat"], VOCAB["sat"], 0]}
QUERY["labels"] = [-100, -100, VOCAB["sat"], 0]


def _run(folder: Path, covariance: bool, stride: int = 1) -> Path:
    model = engine_neox(len(VOCAB) + 1, width=32, layers=1, seed=0)
    settings = TrackSettings(k_in=8, k_out=8, covariance=covariance, covariance_stride=stride)
    return train_own_loop(model, folder, settings, EXAMPLES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, Path]:
    return {c: _run(tmp_path_factory.mktemp(f"cov{int(c)}"), c) for c in (True, False)}


def test_a_run_with_statistics_is_answered_with_k_fac(runs):
    run = open_run(runs[True])
    assert usable_preconditioners(run.store)[0] is PreconditionerKind.KFAC  # the default first
    assert run.settings().preconditioner is PreconditionerKind.KFAC
    assert NO_STATISTICS_NOTE not in run.notes
    res = run.query(**QUERY, top_k=3)
    assert res.query["preconditioner"] == "kfac" and res.query["cosine"]
    default = run.scores(**QUERY)
    kfac = run.scores(**QUERY, settings=IndexSettings(preconditioner="kfac"))
    identity = run.scores(**QUERY, settings=IndexSettings(preconditioner="identity"))
    np.testing.assert_array_equal(default, kfac)  # the same index, the same code path
    assert not np.allclose(default, identity, rtol=1e-3)  # K-FAC was applied


def test_a_run_without_statistics_falls_back_to_identity_and_says_so(runs, capsys):
    run = open_run(runs[False])
    assert usable_preconditioners(run.store) == [PreconditionerKind.IDENTITY]
    assert run.settings().preconditioner is PreconditionerKind.IDENTITY
    assert run.settings(IndexSettings(cosine=False)) == IndexSettings(
        preconditioner="identity",
        cosine=False,
        weighting="recorded",  # auto resolved
        statistics="inline",
        class_prior=0.0,  # a causal LM: no class prior
        lm_bias=0.0,  # answers (rank-1 records) and --no-cosine: no LM-bias term
    )
    assert NO_STATISTICS_NOTE in run.notes
    res = run.query(**QUERY, top_k=3)
    assert res.query["preconditioner"] == "identity" and NO_STATISTICS_NOTE in res.notes
    identity = run.scores(**QUERY, settings=IndexSettings(preconditioner="identity"))
    np.testing.assert_array_equal(run.scores(**QUERY), identity)
    with pytest.raises(StoreError, match="no covariance"):
        run.scores(**QUERY, settings=IndexSettings(preconditioner="ekfac"))
    # the CLI builds and names the index it used
    assert main(["index", str(runs[False])]) == 0
    out = capsys.readouterr()
    assert "index identity-cos:" in out.out and NO_STATISTICS_NOTE in out.err
    assert (runs[False] / "index" / "identity-cos" / "index.json").exists()
    assert not (runs[False] / "index" / "kfac-cos").exists()


def test_few_statistics_batches_are_named_with_the_stride_that_gives_more():
    assert few_statistics(60, 32) is not None and "covariance_stride=3" in few_statistics(60, 32)
    assert "come from 2 of this run's 60 batches" in few_statistics(60, 32)
    assert few_statistics(4, 32) is not None and "covariance_stride=1" in few_statistics(4, 32)
    assert few_statistics(4, 1) is None  # every batch already: nothing better to advise
    assert few_statistics(512, 32) is None  # 16 statistics batches
    assert few_statistics(60, 3) is None  # traceprop train's own choice for 60 steps


def test_an_own_loop_with_too_few_statistics_batches_is_warned_at_close(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="traceprop_engine.capture.tracker"):
        _run(tmp_path / "s32", covariance=True, stride=32)  # 4 batches, statistics from 1
    assert any("come from 1 of this run's 4 batches" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="traceprop_engine.capture.tracker"):
        _run(tmp_path / "s1", covariance=True, stride=1)
    assert not [r for r in caplog.records if "K-FAC statistics" in r.message]
