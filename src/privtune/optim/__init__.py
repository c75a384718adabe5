"""Optimizers over the DP step: they read the privatised ``param.grad`` written by
:meth:`privtune.engine.PrivateGradient.release` (post-processing, no privacy cost).

``make_optimizer("sgd" | "adam" | "adamw" | "lamb", params, learning_rate=...)`` returns a
standard ``torch.optim.Optimizer``; DP-SGD with momentum, DP-Adam, DP-AdamW and DP-LAMB are
these optimizers fed the privatised gradient. No optimizer is monkey-patched.
"""

from __future__ import annotations

from typing import Iterable

import torch

from privtune._validation import check_choice, check_real
from privtune.choices import OPTIMIZERS
from privtune.errors import InvalidParameterError
from privtune.optim.lamb import DPLAMB

__all__ = ["make_optimizer", "DPLAMB", "OPTIMIZERS"]



def make_optimizer(
    name: str,
    params: Iterable,
    *,
    learning_rate: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """Build the optimizer that applies the privatised gradient.

    Args:
        name: ``"sgd"`` (heavy-ball momentum ``momentum``), ``"adam"``, ``"adamw"`` (decoupled weight
            decay) or ``"lamb"`` (:class:`DPLAMB`, Mehta et al.'s trust ratio).
        params: parameters (e.g. ``pg.trainable_parameters``) or parameter groups.
        learning_rate: step size η > 0.
        momentum: SGD momentum μ in [0, 1) (ignored by the adaptive optimizers).
        weight_decay: λ ≥ 0 (L2 for sgd/adam, decoupled for adamw/lamb).
        betas, eps: Adam/LAMB moment decay rates and denominator constant.
    """
    name = check_choice(name, "optimizer", OPTIMIZERS)
    lr = check_real(learning_rate, "learning_rate", low=0.0, fix="Pass a positive learning rate, e.g. 1e-3.")
    momentum = check_real(momentum, "momentum", low=0.0, high=1.0, low_inclusive=True,
                          fix="Momentum μ must be in [0, 1), e.g. 0.9.")
    weight_decay = check_real(weight_decay, "weight_decay", low=0.0, low_inclusive=True)
    eps = check_real(eps, "eps", low=0.0, low_inclusive=True)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise InvalidParameterError(f"`betas` must be a pair (β1, β2) in [0, 1). Got {betas!r}. Pass e.g. (0.9, 0.999).")
    betas = (check_real(betas[0], "betas[0]", low=0.0, high=1.0, low_inclusive=True),
             check_real(betas[1], "betas[1]", low=0.0, high=1.0, low_inclusive=True))
    params = list(params)
    if not params:
        raise InvalidParameterError("`params` must contain at least one parameter. Got an empty list. Pass pg.trainable_parameters.")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return DPLAMB(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
