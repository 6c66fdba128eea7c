"""A Tracker per rank of a DDP-style loop with no targets given, where the ranks' first batches
differ: rank 0's are free text (every token a target), rank 1's answers (two tokens). Every
rank must take the same record rank (the highest any chose), or the shards could not be read as
one store (capture/free_text.py).

    torchrun --nproc_per_node 2 tests/training/first_step_rank_loop.py OUT_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import GPTNeoXForCausalLM

from traceprop_engine import Tracker, TrackSettings
from traceprop_engine.training.hf_trainer import rank_store_path
from traceprop_engine.training.losses import causal_lm_losses
from traceprop_engine.training.models import tiny_config

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPTNeoXForCausalLM(tiny_config(vocab_size=50, width=32, layers=2))
g = torch.Generator().manual_seed(rank)
with Tracker(model, rank_store_path(f"{out}/store.h5", rank, world), TrackSettings()) as tracker:
    for step in range(2):
        ids = torch.randint(1, 50, (2, 24), generator=g)
        labels = ids.clone()
        if rank == 1:
            labels[:, :-2] = -100
        with tracker.step([2 * step, 2 * step + 1], step=step, lr=1e-3) as rec:
            losses = causal_lm_losses(model(input_ids=ids).logits, labels)
            losses.mean().backward()
            rec.losses = losses
        model.zero_grad()
dist.destroy_process_group()
