"""A DDP run's store: one shard per rank (``store.rank{r}.h5``), read as one store.

Each rank of a distributed run writes its own shard (:mod:`traceprop_engine.training.distributed`)
and ``run.json`` lists them; :func:`open_run_store` opens whichever a run has, so callers read a
single-process and a DDP run the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import constants as C
from ..errors import StoreError
from .format import Covariance
from .partial import PartialStatus
from .reader import Store

_STATUS_RANK = {
    C.STATUS_COMPLETED: 0,
    C.STATUS_RUNNING: 1,
    C.STATUS_CANCELLED: 2,
    C.STATUS_FAILED: 3,
}


class ShardedStore(PartialStatus):
    """Several shards of one run (``store.rank{r}.h5``, one per DDP rank) read as one store.

    The read API is :class:`Store`'s: records are the shards' records one after the other (shard 0
    first); the example table, tokens and projections come from shard 0; covariance factors,
    token counts and squared-norm sums are summed over shards; the status is the worst shard's.

    Args:
        paths: the shard files, in rank order.

    Raises:
        StoreError: a shard is missing or unreadable, or the shards track different layers or
            were written with different projections.
    """

    def __init__(self, paths: Sequence[str | os.PathLike]) -> None:
        if not paths:
            raise StoreError("a sharded store needs at least one shard file")
        self.shards: list[Store] = []
        try:
            for p in paths:
                self.shards.append(Store(p))
            first = self.shards[0]
            for sh in self.shards[1:]:
                if sh.layers != first.layers or sh.sketch != first.sketch:
                    raise StoreError(
                        f"{sh.path} tracks other layers than {first.path}: the shards are not from one run"
                    )
                for li in range(len(first.layers)):
                    for side in ("in", "out"):
                        a, b = first.projection(li, side), sh.projection(li, side)
                        if (a is None) != (b is None) or (
                            a is not None and not np.array_equal(a, b)
                        ):
                            raise StoreError(
                                f"{sh.path} and {first.path} use different projections for "
                                f"{first.layers[li].name}: the shards are not from one run"
                            )
        except BaseException:
            self.close()
            raise
        self.path = first.path.parent
        self.paths = [sh.path for sh in self.shards]
        self.layers = first.layers
        self.sketch = first.sketch
        self.schema_version = first.schema_version
        self.manifest = first.manifest
        self.model_origin = first.model_origin
        self._offsets = np.concatenate(
            [[0], np.cumsum([sh.n_records for sh in self.shards])]
        ).astype(np.int64)
        self.n_records = int(self._offsets[-1])

    # -- state ------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        return max((sh.status for sh in self.shards), key=lambda s: _STATUS_RANK.get(s, 3))

    def _partial_where(self) -> str:
        worst = [str(sh.path.name) for sh in self.shards if sh.status != C.STATUS_COMPLETED]
        return f" in {', '.join(worst)}"

    @property
    def n_examples(self) -> int:
        return self.shards[0].n_examples

    @property
    def has_covariance(self) -> bool:
        return all(sh.has_covariance for sh in self.shards)

    @property
    def fingerprint(self) -> str:
        return "|".join(sh.fingerprint for sh in self.shards)

    @property
    def dim(self) -> int:
        return self.shards[0].dim

    # -- data -------------------------------------------------------------------------------
    def sketches(self, layer: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.n_records if stop is None else min(stop, self.n_records)
        parts = []
        for sh, lo, hi in zip(self.shards, self._offsets[:-1], self._offsets[1:], strict=True):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                parts.append(sh.sketches(layer, int(a - lo), int(b - lo)))
        if not parts:
            return np.zeros((0, *self.layers[layer].record_shape), np.float32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def factors(
        self, layer: int, start: int = 0, stop: int | None = None, columns: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        stop = self.n_records if stop is None else min(stop, self.n_records)
        us, vs = [], []
        for sh, lo, hi in zip(self.shards, self._offsets[:-1], self._offsets[1:], strict=True):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                u, v = sh.factors(layer, int(a - lo), int(b - lo), columns)
                us.append(u)
                vs.append(v)
        if not us:
            info = self.layers[layer]
            r = info.rank if columns is None else min(info.rank, int(columns))
            return (
                np.zeros((0, info.k_out, r), np.float32),
                np.zeros((0, info.k_in, r), np.float32),
            )
        return np.concatenate(us), np.concatenate(vs)

    def _split(self, records: np.ndarray):
        records = np.asarray(records, dtype=np.int64)
        for sh, lo, hi in zip(self.shards, self._offsets[:-1], self._offsets[1:], strict=True):
            sel = records[(records >= lo) & (records < hi)]
            if len(sel):
                yield sh, sel - lo

    def sketches_at(self, layer: int, records: np.ndarray) -> np.ndarray:
        parts = [sh.sketches_at(layer, sel) for sh, sel in self._split(records)]
        if not parts:
            return np.zeros((0, *self.layers[layer].record_shape), np.float32)
        return np.concatenate(parts)

    def factors_at(
        self, layer: int, records: np.ndarray, columns: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        parts = [sh.factors_at(layer, sel, columns) for sh, sel in self._split(records)]
        if not parts:
            return self.factors(layer, 0, 0, columns)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def records(self) -> dict[str, np.ndarray]:
        recs = [sh.records() for sh in self.shards]
        return {name: np.concatenate([r[name] for r in recs]) for name in C.RECORD_FIELDS}

    def projection(self, layer: int, side: str) -> np.ndarray | None:
        return self.shards[0].projection(layer, side)

    def dense_projection(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.shards[0].dense_projection(layer)

    def covariance(self, layer: int) -> Covariance | None:
        covs = [sh.covariance(layer) for sh in self.shards]
        if any(c is None for c in covs):
            return None
        return Covariance.merge(covs)

    def sq_norm_sum(self, layer: int) -> float:
        return float(sum(sh.sq_norm_sum(layer) for sh in self.shards))

    def examples(self) -> dict[str, np.ndarray]:
        return self.shards[0].examples()

    def tokens(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        return self.shards[0].tokens(example)

    def timings(self) -> dict:
        """Shard 0's timings, plus every shard's step times (``step_ms_per_shard``)."""
        out = self.shards[0].timings()
        out["step_ms_per_shard"] = [sh.timings()["step_ms"] for sh in self.shards]
        return out

    def attrs(self) -> dict:
        return {**self.shards[0].attrs(), "status": self.status, "n_records": self.n_records}

    def check_model(self, layer_names: Sequence[str], widths: Sequence[tuple[int, int]]) -> None:
        self.shards[0].check_model(layer_names, widths)

    def close(self) -> None:
        for sh in self.shards:
            sh.close()

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shard_paths(run_dir: str | os.PathLike, shards: Sequence[str] | None = None) -> list[Path]:
    """The store shards of a multi-process run (``shards``: file names relative to the run, in
    rank order; read from its ``run.json`` when not given), or ``[]`` for a single-process run
    (``store.h5``)."""
    from ..run import RunManifest

    run_dir = Path(run_dir)
    if shards is None and (run_dir / C.MANIFEST_FILE).exists():
        shards = RunManifest.load(run_dir).shards
    return [run_dir / s for s in shards or []]


def open_run_store(
    run_dir: str | os.PathLike, shards: Sequence[str] | None = None
) -> Store | ShardedStore:
    """The store of a run directory: ``store.h5``, or its shards (multi-process runs; the
    manifest's ``shards`` when not given)."""
    shards = shard_paths(run_dir, shards)
    if shards:
        return ShardedStore(shards)
    return Store(Path(run_dir) / C.STORE_FILE)
