"""Multi-process (DDP or FSDP) training: one process per device, one store shard per rank.

``torchrun --nproc_per_node N -m traceprop_engine train ...`` (or any launcher that sets
``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``) makes
:func:`traceprop_engine.training.loop.train` call :func:`setup`, which initialises the process group
(gloo on CPU, nccl on CUDA). The train loop then

- wraps the model in ``DistributedDataParallel`` (the capture hooks stay on the *underlying*
  module, so layer names are the same as in one process);
- draws the same global permutation on every rank and gives rank ``r`` the ``r``-th contiguous
  part of every global batch (``batch_size`` is the per-rank batch; a global batch is
  ``batch_size × world_size`` examples);
- writes ``RUN/store.rank{r}.h5`` on every rank; rank 0 alone writes the example table,
  ``run.json`` (with ``"shards": [...]``), the progress file and the model.

Loss scaling (checked against one process and autograd in tests/training/test_distributed.py): DDP
averages *parameter* gradients across ranks in its reducer; the tensor hooks on the layer outputs
run before that and see the local ``∂L_local/∂y``. The local loss is
``L_local = Σ_{i∈local} ℓ_i · W / B_global`` (``W`` ranks), so that DDP's average is exactly the
global mean ``Σ_i ℓ_i / B_global`` even when the last global batch does not split evenly, and the
hooks' loss scale is ``B_global / W`` (= the local batch size when the split is even).

``--parallel fsdp`` shards the model with FSDP2's ``fully_shard`` instead
(:mod:`traceprop_engine.training.fsdp`); everything above holds unchanged, since FSDP's
reduce-scatter averages gradients over ranks as DDP does.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import constants as C
from ..errors import ConfigError

log = logging.getLogger(__name__)


def shard_file(rank: int) -> str:
    """The store file of ``rank`` inside the run directory."""
    return f"store.rank{rank}.h5"


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


@dataclass
class DistContext:
    """Where this process stands in a (possibly one-process) run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    owns_group: bool = False
    parallel: str = "ddp"  # or "fsdp": how wrap() distributes the model

    @property
    def fsdp(self) -> bool:
        return self.enabled and self.parallel == "fsdp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def store_file(self) -> str:
        return shard_file(self.rank) if self.enabled else C.STORE_FILE

    @property
    def shard_files(self) -> list[str]:
        return [shard_file(r) for r in range(self.world_size)] if self.enabled else [C.STORE_FILE]

    # -- data -------------------------------------------------------------------------------
    def steps_per_epoch(self, n: int, batch_size: int) -> int:
        return max(1, -(-n // (batch_size * self.world_size)))

    def local_batch(
        self, order: np.ndarray, step_in_epoch: int, batch_size: int
    ) -> tuple[np.ndarray, int]:
        """This rank's examples of one global batch, and the global batch's size."""
        g = batch_size * self.world_size
        glob = order[step_in_epoch * g : (step_in_epoch + 1) * g]
        return np.array_split(glob, self.world_size)[self.rank], len(glob)

    # -- model / collectives ---------------------------------------------------------------
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if not self.enabled:
            return model
        if self.parallel == "fsdp":  # in place: the model itself now runs sharded
            from .fsdp import shard_model

            return shard_model(model)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = (
            [device.index if device.index is not None else self.local_rank]
            if device.type == "cuda"
            else None
        )
        return DDP(model, device_ids=ids)

    def any_true(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (a stop request must stop all ranks)."""
        if not self.enabled:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._coll_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def check_same(self, what: str, value: str) -> None:
        """Raise on every rank unless ``value`` is the same on all (e.g. the tokenizer's vocabulary)."""
        if not self.enabled:
            return
        import torch.distributed as dist

        values: list = [None] * self.world_size
        dist.all_gather_object(values, value)
        if len(set(values)) != 1:
            raise ConfigError(
                f"the ranks disagree on {what}; every rank must build the same model and data"
            )

    def barrier(self) -> None:
        if self.enabled:
            barrier()

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.owns_group = False

    @property
    def _coll_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )


_BARRIERS = itertools.count()  # every rank passes the same barriers in the same order


def barrier() -> None:
    """``dist.barrier()`` through the process group's key-value store on gloo (every barrier of
    this package; :func:`~traceprop_engine.training.fsdp.finish_sharded`'s last one included).

    A gloo barrier keeps the works queued or running when it was issued, and the works those
    kept, until its own work is freed on one of gloo's threads; so does any gloo collective keep
    its tensors. Freeing a tensor Python also sees needs the interpreter's lock: when that free
    comes after the interpreter began to exit, the thread aborts the process ("terminate called
    without an active exception", SIGABRT: rank 1 of ``tests/training/fsdp_user_loop.py`` in 2
    runs of 60 on a loaded 2-core Intel Xeon; the core showed barrier → barrier → the state
    dict's gathers, and with an all-reduce in place of the barrier, the all-reduce's tensor).
    The store (TCP) holds no tensor and starts no gloo work, so a rank's last gloo collective is
    its last real one (a gather), whose work gloo frees while the rank waits here for the others.
    Other backends (nccl) have no such threads: a plain barrier. Waits as long as the store's
    timeout (the process group's)."""
    import torch.distributed as dist

    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)  # private API
    if "gloo" not in str(dist.get_backend()) or default_store is None:
        dist.barrier()
        return
    store = default_store()
    key = f"traceprop/barrier/{next(_BARRIERS)}"
    if store.add(key, 1) == dist.get_world_size():  # the last to arrive opens it for all
        store.set(f"{key}/open", "1")
    store.wait([f"{key}/open"])


def setup(device: torch.device, parallel: str = "ddp") -> tuple[DistContext, torch.device]:
    """Join the process group named by the environment (no-op when ``WORLD_SIZE`` is 1).

    ``parallel``: ``ddp`` or ``fsdp``, how :meth:`DistContext.wrap` distributes the model.

    Returns:
        The context and the device this rank trains on (``cuda:LOCAL_RANK`` for a CUDA run).

    Raises:
        ConfigError: an incomplete launcher environment.
    """
    world = env_world_size()
    if world <= 1:
        return DistContext(), device
    import torch.distributed as dist

    try:
        int(os.environ["RANK"])  # required by init_process_group("env://")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except KeyError:
        raise ConfigError(
            "WORLD_SIZE > 1 but RANK is not set: launch with 'torchrun --nproc_per_node N -m traceprop_engine train ...'"
        ) from None
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        owns = True
    ctx = DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=dist.get_backend(),
        owns_group=owns,
        parallel=parallel,
    )
    log.info(
        "rank %d of %d (%s, %s) on %s", ctx.rank, ctx.world_size, ctx.backend, parallel, device
    )
    return ctx, device
