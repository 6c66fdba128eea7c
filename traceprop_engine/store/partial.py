"""What a store view (:class:`~.reader.Store`, or the shards of a DDP run,
:class:`~.sharded.ShardedStore`) says about a run that did not complete; how a partial store's
records are read when a kill tore its last chunk is :mod:`.torn_tail`."""

from __future__ import annotations

from .. import constants as C


class PartialStatus:
    """What a store view (:class:`Store`, or the shards of a DDP run) says about a run that did
    not complete: one wording for both. Needs ``status``, ``n_records`` and ``has_covariance``."""

    status: str
    n_records: int

    def _partial_where(self) -> str:
        """Which files are partial, as a clause after the status (none for a single file)."""
        return ""

    @property
    def is_partial(self) -> bool:
        """True unless the run that wrote the store completed."""
        return self.status != C.STATUS_COMPLETED

    def describe_partial(self) -> str:
        """A sentence for users about a partial store (empty string when complete)."""
        if not self.is_partial:
            return ""
        if self.status == C.STATUS_RUNNING:  # a train still writing it, or one killed outright
            return (
                f"this store is still being written (status 'running'{self._partial_where()}: "
                f"its train is running, or was killed before it could close it): it holds the "
                f"{self.n_records} records flushed so far; scores cover only those examples"
            )
        return (
            f"this store is partial (status '{self.status}'{self._partial_where()}): it holds the "
            f"{self.n_records} records written before the run stopped; scores cover only the "
            "examples seen so far"
            + (
                ""
                if self.has_covariance
                else ", and it has no covariance (identity preconditioning only)"
            )
        )
