"""Per-example rules for the layers of convolutional vision backbones (timm / torchvision), beside
:mod:`privtune.engine._layers`.

* **Eval-mode BatchNorm** (``nn.BatchNorm1d/2d/3d`` and timm's ``BatchNormAct2d``, which applies its
  activation inside the module): with the running statistics fixed, ``y = γ·x̂ + β`` with
  ``x̂ = (x − μ_run)/√(σ²_run + ε)`` is a per-example affine map, so per example
  ``∂/∂γ_c = Σ_spatial g·x̂`` and ``∂/∂β_c = Σ_spatial g`` (g: the gradient at the normalised output, before
  the activation; for ``BatchNormAct2d`` the engine captures it at the input of the module's ``drop``, which
  follows the normalisation).  Exact, vectorised over the batch, (B, C) per parameter, computed as
  ``(Σ g·x − μ_run·Σ g)/√(σ²_run + ε)`` over channel rows: no normalised copy of the input, no change of layout.
* **TF-"same" padded convolutions** (timm's ``Conv2dSame`` / ``Conv2dSameExport``, used by the ``tf_*``
  EfficientNets): the module pads its input asymmetrically inside ``forward``; the rules below pad (or, for a
  depthwise layer, leave out) the same rows and columns, computed from the stored input's size.
* **Depthwise and narrow grouped convolutions** (at most :data:`MAX_CHANNELS_PER_GROUP` input channels per
  group): per-example weight gradients materialised for all groups at once: a depthwise 2-D layer loops over
  its kernel offsets or its output positions, whichever are fewer, on views of the input (on a CPU in float32, a
  3 × 3 one with at least 256 output positions instead makes one library weight-gradient call per example); other
  grouped layers run one grouped convolution over the batch.

:func:`vision_handler` picks one of these for a module, or returns None.  :func:`has_own_forward` tells the
engine when a subclass of a layer with a fast rule computes something else in ``forward`` (timm's
``LayerNorm2d``, ``StdConv2d``, ``GroupNormAct``, ...): those must not get the base class's rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from privtune.engine._layers import ConvHandler, _MaterialisingHandler

__all__ = ["BatchNormHandler", "GroupedConvHandler", "SamePadConvHandler", "has_own_forward", "vision_handler"]

_BATCHNORM_BASES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def has_own_forward(module: nn.Module, base: type) -> bool:
    """Whether ``module``'s class overrides ``base.forward`` (it is then not the layer ``base``'s rule describes)."""
    return getattr(type(module), "forward", None) is not base.forward


def _is_timm(module: nn.Module, *names: str) -> bool:
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith("timm.")


def _tf_same_pad(size: int, kernel: int, stride: int, dilation: int) -> int:
    """Total padding of TF "SAME" along one axis (the formula timm's ``pad_same`` uses)."""
    return max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)


