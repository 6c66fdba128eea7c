"""Your own loop under FSDP2 (docs/scaling.md): ``fully_shard``, a Tracker per rank, one run.

    torchrun --nproc_per_node 2 tests/training/fsdp_user_loop.py RUN_DIR    # FSDP, store.rank{r}.h5
    python tests/training/fsdp_user_loop.py RUN_DIR                          # one process, store.h5

tests/training/test_fsdp.py runs both and compares them. Every rank takes an equal part of each global
batch and backpropagates the mean of its own per-example losses: FSDP averages the gradients over
ranks, so the update is the global mean, and the Tracker's default loss scale (the local batch
size) gives each example's own gradient.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from transformers import GPTNeoXForCausalLM

from traceprop_engine import Tracker, TrackSettings
from traceprop_engine.training.hf_trainer import rank_store_path
from traceprop_engine.training.losses import causal_lm_losses
from traceprop_engine.training.models import tiny_config

run_dir = sys.argv[1]
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")  # "nccl" on GPUs, with torch.cuda.set_device(LOCAL_RANK)
rank = dist.get_rank() if world > 1 else 0
torch.set_num_threads(1)

texts = ["the cat sat", "the dog ran", "a cat ran", "the bird sang"] * 2
vocab = {w: i + 1 for i, w in enumerate(sorted({w for t in texts for w in t.split()}))}
examples = [[vocab[w] for w in t.split()] + [0] for t in texts]  # example id = position
global_batch = 4

torch.manual_seed(0)  # every rank builds the same model
model = GPTNeoXForCausalLM(tiny_config(vocab_size=len(vocab) + 1, width=32, layers=2))
if world > 1:
    from torch.distributed.fsdp import fully_shard

    for block in model.gpt_neox.layers:  # one FSDP unit per block, then the root
        fully_shard(block)
    fully_shard(model)  # the Linear weights are DTensor shards from here on
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding: it steps the shards

settings = TrackSettings(k_in=4, k_out=4, rank=0)
with Tracker(model, rank_store_path(f"{run_dir}/store.h5", rank, world), settings) as tracker:
    if rank == 0:  # the example table lives in shard 0 only
        tracker.write_examples(
            {
                "source": ["mine.txt"] * len(texts),
                "row": list(range(1, len(texts) + 1)),
                "sha256": [""] * len(texts),
                "split": ["train"] * len(texts),
                "text": texts,
            },
            tokens=[np.array(e) for e in examples],
            loss_masks=[np.array([0] + [1] * (len(e) - 1)) for e in examples],
        )
    step = 0
    for epoch in range(2):
        for start in range(0, len(examples), global_batch):
            glob = np.arange(start, start + global_batch)
            example_ids = np.array_split(glob, world)[rank]  # this rank's equal part
            ids = torch.tensor([examples[i] for i in example_ids])
            with tracker.step(example_ids, step=step, epoch=epoch, lr=1e-3) as rec:
                losses = causal_lm_losses(model(input_ids=ids).logits, ids)
                losses.mean().backward()
                rec.losses = losses
            optimizer.step()
            optimizer.zero_grad()
            step += 1

if world > 1:
    from traceprop_engine.training.fsdp import finish_sharded

    finish_sharded(tracker, model)  # every rank: gathers the model, rank 0 writes run.json
    dist.destroy_process_group()
else:
    tracker.finish(model)
