"""Clipping diagnostics (Rehn et al., seed 003). **NOT PRIVATE.**

Everything here reads private gradients *without noise*. Use it to understand a run (e.g. on a
public split or in a benchmark), never to choose what is released, and label every output
"NOT PRIVATE" wherever it appears (the dictionaries returned carry ``"label": "NOT PRIVATE"``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from privtune._validation import check_int, check_real
from privtune.errors import InvalidParameterError

__all__ = [
    "NOT_PRIVATE",
    "clipping_diagnostics",
    "retained_weight",
    "clip_mse",
    "optimal_clip_mse",
    "per_example_gradients",
]

NOT_PRIVATE = "NOT PRIVATE"


def _as_1d(x, name) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).detach().cpu()
    if t.dim() != 1 or t.numel() == 0:
        raise InvalidParameterError(f"`{name}` must be a non-empty 1-D sequence. Got shape {tuple(t.shape)}. Pass one value per example.")
    if not torch.isfinite(t).all() or (t < 0).any():
        raise InvalidParameterError(f"`{name}` must contain finite non-negative norms. Got {t.min().item()!r}..{t.max().item()!r}.")
    return t


def retained_weight(grad_norms, labels, max_grad_norm: float, num_classes: int) -> torch.Tensor:
    """Per-class mean of min(1, C/‖g_i‖) (seed 003 Eq. 3); NaN for classes without examples. NOT PRIVATE."""
    n = _as_1d(grad_norms, "grad_norms")
    C = check_real(max_grad_norm, "max_grad_norm", low=0.0)
    K = check_int(num_classes, "num_classes", low=1)
    y = torch.as_tensor(labels).long().cpu()
    if y.shape != n.shape:
        raise InvalidParameterError(f"`labels` must have one label per norm ({n.numel()}). Got shape {tuple(y.shape)}.")
    if (y < 0).any() or (y >= K).any():
        raise InvalidParameterError(f"`labels` must lie in [0, {K - 1}]. Got values {y.min().item()}..{y.max().item()}.")
    f = (C / n.clamp_min(1e-300)).clamp(max=1.0)
    s = torch.bincount(y, weights=f, minlength=K)
    c = torch.bincount(y, minlength=K).double()
    return torch.where(c > 0, s / c.clamp_min(1), torch.full_like(s, float("nan")))


def clipping_diagnostics(
    grad_norms,
    max_grad_norm: float,
    labels=None,
    num_classes: int | None = None,
    quantiles: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99),
) -> dict:
    """Fraction clipped, norm quantiles and (with labels) retained weight per class. NOT PRIVATE.

    Args:
        grad_norms: per-example gradient L2 norms (e.g. what ``PrivateGradient.backward`` returns).
        max_grad_norm: clipping norm C.
        labels, num_classes: optional class labels to report the retained weight per class.
    """
    n = _as_1d(grad_norms, "grad_norms")
    C = check_real(max_grad_norm, "max_grad_norm", low=0.0)
    qs = torch.tensor([check_real(q, "quantiles", low=0.0, high=1.0, low_inclusive=True, high_inclusive=True) for q in quantiles],
                      dtype=torch.float64)
    out = {
        "label": NOT_PRIVATE,
        "num_examples": int(n.numel()),
        "max_grad_norm": C,
        "fraction_clipped": float((n > C).double().mean()),
        "mean_retained_factor": float((C / n.clamp_min(1e-300)).clamp(max=1.0).mean()),
        "norm_quantiles": {f"{float(q):g}": float(v) for q, v in zip(qs, torch.quantile(n, qs))},
    }
    if labels is not None:
        if num_classes is None:
            num_classes = int(torch.as_tensor(labels).max()) + 1
        out["retained_weight_per_class"] = [float(v) for v in retained_weight(n, labels, C, num_classes)]
    return out


def _check_grads(grads) -> torch.Tensor:
    G = torch.as_tensor(grads).detach().double().cpu()
    if G.dim() != 2 or G.shape[0] == 0:
        raise InvalidParameterError(
            f"`grads` must be a (n, d) matrix of per-example gradients. Got shape {tuple(G.shape)}. "
            "Use per_example_gradients(...) on a small sample."
        )
    return G


def clip_mse(grads, max_grad_norm: float, noise_multiplier: float) -> float:
    """Exact MSE of the noisy clipped *sum* vs the true sum (seed 003 Eq. 5). NOT PRIVATE.

    MSE(C) = C²σ²d + ‖Σ_{‖g_i‖>C} (‖g_i‖−C)/‖g_i‖ · g_i‖².
    """
    G = _check_grads(grads)
    C = check_real(max_grad_norm, "max_grad_norm", low=0.0)
    s = check_real(noise_multiplier, "noise_multiplier", low=0.0, low_inclusive=True)
    n = G.norm(dim=1)
    I = n > C
    bias = (((n[I] - C) / n[I])[:, None] * G[I]).sum(0)
    return float(C * C * s * s * G.shape[1] + bias @ bias)


def optimal_clip_mse(grads, noise_multiplier: float) -> dict:
    """MSE-optimal clipping norm C* for given per-example gradients (seed 003 Thm 5.2). NOT PRIVATE.

    Exact: on each interval between sorted norms the MSE is a convex quadratic in C; the minimiser
    is a breakpoint ‖g_i‖ or the stationary point C = N_CᵀG_C / (N_CᵀN_C + σ²d) (Eq. 8).
    Returns ``{"C": C*, "mse": MSE(C*), "label": "NOT PRIVATE"}``.
    """
    G = _check_grads(grads)
    s = check_real(noise_multiplier, "noise_multiplier", low=0.0, low_inclusive=True)
    d = G.shape[1]
    n = G.norm(dim=1)
    keep = n > 0
    G, n = G[keep], n[keep]
    if n.numel() == 0:
        return {"C": 0.0, "mse": 0.0, "label": NOT_PRIVATE}
    order = torch.argsort(-n)
    ns, Gs = n[order], G[order]
    U = Gs / ns[:, None]
    cands = [float(v) for v in ns]
    Gc = torch.zeros(d, dtype=torch.float64)
    Nc = torch.zeros(d, dtype=torch.float64)
    for k in range(len(ns)):
        Gc += Gs[k]
        Nc += U[k]
        lo = float(ns[k + 1]) if k + 1 < len(ns) else float(ns[k])
        c = float(Nc @ Gc) / (float(Nc @ Nc) + s * s * d)
        if lo < c < float(ns[k]):
            cands.append(c)
    best = min(cands, key=lambda c: clip_mse(G, c, s))
    return {"C": best, "mse": clip_mse(G, best, s), "label": NOT_PRIVATE}


def per_example_gradients(losses: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """(B, d) matrix of flattened per-example gradients by a plain loop (slow; small samples). NOT PRIVATE.

    ``losses`` is the (B,) per-example loss vector of a forward pass; ``params`` the trainable parameters.
    Call it inside ``PrivateGradient.paused()`` or on a model without a PrivateGradient attached.
    """
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise InvalidParameterError("`losses` must be a (B,) tensor of per-example losses. Got something else. Use reduction='none'.")
    params = list(params)
    rows = []
    for i in range(losses.shape[0]):
        gs = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    return torch.stack(rows)