def _pad_tf_same(m: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded as timm's ``Conv2dSame`` pads it: TF "SAME" (more on the bottom/right when the total is odd),
    computed from the input size at every call."""
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    ph = _tf_same_pad(x.shape[-2], kh, sh, dh)
    pw = _tf_same_pad(x.shape[-1], kw, sw, dw)
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


class SamePadConvHandler(ConvHandler):
    """timm's ``Conv2dSame``: ``conv2d(pad_same(x), W, b, padding=0)``; the stored input is padded the same way."""

    def store_input(self, args, kwargs):
        x = super().store_input(args, kwargs)
        return None if x is None else _pad_tf_same(self.module, x)


#: a grouped convolution whose groups each see at most this many input channels materialises its per-example
#: weight gradients (B × |W|, small: a depthwise 3×3 convolution over C channels has 9·C weights)
MAX_CHANNELS_PER_GROUP = 16


#: a depthwise layer on a CPU in float32 with a kernel of at most this many offsets and an output of at least
#: :data:`_LIBRARY_MIN_POSITIONS` positions gets its per-example weight gradients from one library call per example
#: (oneDNN's direct depthwise kernel); measured by bench/depthwise_rules.py on EfficientNet-Lite0 at 64 and 128 px,
#: batch 32, one thread: 1.0–4.9× faster than the loop over kernel offsets on its 3 × 3 layers with 16 × 16 to
#: 64 × 64 outputs; from 1.4× faster to 86× slower on its 5 × 5 layers, and from 1.6× faster to 65× slower on 3 × 3
#: layers with 4 to 64 output positions (the calls' own cost dominates small outputs)
_LIBRARY_KERNEL_AREA = 9
_LIBRARY_MIN_POSITIONS = 256


#: output rows shorter than this (float32 numbers: one 64-byte cache line) make a depthwise layer's per-example
#: terms run over channels (a channels-last copy) rather than along the rows (EfficientNet-Lite0's late layers)
_SHORT_ROW = 16


def _inside(base: int, step: int, n: int, size: int) -> tuple[int, int]:
    """The t in [0, n) with 0 ≤ base + t·step < size (an index into an unpadded axis of ``size``), as (first, end)."""
    first = max(0, -(base // step))
    end = min(n, (size - 1 - base) // step + 1)
    return first, max(first, end)


class GroupedConvHandler(_MaterialisingHandler):
    """Depthwise and other narrow grouped convolutions (``nn.Conv1d/2d``, timm's ``Conv2dSame``) with a trainable
    weight: per-example weight gradients materialised for all groups at once, and ``∇b_i = Σ_l g_i``.  A depthwise
    2-D convolution loops over its kernel offsets or its output positions (:meth:`_by_windows`); other grouped
    convolutions run one grouped convolution over the whole batch (:meth:`_by_grouped_conv`).  The unfold-based
    rule of ``ConvHandler`` works group by group, one pass per channel for a depthwise convolution.  Norms are
    those of exactly the vectors added (float64, rounded up), as for the normalisation layers."""

    kind = "conv"

    def __init__(self, module, params, same_pad: bool):
        super().__init__(module, params)
        self.same_pad = same_pad

    def _padding(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        """(left, right, top, bottom) zero or mode padding of the 2-D input ``x`` (as stored: unpadded)."""
        m = self.module
        if not self.same_pad:
            return tuple(m._reversed_padding_repeated_twice)
        (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
        ph, pw = _tf_same_pad(x.shape[-2], kh, sh, dh), _tf_same_pad(x.shape[-1], kw, sw, dw)
        return pw // 2, pw - pw // 2, ph // 2, ph - ph // 2

    def _by_grouped_conv(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per-example weight gradients (B, *W) as one convolution with B·Cin groups: each example's input
        channel is correlated with its own output gradients used as kernels (dilated by the stride; the layer's
        dilation becomes the stride), ``∇W_i[o, j, u, v] = Σ_l x_i[j, u·d + l·s] g_i[o, l]``; no unfolded copy of
        the input is made."""
        m = self.module
        if isinstance(m, nn.Conv1d):
            pad = m._reversed_padding_repeated_twice
        else:
            pad = self._padding(x)
        if any(pad):
            mode = "constant" if self.same_pad or m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, pad, mode=mode)
        k, st, dil = m.kernel_size, m.stride, m.dilation
        if isinstance(m, nn.Conv1d):
            x, g, k, st, dil = x.unsqueeze(2), g.unsqueeze(2), (1, k[0]), (1, st[0]), (1, dil[0])
        B, Cin = x.shape[:2]
        G, Cout = m.groups, g.shape[1]
        n, mo = Cin // G, Cout // G
        Ho, Wo = g.shape[-2:]
        kernels = g.reshape(B, G, 1, mo, Ho, Wo).expand(B, G, n, mo, Ho, Wo).reshape(B * Cin * mo, 1, Ho, Wo)
        r = F.conv2d(x.reshape(1, B * Cin, *x.shape[-2:]), kernels, stride=dil, dilation=st, groups=B * Cin)
        r = r.reshape(B, G, n, mo, r.shape[-2], r.shape[-1])[..., :k[0], :k[1]]
        return r.permute(0, 1, 3, 2, 4, 5).reshape(B, *self.params["weight"].shape)

    def _by_library(self, x: torch.Tensor, g: torch.Tensor) -> bool:
        """Whether this depthwise layer's per-example gradients come from :meth:`_by_example_calls` (see
        :data:`_LIBRARY_KERNEL_AREA`); zero padding only (another mode is padded by :meth:`_by_windows`)."""
        m = self.module
        kh, kw = m.kernel_size
        return (x.device.type == "cpu" and x.dtype == g.dtype == torch.float32
                and kh * kw <= _LIBRARY_KERNEL_AREA and g.shape[-2] * g.shape[-1] >= _LIBRARY_MIN_POSITIONS
                and (self.same_pad or m.padding_mode == "zeros" or not any(self._padding(x))))

    def _by_example_calls(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per-example weight gradients of a depthwise 2-D convolution as one weight-gradient call of the convolution
        library per example (``torch.nn.grad.conv2d_weight`` on the example's own rows, a view in either memory
        layout): the library's depthwise kernel runs over the example's positions once for all kernel offsets,
        where :meth:`_by_windows` makes a pass per offset.  Symmetric zero padding is the call's own; asymmetric
        ("same") padding copies each example into one zero-bordered buffer (in the input's memory layout).  Returns a
        (B, C, 1, kh, kw) tensor."""
        m = self.module
        left, right, top, bottom = self._padding(x)
        symmetric = left == right and top == bottom
        if not symmetric:
            layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) \
                and not x.is_contiguous() else torch.contiguous_format
            padded = torch.empty(1, x.shape[1], x.shape[2] + top + bottom, x.shape[3] + left + right,
                                 dtype=x.dtype, device=x.device, memory_format=layout).zero_()
            interior = padded[:, :, top:top + x.shape[2], left:left + x.shape[3]]
        out = g.new_empty(g.shape[0], *m.weight.shape)
        for i in range(x.shape[0]):
            if symmetric:
                xi = x[i:i + 1]
            else:
                interior.copy_(x[i:i + 1])
                xi = padded
            out[i] = torch.nn.grad.conv2d_weight(xi, m.weight.shape, g[i:i + 1], stride=m.stride,
                                                 padding=(top, left) if symmetric else 0, dilation=m.dilation,
                                                 groups=m.groups)
        return out

    def _by_windows(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per-example weight gradients of a depthwise 2-D convolution (one input channel per output channel),
        ``∇W_i[c, 0, u, v] = Σ_l x_i[c, u·d + l·s − p] g_i[c, l]``, as a loop over whichever is fewer: the kernel
        offsets (u, v) (a strided view of the input times the output gradient, summed over positions) or the output
        positions l (the input window under l, scaled by g_i[c, l], accumulated).  Every term is a view: no
        unfolded or padded copy of the input (zero padding is the part of a window that falls outside the input,
        left out).  The views keep a contiguous dimension innermost: (B, H, W, C) for a channels-last input;
        (B, C, H, W) for a contiguous one with unit stride and rows of at least :data:`_SHORT_ROW`, else one
        channels-last copy of the input and the gradient first.  Read across the layout (channels innermost over
        a contiguous input) the products of EfficientNet-Lite0's first 3 × 3 layer (64 px, batch 32) ran about
        5× slower on a CPU, and strided or short rows read along the layout about as slowly.  On a CPU this beats
        one grouped convolution with a kernel per channel and example.  Returns a (B, C, 1, kh, kw) tensor."""
        m = self.module
        left, right, top, bottom = self._padding(x)
        if (left or right or top or bottom) and not self.same_pad and m.padding_mode != "zeros":
            x = F.pad(x, (left, right, top, bottom), mode=m.padding_mode)
            left = right = top = bottom = 0
        (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
        (H, W), (Ho, Wo) = x.shape[-2:], g.shape[-2:]
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        if not channels_last and (sh > 1 or sw > 1 or Wo < _SHORT_ROW):
            # a strided window, or rows shorter than a cache line, read in (B, C, H, W) make every term a scalar
            # loop; one channels-last copy of the input and the gradient makes each a run over contiguous channels
            x, g = x.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
            channels_last = True
        if channels_last:  # (B, H, W, C) views; the spatial dimensions are 1 and 2
            xs, gs = x.permute(0, 2, 3, 1), g.permute(0, 2, 3, 1)
            out = g.new_zeros(g.shape[0], kh, kw, g.shape[1])

            def spatial(t, rows, cols):
                return t[:, rows, cols]
        else:  # (B, C, H, W) as stored; the spatial dimensions are 2 and 3
            xs, gs = x, g
            out = g.new_zeros(g.shape[0], g.shape[1], kh, kw)

            def spatial(t, rows, cols):
                return t[:, :, rows, cols]
        if Ho * Wo <= kh * kw:
            for i in range(Ho):
                u0, u1 = _inside(i * sh - top, dh, kh, H)
                r0 = i * sh - top + u0 * dh
                for j in range(Wo):
                    v0, v1 = _inside(j * sw - left, dw, kw, W)
                    c0 = j * sw - left + v0 * dw
                    if u1 > u0 and v1 > v0:
                        window = spatial(xs, slice(r0, r0 + dh * (u1 - u0 - 1) + 1, dh),
                                         slice(c0, c0 + dw * (v1 - v0 - 1) + 1, dw))
                        spatial(out, slice(u0, u1), slice(v0, v1)).addcmul_(
                            window, spatial(gs, slice(i, i + 1), slice(j, j + 1)))
            return (out.permute(0, 3, 1, 2) if channels_last else out).unsqueeze(2)
        buffers: dict = {}  # one buffer per shape for the k_h·k_w products (offsets near a border see fewer rows)
        position_dims = (1, 2) if channels_last else (2, 3)
        for u in range(kh):
            i0, i1 = _inside(u * dh - top, sh, Ho, H)
            for v in range(kw):
                j0, j1 = _inside(v * dw - left, sw, Wo, W)
                if i1 <= i0 or j1 <= j0:
                    continue
                r0, c0 = u * dh - top + i0 * sh, v * dw - left + j0 * sw
                window = spatial(xs, slice(r0, r0 + sh * (i1 - i0 - 1) + 1, sh),
                                 slice(c0, c0 + sw * (j1 - j0 - 1) + 1, sw))
                rows = spatial(gs, slice(i0, i1), slice(j0, j1))
                product = buffers.get(rows.shape)
                if product is None:
                    product = buffers[rows.shape] = torch.empty(rows.shape, dtype=g.dtype, device=g.device)
                torch.mul(window, rows, out=product)
                torch.sum(product.flatten(*position_dims), position_dims[0],
                          out=out[:, u, v] if channels_last else out[:, :, u, v])
        return (out.permute(0, 3, 1, 2) if channels_last else out).unsqueeze(2)

    def per_example(self, records):
        w = self.params["weight"]
        m = self.module
        depthwise = isinstance(m, nn.Conv2d) and m.groups == m.in_channels == m.out_channels
        out: dict = {}
        for r in records:
            g = r.grads[0]
            if not depthwise:
                pe = self._by_grouped_conv(r.act, g)
            else:
                pe = self._by_example_calls(r.act, g) if self._by_library(r.act, g) else self._by_windows(r.act, g)
            out[w] = pe if w not in out else out[w] + pe
            if "bias" in self.params:
                b = self.params["bias"]
                gb = g.sum(tuple(range(2, g.dim())))
                out[b] = gb if b not in out else out[b] + gb
        return out


class BatchNormHandler(_MaterialisingHandler):
    """Eval-mode BatchNorm (running statistics): per-example ``∂/∂γ = Σ_spatial g·x̂``, ``∂/∂β = Σ_spatial g``.

    For timm's ``BatchNormAct2d`` the module output is ``act(drop(BN(x)))``: the engine captures the gradient of
    ``drop``'s input, the BN output itself (:attr:`capture_module`), so g needs no recomputation of the activation
    and β alone keeps no activation (DP-BiTFiT), as for the plain layer.  A dropout there is allowed: its mask,
    drawn in the forward pass, is part of each example's own computation.  A module in train mode, or one without
    running statistics, is refused by the engine's BatchNorm check before it gets here."""

    kind = "batchnorm"

    def __init__(self, module, params, with_activation: bool):
        super().__init__(module, params)
        self.with_activation = with_activation
        if with_activation:
            self.capture_module = module.drop

    def reduce_grad(self, g):
        if self.needs_input:
            return g
        return g.sum(tuple(range(2, g.dim()))) if g.dim() > 2 else g  # β only: (B, C), DP-BiTFiT

    def per_example(self, records):
        m = self.module
        out: dict = {}
        for r in records:
            g = r.grads[0]
            if not self.needs_input:
                out[self.params["bias"]] = out.get(self.params["bias"], 0) + g
                continue
            # Σ_spatial g·x̂ = (Σ g·x − μ·Σ g) / √(σ² + ε): no normalised copy of the input is made, and the sums
            # run over channel rows in the tensors' own memory layout (a channels-last network is not copied)
            gx, gs = _channel_sums(r.act, g)
            gw = (gx - m.running_mean * gs) * torch.rsqrt(m.running_var + m.eps)
            out[self.params["weight"]] = out.get(self.params["weight"], 0) + gw
            if "bias" in self.params:
                out[self.params["bias"]] = out.get(self.params["bias"], 0) + gs
        return out


def _channel_rows(t: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) → (B, positions, C), a view for both the contiguous and the channels-last layout."""
    return t.reshape(t.shape[0], t.shape[1], -1).transpose(1, 2) if t.is_contiguous() else \
        t.flatten(2).transpose(1, 2)


def _channel_sums(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example and channel, ``(Σ_spatial g·x, Σ_spatial g)``, each (B, C), in float32 at least."""
    if x.dim() == 2:
        x, g = x.unsqueeze(-1), g.unsqueeze(-1)
    if g.dtype not in (torch.float32, torch.float64):  # half precision: the difference above would cancel
        x, g = x.float(), g.float()
    xr, gr = _channel_rows(x), _channel_rows(g)
    return torch.linalg.vecdot(xr, gr, dim=1), gr.sum(1)  # vecdot: no (B, positions, C) product is stored


def vision_handler(module: nn.Module, own: dict[str, nn.Parameter]):
    """The handler of this module for the trainable parameters ``own`` (role → parameter), or None when no rule
    here applies (the engine then uses its own rules or the exact ``torch.func`` fallback)."""
    roles = set(own)
    if not roles <= {"weight", "bias"}:
        return None
    same_pad = isinstance(module, nn.Conv2d) and _is_timm(module, "Conv2dSame", "Conv2dSameExport")
    plain_conv = any(isinstance(module, base) and not has_own_forward(module, base) for base in (nn.Conv1d, nn.Conv2d))
    if (same_pad or plain_conv) and "weight" in own and module.groups > 1 \
            and module.in_channels // module.groups <= MAX_CHANNELS_PER_GROUP:
        return GroupedConvHandler(module, own, same_pad)
    if same_pad:
        return SamePadConvHandler(module, own)
    if isinstance(module, _BATCHNORM_BASES) and module.affine:
        if not any(has_own_forward(module, base) for base in _BATCHNORM_BASES if isinstance(module, base)):
            return BatchNormHandler(module, own, with_activation=False)
        if _is_timm(module, "BatchNormAct2d") and isinstance(getattr(module, "drop", None), nn.Module) \
                and isinstance(getattr(module, "act", None), nn.Module):
            return BatchNormHandler(module, own, with_activation=True)
    return None
