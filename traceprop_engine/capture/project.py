"""Per-example projections of the default full-space factors, batched over layers once the
backward pass is over.

The default record of a layer (rank 1, half a power step, ``TrackSettings()``) is
``U Vᵀ = s · P_out û ûᵀ G P_inᵀ`` with ``û = Σ_t g_t / ‖Σ_t g_t‖`` and ``G = Σ_t g_t a_tᵀ``.
Its hook (:meth:`Capture._backward_full`) only does what needs the layer's own activations and
gradients, three ops into preallocated scratch:

    σ = Σ_t g_t          (B, d_out)   torch.sum(out=)
    c_t = g_t · σ        (B, 1, T)    bmm
    w = Σ_t c_t a_t      (B, d_in)    bmm(out=)        i.e. w = Gᵀ σ

and :meth:`DeferredFactors.write` turns every layer's ``(σ, w)`` into its record after the
backward: ``U = s · P_out σ / ‖σ‖``, ``V = P_in w / ‖σ‖`` (the same factors as
:func:`~traceprop_engine.capture.sketch.full_factors` with ``iters = 0``), with one batched GEMM per
group of sides that share a ``(width, k)`` (the 34 sides of the default tiny model's 17 layers
make 3 groups) and two element-wise writes per layer.

Why: inside a backward hook every distinct ATen op pays a cold-code cost (the big GEMMs of the
backward evict the dispatcher's code from the CPU's caches): measured on the default tiny model,
the first ``norm`` in a hook took 124 µs, the next ones 8–16 µs, against 5 µs in a warm loop.
The per-layer normalisation, projections and copies cost more than the products themselves
(7 ms of a 15 ms hook budget per step); after the backward, in one place, they run warm.
"""

from __future__ import annotations

import torch

from .layers import TrackedLayer

SIGMA_FLOOR = 1e-30
"""Smallest ``‖σ‖`` divided by: ``1/‖σ‖ · s`` stays finite for any loss scale below 1e8."""


def deferrable(layer: TrackedLayer) -> bool:
    """The layers whose factors :class:`DeferredFactors` projects: full-space, rank 1, half a step."""
    return layer.full_factor and layer.rank == 1 and layer.power_iters == 0


