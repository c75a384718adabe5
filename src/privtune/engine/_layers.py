"""Per-layer rules for per-example gradient norms and clipped sums (book-keeping).

Every handler sees, for each call of its module in the current forward pass, what the
forward hook stored (the layer input, only when a *weight* is trainable) and the gradient
of the summed per-example losses with respect to the module output, ``g`` (shape
``(B, ...)``).  Because the loss is a sum of per-example losses and examples do not
interact, ``g[i]`` is the gradient of ``loss_i`` with respect to example ``i``'s output,
so per-example parameter gradients are functions of ``(a[i], g[i])`` alone.

A handler provides two things:

* ``sq_norms(records) -> (B,)``: the squared L2 norm of each example's gradient over the
  handler's trainable parameters, without materialising per-example gradients when the
  layer allows it (ghost norm ``‖aᵀg‖²_F = Σ_{t,s} (a_t·a_s)(g_t·g_s)``), and
* ``clipped_sum(records, c) -> {param: tensor}``: ``Σ_i c_i ∇_θ loss_i`` from the same
  stored tensors (one matrix product per weight; a weighted sum for biases).

Bias-only layers store no input activation at all (DP-BiTFiT, Bu et al. 2024): their
output gradient is reduced to ``(B, p)`` inside the backward hook.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Record:
    """What one call of a hooked module leaves for the backward pass."""

    act: Any = None                  # stored input (tensor, or (args, kwargs) for the fallback)
    grads: list = field(default_factory=list)  # output gradients, one per captured output
    n_outputs: int = 1
    leaf_index: list = field(default_factory=list)  # fallback: positions of captured outputs
    ready: bool = False


def hf_conv1d_type():
    """HF ``Conv1D`` (GPT-2) if transformers is loaded; a model containing one has imported it already."""
    import sys

    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None) if mod is not None else None


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        return args[0]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


class Handler(ABC):
    """Base class.  ``params`` maps a role ('weight', 'bias', ...) to a trainable Parameter."""

    kind = "base"

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]):
        self.module = module
        self.params = params
        self.records: list[Record] = []
        self.sq: torch.Tensor | None = None  # per-example squared norm, filled when all records are ready
        self.gram_cache: dict | None = None   # shared across handlers for one backward pass

    @property
    def needs_input(self) -> bool:
        return "weight" in self.params

    # -- called from the forward hook -------------------------------------------------
    def store_input(self, args: tuple, kwargs: dict) -> Any:
        return _first_input(args, kwargs).detach() if self.needs_input else None

    # -- called from the backward hook ------------------------------------------------
    def reduce_grad(self, g: torch.Tensor) -> torch.Tensor:
        """Shrink the output gradient right away when only the bias is trainable."""
        return g

    def finish(self) -> None:
        """All records have gradients: compute per-example squared norms."""
        self.sq = self.sq_norms(self.records)

    @abstractmethod
    def sq_norms(self, records: list[Record]) -> torch.Tensor:
        """(B,) per-example squared gradient norms of this layer's parameters."""

    @abstractmethod
    def clipped_sum(self, records: list[Record], c: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """Σ_i c_i · ∇_θ loss_i for each parameter of this layer (c: (B,) clipping factors)."""

    def clear(self) -> None:
        self.records = []
        self.sq = None


# ----------------------------------------------------------------------------------------
# Linear-like layers: nn.Linear, HF Conv1D, and convolutions after unfolding
# ----------------------------------------------------------------------------------------

def linear_norm_form(T: int, p: int, d: int) -> str:
    """Which per-example weight-norm form a linear layer uses for sequence length T, output size p and
    input size d: ``"rank-one"`` (T = 1: ‖a‖²‖g‖², exact and cheapest), ``"ghost"`` (T×T Gram matrices,
    memory ~2T² per example) when 2T² < p·d, else ``"per-example"`` (materialise the p×d gradient of
    each example).  Bu et al.'s mixed ghost norm rule: ghost costs ~2T²(p+d) flops and 2T² memory per
    example, the per-example form ~2Tpd flops and p·d memory."""
    if T == 1:
        return "rank-one"
    return "ghost" if 2 * T * T < p * d else "per-example"


def _linear_weight_sq(a: torch.Tensor, g: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """Per-example ‖g_iᵀ a_i‖²_F for a (B, T, d), g (B, T, p), choosing the cheaper form
    (:func:`linear_norm_form`: ghost when 2T² < p·d)."""
    _, T, d = a.shape
    p = g.shape[-1]
    form = linear_norm_form(T, p, d)
    if form == "rank-one":
        return a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))
    if form == "ghost":
        key = (a.data_ptr(), tuple(a.shape), tuple(a.stride()), a.dtype)
        hit = cache.get(key) if cache is not None else None
        if hit is not None:  # layers sharing one input (Q, K, V; LoRA A and its base) share the Gram matrix
            aa = hit[1]
        else:
            aa = torch.bmm(a, a.transpose(1, 2))
            if cache is not None:
                cache[key] = (a, aa)  # holding `a` keeps its address from being reused by another tensor
        gg = torch.bmm(g, g.transpose(1, 2))
        return (aa * gg).sum((1, 2))
    return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))


