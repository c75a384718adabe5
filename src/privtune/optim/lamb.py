"""DP-LAMB (Mehta et al., §2.5): LAMB applied to the privatised gradient in ``param.grad``.

Everything is computed from the noisy gradient and the parameters only, so it is post-processing
of the DP release (no extra privacy cost). For each tensor θ_ℓ at step t::

    m = β1 m + (1−β1) g ;  v = β2 v + (1−β2) g²
    r = m̂ / (sqrt(v̂) + eps) + λ θ                       (m̂, v̂ bias-corrected)
    τ = ‖θ‖ / ‖r‖   if ‖θ‖ > 0 and ‖r‖ > 0, else 1        (so a zero-initialised head starts as Adam)
    θ ← θ − lr · τ · r

Tensors excluded from adaptation (by default every tensor with ``dim() <= 1``: biases and norm
scales/offsets) use τ = 1, i.e. plain Adam(W) steps.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from privtune._validation import check_real
from privtune.errors import InvalidParameterError

__all__ = ["DPLAMB"]


def _default_exclude(p: torch.Tensor) -> bool:
    return p.dim() <= 1


class DPLAMB(torch.optim.Optimizer):
    """LAMB with the seed-002 trust-ratio conventions for noisy gradients.

    Args:
        params: parameters or parameter groups. A group may set ``"adapt": False`` to exclude all
            its tensors from layer adaptation.
        lr: learning rate η > 0.
        betas: (β1, β2) in [0, 1).
        eps: ε added to sqrt(v̂) (1e-6, the LAMB default; it matters under DP noise).
        weight_decay: decoupled weight decay λ ≥ 0 inside the trust-ratio update.
        exclude_from_adaptation: predicate on a tensor; True → τ = 1. Default: 1-D tensors.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        exclude_from_adaptation: Callable[[torch.Tensor], bool] | None = _default_exclude,
    ) -> None:
        lr = check_real(lr, "learning_rate", low=0.0, fix="Pass a positive learning rate, e.g. 1e-3.")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InvalidParameterError(f"`betas` must be a pair (β1, β2) in [0, 1). Got {betas!r}. Pass e.g. (0.9, 0.999).")
        b1 = check_real(betas[0], "betas[0]", low=0.0, high=1.0, low_inclusive=True)
        b2 = check_real(betas[1], "betas[1]", low=0.0, high=1.0, low_inclusive=True)
        eps = check_real(eps, "eps", low=0.0, low_inclusive=True)
        weight_decay = check_real(weight_decay, "weight_decay", low=0.0, low_inclusive=True)
        self.exclude_from_adaptation = exclude_from_adaptation or (lambda p: False)
        super().__init__(params, dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, adapt=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                mhat = m / (1 - b1 ** t)
                vhat = v / (1 - b2 ** t)
                r = mhat / (vhat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    r = r + group["weight_decay"] * p
                ratio = 1.0
                if group["adapt"] and not self.exclude_from_adaptation(p):
                    w_norm = float(p.norm())
                    r_norm = float(r.norm())
                    if w_norm > 0 and r_norm > 0:
                        ratio = w_norm / r_norm
                state["trust_ratio"] = ratio
                p.add_(r, alpha=-group["lr"] * ratio)
        return loss
