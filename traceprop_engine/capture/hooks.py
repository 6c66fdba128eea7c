"""Capture hooks: per-example gradient records and K-FAC statistics computed inside the
training backward pass.

Exposes :class:`Capture`, which owns the hooks on the tracked layers of one model. For a tracked
layer ``y = W a`` a forward hook keeps the input ``a`` ``(B, T, d_in)`` and registers a tensor hook
on the output; in the backward pass that hook sees ``g = ∂L/∂y`` ``(B, T, d_out)`` scaled by
``s`` (the loss scale that turns the batch-loss gradient into per-example-loss gradients) and
writes each example's record into its buffer slot:

- factor records of the full gradient (``factor_space='full'``, the default): rank-r factors
  of ``G_b = Σ_t g_bt a_btᵀ`` by power iteration on ``a`` and ``g`` themselves
  (:func:`~.sketch.full_factors`), projected per example by ``P_out``, ``P_in`` after the
  backward (:class:`~.project.DeferredFactors`): the per-token cost does not grow with k;
  with ``half_step_start='narrow'`` a layer whose input is narrower than its output starts
  from ``v = Σ_t a_t`` instead, summed with ``c_t = a_t · v`` in the forward hook while ``a``
  is hot, so that its backward hook reads ``g`` once (``u = Σ_t c_t g_t = G v``);
- factor records of the sketch (``'sketch'``) and full sketches (``rank=0``): every token
  projected, ``Ŝ_b = Σ_t (P_out g̃)(P_in a)ᵀ``, then factored (:func:`~.sketch.top_factors`);
- dense records: ``vec(G_b)`` through a sparse JL matrix.

K-FAC statistics ``A = Σ ããᵀ``, ``S = Σ g̃g̃ᵀ`` (projected, token-masked) are accumulated in the
backward hook, so a forward whose backward never runs leaves no trace. Nothing calls ``.item()``
or otherwise synchronises a device per step. Hooks never replace modules (parameter names and
checkpoints stay valid); :meth:`Capture.detach` removes every handle (also after an exception,
when used as a context manager); nothing happens on a forward pass without gradients or outside
a :meth:`Capture.batch` block. :meth:`Capture.state_dict` / :meth:`Capture.load_state_dict` carry
the running state across a checkpoint. On the query side, :attr:`Capture.token_factors` keeps each
sketch-path layer's per-token ``(s P_out g_t, P_in a_t)`` beside its sum
(:mod:`~traceprop_engine.attribution.query_sketches`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import ConfigError
from ..settings import SketchKind
from .layers import TrackedLayer
from .project import DeferredFactors
from .sketch import apply_sparse_jl, full_factors, project_factor, top_factors, transposed_on
from .state import CaptureState


class Capture(CaptureState):
    """Owns the hooks on the tracked layers of one model.

    Use as a context manager (hooks attached on enter, always removed on exit), and wrap each
    micro-batch's forward + backward in :meth:`batch`, which says where the sketches go.

    Args:
        model: the model whose layers are tracked.
        layers: from :func:`build_layers`.
        covariance: accumulate ``A = Σ ã ãᵀ`` and ``S = Σ g̃ g̃ᵀ`` per layer.
    """

    def __init__(
        self, model: nn.Module, layers: list[TrackedLayer], covariance: bool = True
    ) -> None:
        self.model = model
        self.layers = layers
        self.covariance = covariance
        self._handles: list = []
        self._active = False
        self._slots: list[torch.Tensor] | None = None
        self._mask: torch.Tensor | None = None  # (B, T, 1) float32
        self._scale = 1.0
        self._n_tokens: torch.Tensor | None = None
        self.batches = 0  # batches recorded (rotates the covariance token offset)
        self._deferred: DeferredFactors | None = None  # made on attach
        # optimizer-aware records: () -> {layer: (a, b)} read after the backward of a batch
        self.row_scales = None
        self._mask_row: torch.Tensor | None = None  # (B, 1, T) of the open batch's padding
        self._input_start = any(layer.input_start for layer in layers)
        # a query's per-token factors: one list per layer, or None (training never sets it)
        self.token_factors: list[list] | None = None
        # counts each example's loss positions in one batch (free_text.TargetProbe), or None
        self.probe = None

    # -- lifetime -------------------------------------------------------------------------
    def attach(self) -> Capture:
        if self._handles:
            return self
        device = next(self.model.parameters()).device
        for i, layer in enumerate(self.layers):
            # full-space factors are projected per example in fp32; the per-token sketch path
            # multiplies activations of the layer's own dtype
            dtype = torch.float32 if layer.full_factor else layer.module.weight.dtype
            # made once per (device, dtype): a bench or a loop that detaches and re-attaches
            # every step must not copy every projection every time
            if layer.embedding:  # its inputs arrive projected (gathered columns of P_in)
                layer._gather = transposed_on(layer.P_in, layer._gather, device, torch.float32)
                layer._P_in_T = None
            else:
                layer._P_in_T = transposed_on(layer.P_in, layer._P_in_T, device, dtype)
            layer._P_out_T = transposed_on(layer.P_out, layer._P_out_T, device, dtype)
            if layer.dense_index is not None:
                layer._dense_index = layer.dense_index.to(device)
                layer._dense_sign = layer.dense_sign.to(device)
            # dense layers have no Kronecker factors to precondition with, and full d×d
            # statistics per token would cost more than the training step: none recorded
            if self.covariance and layer.A is None and layer.sketch is SketchKind.FACTORED:
                layer.A = torch.zeros(layer.k_in, layer.k_in, device=device)
                layer.S = torch.zeros(layer.k_out, layer.k_out, device=device)
                layer.a_tokens = torch.zeros((), device=device, dtype=torch.float64)
            self._handles.append(layer.module.register_forward_hook(self._make_forward_hook(i)))
        if self._deferred is None or self._deferred.device != device:
            self.write_deferred()  # records of the former device's batches, before its scratch goes
            self._deferred = DeferredFactors(self.layers, device) or None
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False
        for layer in self.layers:
            layer._stack.clear()

    def __enter__(self) -> Capture:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def relayout(self) -> None:
        """Rebuild what depends on the layers' record form after their rank changed
        (:func:`~.layers.set_rank`): what is queued is written first, in the former form."""
        self.write_deferred()
        self._input_start = any(layer.input_start for layer in self.layers)
        self._deferred = None
        if self._handles:
            device = next(self.model.parameters()).device
            self._deferred = DeferredFactors(self.layers, device) or None

    def write_deferred(self) -> None:
        """Write the records of every batch run with ``defer=True`` into their slots now."""
        if self._deferred is not None:
            self._deferred.write()

    def drop_deferred_batch(self) -> None:
        """Forget the last batch run with ``defer=True``: its slots are not kept (its records
        are never written; its scratch rows are reused)."""
        if self._deferred is not None:
            self._deferred.drop_last()

    @property
    def deferred_write_s(self) -> float:
        """Seconds spent projecting deferred factors so far."""
        return 0.0 if self._deferred is None else self._deferred.write_s

    # -- one micro-batch ------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(
        self,
        slots: list[torch.Tensor],
        token_mask: torch.Tensor | None = None,
        loss_scale: float = 1.0,
        defer: bool = False,
    ) -> Iterator[None]:
        """Record the next forward + backward into ``slots`` (one ``(B, *record_shape)`` per layer).

        Args:
            slots: where each layer's per-example sketches are written.
            token_mask: ``(B, T)`` 1 for real tokens, 0 for padding (for the covariance ``A``).
            loss_scale: factor turning ``∂L/∂y`` of the batch loss into per-example-loss
                gradients (the local batch size when ``L`` is the mean of per-example losses).
            defer: leave the default factors' projection for later (:meth:`write_deferred`,
                or when the scratch is full): ``slots`` must stay valid and unread until
                then. Without it every record is in its slot when the block exits.
        """
        if not self._handles:
            raise RuntimeError("Capture.batch() needs attached hooks: use 'with Capture(...)'")
        self._slots = slots
        self._scale = float(loss_scale)
        self._mask = None
        self._mask_row = None
        self._n_tokens = None
        # The mask matters for A and for an input start's Σ_t a_t (padding has activations but
        # no gradient). A CPU mask without padding needs no masking at all (checked on the
        # host, no device sync); a device mask is used as given.
        if (
            token_mask is not None
            and (self.covariance or self._input_start)
            and (token_mask.device.type != "cpu" or not bool(token_mask.all()))
        ):
            device = slots[0].device if slots else token_mask.device
            self._mask = token_mask.to(device=device, dtype=torch.float32).unsqueeze(-1)
            self._mask_row = self._mask.transpose(1, 2)  # (B, 1, T)
            self._n_tokens = self._mask.sum(dtype=torch.float64)
        for layer in self.layers:
            layer._stack.clear()
            layer._fired = False
            layer._started = False
        self.batches += 1
        deferred = self._deferred
        if deferred is not None:
            deferred.start(slots[deferred.members[0]].shape[0])
        self._active = True
        try:
            yield
            if deferred is not None:
                if self.row_scales is not None:
                    deferred.scale_rows(self.row_scales(), slots[deferred.members[0]].shape[0])
                deferred.finish(slots, self._scale)
                if not defer:
                    deferred.write()
        finally:
            self._active = False
            if deferred is not None:
                deferred.drop()  # an exception in the block: the open batch is forgotten
            for layer, slot in zip(self.layers, slots, strict=True):
                if not layer._fired:  # the layer took no part in this backward: a zero gradient
                    slot.zero_()
                layer._stack.clear()
            self._slots = None
            self._mask = None
            self._mask_row = None

    # -- hooks ----------------------------------------------------------------------------
    def _make_forward_hook(self, i: int):
        layer = self.layers[i]
        stack = layer._stack
        f32 = torch.float32

        def backward_hook(g: torch.Tensor) -> None:
            self._backward(layer, i, g)

        def forward_hook(module, inputs, output):
            # output.requires_grad is False under no_grad / inference_mode: no work at all
            if not self._active or not output.requires_grad:
                return None
            a = inputs[0]
            if layer.embedding:
                a = layer.embedding_input(a)  # (B, T, k_in) float32: P_in a_t for each token
            slots = self._slots
            if slots and a.shape[0] != slots[i].shape[0]:
                raise ConfigError(
                    f"the tracked layer {layer.name} sees a batch of {a.shape[0]} examples, but "
                    f"the step was given {slots[i].shape[0]} example ids: pass one id per "
                    "example of the micro-batch"
                )
            if layer.full_factor:  # the raw input: autograd keeps it for the weight grad anyway
                if layer.input_start and not layer._started and self._deferred is not None:
                    # the half step from the input side while a is hot (its first use in the
                    # batch; a later one keeps a only): the backward hook then reads g once
                    layer._started = True
                    stack.append((self._deferred.start_from_input(i, a, self._mask_row), a))
                else:
                    stack.append(a)  # detached in the backward hook, only where grad mode is on
                output.register_hook(backward_hook)
                return None
            a = a.detach()
            if a.dim() == 2:
                a = a.unsqueeze(1)  # (B, 1, d_in): one "token" per example (classifier heads)
            P = layer._P_in_T
            if P is not None:
                if a.dtype != P.dtype:  # e.g. an fp32 input to a layer whose weights are bf16
                    a = a.to(P.dtype)
                a = torch.matmul(a, P)  # (B, T, k_in)
            if a.dtype != f32:
                a = a.float()
            stack.append(a)
            output.register_hook(backward_hook)
            return None

        return forward_hook

    def _backward_full(self, layer: TrackedLayer, i: int, g: torch.Tensor) -> None:
        """Rank-r factors of the full per-example gradient, projected per example.

        ``G_b = s Σ_t g_bt a_btᵀ`` is never formed: ``power_iters`` power iterations use only
        ``(B, T, d) × (B, d, r)`` products of the layer's own ``a`` and ``g``
        (:func:`~traceprop_engine.capture.sketch.full_factors`), so the per-token cost does not depend
        on k. The factors are then projected per example, ``U = P_out u``, ``V = P_in v``
        (``(B, d) × (d, k)``, no token dimension), and written as the record
        ``(k_out + k_in, r)``. ``U Vᵀ = P_out (u vᵀ) P_inᵀ``: the sketch of the rank-r
        approximation of ``G``.
        """
        slots = self._slots
        a = layer._stack.pop()  # (B, T, d_in), the layer's raw input
        c = None  # input start: (B, 1, T) c_t = a_t · v, v already in the scratch row
        if type(a) is tuple:
            c, a = a
        if torch.is_grad_enabled():  # backward(create_graph=True): build no graph from here
            a, g = a.detach(), g.detach()
        if a.dim() == 2:
            a = a.unsqueeze(1)  # (B, 1, d_in): one "token" per example (classifier heads)
        if g.dim() == 2:
            g = g.unsqueeze(1)
        if a.dtype != torch.float32:  # bf16/fp16 models: iterate in fp32
            a = a.float()
        if g.dtype != torch.float32:
            g = g.float()
        scale = self._scale
        deferred = self._deferred
        if deferred is not None and i in deferred.member_set:
            # the first use: the products here, the projection after the backward (an input-start
            # layer whose later use fires first takes the per-layer path below)
            if not layer._fired and (c is not None or not layer.input_start):
                b = g.shape[0]
                sigma, w = deferred.raw(i, b)  # (B, 1, d_out), (B, 1, d_in) scratch rows
                if c is not None:  # input start, v in w already: one op, u = Σ_t c_t g_t = G v
                    torch.bmm(c, g, out=sigma)
                else:  # three ops
                    torch.bmm(deferred.ones(b, g.shape[1]), g, out=sigma)  # σ = Σ_t g_t
                    c = torch.bmm(sigma, g.transpose(1, 2))  # (B, 1, T): g_t · σ
                    torch.bmm(c, a, out=w)  # w = Gᵀ σ
                deferred.pending.add(i)
                layer._fired = True
                self._covariance_if_due(layer, a, g, scale)
                return
            # a second use (or an input-start layer's later use fired first): the first one's
            # record into its slot now, then this one's from its own a and g, summed
            deferred.write((slots, scale, {i}))
        m = self._mask_row if layer.input_start else None
        m = m if m is not None and m.shape[2] == a.shape[1] else None
        u, v = full_factors(
            a, g, layer.rank, layer.power_iters, layer.input_start, m, layer.exact_input
        )
        u, v = project_factor(u, layer._P_out_T), project_factor(v, layer._P_in_T)
        slot = slots[i]  # (B, k_out + k_in, r)
        k_out = layer.k_out
        if layer._fired:  # a layer used twice in one batch: factor the sum of both records
            prev = torch.bmm(slot[:, :k_out], slot[:, k_out:].transpose(1, 2))
            u, v = top_factors(prev + scale * torch.bmm(u, v.transpose(1, 2)), layer.rank)
            r = u.shape[2]  # clamped to min(k_out, k_in): below an exact-input layer's rank
            slot[:, :k_out, :r].copy_(u)
            slot[:, k_out:, :r].copy_(v)
            slot[:, :, r:].zero_()
        else:
            slot[:, :k_out].copy_(u.mul_(scale))
            slot[:, k_out:].copy_(v)
        layer._fired = True
        self._covariance_if_due(layer, a, g, scale)

    def _covariance_if_due(self, layer: TrackedLayer, a, g, scale: float) -> None:
        """K-FAC statistics from every cov_stride-th batch (the first included): all of that
        batch's tokens up to about ``cov_tokens`` (a classifier's one pooled token a row, so
        every example), an evenly spaced subset of them beyond."""
        if layer.S is not None and self.covariance and (self.batches - 1) % layer.cov_stride == 0:
            self._covariance_projected(layer, a, g, scale)

    def _covariance_projected(self, layer: TrackedLayer, a, g, scale: float) -> None:
        """``A``, ``S`` of one batch's tokens (every s-th row when it has more than about
        ``cov_tokens``, from an offset that rotates between statistics batches), projected."""
        a2 = a.flatten(0, 1)  # (N, d_in)
        g2 = g.flatten(0, 1)
        mask = self._mask  # (B, T, 1) when the batch has padding (used for A only)
        mask = mask.flatten(0, 1) if mask is not None and mask.shape[1] == a.shape[1] else None
        n = a2.shape[0]
        every = -(-n // layer.cov_tokens) if layer.cov_tokens else 1
        if every > 1:  # strided views: A and S from the same rows
            off = ((self.batches - 1) // layer.cov_stride) % every
            a2, g2 = a2[off::every], g2[off::every]
            if mask is not None:
                mask = mask[off::every]
        if layer._P_in_T is not None:
            a2 = torch.matmul(a2, layer._P_in_T)  # (N, k_in), fp32 (attach)
        if layer._P_out_T is not None:
            g2 = torch.matmul(g2, layer._P_out_T)
        layer.S.addmm_(g2.T, g2, alpha=scale * scale)  # padded tokens have g = 0
        if mask is not None:
            layer.A.addmm_((a2 * mask).T, a2)
            layer.a_tokens += self._n_tokens if every == 1 else mask.sum(dtype=torch.float64)
        else:
            layer.A.addmm_(a2.T, a2)
            layer.a_rows += a2.shape[0]

    def _backward(self, layer: TrackedLayer, i: int, g: torch.Tensor) -> None:
        slots = self._slots
        if not layer._stack or slots is None:
            return
        if self.probe is not None:
            self.probe.add(g)
        if layer.full_factor:
            self._backward_full(layer, i, g)
            return
        a = layer._stack.pop()  # (B, T, k_in) float32
        g = g.detach()
        if g.dim() == 2:
            g = g.unsqueeze(1)
        P = layer._P_out_T
        if P is not None:
            if (
                g.dtype != P.dtype
            ):  # bf16 gradient of an fp32 layer under autocast (no autocast here)
                g = g.to(P.dtype)
            g = torch.matmul(g, P)  # (B, T, k_out), unscaled
        if g.dtype != torch.float32:
            g = g.float()
        scale = self._scale
        slot = slots[i]
        gT = g.transpose(1, 2)
        if layer.sketch is SketchKind.DENSE:
            G = torch.bmm(gT, a).flatten(1)  # (B, d_out*d_in), dense path only
            if scale != 1.0:
                G.mul_(scale)
            rec = apply_sparse_jl(G, layer._dense_index, layer._dense_sign, layer.dense_k)
            if layer._fired:
                slot.add_(rec)
            else:
                slot.copy_(rec)
        elif layer._fired:
            slot.baddbmm_(gT, a, alpha=scale)  # a layer used twice in one batch: accumulate
        else:
            slot.baddbmm_(gT, a, beta=0.0, alpha=scale)  # (B, k_out, k_in) into the buffer, no copy
        if self.token_factors is not None and layer.sketch is SketchKind.FACTORED:
            # the sketch is Σ_t (s P_out g_t)(P_in a_t)ᵀ: keep both sides of every token
            self.token_factors[i].append((g * scale, a.clone()))
        layer._fired = True
        S = layer.S
        if S is not None and self.covariance:
            g2 = g.flatten(0, 1)
            S.addmm_(g2.T, g2, alpha=scale * scale)  # padded tokens have g = 0
            a2 = a.flatten(0, 1)
            mask = self._mask
            if mask is not None and mask.shape[1] == a.shape[1]:
                layer.A.addmm_((a * mask).flatten(0, 1).T, a2)
                layer.a_tokens += self._n_tokens
            else:
                layer.A.addmm_(a2.T, a2)
                layer.a_rows += a2.shape[0]
        return None