def _cat3(ts: list[torch.Tensor]) -> torch.Tensor:
    """(B, *, k) tensors → (B, T, k), concatenated over calls; no copy for a single call."""
    ts = [t.reshape(t.shape[0], -1, t.shape[-1]) for t in ts]
    return ts[0] if len(ts) == 1 else torch.cat(ts, 1)


class LinearHandler(Handler):
    """``y = x Wᵀ + b`` over the last dimension (nn.Linear), or ``y = x W + b`` (HF Conv1D)."""

    kind = "linear"

    def __init__(self, module, params, transposed: bool = False):
        super().__init__(module, params)
        self.transposed = transposed  # HF Conv1D stores W as (d, p)

    def reduce_grad(self, g):
        if not self.needs_input:
            return g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)  # (B, p): DP-BiTFiT
        return g

    def _cat(self, records):
        a = _cat3([r.act for r in records])
        g = _cat3([r.grads[0] for r in records])
        return a, g

    def sq_norms(self, records):
        if not self.needs_input:
            gb = sum(r.grads[0] for r in records)
            return gb.pow(2).sum(1)
        a, g = self._cat(records)
        sq = _linear_weight_sq(a, g, self.gram_cache)
        if "bias" in self.params:
            sq = sq + g.sum(1).pow(2).sum(1)
        return sq

    def clipped_sum(self, records, c):
        out = {}
        if not self.needs_input:
            gb = sum(r.grads[0] for r in records)
            out[self.params["bias"]] = c.to(gb.dtype) @ gb
            return out
        a, g = self._cat(records)
        gc = g * c.to(g.dtype)[:, None, None]
        p, d = g.shape[-1], a.shape[-1]
        gw = gc.reshape(-1, p).t() @ a.reshape(-1, d)  # (p, d)
        out[self.params["weight"]] = gw.t() if self.transposed else gw
        if "bias" in self.params:
            out[self.params["bias"]] = gc.sum((0, 1))
        return out


