"""Per-example rules for the layers of convolutional vision backbones (timm / torchvision), beside
:mod:`privtune.engine._layers`.

* **Eval-mode BatchNorm** (``nn.BatchNorm1d/2d/3d`` and timm's ``BatchNormAct2d``, which applies its
  activation inside the module): with the running statistics fixed, ``y = γ·x̂ + β`` with
  ``x̂ = (x − μ_run)/√(σ²_run + ε)`` is a per-example affine map, so per example
  ``∂/∂γ_c = Σ_spatial g·x̂`` and ``∂/∂β_c = Σ_spatial g`` (g: the gradient at the normalised output, before
  the activation; for ``BatchNormAct2d`` the engine captures it at the input of the module's ``drop``, which
  follows the normalisation).  Exact, vectorised over the batch, (B, C) per parameter.
* **TF-"same" padded convolutions** (timm's ``Conv2dSame`` / ``Conv2dSameExport``, used by the ``tf_*``
  EfficientNets): the module pads its input asymmetrically inside ``forward``; the stored input is padded the
  same way, then the ordinary unfold rule applies.
* **Depthwise and narrow grouped convolutions** (at most :data:`MAX_CHANNELS_PER_GROUP` input channels per
  group): per-example weight gradients materialised for all groups in one batched product.

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


class GroupedConvHandler(_MaterialisingHandler):
    """Depthwise and other narrow grouped convolutions (``nn.Conv1d/2d``, timm's ``Conv2dSame``) with a trainable
    weight: per-example gradients materialised by one grouped convolution over the whole batch (each example's
    input channels correlated with its own output gradients, :meth:`_by_grouped_conv`), and ``∇b_i = Σ_l g_i``.
    The unfold-based rule of ``ConvHandler`` works group by group, which costs one pass per channel for a
    depthwise convolution; this is one pass for all, without an unfolded copy of the input.  Norms are those of
    exactly the vectors added (float64, rounded up), as for the normalisation layers."""

    kind = "conv"

    def __init__(self, module, params, same_pad: bool):
        super().__init__(module, params)
        self.same_pad = same_pad

    def store_input(self, args, kwargs):
        x = super().store_input(args, kwargs)
        return _pad_tf_same(self.module, x) if self.same_pad else x

    def _by_grouped_conv(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per-example weight gradients (B, *W) as one convolution with B·Cin groups: each example's input
        channel is correlated with its own output gradients used as kernels (dilated by the stride; the layer's
        dilation becomes the stride), ``∇W_i[o, j, u, v] = Σ_l x_i[j, u·d + l·s] g_i[o, l]``; no unfolded copy of
        the input is made."""
        m = self.module
        if not self.same_pad and any(m._reversed_padding_repeated_twice):
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
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

    def per_example(self, records):
        w = self.params["weight"]
        out: dict = {}
        for r in records:
            g = r.grads[0]
            B, Cout = g.shape[0], g.shape[1]
            pe = self._by_grouped_conv(r.act, g)
            out[w] = out.get(w, 0) + pe
            if "bias" in self.params:
                b = self.params["bias"]
                out[b] = out.get(b, 0) + g.reshape(B, Cout, -1).sum(2)
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
        return g.reshape(g.shape[0], g.shape[1], -1).sum(2)  # β only: (B, C), DP-BiTFiT

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - m.running_mean.reshape(shape)) * torch.rsqrt(m.running_var.reshape(shape) + m.eps)

    def per_example(self, records):
        out: dict = {}
        for r in records:
            g = r.grads[0]
            if not self.needs_input:
                out[self.params["bias"]] = out.get(self.params["bias"], 0) + g
                continue
            B, C = g.shape[0], g.shape[1]
            gs = g.reshape(B, C, -1)
            out[self.params["weight"]] = out.get(self.params["weight"], 0) + \
                (self._normalised(r.act).reshape(B, C, -1) * gs).sum(2)
            if "bias" in self.params:
                out[self.params["bias"]] = out.get(self.params["bias"], 0) + gs.sum(2)
        return out


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
