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

Sequence layers (linear, embedding) drop, in the backward hook, the positions whose output gradient is
exactly zero (:func:`drop_zero_rows`: padding behind an attention mask), and the ghost norms of linear
layers run over groups of examples of similar length (:func:`length_groups`): a padded batch costs what its
real tokens cost, with the same results (a dropped position adds exactly zero everywhere).

**Norms are certified upper bounds, computed in float64.**  A ghost norm is a sum of T² terms of
both signs; in float32 an example whose token contributions nearly cancel could get a reported norm of
0 and go in unclipped (measured: a gradient of norm 10⁴·C entered the sum whole).  So every ``sq`` a
handler returns is an *upper bound* on the exact squared norm of that example's gradient (of the stored
float tensors): the sums run in float64 on exact float64 copies, and the worst-case float64 rounding error of
the formula used (Higham's γₙ = n·u/(1 − n·u), u = 2⁻⁵³, any summation order, with or without FMA) is added:
γ·U² for a ghost sum, where U = Σ_t ‖a_t‖‖g_t‖ bounds the norm by the triangle inequality. For natural data
the added term is ≈ 1e-12 relative; for a crafted, cancelling example it is what makes the bound hold. When an
example's gradient is so cancelled that its norm is below :data:`ILL_CONDITIONED` · U, the layer's clipped sum
for that micro-batch is also accumulated in float64, so that the float32 rounding of the sum (≈ u₃₂ · c·U per
example) stays negligible next to C.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: float64 unit roundoff.
_U64 = 2.0 ** -53
#: An example whose per-layer gradient norm is below this fraction of U = Σ_t ‖a_t‖‖g_t‖ is
#: "ill-conditioned" (heavy cancellation between its tokens; ~1/√T for natural data): the layer's
#: clipped sum is then accumulated in float64.
ILL_CONDITIONED = 2.0 ** -10


def _gamma(n: float) -> float:
    """Twice Higham's γₙ for float64 (a safety factor of 2); inf when it would not be meaningful."""
    nu = 2.0 * float(n) * _U64
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def _inflate(sq: torch.Tensor, n: float) -> torch.Tensor:
    """A float64 sum of n non-negative terms (no cancellation), made an upper bound on the exact sum."""
    return sq * (1.0 + _gamma(n + 4))


def example_sq_norms(t: torch.Tensor) -> torch.Tensor:
    """Upper bounds on the squared L2 norms of the rows ``t[i]`` of a (B, ...) tensor, float64 (B,): accumulated in
    float64 in ``t``'s own memory layout (no reshaped or converted copy of t), then rounded up by the worst-case
    error of a float64 sum of n squares in any order, the square root and the square."""
    if t.dim() == 1:
        return t.to(torch.float64).pow(2) * (1.0 + 4 * _U64)
    norm = torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim())), dtype=torch.float64)
    return _inflate(norm.pow(2), t[0].numel()) * (1.0 + 8 * _U64)