class ConvHandler(LinearHandler):
    """nn.Conv1d / nn.Conv2d: unfold the (padded) input so the layer is a linear map per position."""

    kind = "conv"

    def reduce_grad(self, g):
        if not self.needs_input:
            return g.reshape(g.shape[0], g.shape[1], -1).sum(2)  # channel-first
        return g

    def _unfold(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, pad, mode=mode)
        if isinstance(m, nn.Conv1d):
            x = x.unsqueeze(2)
            k, dil, st = (1, m.kernel_size[0]), (1, m.dilation[0]), (1, m.stride[0])
        else:
            k, dil, st = m.kernel_size, m.dilation, m.stride
        return F.unfold(x, k, dilation=dil, padding=0, stride=st)  # (B, Cin*k, L)

    def _cat(self, records):
        G = self.module.groups
        a_list, g_list = [], []
        for r in records:
            u = self._unfold(r.act)  # (B, Cin*k, L)
            B, CK, L = u.shape
            u = u.reshape(B, G, CK // G, L).permute(1, 0, 3, 2)  # (G, B, L, CK/G)
            go = r.grads[0].reshape(B, G, -1, L).permute(1, 0, 3, 2)  # (G, B, L, Cout/G)
            a_list.append(u)
            g_list.append(go)
        if len(a_list) == 1:
            return a_list[0], g_list[0]
        return torch.cat(a_list, 2), torch.cat(g_list, 2)

    def sq_norms(self, records):
        if not self.needs_input:
            gb = sum(r.grads[0] for r in records)
            return gb.pow(2).sum(1)
        a, g = self._cat(records)
        sq = sum(_linear_weight_sq(a[j], g[j]) for j in range(a.shape[0]))
        if "bias" in self.params:
            gb = g.sum(2).permute(1, 0, 2).reshape(g.shape[1], -1)
            sq = sq + gb.pow(2).sum(1)
        return sq

    def clipped_sum(self, records, c):
        if not self.needs_input:
            return super().clipped_sum(records, c)
        a, g = self._cat(records)
        gc = g * c.to(g.dtype)[None, :, None, None]
        w = self.params["weight"]
        parts = [gc[j].reshape(-1, gc.shape[-1]).t() @ a[j].reshape(-1, a.shape[-1]) for j in range(a.shape[0])]
        out = {w: torch.cat(parts, 0).reshape(w.shape)}
        if "bias" in self.params:
            out[self.params["bias"]] = gc.sum((1, 2)).reshape(-1)
        return out


# ----------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------

class EmbeddingHandler(Handler):
    """nn.Embedding: per-example ‖Σ_t onehot(x_t) g_tᵀ‖² = Σ_{t,s} [x_t = x_s] g_t·g_s (ghost)."""

    kind = "embedding"

    def store_input(self, args, kwargs):
        return _first_input(args, kwargs).detach()

    def _cat(self, records):
        ids = [r.act.reshape(r.act.shape[0], -1) for r in records]
        ids = ids[0] if len(ids) == 1 else torch.cat(ids, 1)
        g = _cat3([r.grads[0] for r in records])
        pad = self.module.padding_idx
        if pad is not None:
            g = g * (ids != pad).unsqueeze(-1).to(g.dtype)
        return ids, g

    def sq_norms(self, records):
        ids, g = self._cat(records)
        if ids.shape[1] == 1:
            return g.pow(2).sum((1, 2))
        eq = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g.dtype)
        gg = torch.bmm(g, g.transpose(1, 2))
        return (eq * gg).sum((1, 2))

    def clipped_sum(self, records, c):
        ids, g = self._cat(records)
        w = self.params["weight"]
        gc = (g * c.to(g.dtype)[:, None, None]).reshape(-1, g.shape[-1])
        out = torch.zeros(w.shape, dtype=g.dtype, device=g.device)
        out.index_add_(0, ids.reshape(-1), gc)
        return {w: out}


# ----------------------------------------------------------------------------------------
# Normalisation layers: per-example gradients are small (B × channels): materialise them
# ----------------------------------------------------------------------------------------

class _MaterialisingHandler(Handler):
    """Handlers whose per-example gradients are cheap to hold: (B, *param.shape) each."""

    @abstractmethod
    def per_example(self, records) -> dict[nn.Parameter, torch.Tensor]:
        """Per-example gradients, (B, *param.shape) for each parameter."""

    def finish(self):
        self._pe = self.per_example(self.records)
        self.sq = sum(t.reshape(t.shape[0], -1).pow(2).sum(1) for t in self._pe.values())

    def sq_norms(self, records):
        pe = self.per_example(records)
        return sum(t.reshape(t.shape[0], -1).pow(2).sum(1) for t in pe.values())

    def clipped_sum(self, records, c):
        pe = getattr(self, "_pe", None)
        if pe is None:
            pe = self.per_example(records)
        return {p: torch.tensordot(c.to(t.dtype), t, dims=1) for p, t in pe.items()}

    def clear(self):
        super().clear()
        self._pe = None


