"""FSDP training (torch's FSDP2 ``fully_shard``): sharded parameters, one store shard per rank.

``traceprop train --parallel fsdp`` under ``torchrun`` (docs/scaling.md) takes the DDP path of
:mod:`traceprop_engine.training.distributed` — same process group, same global permutation split
into per-rank parts, same loss scaling, one ``store.rank{r}.h5`` per rank — with the model sharded
by :func:`shard_model` instead of wrapped in ``DistributedDataParallel``.

Why the capture needs no change: FSDP2 shards *parameters* only. Before a sharded block runs
forward (and again in backward) its parameters are all-gathered and the ``nn.Linear`` modules see
plain, whole weights; activations and output gradients are never sharded, so the forward hooks
and the tensor hooks on the layer outputs see the rank's full ``(B_local, T, d)`` tensors, as
under DDP. FSDP's reduce-scatter averages gradients over ranks exactly like DDP's all-reduce, so
the DDP loss scale (``B_global / W``) is right too. Outside forward/backward the weights are
``DTensor`` shards; the Tracker sizes its projections from ``in_features`` / ``out_features``
(a DTensor's ``shape`` is the global one anyway), so it may be built before or after sharding.

The model is saved from the gathered full state dict (:func:`full_state_dict`, a collective:
every rank calls it, rank 0 receives it on the CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import constants as C


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the entries of the outermost ``nn.ModuleList``s.

    Transformers keep their layers in a ``ModuleList`` (``gpt_neox.layers``, ``model.layers``,
    ``transformer.h``); sharding per block keeps only one block's full weights alive at a time.
    """
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # pre-order: an outer list is seen before the lists inside it
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList):
            blocks.extend(b for b in m if any(True for _ in b.parameters()))
            inside.update(id(x) for x in m.modules())
    return blocks


def shard_model(
    model: nn.Module,
    mesh=None,
    *,
    mp_policy=None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` every block of ``model`` (:func:`block_modules`), then the root; in place.

    Args:
        model: the model on this rank's device, with every rank holding the same weights.
        mesh: a 1-D ``DeviceMesh`` (default: all ranks of the process group, on the model's
            device type).
        mp_policy: an optional ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. bf16
            parameters with fp32 gradient reduction; docs/scaling.md).
        reshard_after_forward: FSDP2's option (True: free the gathered weights after forward).

    Returns:
        ``model`` itself (now an ``FSDPModule``; its parameters are ``DTensor`` shards).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
    }
    for block in block_modules(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on rank 0's CPU (``{}`` on other ranks). A collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def plain_class(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its pre-``fully_shard`` class for the duration of a ``save_pretrained``.

    ``fully_shard`` swaps the root's class for a subclass named ``FSDP<Name>``; Hugging Face
    writes the class name into ``config.json`` (``architectures``), which must name the real
    class for the saved model to describe itself. Nothing but saving runs inside the block.
    """
    cls = type(model)
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    orig = next(b for b in cls.__bases__ if b is not FSDPModule)
    model.__class__ = orig
    try:
        yield model
    finally:
        model.__class__ = cls


def finish_sharded(
    tracker,
    model: nn.Module,
    tokenizer=None,
    **kwargs,
) -> Path | None:
    """:meth:`Tracker.finish` for a multi-process loop (FSDP or DDP): a collective on every rank.

    Every rank's tracker wrote ``RUN/store.rank{r}.h5`` (and rank 0 the example table). This
    closes each rank's store, gathers the full model onto rank 0 (for an FSDP model) and lets
    rank 0 save it and write ``run.json`` listing the shards, so ``open_run(RUN)`` reads them as
    one run. ``kwargs`` are :meth:`Tracker.finish`'s (task, labels, max_length, data, config).

    Returns on every rank once rank 0 has written ``run.json`` (a failure there raises on rank 0).

    Returns:
        The run directory on rank 0, ``None`` on the other ranks.
    """
    import torch.distributed as dist

    from ..run_record import make_run
    from .distributed import barrier

    if not tracker._closed:
        tracker.close(C.STATUS_COMPLETED)
    world = dist.get_world_size()
    counts: list = [None] * world
    dist.all_gather_object(counts, (tracker.store_path.name, tracker.n_records, tracker.status))
    state = full_state_dict(model) if is_sharded(model) else None
    if dist.get_rank() != 0:
        barrier()  # rank 0 has written run.json (and the gathers are freed while it writes)
        return None
    try:
        names = [c[0] for c in counts]
        n = [int(c[1]) for c in counts]
        status = next((c[2] for c in counts if c[2] != C.STATUS_COMPLETED), C.STATUS_COMPLETED)
        return make_run(
            tracker.store_path.parent,
            model,
            tokenizer,
            status=status,
            state_dict=state,
            shards=names,
            **{
                **kwargs,
                "config": {"trainer": "traceprop_engine.Tracker", **(kwargs.get("config") or {})},
            },
            tracking=tracker.tracking_manifest(),
            distributed={"world_size": world, "backend": dist.get_backend()},
            timings={
                "n_steps": len(tracker.step_ms),
                "median_step_ms": float(np.median(tracker.step_ms)) if tracker.step_ms else None,
            },
            store={"file": None, "shards": names, "n_records": sum(n), "n_records_per_shard": n},
        )
    finally:
        barrier()
