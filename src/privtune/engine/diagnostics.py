"""Clipping diagnostics (Rehn et al.). **NOT PRIVATE.**

Everything here reads private gradients *without noise*. Use it to understand a run (e.g. on a
public split or in a benchmark), never to choose what is released, and label every output
"NOT PRIVATE" wherever it appears (the dictionaries returned carry ``"label": "NOT PRIVATE"``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from privtune._validation import check_int, check_real
from privtune.engine.private_gradient import CLIPPINGS
from privtune.errors import InvalidParameterError
from privtune.engine.private_gradient import clip_factors, per_example_gradients

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


def _factor_rule(clipping: str, gamma: float) -> str:
    if clipping == "flat":
        return "min(1, threshold/||g||) (flat, Abadi)"
    return f"threshold/(||g|| + {gamma:g}) (automatic, AUTO-S; may exceed 1: small gradients are scaled up)"


def _clip_factors(norms: torch.Tensor, threshold: float, clipping: str, gamma: float) -> torch.Tensor:
    return clip_factors(norms, threshold, clipping, gamma)  # the engine's one rule


def _retained(n: torch.Tensor, C: float, clipping: str, gamma: float, layer_norms) -> tuple[torch.Tensor, dict]:
    """Per-example retained factor ‖clip(g_i)‖ / ‖g_i‖ under the clipping actually used, and facts about it.

    Flat or automatic clipping of the whole gradient: the factor is c_i itself.  Per-layer clipping
    (``layer_norms`` of shape (n, K)): layer k of example i is scaled by c_ik computed against C/√K, and
    the example keeps sqrt(Σ_k c_ik² ‖g_ik‖²) / ‖g_i‖ of its norm."""
    if clipping not in CLIPPINGS:
        raise InvalidParameterError(f"`clipping` must be one of {CLIPPINGS}. Got {clipping!r}.")
    gamma = check_real(gamma, "gamma", low=0.0)
    if layer_norms is None:
        f = _clip_factors(n, C, clipping, gamma)
        return f, {"per_layer": False, "num_layers": None, "threshold": C,
                   "scaled_down": f < 1.0, "layers_scaled_down": None}
    L = torch.as_tensor(layer_norms, dtype=torch.float64).detach().cpu()
    if L.dim() != 2 or L.shape[0] != n.shape[0] or L.shape[1] == 0:
        raise InvalidParameterError(
            f"`layer_norms` must have shape (n, K) = ({n.shape[0]}, K>=1), one row per norm. Got {tuple(L.shape)}."
        )
    if not torch.isfinite(L).all() or (L < 0).any():
        raise InvalidParameterError("`layer_norms` must contain finite non-negative norms.")
    K = L.shape[1]
    thr = C / K ** 0.5
    fl = _clip_factors(L, thr, clipping, gamma)  # (n, K)
    kept = ((fl * L) ** 2).sum(1).sqrt()
    f = torch.where(n > 0, kept / n.clamp_min(1e-300), torch.ones_like(n))
    active = L > 0
    return f, {"per_layer": True, "num_layers": K, "threshold": thr,
               "scaled_down": ((fl < 1.0) & active).any(1), "layers_scaled_down": (fl < 1.0)[active]}


def retained_weight(grad_norms, labels, max_grad_norm: float, num_classes: int, *, clipping: str = "flat",
                    gamma: float = 0.01, layer_norms=None) -> torch.Tensor:
    """Per-class mean retained factor (Rehn et al., Eq. 3: mean of min(1, C/‖g_i‖)); NaN for empty classes. NOT PRIVATE.

    The factor follows the clipping actually used: ``clipping="automatic"`` uses C/(‖g_i‖ + γ) (AUTO-S,
    which can exceed 1), and ``layer_norms`` ((n, K) per-layer norms, per-layer clipping at C/√K) gives
    ‖clip(g_i)‖/‖g_i‖ of the layer-wise clipped gradient.
    """
    n = _as_1d(grad_norms, "grad_norms")
    C = check_real(max_grad_norm, "max_grad_norm", low=0.0)
    K = check_int(num_classes, "num_classes", low=1)
    y = torch.as_tensor(labels).long().cpu()
    if y.shape != n.shape:
        raise InvalidParameterError(f"`labels` must have one label per norm ({n.numel()}). Got shape {tuple(y.shape)}.")
    if (y < 0).any() or (y >= K).any():
        raise InvalidParameterError(f"`labels` must lie in [0, {K - 1}]. Got values {y.min().item()}..{y.max().item()}.")
    f, _ = _retained(n, C, clipping, gamma, layer_norms)
    s = torch.bincount(y, weights=f, minlength=K)
    c = torch.bincount(y, minlength=K).double()
    return torch.where(c > 0, s / c.clamp_min(1), torch.full_like(s, float("nan")))


def clipping_diagnostics(
    grad_norms,
    max_grad_norm: float,
    labels=None,
    num_classes: int | None = None,
    quantiles: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99),
    *,
    clipping: str = "flat",
    gamma: float = 0.01,
    layer_norms=None,
) -> dict:
    """Fraction clipped, norm quantiles and (with labels) retained weight per class. NOT PRIVATE.

    Every statistic follows the clipping that was actually applied:

    * flat clipping of the whole gradient (default): an example is clipped when ‖g_i‖ > C and keeps
      min(1, C/‖g_i‖) of its gradient (Rehn et al.);
    * ``clipping="automatic"`` (AUTO-S): every example is rescaled by C/(‖g_i‖ + γ), so "fraction clipped"
      is not defined and is reported as ``None`` with a note; ``fraction_scaled_down`` counts the examples
      whose factor is below 1, and the retained factors may exceed 1;
    * ``layer_norms`` given (per-layer clipping): each of the K layers is compared with C/√K;
      ``fraction_clipped`` counts examples with at least one layer clipped, ``fraction_layers_clipped``
      the (example, layer) pairs, and the retained factor is ‖clip(g_i)‖/‖g_i‖ of the whole gradient.

    Args:
        grad_norms: per-example gradient L2 norms (e.g. what ``PrivateGradient.backward`` returns).
        max_grad_norm: clipping norm C (the sensitivity; the per-layer threshold is C/√K).
        labels, num_classes: optional class labels to report the retained weight per class.
        clipping: ``"flat"`` or ``"automatic"``; gamma: AUTO-S γ.
        layer_norms: optional (n, K) per-layer norms (``PrivateGradient.last_layer_norms``) for per-layer clipping.
    """
    n = _as_1d(grad_norms, "grad_norms")
    C = check_real(max_grad_norm, "max_grad_norm", low=0.0)
    qs = torch.tensor([check_real(q, "quantiles", low=0.0, high=1.0, low_inclusive=True, high_inclusive=True) for q in quantiles],
                      dtype=torch.float64)
    f, info = _retained(n, C, clipping, gamma, layer_norms)
    out = {
        "label": NOT_PRIVATE,
        "num_examples": int(n.numel()),
        "max_grad_norm": C,
        "clipping": clipping,
        "per_layer": info["per_layer"],
        "num_layers": info["num_layers"],
        "threshold": info["threshold"],
        "retained_factor": ("||clip(g)|| / ||g|| per example, with per-layer factors "
                            if info["per_layer"] else "per-example factor ") + _factor_rule(clipping, gamma),
        "mean_retained_factor": float(f.mean()),
        "norm_quantiles": {f"{float(q):g}": float(v) for q, v in zip(qs, torch.quantile(n, qs))},
    }
    if clipping == "flat":
        out["fraction_clipped"] = float(info["scaled_down"].double().mean())
    else:
        out["fraction_clipped"] = None
        out["fraction_clipped_note"] = (
            "not defined for automatic clipping (AUTO-S): every example is rescaled, none is left unclipped; "
            "fraction_scaled_down counts the examples whose factor is below 1"
        )
        out["fraction_scaled_down"] = float(info["scaled_down"].double().mean())
    if info["per_layer"]:
        lay = info["layers_scaled_down"]
        out["fraction_layers_clipped"] = float(lay.double().mean()) if lay.numel() else 0.0
        out["norm_quantiles_note"] = ("quantiles of the whole-gradient norm ||g_i||; per-layer clipping compares "
                                      f"each layer's norm with the threshold C/sqrt(K) = {info['threshold']:.6g}")
    if labels is not None:
        if num_classes is None:
            num_classes = int(torch.as_tensor(labels).max()) + 1
        out["retained_weight_per_class"] = [float(v) for v in retained_weight(
            n, labels, C, num_classes, clipping=clipping, gamma=gamma, layer_norms=layer_norms)]
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
    """Exact MSE of the noisy clipped *sum* vs the true sum (Rehn et al., Eq. 5). NOT PRIVATE.

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
    """MSE-optimal clipping norm C* for given per-example gradients (Rehn et al., Thm 5.2). NOT PRIVATE.

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