class LayerNormHandler(_MaterialisingHandler):
    """nn.LayerNorm: ∂/∂γ = Σ_t x̂_t ∘ g_t, ∂/∂β = Σ_t g_t (x̂ recomputed from the stored input)."""

    kind = "layernorm"

    def reduce_grad(self, g):
        nd = len(self.module.normalized_shape)
        return g if self.needs_input else g.reshape(g.shape[0], -1, *g.shape[g.dim() - nd:]).sum(1)

    def per_example(self, records):
        m = self.module
        nd = len(m.normalized_shape)
        out = {}
        for r in records:
            g = r.grads[0]
            if self.needs_input:
                B = g.shape[0]
                xhat = F.layer_norm(r.act, m.normalized_shape, None, None, m.eps)
                gw = (xhat * g).reshape(B, -1, *g.shape[g.dim() - nd:]).sum(1)
                out[self.params["weight"]] = out.get(self.params["weight"], 0) + gw
                if "bias" in self.params:
                    gb = g.reshape(B, -1, *g.shape[g.dim() - nd:]).sum(1)
                    out[self.params["bias"]] = out.get(self.params["bias"], 0) + gb
            else:
                out[self.params["bias"]] = out.get(self.params["bias"], 0) + g
        return out


class GroupNormHandler(_MaterialisingHandler):
    """nn.GroupNorm (channel-first): ∂/∂γ_c = Σ_spatial x̂ ∘ g, ∂/∂β_c = Σ_spatial g."""

    kind = "groupnorm"

    def reduce_grad(self, g):
        return g if self.needs_input else g.reshape(g.shape[0], g.shape[1], -1).sum(2)

    def per_example(self, records):
        m = self.module
        out = {}
        for r in records:
            g = r.grads[0]
            B, C = g.shape[0], g.shape[1]
            if self.needs_input:
                xhat = F.group_norm(r.act, m.num_groups, None, None, m.eps)
                out[self.params["weight"]] = out.get(self.params["weight"], 0) + (xhat * g).reshape(B, C, -1).sum(2)
                if "bias" in self.params:
                    out[self.params["bias"]] = out.get(self.params["bias"], 0) + g.reshape(B, C, -1).sum(2)
            else:
                out[self.params["bias"]] = out.get(self.params["bias"], 0) + g
        return out


# ----------------------------------------------------------------------------------------
# General fallback: torch.func per-example gradients of the module's own parameters
# ----------------------------------------------------------------------------------------

class FallbackHandler(_MaterialisingHandler):
    """Any other module: per-example gradients by ``vmap(grad(⟨f(θ, x_i), g_i⟩))``.

    The module's forward is recomputed per example from its stored inputs, so it must be
    deterministic (no active dropout inside it).  Costs a forward + backward of the module
    per example and ``B × numel`` memory for its parameters.
    """

    kind = "fallback"

    def __init__(self, module, params, names: dict[nn.Parameter, str]):
        super().__init__(module, params)
        self.names = names  # param -> name relative to the module (for functional_call)

    @property
    def needs_input(self):
        return True

    def store_input(self, args, kwargs):
        det = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
        return (tuple(det(a) for a in args), {k: det(v) for k, v in kwargs.items()})

    def per_example(self, records):
        from torch.func import functional_call, grad, vmap
        from torch.utils._pytree import tree_flatten

        module = self.module
        pnames = {self.names[p]: p for p in self.params.values()}
        out: dict[nn.Parameter, torch.Tensor] = {}
        for r in records:
            args, kwargs = r.act
            B = r.grads[0].shape[0]
            t_args = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == B]
            t_kw = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B]
            leaf_index = r.leaf_index

            def f(params, bargs, bkw, grads):
                a2 = list(args)
                for (i, _), v in zip(t_args, bargs):
                    a2[i] = v.unsqueeze(0)
                kw2 = dict(kwargs)
                for (k, _), v in zip(t_kw, bkw):
                    kw2[k] = v.unsqueeze(0)
                y = functional_call(module, params, tuple(a2), kw2)
                leaves = tree_flatten(y)[0]
                total = 0
                for j, gi in zip(leaf_index, grads):
                    total = total + (leaves[j] * gi.unsqueeze(0)).sum()
                return total

            params = {n: p.detach() for n, p in pnames.items()}
            pe = vmap(grad(f), in_dims=(None, 0, 0, 0), randomness="error")(
                params, [v for _, v in t_args], [v for _, v in t_kw], list(r.grads)
            )
            for n, p in pnames.items():
                out[p] = out.get(p, 0) + pe[n]
        return out
