"""Tied input embedding and output projection (LM head): one parameter, one per-example gradient.

Language models such as GPT-2 and SmolLM2 use the same (V, d) matrix W as the token embedding
(``nn.Embedding``) and as the LM head (``nn.Linear``, ``logits = h Wᵀ``).  Example i's gradient of W is the
sum of both uses, ``G_i = E_i + L_i`` with

* ``E_i = Σ_t onehot(x_t) e_tᵀ`` (embedding: ids x_t, output gradients e_t ∈ ℝᵈ), and
* ``L_i = Σ_s z_s h_sᵀ`` (head: inputs h_s ∈ ℝᵈ, output gradients z_s ∈ ℝⱽ),

so ``‖G_i‖² = ‖E_i‖² + ‖L_i‖² + 2⟨E_i, L_i⟩``.  The two squared norms are the handlers' own ghost norms; the
cross term is a ghost sum too and never forms a V × d matrix:

    ⟨E_i, L_i⟩ = Σ_{t,s} z_s[x_t] · (h_s · e_t)

(a gather of the head's output gradient at the input ids, times the T_L × T_E matrix of inner products).
Like every norm of the engine it is returned as a certified upper bound in float64 (engine/_layers.py): the
float64 rounding error of the cross term is at most γ · U_L · U_E with U_L = Σ_s ‖h_s‖‖z_s‖ and
U_E = Σ_t ‖e_t‖.  Clipped sums need nothing new: both handlers add ``c_i`` times their part to the same
parameter, which is ``c_i G_i`` in total.
"""

from __future__ import annotations

import torch
from torch import nn

from privtune.engine._layers import (
    _U64,
    ILL_CONDITIONED,
    EmbeddingHandler,
    Handler,
    LinearHandler,
    _gamma,
    _gamma32,
    _token_norm_sum,
)


def tied_pair(first: Handler, second: Handler, p: nn.Parameter) -> tuple[EmbeddingHandler, LinearHandler] | None:
    """``(embedding handler, head handler)`` when ``p`` is the weight of an ``nn.Embedding`` and of a plain
    ``nn.Linear`` (not HF Conv1D) of the same shape; None for any other sharing (refused by the caller)."""
    pair = (first, second) if isinstance(first, EmbeddingHandler) else (second, first)
    emb, lin = pair
    if not isinstance(emb, EmbeddingHandler) or type(lin) is not LinearHandler or lin.transposed:
        return None
    if emb.params.get("weight") is not p or lin.params.get("weight") is not p:
        return None
    return emb, lin


def _cross(emb: EmbeddingHandler, lin: LinearHandler) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B,) float64 ⟨E_i, L_i⟩ as computed, (B,) its rounding-error bound γ · U_L · U_E, and (B,) U_L + U_E."""
    ids, e = emb._cat(emb.records)          # (B, T_E), (B, T_E, d), padding rows already zeroed
    h, z = lin._cat(lin.records)            # (B, T_L, d), (B, T_L, V)
    B, T_E = ids.shape
    T_L, d = h.shape[1], h.shape[2]
    # z_s[x_t]: gather in the stored precision (small: B × T_L × T_E), then an exact cast to float64
    zx = torch.gather(z, 2, ids.unsqueeze(1).expand(B, T_L, T_E).to(z.device)).to(torch.float64)
    he = torch.bmm(h.to(torch.float64), e.to(torch.float64).transpose(1, 2))   # (B, T_L, T_E)
    cross = (zx * he).sum((1, 2))
    U_L = _token_norm_sum(h, z)
    U_E = torch.linalg.vector_norm(e.float(), dim=-1).double().sum(1) * (1.0 + _gamma32(d + T_E + 8))
    return cross, _gamma(d + T_L * T_E + 1) * U_L * U_E, U_L + U_E


def tied_sq_norms(emb: EmbeddingHandler | None, lin: LinearHandler | None) -> torch.Tensor:
    """(B,) float64 upper bound on ‖E_i + L_i‖² for the handlers the loss reached (their ``sq`` filled in).

    With only one of them reached it is that handler's own ``sq``.  Marks both handlers ill-conditioned (clipped
    sums then accumulate in float64) when the two uses nearly cancel: ‖G_i‖ < ILL_CONDITIONED · (U_L + U_E)."""
    if emb is None or lin is None:
        return (emb or lin).sq.to(torch.float64)
    cross, err, scale = _cross(emb, lin)
    sq = (emb.sq.to(torch.float64) + lin.sq.to(torch.float64) + 2.0 * (cross + err)).clamp_min(0.0)
    sq = sq * (1.0 + 4 * _U64)
    if bool((sq < (ILL_CONDITIONED * scale).pow(2)).any()):
        emb.ill = lin.ill = True
    return sq