class DeferredFactors:
    """Scratch for the raw ``(σ, w)`` of every deferrable layer and their batched projection.

    Args:
        layers: the tracked layers; those for which :func:`deferrable` holds take part (their
            ``_P_in_T`` / ``_P_out_T`` already on the device, :meth:`Capture.attach`).
        device: where the scratch lives (the model's device).
    """

    def __init__(self, layers: list[TrackedLayer], device: torch.device) -> None:
        self.members = [i for i, layer in enumerate(layers) if deferrable(layer)]
        self.member_set = frozenset(self.members)  # the hooks ask "is layer i one?" every call
        self.layers = layers
        self.device = device
        # one group per (width, projection size or None for an exact side); each side of each
        # member is a row j of its group: (layer index, "out"|"in") -> (group key, j)
        self._where: dict[tuple[int, str], tuple[tuple[int, int | None], int]] = {}
        sides: dict[tuple[int, int | None], list[torch.Tensor | None]] = {}
        for i in self.members:
            layer = layers[i]
            for side, d, p_t in (
                ("out", layer.d_out, layer._P_out_T),
                ("in", layer.d_in, layer._P_in_T),
            ):
                key = (d, None if p_t is None else p_t.shape[1])
                rows = sides.setdefault(key, [])
                self._where[(i, side)] = (key, len(rows))
                rows.append(p_t)
        self._P = {  # (n, d, k) stacked Pᵀ of a projected group; None for an exact one
            key: None if key[1] is None else torch.stack(rows) for key, rows in sides.items()
        }
        self._n = {key: len(rows) for key, rows in sides.items()}
        self._raw: dict[int, dict] = {}
        self._ones: dict[tuple[int, int], torch.Tensor] = {}
        self._side_scale: dict[float, dict] = {}
        # where each member's σ row is, and for every row of every group the member it belongs to
        self._sigma_keys = sorted({self._where[(i, "out")][0] for i in self.members}, key=str)
        sigma_order = [
            i for key in self._sigma_keys for i in self.members if self._where[(i, "out")][0] == key
        ]
        pos = {i: p for p, i in enumerate(sigma_order)}  # member -> row of the concatenated norms
        self._sigma_rows = {
            key: torch.tensor(
                [
                    self._where[(i, "out")][1]
                    for i in sigma_order
                    if self._where[(i, "out")][0] == key
                ],
                device=device,
            )
            for key in self._sigma_keys
        }
        owner: dict = {key: [None] * n for key, n in self._n.items()}
        is_out: dict = {key: [0.0] * n for key, n in self._n.items()}
        for (i, side), (key, j) in self._where.items():
            owner[key][j] = pos[i]
            is_out[key][j] = 1.0 if side == "out" else 0.0
        self._row_member = {key: torch.tensor(v, device=device) for key, v in owner.items()}
        self._is_out = {key: torch.tensor(v, device=device) for key, v in is_out.items()}
        self.pending: set[int] = set()  # layers whose (σ, w) are written but not yet projected

    def __bool__(self) -> bool:
        return bool(self.members)

    def _scratch(self, batch: int) -> dict:
        """Per batch size: the group tensors and, per member, its ready-made views."""
        got = self._raw.get(batch)
        if got is None:
            if len(self._raw) > 4:  # a few batch sizes recur (the last batch of an epoch)
                self._raw.clear()
            groups = {
                key: torch.empty(n, batch, key[0], device=self.device, dtype=torch.float32)
                for key, n in self._n.items()
            }
            views = {}
            for i in self.members:
                (ko, jo), (ki, ji) = self._where[(i, "out")], self._where[(i, "in")]
                views[i] = (groups[ko][jo].unsqueeze(1), groups[ki][ji].unsqueeze(1))
            got = self._raw[batch] = {"groups": groups, "views": views, "slots": {}}
        return got

    def raw(self, i: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(B, 1, d_out)`` and ``(B, 1, d_in)`` scratch rows for ``σ`` and ``w``."""
        return self._scratch(batch)["views"][i]

    def ones(self, batch: int, tokens: int) -> torch.Tensor:
        """A ``(B, 1, T)`` tensor of ones: ``σ = 1ᵀ g`` is then the same batched GEMM as the
        next product (one kernel's code warm in the hook instead of two)."""
        o = self._ones.get((batch, tokens))
        if o is None:
            if len(self._ones) > 8:
                self._ones.clear()
            o = self._ones[(batch, tokens)] = torch.ones(
                batch, 1, tokens, device=self.device, dtype=torch.float32
            )
        return o

    def _coefficients(self, groups: dict, scale: float) -> dict:
        """Per group ``(n, B, 1)``: ``s/‖σ‖`` on σ rows, ``1/‖σ‖`` on w rows (σ of the row's layer)."""
        norms = torch.cat(
            [
                groups[key].norm(dim=-1).index_select(0, self._sigma_rows[key])
                for key in self._sigma_keys
            ]
        )
        # an example without gradient at a layer (σ = 0, so w = 0) keeps a zero record: the floor
        # stays far from float32's overflow even times the loss scale (1/tiny · s would be inf,
        # and 0 · inf a NaN record)
        inv = norms.clamp_min_(SIGMA_FLOOR).reciprocal_()  # (members, B), by group, then member
        side = self._side_scale.get(scale)
        if side is None:
            if len(self._side_scale) > 8:  # a few loss scales recur (the last batch of an epoch)
                self._side_scale.clear()
            side = self._side_scale[scale] = {
                key: (1.0 + (scale - 1.0) * m).view(-1, 1, 1) for key, m in self._is_out.items()
            }
        return {
            key: inv.index_select(0, self._row_member[key]).unsqueeze(-1).mul_(side[key])
            for key in groups
        }

    def _slot_views(self, got: dict, slots: list[torch.Tensor]) -> dict:
        """Per member, the ``U`` and ``V`` columns of its slot (cached per buffer window)."""
        key = tuple(slots[i].data_ptr() for i in self.members)
        views = got["slots"].get(key)
        if views is None:
            if len(got["slots"]) > 64:
                got["slots"].clear()
            views = got["slots"][key] = {
                i: (slots[i][:, : self.layers[i].k_out, 0], slots[i][:, self.layers[i].k_out :, 0])
                for i in self.members
            }
        return views

    def write(self, slots: list[torch.Tensor], scale: float, only: set[int] | None = None) -> None:
        """Project the pending layers' ``(σ, w)`` into their record slots ``(B, k_out + k_in, 1)``.

        Args:
            slots: every layer's slot of this batch.
            scale: the loss scale (per-example gradients from the batch loss's).
            only: project just these pending layers (a layer about to fire a second time).
        """
        todo = self.pending if only is None else self.pending & only
        if not todo:
            return
        got = self._scratch(slots[self.members[0]].shape[0])
        groups = got["groups"]
        coef = self._coefficients(groups, scale)
        proj = {}
        for key, x in groups.items():  # (n, B, d) -> (n, B, k), times the row's coefficient
            p = self._P[key]
            proj[key] = (x * coef[key]) if p is None else torch.bmm(x, p).mul_(coef[key])
        views = self._slot_views(got, slots)
        for i in sorted(todo):
            (ko, jo), (ki, ji) = self._where[(i, "out")], self._where[(i, "in")]
            u_dst, v_dst = views[i]
            u_dst.copy_(proj[ko][jo])
            v_dst.copy_(proj[ki][ji])
        self.pending -= todo
