"""The running state of a :class:`~.hooks.Capture` that outlives one batch: its K-FAC statistics
as arrays for the store, and the checkpoint state a resumed run needs."""

from __future__ import annotations

from ..store.format import Covariance


class CaptureState:
    """Covariance read-out and checkpoint state of a capture (mixed into ``Capture``, whose
    ``layers`` and ``batches`` it reads)."""

    layers: list
    batches: int

    def covariance_arrays(self) -> list[Covariance | None]:
        """Per layer: ``A``, ``S`` (float64 numpy) and the token count, or None when off."""
        out: list[Covariance | None] = []
        for layer in self.layers:
            if layer.A is None:
                out.append(None)
                continue
            out.append(
                Covariance(
                    A=layer.A.double().cpu().numpy(),
                    S=layer.S.double().cpu().numpy(),
                    n_tokens=float(layer.a_tokens.item()) + layer.a_rows,
                )
            )
        return out

    # -- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The running state a resumed run needs: ``batches`` (picks the statistics batches and
        rotates their token offset), per layer ``a_rows`` and, where covariance is on, copies of
        ``A``, ``S`` and the token sum (``covariance``: a list of dicts or None)."""
        cov = [
            None
            if layer.A is None
            else {
                "A": layer.A.detach().clone(),
                "S": layer.S.detach().clone(),
                "a_tokens": layer.a_tokens.detach().clone(),
            }
            for layer in self.layers
        ]
        rows = [int(layer.a_rows) for layer in self.layers]
        return {"batches": int(self.batches), "a_rows": rows, "covariance": cov}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values into this capture's tensors (same layers)."""
        self.batches = int(state.get("batches", 0))
        pairs = zip(
            self.layers, state.get("a_rows", []), state.get("covariance") or [], strict=False
        )
        for layer, rows, t in pairs:
            layer.a_rows = int(rows)
            if t is not None and layer.A is not None:
                layer.A.copy_(t["A"])
                layer.S.copy_(t["S"])
                layer.a_tokens.copy_(t["a_tokens"])
