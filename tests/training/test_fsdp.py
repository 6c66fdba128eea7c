"""FSDP2 training (``fully_shard``, 2 ranks, gloo, CPU): one store shard per rank, read as one run,
equal to the one-process run's sketches; the Python API (fully_shard in a user's loop, a Tracker
per rank, ``finish_sharded``) makes a run that opens and answers a query."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    FAST,
    assert_same_answers,
    facts_data,
    fast_settings,
    run_quietly,
    run_torchrun,
)

from traceprop_engine import Store
from traceprop_engine.run import read_manifest
from traceprop_engine.settings import TrackSettings
from traceprop_engine.store.sharded import ShardedStore, open_run_store
from traceprop_engine.training.distributed import shard_file
from traceprop_engine.training.loop import train

pytestmark = pytest.mark.slow  # torchrun jobs of 2 ranks

# The tolerance of FSDP vs one process: two ranks reduce-scatter gradients in another order than
# one process sums them: fp32 round-off, grown a little by a few Adam steps (measured: 4e-7 of
# the largest sketch entry; these bounds leave a margin of ~25x).
RTOL = 1e-4
ATOL_REL = 1e-5
WORLD = 2
TRACK = TrackSettings(k_in=4, k_out=4, rank=0, covariance_stride=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    data = facts_data(root / "data")
    single = train(fast_settings(data, root / "single", batch_size=WORLD * 4, track=TRACK))
    out = root / "fsdp"
    # fmt: off
    run_torchrun(WORLD, [
        "-m", "traceprop_engine", "train", "--parallel", "fsdp",
        "--data", str(data / "train"), "--eval-data", str(data / "eval"), "--out", str(out),
        "--device", "cpu", "--batch-size", "4", "--epochs", str(FAST["epochs"]),
        "--max-length", str(FAST["max_length"]), "--tiny-layers", str(FAST["tiny_layers"]),
        "--tiny-width", str(FAST["tiny_width"]), "--tiny-vocab", str(FAST["tiny_vocab"]),
        "--threads", "1", "--k-in", "4", "--k-out", "4",
        "--covariance-stride", "1",  # every token: the shards' statistics sum to one process's
        "--rank", "0",  # full sketches
    ])
    # fmt: on
    return data, single, out


def _sorted(store):
    rec = store.records()
    return rec, np.lexsort((rec["example_index"], rec["step"]))


def test_fsdp_run_lists_its_shards(runs):
    _, _, out = runs
    m = read_manifest(out)
    assert m["status"] == "completed" and m["shards"] == [shard_file(r) for r in range(WORLD)]
    assert m["distributed"] == {"world_size": WORLD, "backend": "gloo", "parallel": "fsdp"}
    assert m["config"]["parallel"] == "fsdp"
    # layer widths are the unsharded ones (d_out of a sharded weight would be halved)
    single = read_manifest(runs[1])
    assert m["tracking"]["layers"] == single["tracking"]["layers"]
    # the saved model is the gathered full one, under its own class name
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["GPTNeoXForCausalLM"]
    assert m["metrics"]["eval_loss"] == pytest.approx(single["metrics"]["eval_loss"], rel=RTOL)


def test_fsdp_shards_equal_the_one_process_store(runs):
    _, single, out = runs
    one, sharded = Store(single / "store.h5"), open_run_store(out)
    assert isinstance(sharded, ShardedStore) and sharded.n_records == one.n_records
    r1, o1 = _sorted(one)
    r2, o2 = _sorted(sharded)
    for name in ("example_index", "step", "epoch"):
        np.testing.assert_array_equal(r1[name][o1], r2[name][o2])
    np.testing.assert_allclose(r1["loss"][o1], r2["loss"][o2], rtol=RTOL)
    for li in range(len(one.layers)):
        x, y = sharded.sketches(li)[o2], one.sketches(li)[o1]
        np.testing.assert_allclose(
            x, y, rtol=RTOL, atol=ATOL_REL * np.abs(y).max(), err_msg=one.layers[li].name
        )
        c1, c2 = one.covariance(li), sharded.covariance(li)
        assert c1.n_tokens == c2.n_tokens
        for k in ("A", "S"):
            np.testing.assert_allclose(
                getattr(c2, k),
                getattr(c1, k),
                rtol=RTOL,
                atol=ATOL_REL * np.abs(getattr(c1, k)).max(),
            )


def test_fsdp_saved_model_equals_the_one_process_model(runs):
    from safetensors.torch import load_file

    _, single, out = runs
    a = load_file(single / "model" / "model.safetensors")
    b = load_file(out / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        # Adam turns round-off in near-zero gradients into steps of up to lr: measured 7e-6
        torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=1e-4, msg=k)


def test_fsdp_run_answers_a_query(runs):
    _, single, out = runs
    assert_same_answers(single, out)


USER_LOOP = Path(__file__).with_name("fsdp_user_loop.py")


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory):
    """docs/scaling.md's own loop: fully_shard, then a Tracker per rank, then finish_sharded."""
    root = tmp_path_factory.mktemp("fsdp_user")
    run_quietly([sys.executable, str(USER_LOOP), str(root / "single")])
    run_torchrun(WORLD, [str(USER_LOOP), str(root / "fsdp")])
    return root / "single", root / "fsdp"


def test_user_loop_under_fsdp_equals_one_process(user_runs):
    from traceprop_engine.attribution.query import open_run

    single, out = user_runs
    m, m1 = read_manifest(out), read_manifest(single)
    assert m["status"] == "completed" and m["shards"] == [shard_file(r) for r in range(WORLD)]
    # a Tracker built on DTensor weights sizes its layers from the unsharded widths
    assert m["tracking"]["layers"] == m1["tracking"]["layers"]
    one, sharded = Store(single / "store.h5"), open_run_store(out)
    assert sharded.n_records == one.n_records == 16
    r1, o1 = _sorted(one)
    r2, o2 = _sorted(sharded)
    np.testing.assert_array_equal(r1["example_index"][o1], r2["example_index"][o2])
    for li in range(len(one.layers)):
        y = one.sketches(li)[o1]
        np.testing.assert_allclose(
            sharded.sketches(li)[o2], y, rtol=RTOL, atol=ATOL_REL * np.abs(y).max()
        )
    query = dict(input_ids=[1, 4, 7, 0], labels=[-100, 4, 7, 0])
    scores = {}
    for name, run_dir in (("single", single), ("fsdp", out)):
        run = open_run(run_dir)
        try:
            scores[name] = run.scores(**query)
        finally:
            run.close()
    assert scores["fsdp"].shape == (8,)
    np.testing.assert_allclose(scores["fsdp"], scores["single"], rtol=1e-2, atol=1e-6)
