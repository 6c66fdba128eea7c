"""Per-example projections of the default full-space factors, batched over layers and over
steps, away from the backward pass.

The default record of a layer (rank 1, half a power step, ``TrackSettings()``) is
``U Vᵀ = s · P_out û ûᵀ G P_inᵀ`` with ``û = Σ_t g_t / ‖Σ_t g_t‖`` and ``G = Σ_t g_t a_tᵀ``.
Its hook (:meth:`Capture._backward_full`) only does what needs the layer's own activations and
gradients, three ops into preallocated scratch rows:

    σ = Σ_t g_t          (B, d_out)   bmm(out=)
    c_t = g_t · σ        (B, 1, T)    bmm
    w = Σ_t c_t a_t      (B, d_in)    bmm(out=)        i.e. w = Gᵀ σ

(an input-start layer, ``TrackSettings.half_step_start='narrow'``, holds ``u = G v`` in the
σ row and ``v = Σ_t a_t`` in the w row instead, and is normalised by ``‖v‖``: the record
``s · P_out G v̂ v̂ᵀ P_inᵀ``), and :meth:`DeferredFactors.write` turns every layer's ``(σ, w)``
into its record later:
``U = s · P_out σ / ‖σ‖``, ``V = P_in w / ‖σ‖`` (the same factors as
:func:`~traceprop_engine.capture.sketch.full_factors` with ``iters = 0``), with one batched GEMM per
group of sides that share a ``(width, k)`` (the 34 sides of the default tiny model's 17 layers
make 3 groups) and one copy per layer side into the record slots.

Why after the backward: inside a backward hook every distinct op pays a cold-code cost (the big
GEMMs of the backward evict the dispatcher's code from the caches); after it, in one place, the
normalisation, projections and copies run warm. Why over several steps: one step's few rows
would read every ``P`` (evicted by the step) for a thin GEMM. The raw rows of consecutive steps
stay in scratch (``rows`` of them, within :data:`DEFER_BYTES`) and are projected together when
the owner asks (:class:`~traceprop_engine.capture.tracker.Tracker`: before each buffer flush,
whose rows they are) or when the scratch is full: one read of ``P`` and one copy per layer side
for up to :data:`DEFER_MAX_ROWS` records. The records are the same, only written later; a
caller that reads its slots right after a batch (the query encoders, the tests) gets them
written at the end of the batch (``Capture.batch(defer=False)``, the default).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .layers import TrackedLayer

SIGMA_FLOOR = 1e-30
"""Smallest ``‖σ‖`` divided by: ``1/‖σ‖ · s`` stays finite for any loss scale below 1e8."""

DEFER_BYTES = 32 * 2**20
"""Scratch for raw ``(σ, w)`` rows kept between projections (the tiny model's 17 layers need
70 KB a record: 256 rows fit; a model too wide for one batch's rows within this falls back to
projecting after every batch)."""

DEFER_MAX_ROWS = 256
"""At most this many records wait for their projection (the default buffer's size)."""


def deferrable(layer: TrackedLayer) -> bool:
    """The layers whose factors :class:`DeferredFactors` projects: full-space, rank 1, half a step."""
    return layer.full_factor and layer.rank == 1 and layer.power_iters == 0


@dataclass
class _Batch:
    """A finished batch whose raw rows ``[row, row + size)`` wait for their projection."""

    row: int
    size: int
    slots: list[torch.Tensor]  # every layer's slot of that batch, where the records go
    scale: float
    members: frozenset[int]  # the layers to write (those that fired and are not written yet)


class DeferredFactors:
    """Scratch for the raw ``(σ, w)`` of every deferrable layer and their batched projection.

    A batch is opened with :meth:`start` (its rows in the scratch), the hooks write into
    :meth:`raw` and add their layer to :attr:`pending`, and :meth:`finish` queues the batch;
    :meth:`write` projects everything queued into the batches' slots. :meth:`drop` forgets the
    open batch (an exception in it).

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
                ("in", layer.a_width, layer._P_in_T),
            ):
                key = (d, None if p_t is None else p_t.shape[1])
                rows = sides.setdefault(key, [])
                self._where[(i, side)] = (key, len(rows))
                rows.append(p_t)
        self._P = {  # (n, d, k) stacked Pᵀ of a projected group; None for an exact one
            key: None if key[1] is None else torch.stack(rows) for key, rows in sides.items()
        }
        self._n = {key: len(rows) for key, rows in sides.items()}
        row_bytes = 4 * sum(key[0] * n for key, n in self._n.items())
        self.max_rows = max(1, min(DEFER_MAX_ROWS, DEFER_BYTES // max(row_bytes, 1)))
        self._groups: dict | None = None  # (n, rows, d) per group, made on the first start()
        self._rows = 0
        self._views: dict[tuple[int, int], dict] = {}  # (row, size) -> member -> (σ, w) views
        self._ones: dict[tuple[int, int], torch.Tensor] = {}
        # where each member's unit row is (σ; v for an input-start layer, whose out row holds
        # u = G v), and for every row of every group the member it belongs to
        unit = {i: self._where[(i, "in" if layers[i].input_start else "out")] for i in self.members}
        self._sigma_keys = sorted({unit[i][0] for i in self.members}, key=str)
        sigma_order = [i for key in self._sigma_keys for i in self.members if unit[i][0] == key]
        pos = {i: p for p, i in enumerate(sigma_order)}  # member -> row of the concatenated norms
        self._sigma_rows = {
            key: torch.tensor([unit[i][1] for i in sigma_order if unit[i][0] == key], device=device)
            for key in self._sigma_keys
        }
        owner: dict = {key: [None] * n for key, n in self._n.items()}
        is_out: dict = {key: [0.0] * n for key, n in self._n.items()}
        for (i, side), (key, j) in self._where.items():
            owner[key][j] = pos[i]
            is_out[key][j] = 1.0 if side == "out" else 0.0
        self._row_member = {key: torch.tensor(v, device=device) for key, v in owner.items()}
        self._is_out = {
            key: torch.tensor(v, device=device).view(-1, 1, 1) for key, v in is_out.items()
        }
        self.pending: set[int] = set()  # layers of the open batch whose (σ, w) are written
        self._queue: list[_Batch] = []  # finished batches, not yet projected
        self._next = 0  # first free scratch row
        self._open: tuple[int, int] | None = None  # (row, size) of the open batch
        self.write_s = 0.0  # time spent in write(), for the overhead bench

    def __bool__(self) -> bool:
        return bool(self.members)

    @property
    def queued(self) -> int:
        """Records waiting for their projection."""
        return sum(b.size for b in self._queue)

    # -- one batch ------------------------------------------------------------------------
    def start(self, batch: int) -> None:
        """Open a batch of ``batch`` records: the next free scratch rows (projecting what is
        queued first when they are full)."""
        if self._next + batch > self._rows:
            self.write()
            self._next = 0
            if batch > self._rows:
                rows = max(batch, self.max_rows)
                self._groups = {
                    key: torch.empty(n, rows, key[0], device=self.device, dtype=torch.float32)
                    for key, n in self._n.items()
                }
                self._rows = rows
                self._views.clear()
        self._open = (self._next, batch)
        self.pending.clear()

    def raw(self, i: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(B, 1, d_out)`` and ``(B, 1, d_in)`` scratch rows for ``σ`` and ``w``
        in the open batch."""
        if self._open is None or self._open[1] != batch:
            raise RuntimeError(f"no open batch of {batch} records in the factor scratch")
        views = self._views.get(self._open)
        if views is None:
            if len(self._views) > 4 * DEFER_MAX_ROWS:  # windows recur every scratch cycle
                self._views.clear()
            row, size = self._open
            views = self._views[self._open] = {}
            for m in self.members:
                (ko, jo), (ki, ji) = self._where[(m, "out")], self._where[(m, "in")]
                views[m] = (
                    self._groups[ko][jo, row : row + size].unsqueeze(1),
                    self._groups[ki][ji, row : row + size].unsqueeze(1),
                )
        return views[i]

    def start_from_input(
        self, i: int, a: torch.Tensor, mask_row: torch.Tensor | None
    ) -> torch.Tensor:
        """An input-start layer's forward half (``TrackSettings.half_step_start``): ``v = Σ_t a_t``
        over the real tokens (``mask_row`` ``(B, 1, T)``, None: every token) into layer ``i``'s
        w row of the open batch, and the returned ``(B, 1, T)`` ``c_t = a_t · v``, from which
        its backward hook makes ``u = Σ_t c_t g_t = G v`` in its σ row. In float32, autocast off
        (an autocast forward would round ``v`` and ``c`` to bfloat16)."""
        if torch.is_autocast_enabled(a.device.type):
            with torch.autocast(a.device.type, enabled=False):
                return self.start_from_input(i, a, mask_row)
        x = a.detach()
        if x.dim() == 2:
            x = x.unsqueeze(1)  # (B, 1, d_in): one "token" per example (classifier heads)
        if x.dtype != torch.float32:
            x = x.float()
        b, t = x.shape[0], x.shape[1]
        v = self.raw(i, b)[1]  # (B, 1, d_in)
        m = mask_row if mask_row is not None and mask_row.shape[2] == t else self.ones(b, t)
        torch.bmm(m, x, out=v)
        return torch.bmm(v, x.transpose(1, 2))

    def scale_rows(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], batch: int) -> None:
        """Scale the open batch's raw rows elementwise, ``σ ← a ⊙ σ``, ``w ← b ⊙ w`` (layer
        ``i``: ``scales[i] = (a, b)``), so that the record becomes ``(a ⊙ σ)(b ⊙ w)ᵀ / ‖σ‖²``
        of the *unscaled* ``σ`` (``w`` also takes ``‖a ⊙ σ‖² / ‖σ‖²``: the projection divides
        by the norm of the row it finds). Optimizer-aware records (``optimizer_scale.py``)."""
        for i, (a, b) in scales.items():
            if i not in self.pending:
                continue
            sig, w = self.raw(i, batch)
            n0 = sig.square().sum(-1, keepdim=True)
            sig.mul_(a)
            ratio = sig.square().sum(-1, keepdim=True) / n0.clamp_min(SIGMA_FLOOR**2)
            w.mul_(b).mul_(ratio)

    def finish(self, slots: list[torch.Tensor], scale: float) -> None:
        """Queue the open batch: its pending layers' records go to ``slots`` at the next write."""
        if self._open is None:
            return
        row, size = self._open
        # queued even with no layer to write, so that drop_last() always forgets this batch
        self._queue.append(_Batch(row, size, slots, float(scale), frozenset(self.pending)))
        self._next = row + size
        self._open = None
        self.pending.clear()

    def drop(self) -> None:
        """Forget the open batch (its rows are reused); what is queued stays."""
        self._open = None
        self.pending.clear()

    def drop_last(self) -> None:
        """Forget the last queued batch (its records were not kept by the caller)."""
        if self._queue:
            last = self._queue.pop()
            self._next = last.row

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

    # -- projection -----------------------------------------------------------------------
    def _coefficients(self, groups: dict, scales: torch.Tensor | float) -> dict:
        """Per group ``(n, R, 1)``: ``s/‖σ‖`` on σ rows, ``1/‖σ‖`` on w rows (σ of the row's
        layer, ``s`` the row's loss scale: a float, or ``(R,)`` when batches differ)."""
        norms = torch.cat(
            [
                groups[key].norm(dim=-1).index_select(0, self._sigma_rows[key])
                for key in self._sigma_keys
            ]
        )
        # an example without gradient at a layer (σ = 0, so w = 0) keeps a zero record: the floor
        # stays far from float32's overflow even times the loss scale (1/tiny · s would be inf,
        # and 0 · inf a NaN record)
        inv = norms.clamp_min_(SIGMA_FLOOR).reciprocal_()  # (members, R), by group, then member
        if isinstance(scales, torch.Tensor):
            scales = scales.view(1, -1, 1)
        out = {}
        for key in groups:
            c = inv.index_select(0, self._row_member[key]).unsqueeze(-1)  # (n, R, 1)
            # σ rows times s, w rows times 1: 1 + (s - 1)·[row is σ]
            out[key] = c.mul_(1.0 + (scales - 1.0) * self._is_out[key])
        return out

    def write(self, current: tuple[list[torch.Tensor], float, set[int]] | None = None) -> None:
        """Project every queued batch's raw rows into its slots ``(B, k_out + k_in, 1)``.

        Args:
            current: ``(slots, scale, layers)`` to also write those layers of the open batch now
                (a layer about to fire a second time in it: its first record must be in its
                slot before the second is added); they leave :attr:`pending`.
        """
        jobs = list(self._queue)
        if current is not None and self._open is not None:
            slots, scale, only = current
            now = frozenset(only) & self.pending
            if now:
                jobs.append(_Batch(*self._open, slots, float(scale), now))
                self.pending -= now
        jobs = [b for b in jobs if b.members]
        if not jobs:
            self._queue.clear()
            return
        t0 = time.perf_counter()
        lo = min(b.row for b in jobs)
        hi = max(b.row + b.size for b in jobs)
        groups = {key: t[:, lo:hi] for key, t in self._groups.items()}
        if len({b.scale for b in jobs}) == 1:
            scales: torch.Tensor | float = jobs[0].scale
        else:  # rows not in a job get s = 1: they are computed and not copied
            host = torch.ones(hi - lo)
            for b in jobs:
                host[b.row - lo : b.row - lo + b.size] = b.scale
            scales = host.to(self.device)
        coef = self._coefficients(groups, scales)
        proj = {}
        for key, x in groups.items():  # (n, R, d) -> (n, R, k), times the row's coefficient
            p = self._P[key]
            proj[key] = (x * coef[key]) if p is None else torch.bmm(x, p).mul_(coef[key])
        for i in self.members:
            k_out = self.layers[i].k_out
            (ko, jo), (ki, ji) = self._where[(i, "out")], self._where[(i, "in")]
            for first, n_rows, dst in _runs(jobs, i):
                r = first - lo
                dst[:, :k_out, 0].copy_(proj[ko][jo, r : r + n_rows])
                dst[:, k_out:, 0].copy_(proj[ki][ji, r : r + n_rows])
        self._queue.clear()
        self.write_s += time.perf_counter() - t0