def weighted_example_sum(c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``Σ_i c_i t[i]`` for a (B, ...) tensor, as one matrix-vector product over t's storage order, so that a
    permuted view (a channels-last result) is not copied; ``c`` is cast toward zero to t's dtype."""
    c = factors_as(c, t.dtype)
    if t.dim() == 1:  # a scalar parameter: (B,)
        return c @ t
    order = sorted(range(1, t.dim()), key=lambda d: -t.stride(d))
    dense = t.permute(0, *order)
    if not dense.is_contiguous():
        return torch.tensordot(c, t, dims=1)
    out = (c @ dense.reshape(t.shape[0], -1)).reshape(dense.shape[1:])
    return out.permute(*sorted(range(len(order)), key=lambda k: order[k]))


def factors_as(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clipping factors ``c`` cast to ``dtype``, rounded toward zero: never above the float64 factor
    (a round-to-nearest cast could raise c by 2⁻²⁴ in float32 or 2⁻⁸ in bfloat16)."""
    out = c.to(dtype)
    if dtype == c.dtype:
        return out
    too_big = out.to(c.dtype) > c
    if bool(too_big.any()):
        out = torch.where(too_big, torch.nextafter(out, torch.zeros_like(out)), out)
    return out


@dataclass
class Record:
    """What one call of a hooked module leaves for the backward pass."""

    act: Any = None                  # stored input (tensor, or (args, kwargs) for the fallback)
    grads: list = field(default_factory=list)  # output gradients, one per captured output
    n_outputs: int = 1
    leaf_index: list = field(default_factory=list)  # fallback: positions of captured outputs
    ready: bool = False
    keep: Any = None  # linear layers: (B, T) bool, the stored positions whose output gradient is not 0


def hf_conv1d_type():
    """HF ``Conv1D`` (GPT-2) if transformers is loaded; a model containing one has imported it already."""
    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None) if mod is not None else None


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        return args[0]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


class Handler(ABC):
    """Base class.  ``params`` maps a role ('weight', 'bias', ...) to a trainable Parameter."""

    kind = "base"

    #: a submodule called inside ``module`` whose *input* is the tensor whose gradient the rule needs, when that
    #: is not the module's output (timm's ``BatchNormAct2d``: the normalised values before the activation); the
    #: engine then captures that tensor's gradient instead of the output's
    capture_module: nn.Module | None = None

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]):
        self.module = module
        self.params = params
        self.pending: Record | None = None  # with capture_module: the record begun by its pre-hook
        self.records: list[Record] = []
        self.sq: torch.Tensor | None = None  # per-example squared norm, filled when all records are ready
        self.gram_cache: dict | None = None   # shared across handlers for one backward pass
        self.pack_cache: dict | None = None   # shared packed layer inputs, during one backward pass

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

    def receive_grad(self, rec: Record, k: int, g: torch.Tensor) -> None:
        """Called from the backward hook with output ``k``'s gradient: store what the norms and sums need."""
        rec.grads[k] = self.reduce_grad(g)

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


def conv_norm_form(T: int, p: int, d: int) -> str:
    """Which per-example weight-norm form a convolution uses over T positions (p outputs, d inputs per group):
    ``"per-example"`` while the p·d per-example gradient is at most twice the layer's stored T·(p + d) input and
    output gradient, else ``"ghost"``.  Unlike a linear layer's (:func:`linear_norm_form`), a convolution keeps
    the materialised gradients for its clipped sum, so the per-example form costs one product of 2·T·p·d float32
    operations in all, where the ghost form costs that product again in the clipped sum plus 2·T²·(p + d)
    float64 operations for the norms: the choice is one of memory."""
    return "per-example" if p * d <= 2 * T * (p + d) else "ghost"


def _gamma32(n: float) -> float:
    """Twice Higham's γₙ for float32 (u = 2⁻²⁴)."""
    nu = 2.0 * float(n) * 2.0 ** -24
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def _token_norm_sum(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """U_i ≥ Σ_t ‖a_t‖‖g_t‖ as float64 (B,): a bound on the per-example weight-gradient norm
    ‖Σ_t g_t a_tᵀ‖_F by the triangle inequality, and the scale of every rounding error below.

    Row norms in float32 (cheap; sums of squares cannot cancel), then rounded up by their worst-case
    float32 error; an overflow gives inf, which clips that example to 0."""
    na = torch.linalg.vector_norm(a.float(), dim=-1)
    ng = torch.linalg.vector_norm(g.float(), dim=-1)
    slack = _gamma32(a.shape[-1] + g.shape[-1] + a.shape[1] + 8)
    return (na.double() * ng.double()).sum(1) * (1.0 + slack)


def _linear_weight_sq(a: torch.Tensor, g: torch.Tensor, cache: dict | None = None,
                      U: torch.Tensor | None = None, cache_key: Any = None) -> torch.Tensor:
    """Per-example upper bound on ‖g_iᵀ a_i‖²_F for a (B, T, d), g (B, T, p): float64, shape (B,).

    Computed in float64 with the cheaper form (:func:`linear_norm_form`: ghost when 2T² < p·d) plus that
    form's worst-case float64 rounding error (module docstring), so it is ≥ the exact squared norm
    whatever the data; for natural data it exceeds it by ~1e-12 relative.  ``U``: :func:`_token_norm_sum`
    of (a, g) when the caller has it already; ``cache_key``: the Gram cache's key for ``a`` when ``a`` is a
    temporary (default: its address)."""
    _, T, d = a.shape
    p = g.shape[-1]
    form = linear_norm_form(T, p, d)
    g64 = g.to(torch.float64)
    if form == "rank-one":  # ‖a‖²‖g‖²: no cancellation
        a64 = a.to(torch.float64)
        return _inflate(a64.pow(2).sum((1, 2)), d) * _inflate(g64.pow(2).sum((1, 2)), p) * (1.0 + 4 * _U64)
    U = _token_norm_sum(a, g) if U is None else U
    if form == "ghost":
        key = (a.data_ptr(), tuple(a.shape), tuple(a.stride()), a.dtype) if cache_key is None else cache_key
        hit = cache.get(key) if cache is not None else None
        if hit is not None:  # layers sharing one input (Q, K, V; LoRA A and its base) share the Gram matrix
            aa = hit[1]
        else:
            a64 = a.to(torch.float64)
            aa = torch.bmm(a64, a64.transpose(1, 2))
            if cache is not None:
                cache[key] = (a, aa)  # holding `a` keeps its address from being reused by another tensor
        gg = torch.bmm(g64, g64.transpose(1, 2))
        # |computed − exact| ≤ γ_{d+p+T²+1} · Σ_{t,s} ‖a_t‖‖a_s‖‖g_t‖‖g_s‖ = γ · U²
        return ((aa * gg).sum((1, 2)).clamp_min(0.0) + _gamma(d + p + T * T + 1) * U.pow(2)) * (1.0 + 4 * _U64)
    # entries of the per-example gradient are sums of T products: ‖Ĝ − G‖_F ≤ γ_T · U
    G = torch.bmm(g64.transpose(1, 2), a.to(torch.float64))
    norm = _inflate(G.pow(2).sum((1, 2)), p * d).sqrt() + _gamma(T) * U
    return norm.pow(2) * (1.0 + 8 * _U64)


def length_groups(counts: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Examples grouped by their number of kept positions (``counts``, (B,)), for ghost norms whose cost is
    Σ_groups n·width² instead of B·T'²: sorted by count and cut at B/2, 3B/4 and 7B/8 (natural lengths
    have a long upper tail), each group with its largest count as width; neighbours of equal width merge.
    Returns (example indices, width) pairs."""
    order = torch.argsort(counts, stable=True)
    ordered = counts[order].tolist()
    B = len(ordered)
    cuts = sorted({0, B // 2, 3 * B // 4, 7 * B // 8, B})
    groups: list[tuple[int, int, int]] = []
    for lo, hi in zip(cuts, cuts[1:]):
        width = max(int(ordered[hi - 1]), 1)
        if groups and groups[-1][2] == width:
            groups[-1] = (groups[-1][0], hi, width)
        else:
            groups.append((lo, hi, width))
    return [(order[lo:hi], width) for lo, hi, width in groups]


def _ill_conditioned(sq: torch.Tensor, a: torch.Tensor, g: torch.Tensor, U: torch.Tensor | None = None) -> bool:
    """Whether some example's weight-gradient norm is below ILL_CONDITIONED · Σ_t ‖a_t‖‖g_t‖ (``U``)."""
    if a.shape[1] == 1:
        return False  # one token: nothing can cancel
    U = _token_norm_sum(a, g) if U is None else U
    return bool((sq < (ILL_CONDITIONED * U).pow(2)).any())


def _pack_rows(x: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """The rows ``x[b, t]`` with ``keep[b, t]``, moved to the front of each example in their order, the
    remaining slots zero: shape (B, width, *x.shape[2:])."""
    out = x.new_zeros((x.shape[0], width) + tuple(x.shape[2:]))
    slots = torch.arange(width, device=x.device) < counts[:, None]
    out[slots] = x[keep]  # both sides enumerate examples in order, then positions in order
    return out


def drop_zero_rows(act: torch.Tensor, g: torch.Tensor,
                   cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Remove the positions whose output gradient is exactly zero from a (B, T, ·) input ``act`` and output
    gradient ``g``: returns (B, T', ·) tensors holding each example's other positions first (same order),
    zero-filled after, with T' the largest number an example keeps, and the (B, T') bool mask of the
    filled slots; ``act``, ``g`` and an all-true mask when every position is kept (None: one position, or
    input and gradient not aligned position by position).

    A position with g_t = 0 adds g_t a_tᵀ = 0 to the weight gradient and g_t = 0 to the bias gradient, and
    a zero-filled slot (a_t = 0 and g_t = 0) adds 0 to every Gram term and to U = Σ_t ‖a_t‖‖g_t‖: per-example
    norms, their certified rounding bounds and clipped sums are those of the full tensors, at the cost of
    T' instead of T positions.  Padding tokens behind an attention mask are such positions (their outputs
    reach no loss), as are masked-out targets.  A non-finite row is kept.

    ``cache`` (one backward pass): layers fed the same input with the same kept positions (Q, K and V)
    share one packed input.  It is keyed by the input's address; every input looked up is held by a
    record made in the same forward pass, so two inputs alive together with one address are one tensor."""
    if g.shape[1] <= 1 or act.shape[:2] != g.shape[:2]:
        return act, g, None
    # a row is zero iff its max and min are (NaN propagates: a non-finite row is kept); two cheap reductions
    keep = (g.amax(-1) != 0) | (g.amin(-1) != 0) if g.dim() > 2 else g != 0
    if bool(keep.all()):
        return act, g, keep
    counts = keep.sum(1)
    width = max(int(counts.max()), 1)
    key = ("rows", act.data_ptr(), act.device, tuple(act.shape), tuple(act.stride()), act.dtype)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and torch.equal(hit[0], keep):
        packed_act = hit[1]
    else:
        packed_act = _pack_rows(act, keep, counts, width)
        if cache is not None:
            cache[key] = (keep, packed_act)
    slots = torch.arange(width, device=g.device) < counts[:, None]
    return packed_act, _pack_rows(g, keep, counts, width), slots


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

    def receive_grad(self, rec, k, g):
        if not self.needs_input:
            rec.grads[k] = self.reduce_grad(g)
            return
        a = rec.act
        if a.dim() < 3:  # (B, d): one position
            rec.grads[k] = g
            return
        if a.dim() > 3:  # (B, *, d): packed as (B, T, d), without the shared cache (the reshape may copy)
            a, g, cache = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1]), None
        else:
            cache = self.pack_cache
        rec.act, rec.grads[k], rec.keep = drop_zero_rows(a, g, cache)

    def _cat(self, records):
        a = _cat3([r.act for r in records])
        g = _cat3([r.grads[0] for r in records])
        return a, g

    def sq_norms(self, records):
        self.ill = False
        if not self.needs_input:
            gb = sum(r.grads[0] for r in records)  # the (B, p) vectors that clipped_sum adds
            return example_sq_norms(gb)
        a, g = self._cat(records)
        U = _token_norm_sum(a, g) if a.shape[1] > 1 else None  # shared by the bound and the conditioning test
        keep = records[0].keep if len(records) == 1 else None
        if keep is not None and keep.shape[1] > 1 and not bool(keep.all()):
            # packed (drop_zero_rows): example i's positions are its first counts[i] slots, so groups of
            # examples of similar length need only their own width (the other slots are zero)
            sq = torch.empty(a.shape[0], dtype=torch.float64, device=a.device)
            base = (a.data_ptr(), tuple(a.shape), tuple(a.stride()), a.dtype)
            for j, (idx, width) in enumerate(length_groups(keep.sum(1))):
                sq[idx] = _linear_weight_sq(a[idx, :width], g[idx, :width], self.gram_cache, U=U[idx],
                                            cache_key=base + (j, width))
        else:
            sq = _linear_weight_sq(a, g, self.gram_cache, U=U)
        self.ill = _ill_conditioned(sq, a, g, U)
        if "bias" in self.params:
            # the per-example bias gradients Σ_t g_t; clipped_sum adds exactly these (B, p) vectors
            self._bias_pe = g.sum(1)
            sq = sq + example_sq_norms(self._bias_pe)
        return sq

    def clipped_sum(self, records, c):
        out = {}
        if not self.needs_input:
            gb = sum(r.grads[0] for r in records)
            out[self.params["bias"]] = factors_as(c, gb.dtype) @ gb
            return out
        a, g = self._cat(records)
        p, d = g.shape[-1], a.shape[-1]
        cf = c[:, None].expand(g.shape[:2])
        # positions with g_t = 0 (padding, zero-filled slots) add nothing: the matmul skips them
        keeps = [r.keep for r in records]
        keep = None if any(k is None for k in keeps) else keeps[0] if len(keeps) == 1 else torch.cat(keeps, 1)
        if keep is None or bool(keep.all()):
            a, g, cf = a.reshape(-1, d), g.reshape(-1, p), cf.reshape(-1)
        else:
            a, g, cf = a[keep], g[keep], cf[keep]
        if getattr(self, "ill", False):  # heavy cancellation inside an example: accumulate in float64
            a, g = a.to(torch.float64), g.to(torch.float64)
        gw = (g * factors_as(cf, g.dtype)[:, None]).t() @ a  # (p, d)
        out[self.params["weight"]] = gw.t() if self.transposed else gw
        if "bias" in self.params:
            bias_pe = getattr(self, "_bias_pe", None)
            if bias_pe is None or bias_pe.shape[0] != c.shape[0]:
                bias_pe = self._cat(records)[1].sum(1)
            out[self.params["bias"]] = factors_as(c, bias_pe.dtype) @ bias_pe
        return out

    def clear(self):
        super().clear()
        self.ill = False
        self._bias_pe = None


class ConvHandler(LinearHandler):
    """nn.Conv1d / nn.Conv2d: unfold the (padded) input so the layer is a linear map per position.

    A pointwise (1×1, unpadded) convolution is a linear layer over positions: its input is read as (B, C, L)
    without unfolding.  Where the per-example gradients are small next to what the layer stores anyway
    (:func:`conv_norm_form`), they are materialised in the layer's precision
    (one batched product), their norms are those of exactly these vectors (float64, rounded up, as for the
    normalisation layers), and the clipped sum is their weighted sum (B·|W| operations instead of another pass
    over every position).  Otherwise the ghost norm bounds the exact norm, as for nn.Linear."""

    kind = "conv"

    receive_grad = Handler.receive_grad  # the unfolded positions are made in _cat, after backward

    def reduce_grad(self, g):
        if not self.needs_input:
            return g.reshape(g.shape[0], g.shape[1], -1).sum(2)  # channel-first
        return g

    def _unfold(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as patches (B, Cin·k, L): for a pointwise convolution a view of the input itself
        (channel rows of a channels-last tensor stay where they are)."""
        m = self.module
        pad = m._reversed_padding_repeated_twice
        if all(k == 1 for k in m.kernel_size) and not any(pad):  # pointwise: the positions are the patches
            x = x[:, :, ::m.stride[0]] if isinstance(m, nn.Conv1d) else x[:, :, ::m.stride[0], ::m.stride[1]]
            return x.flatten(2)
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
            go = r.grads[0].flatten(2).reshape(B, G, -1, L).permute(1, 0, 3, 2)  # (G, B, L, Cout/G)
            a_list.append(u)
            g_list.append(go)
        if len(a_list) == 1:
            return a_list[0], g_list[0]
        return torch.cat(a_list, 2), torch.cat(g_list, 2)

    def sq_norms(self, records):
        self.ill = False
        self._pe = None
        if not self.needs_input:
            gb = sum(r.grads[0] for r in records)
            return example_sq_norms(gb)
        a, g = self._cat(records)
        if conv_norm_form(a.shape[2], g.shape[3], a.shape[3]) == "per-example":
            # materialise in the layer's precision, one batched product per group; the norms are those of exactly
            # the vectors that clipped_sum adds (float64, rounded up)
            w = self.params["weight"]
            pe = torch.matmul(g.transpose(2, 3), a).transpose(0, 1).reshape(a.shape[1], *w.shape)  # (B, *W)
            self._pe = {w: pe}
            sq = example_sq_norms(pe)
        else:
            parts = [_linear_weight_sq(a[j], g[j]) for j in range(a.shape[0])]
            sq = sum(parts)
            self.ill = any(_ill_conditioned(part, a[j], g[j]) for j, part in enumerate(parts))
        if "bias" in self.params:  # per-example bias gradients; clipped_sum adds exactly these vectors
            self._bias_pe = g.sum(2).permute(1, 0, 2).reshape(g.shape[1], -1)
            sq = sq + example_sq_norms(self._bias_pe)
        return sq

    def clipped_sum(self, records, c):
        if not self.needs_input:
            return super().clipped_sum(records, c)
        w = self.params["weight"]
        pe = getattr(self, "_pe", None)
        if pe is not None and pe[w].shape[0] == c.shape[0]:
            out = {w: weighted_example_sum(c, pe[w])}
            g = None
        else:
            a, g = self._cat(records)
            if getattr(self, "ill", False):  # heavy cancellation inside an example: accumulate in float64
                a, g = a.to(torch.float64), g.to(torch.float64)
            gc = g * factors_as(c, g.dtype)[None, :, None, None]
            parts = [gc[j].reshape(-1, gc.shape[-1]).t() @ a[j].reshape(-1, a.shape[-1]) for j in range(a.shape[0])]
            out = {w: torch.cat(parts, 0).reshape(w.shape)}
        if "bias" in self.params:
            bias_pe = getattr(self, "_bias_pe", None)
            if bias_pe is None or bias_pe.shape[0] != c.shape[0]:
                g = self._cat(records)[1] if g is None else g
                bias_pe = g.sum(2).permute(1, 0, 2).reshape(g.shape[1], -1)
            out[self.params["bias"]] = factors_as(c, bias_pe.dtype) @ bias_pe
        return out

    def clear(self):
        super().clear()
        self._pe = None


# ----------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------

class EmbeddingHandler(Handler):
    """nn.Embedding: per-example ‖Σ_t onehot(x_t) g_tᵀ‖² = Σ_{t,s} [x_t = x_s] g_t·g_s (ghost)."""

    kind = "embedding"

    def store_input(self, args, kwargs):
        return _first_input(args, kwargs).detach()

    def receive_grad(self, rec, k, g):
        ids = rec.act.reshape(rec.act.shape[0], -1)
        g = g.reshape(g.shape[0], -1, g.shape[-1])
        if self.module.padding_idx is not None:  # a padding lookup has no gradient: its rows can be dropped
            g = g * (ids != self.module.padding_idx).unsqueeze(-1).to(g.dtype)
        rec.act, rec.grads[k], _ = drop_zero_rows(ids, g)

    def _cat(self, records):
        ids = [r.act.reshape(r.act.shape[0], -1) for r in records]
        ids = ids[0] if len(ids) == 1 else torch.cat(ids, 1)
        g = _cat3([r.grads[0] for r in records])
        pad = self.module.padding_idx
        if pad is not None:
            g = g * (ids != pad).unsqueeze(-1).to(g.dtype)
        return ids, g

    def sq_norms(self, records):
        self.ill = False
        ids, g = self._cat(records)
        g64 = g.to(torch.float64)
        T, p = g.shape[1], g.shape[-1]
        if T == 1:
            return _inflate(g64.pow(2).sum((1, 2)), p)
        eq = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(torch.float64)
        gg = torch.bmm(g64, g64.transpose(1, 2))
        # ≥ Σ_t ‖g_t‖ ≥ the exact norm (float32 row norms rounded up, as in _token_norm_sum)
        U = torch.linalg.vector_norm(g.float(), dim=-1).double().sum(1) * (1.0 + _gamma32(p + T + 8))
        # float64 ghost sum plus its worst-case rounding error γ · U² (module docstring)
        sq = ((eq * gg).sum((1, 2)).clamp_min(0.0) + _gamma(p + T * T + 1) * U.pow(2)) * (1.0 + 4 * _U64)
        self.ill = bool((sq < (ILL_CONDITIONED * U).pow(2)).any())
        return sq

    def clipped_sum(self, records, c):
        ids, g = self._cat(records)
        if getattr(self, "ill", False):  # heavy cancellation inside an example: accumulate in float64
            g = g.to(torch.float64)
        w = self.params["weight"]
        gc = (g * factors_as(c, g.dtype)[:, None, None]).reshape(-1, g.shape[-1])
        out = torch.zeros(w.shape, dtype=g.dtype, device=g.device)
        out.index_add_(0, ids.reshape(-1), gc)
        return {w: out}

    def clear(self):
        super().clear()
        self.ill = False


# ----------------------------------------------------------------------------------------
# Normalisation layers: per-example gradients are small (B × channels): materialise them
# ----------------------------------------------------------------------------------------

class _MaterialisingHandler(Handler):
    """Handlers whose per-example gradients are cheap to hold: (B, *param.shape) each."""

    @abstractmethod
    def per_example(self, records) -> dict[nn.Parameter, torch.Tensor]:
        """Per-example gradients, (B, *param.shape) for each parameter."""

    @staticmethod
    def _sq_of(pe: dict) -> torch.Tensor:
        # squared norms of exactly the vectors clipped_sum adds, in float64, rounded up
        return sum(example_sq_norms(t) for t in pe.values())

    def finish(self):
        self._pe = self.per_example(self.records)
        self.sq = self._sq_of(self._pe)

    def sq_norms(self, records):
        return self._sq_of(self.per_example(records))

    def clipped_sum(self, records, c):
        pe = getattr(self, "_pe", None)
        if pe is None:
            pe = self.per_example(records)
        return {p: weighted_example_sum(c, t) for p, t in pe.items()}

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
        # Lazy: torch.func only on the rare fallback path.
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
