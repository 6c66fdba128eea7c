"""The factor file ``RUN/factors-c{rank}.h5`` (layout in :mod:`.compact`): its names and the
read-only :class:`FactorStore` that attribution (``attribution/score/factor_scores.py``) and the LDS
evaluation read; :mod:`.compact` writes it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from .. import constants as C
from ..errors import ConfigError, IndexStaleError, StoreError
from .reader import Store

FACTORS_FORMAT = "traceprop-factors"
FACTORS_VERSION = 1
CHUNK = 4096  # records per streamed chunk (as in attribution.score.scoring)

F_U, F_V = "U", "V"
F_RES_FRO, F_RES_NUC = "residual_fro", "residual_nuc"


def factor_file_name(rank: int) -> str:
    return f"factors-c{int(rank)}.h5"


def check_rank(rank: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ConfigError(
            f"the factor rank c must be a positive integer (1 ≤ c ≤ min(k_out, k_in)), got {rank!r}"
        )
    return int(rank)


@dataclass(frozen=True)
class FactorLayer:
    """One layer of a factor file."""

    index: int
    name: str
    k_out: int
    k_in: int
    rank: int
    sq_norm_sum: float
    residual_sq_sum: float

    @property
    def record_shape(self) -> tuple[int, int]:
        return (self.k_out, self.k_in)

    @property
    def group(self) -> str:
        return f"{C.G_LAYERS}/{self.index:03d}"

    @property
    def relative_residual(self) -> float:
        """``(Σ‖Ŝ − UVᵀ‖²_F / Σ‖Ŝ‖²_F)^{1/2}`` over all records of the layer."""
        return (
            float(np.sqrt(self.residual_sq_sum / self.sq_norm_sum)) if self.sq_norm_sum > 0 else 0.0
        )


class FactorStore:
    """Read-only view of a factor file, validated on open.

    Args:
        path: a factor file, or a run directory together with ``rank``.
        rank: with a run directory, opens ``RUN/factors-c{rank}.h5``.

    Raises:
        StoreError: missing, unreadable, unfinished or foreign file.
    """

    def __init__(self, path: str | os.PathLike, rank: int | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            if rank is None:
                raise ConfigError(
                    f"{p} is a directory: pass rank= to open its factors-c{{rank}}.h5"
                )
            p = p / factor_file_name(rank)
        self.path = p
        if not p.exists():
            raise StoreError(f"no factor file at {p}: run compact_store(run_dir, rank) first")
        try:
            self._f = h5py.File(p, "r", locking=False)
        except OSError as e:
            raise StoreError(
                f"{p} is not a readable HDF5 file ({e}); rebuild it with compact_store"
            ) from e
        a = self._f.attrs
        try:
            if a.get("format") != FACTORS_FORMAT:
                raise StoreError(
                    f"{p} is not a Traceprop factor file (no format='{FACTORS_FORMAT}' attribute)"
                )
            if int(a.get("version", -1)) != FACTORS_VERSION:
                raise StoreError(
                    f"{p} has factor-file version {a.get('version')}; this Traceprop reads "
                    f"{FACTORS_VERSION}. Rebuild it with compact_store"
                )
            if a.get("status") != C.STATUS_COMPLETED:
                raise StoreError(
                    f"{p} is unfinished (status {a.get('status')!r}); rebuild it with compact_store"
                )
            self.rank = int(a["rank"])
            self.n_records = int(a["n_records"])
            self.lossless = bool(a["lossless"])
            self.source = {
                k: (v.item() if hasattr(v, "item") else v)
                for k, v in a.items()
                if k.startswith("source_")
            }
            self.layers = []
            for i, k in enumerate(sorted(self._f[C.G_LAYERS])):
                at = self._f[f"{C.G_LAYERS}/{k}"].attrs
                self.layers.append(
                    FactorLayer(
                        i,
                        str(at["name"]),
                        int(at["k_out"]),
                        int(at["k_in"]),
                        int(at["rank"]),
                        float(at["sq_norm_sum"]),
                        float(at["residual_sq_sum"]),
                    )
                )
                if self._f[f"{C.G_LAYERS}/{k}/{F_U}"].shape[0] < self.n_records:
                    raise StoreError(
                        f"{p}: layer {at['name']} holds fewer than n_records={self.n_records} records"
                    )
        except (KeyError, ValueError) as e:
            self._f.close()
            raise StoreError(
                f"{p} is damaged or incomplete ({e}); rebuild it with compact_store"
            ) from e
        except StoreError:
            self._f.close()
            raise

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def check_source(self, store: Store) -> None:
        """Raise :class:`IndexStaleError` unless the factors were built from this store's content."""
        if self.source.get("source_fingerprint") != store.fingerprint:
            raise IndexStaleError(
                f"{self.path} was built from store content {self.source.get('source_fingerprint')!r}, the "
                f"store is now {store.fingerprint!r}; rebuild it with compact_store"
            )

    def factors(
        self, layer: int, start: int = 0, stop: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(U (n, k_out, c), V (n, k_in, c))`` float32 of records ``start:stop``."""
        stop = self.n_records if stop is None else min(stop, self.n_records)
        g = self._f[self.layers[layer].group]
        return g[F_U][start:stop], g[F_V][start:stop]

    def reconstruct(self, layer: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``U Vᵀ`` (n, k_out, k_in) float32 — the rank-c approximation of the stored sketches."""
        u, v = self.factors(layer, start, stop)
        return np.matmul(u, np.swapaxes(v, 1, 2))

    def residual_norms(
        self, layer: int, start: int = 0, stop: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per record ``(‖Ŝ − UVᵀ‖_F, ‖Ŝ − UVᵀ‖_*)`` (the discarded singular values' 2- and 1-norms)."""
        stop = self.n_records if stop is None else min(stop, self.n_records)
        g = self._f[self.layers[layer].group]
        return g[F_RES_FRO][start:stop], g[F_RES_NUC][start:stop]

    def records(self) -> dict[str, np.ndarray]:
        g = self._f[C.G_RECORDS]
        return {name: g[name][: self.n_records] for name in C.RECORD_FIELDS}

    def nbytes_per_record(self) -> int:
        """Stored float32 bytes per record, all layers (U, V; not the residual norms)."""
        return sum(4 * layer.rank * (layer.k_out + layer.k_in) for layer in self.layers)

    def close(self) -> None:
        if self._f.id.valid:
            self._f.close()

    def __enter__(self) -> FactorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