def _runs(jobs: list[_Batch], i: int):
    """Layer ``i``'s destinations of ``jobs``: ``(first scratch row, rows, slot view)``, one per
    run of jobs whose scratch rows and slots both follow on (one buffer window: one copy)."""
    run = None  # [first row, rows, first slot, next slot data_ptr]
    for b in jobs:
        if i not in b.members:
            continue
        slot = b.slots[i]
        if (
            run is not None
            and b.row == run[0] + run[1]
            and slot.data_ptr() == run[3]
            and slot.stride() == run[2].stride()
            and slot.untyped_storage().data_ptr() == run[2].untyped_storage().data_ptr()
        ):
            run[1] += b.size
        else:
            if run is not None:
                yield run[0], run[1], _rows_of(run[2], run[1])
            run = [b.row, b.size, slot, 0]
        run[3] = slot.data_ptr() + b.size * slot.stride(0) * slot.element_size()
    if run is not None:
        yield run[0], run[1], _rows_of(run[2], run[1])


def _rows_of(slot: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``n_rows`` records from ``slot``'s first one on, in the same memory (the slots of the
    following batches, checked to follow on by :func:`_runs`)."""
    if n_rows == slot.shape[0]:
        return slot
    return slot.as_strided((n_rows, *slot.shape[1:]), slot.stride(), slot.storage_offset())
