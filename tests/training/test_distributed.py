"""DDP training (2 ranks, gloo, CPU) writes one shard per rank that reads as the one-process store."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch
from helpers import (
    FAST,
    assert_same_answers,
    facts_data,
    fast_settings,
    torchrun,
    torchrun_failure,
)

from traceprop_engine import Store
from traceprop_engine.run import read_manifest
from traceprop_engine.settings import TrackSettings
from traceprop_engine.store.sharded import ShardedStore, open_run_store
from traceprop_engine.training.command import train_argv
from traceprop_engine.training.data import load_examples
from traceprop_engine.training.distributed import DistContext, shard_file
from traceprop_engine.training.loop import train
from traceprop_engine.training.losses import causal_lm_losses
from traceprop_engine.training.models import build_model

pytestmark = pytest.mark.slow  # torchrun jobs of 2 ranks

# two processes reduce in another order than one: fp32 round-off, grown a little by a few Adam steps
RTOL = 1e-3
ATOL_REL = 1e-4
WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    data = facts_data(root / "data")
    single = train(
        fast_settings(
            data,
            root / "single",
            batch_size=WORLD * 4,
            track=TrackSettings(k_in=4, k_out=4, rank=0, covariance_stride=1),
        )
    )
    ddp = root / "ddp"
    launcher = tuple(torchrun(WORLD))
    flags = {
        "data": data / "train",
        "eval_data": data / "eval",
        "out": ddp,
        "device": "cpu",
        "batch_size": 4,
        **{k: FAST[k] for k in ("epochs", "max_length", "tiny_layers", "tiny_width", "tiny_vocab")},
        "threads": 1,
        "k_in": 4,
        "k_out": 4,
        "covariance_stride": 1,  # every token: the shards' statistics sum to the one-process ones exactly
        "rank": 0,  # full sketches, compared with autograd below
    }
    cmd = train_argv(flags, launcher=launcher)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, torchrun_failure(p.stderr)
    return data, single, ddp


def _sorted(store) -> tuple[np.ndarray, list[np.ndarray]]:
    rec = store.records()
    order = np.lexsort((rec["example_index"], rec["step"]))
    return rec, order


def test_ddp_run_lists_its_shards(runs):
    _, single, ddp = runs
    m = read_manifest(ddp)
    assert m["status"] == "completed" and m["shards"] == [shard_file(r) for r in range(WORLD)]
    assert m["distributed"] == {"world_size": WORLD, "backend": "gloo"}
    assert not (ddp / "store.h5").exists() and (ddp / "model" / "model.safetensors").exists()
    counts = [Store(ddp / s).n_records for s in m["shards"]]
    assert m["store"]["n_records_per_shard"] == counts and min(counts) > 0


def test_shards_read_as_the_one_process_store(runs):
    _, single, ddp = runs
    one, sharded = Store(single / "store.h5"), open_run_store(ddp)
    assert isinstance(sharded, ShardedStore) and sharded.n_records == one.n_records
    r1, o1 = _sorted(one)
    r2, o2 = _sorted(sharded)
    # the same examples at the same steps (rank r takes the r-th part of each global batch)
    for name in ("example_index", "step", "epoch"):
        np.testing.assert_array_equal(r1[name][o1], r2[name][o2])
    np.testing.assert_allclose(r1["lr"][o1], r2["lr"][o2], rtol=1e-6)
    np.testing.assert_allclose(r1["loss"][o1], r2["loss"][o2], rtol=RTOL)
    for li in range(len(one.layers)):
        x, y = sharded.sketches(li)[o2], one.sketches(li)[o1]
        np.testing.assert_allclose(
            x, y, rtol=RTOL, atol=ATOL_REL * np.abs(y).max(), err_msg=one.layers[li].name
        )
        # a slice across the shard boundary is the concatenation
        n0 = sharded.shards[0].n_records
        np.testing.assert_array_equal(
            sharded.sketches(li, n0 - 2, n0 + 2),
            np.concatenate(
                [sharded.shards[0].sketches(li, n0 - 2), sharded.shards[1].sketches(li, 0, 2)]
            ),
        )
        c1, c2 = one.covariance(li), sharded.covariance(li)
        assert c1.n_tokens == c2.n_tokens
        for a, b in ((c2.A, c1.A), (c2.S, c1.S)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL_REL * np.abs(b).max())
        assert sharded.sq_norm_sum(li) == pytest.approx(one.sq_norm_sum(li), rel=RTOL)
    assert (
        sharded.status == "completed"
        and not sharded.is_partial
        and sharded.describe_partial() == ""
    )
    assert sharded.examples()["sha256"].tolist() == one.examples()["sha256"].tolist()


def test_ddp_loss_scale_against_autograd(runs):
    """Step-0 records of both shards equal P_out ∇_W ℓ_i P_inᵀ from a per-example backward."""
    data, _, ddp = runs
    store = open_run_store(ddp)
    train_ex, _ = load_examples(str(data / "train"), task="causal-lm")
    loaded = build_model(
        "tiny",
        "causal-lm",
        [e.full_text() for e in train_ex],
        seed=0,
        tiny_vocab=FAST["tiny_vocab"],
        tiny_width=FAST["tiny_width"],
        tiny_layers=FAST["tiny_layers"],
        max_length=FAST["max_length"],
    )
    model = loaded.model.train()
    modules = dict(model.named_modules())
    rec = store.records()
    rows = [r for r in np.flatnonzero(rec["step"] == 0)]
    per_shard = {s.path.name: s.records()["step"].tolist().count(0) for s in store.shards}
    assert all(v == 4 for v in per_shard.values()), per_shard  # both ranks recorded step 0
    for r in rows:
        ids, mask = store.tokens(int(rec["example_index"][r]))
        x = torch.from_numpy(ids.astype(np.int64))[None]
        labels = torch.where(torch.from_numpy(mask.astype(bool))[None], x, torch.full_like(x, -100))
        model.zero_grad(set_to_none=True)
        causal_lm_losses(model(input_ids=x).logits, labels)[0].backward()
        for li, info in enumerate(store.layers):
            G = modules[info.name].weight.grad.double().numpy()  # (d_out, d_in)
            want = (
                store.projection(li, "out").astype(np.float64)
                @ G
                @ store.projection(li, "in").astype(np.float64).T
            )
            got = store.sketches(li, int(r), int(r) + 1)[0]
            np.testing.assert_allclose(
                got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=info.name
            )


def test_sharded_run_answers_a_query(runs):
    _, single, ddp = runs
    assert_same_answers(single, ddp)


def test_local_batches_partition_every_global_batch():
    order = np.random.default_rng(0).permutation(21)
    seen = []
    for s in range(DistContext(world_size=3).steps_per_epoch(21, 2)):
        parts = [DistContext(rank=r, world_size=3).local_batch(order, s, 2) for r in range(3)]
        assert len({g for _, g in parts}) == 1  # every rank knows the global batch size
        seen.extend(np.concatenate([p for p, _ in parts]).tolist())
    assert seen == order.tolist()  # disjoint, complete, in the permutation's order
