"""DP training of a linear softmax head on cached features (the trial workhorse of HPO).

A linear head ``z = W x + b`` with softmax cross-entropy has per-example gradients in
closed form: ``∂ℓ/∂W = (p − e_y) xᵀ`` and ``∂ℓ/∂b = p − e_y``, so the per-example norm
is ``‖p − e_y‖ · sqrt(‖x‖² + [bias])`` and the clipped sum is one matrix product.  No
per-example gradient materialisation, no hooks: a full-batch step over 67k × 384
features takes milliseconds, which is what makes tuning with many trials affordable.

This is the training subroutine of seed 000 (Algorithm 1: zero-initialised bias-free
head, full batch, unit clipping, SGD momentum 0.9, one free step along the momentum
buffer), of seed 002 (one full-batch DP-Adam step from a zero head) and the head path
of seed 001 (AUTO-S, Poisson batches).  Conventions:

* ``noise_multiplier`` σ multiplies the clipping norm C: noise N(0, σ²C²) on the sum.
* Learning rates act on the *mean* over the expected batch size (q·N), so η is
  batch-size invariant (digest 000 §8 D2).
* Events: full batch → ``GaussianEvent(σ, count=T)`` (exactly √T/σ-GDP); Poisson
  batches → ``DPSGDEvent(σ, q, T)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from privtune.accounting.events import DPSGDEvent, GaussianEvent
from privtune.errors import InvalidParameterError
from privtune.engine.sampling import make_generator, poisson_indices


@dataclass
class LinearHead:
    """A linear classifier ``logits = X Wᵀ + b`` on features (W: (K, d), b: (K,) or None)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @classmethod
    def zeros(cls, num_features: int, num_classes: int, bias: bool = False, init_bias: float = 0.0,
              dtype=torch.float32) -> "LinearHead":
        w = torch.zeros(num_classes, num_features, dtype=dtype)
        b = torch.full((num_classes,), float(init_bias), dtype=dtype) if bias else None
        return cls(w, b)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        z = X @ self.weight.T
        return z + self.bias if self.bias is not None else z

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        return self.logits(X).argmax(dim=1)

    def copy(self) -> "LinearHead":
        return LinearHead(self.weight.detach().clone(), None if self.bias is None else self.bias.detach().clone())

    def state_dict(self) -> dict:
        out = {"weight": self.weight.detach().clone()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out


def per_example_losses(head: LinearHead, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each example, shape (B,)."""
    return F.cross_entropy(head.logits(X), y, reduction="none")


def clipped_gradient_sum(
    head: LinearHead, X: torch.Tensor, y: torch.Tensor, *, clip: float = 1.0, clipping: str = "flat",
    gamma: float = 0.01, xsq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Sum of clipped per-example gradients of the head.

    ``clipping="flat"``: g_i · min(1, C/‖g_i‖); ``"automatic"`` (AUTO-S, Bu et al.):
    g_i · C/(‖g_i‖ + γ).  Both have L2 sensitivity ≤ C.  Returns (ΣW, Σb or None, norms).
    """
    K = head.weight.shape[0]
    logits = head.logits(X)
    E = torch.softmax(logits, dim=1) - F.one_hot(y, K).to(logits.dtype)
    if xsq is None:
        xsq = (X * X).sum(dim=1)
    xsq = xsq + (1.0 if head.bias is not None else 0.0)
    norms = E.norm(dim=1) * xsq.sqrt()
    if clipping == "flat":
        c = torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)
    elif clipping == "automatic":
        c = clip / (norms + gamma)
    else:  # pragma: no cover - validated by callers
        raise InvalidParameterError(f"`clipping` must be 'flat' or 'automatic'. Got {clipping!r}.")
    Ec = E * c[:, None]
    gW = Ec.T @ X
    gb = Ec.sum(dim=0) if head.bias is not None else None
    return gW, gb, norms


@dataclass
class HeadFit:
    """Result of :func:`train_head`: the trained head, its privacy events and a short history."""

    head: LinearHead
    events: list
    history: dict = field(default_factory=dict)


def _poisson_batch(n: int, q: float, gen: torch.Generator) -> torch.Tensor:
    return poisson_indices(n, q, gen)  # P(included) ≤ q exactly (integer threshold)


def train_head(
    X: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    *,
    learning_rate: float,
    steps: int,
    noise_multiplier: float,
    sample_rate: float = 1.0,
    clip: float = 1.0,
    clipping: str = "flat",
    gamma: float = 0.01,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    eps_adam: float = 1e-8,
    weight_decay: float = 0.0,
    bias: bool = False,
    init_bias: float = 0.0,
    free_step: bool = False,
    seed: int | None = None,
    label: str = "",
    eval_fn: Callable[[LinearHead], float] | None = None,
    eval_every: int = 0,
) -> HeadFit:
    """DP training of a zero-initialised linear head on features.

    Parameters
    ----------
    X, y : features (N, d) float and labels (N,) int of the private training set.
    learning_rate : η on the mean gradient (sum / expected batch size q·N).
    steps : T optimizer steps.
    noise_multiplier : σ, multiplier of ``clip``.
    sample_rate : q, Poisson rate; 1.0 means full batch (every example every step).
    optimizer : ``"sgd"`` (heavy-ball momentum), ``"adam"`` or ``"adamw"``.
    free_step : one extra step along the SGD momentum buffer after training
        (post-processing, seed 000 A.3).
    eval_fn : optional callback on a *public* split (e.g. public validation accuracy) for
        curves; never pass the reported split.
    """
    n, d = X.shape
    gen = make_generator(seed)  # OS-seeded unless a seed is given
    head = LinearHead.zeros(d, num_classes, bias=bias, init_bias=init_bias, dtype=X.dtype)
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    for p in params:
        p.requires_grad_(False)
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=learning_rate, momentum=momentum, weight_decay=weight_decay)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=learning_rate, betas=betas, eps=eps_adam, weight_decay=weight_decay)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=learning_rate, betas=betas, eps=eps_adam, weight_decay=weight_decay)
    else:
        raise InvalidParameterError(f"`optimizer` must be one of 'sgd', 'adam', 'adamw'. Got {optimizer!r}.")
    expected = sample_rate * n
    hist: dict = {"step": [], "lr": [], "eval": []}
    full = sample_rate >= 1.0
    xsq_all = (X * X).sum(dim=1)
    for t in range(int(steps)):
        idx = _poisson_batch(n, sample_rate, gen)
        if full:
            gW, gb, _ = clipped_gradient_sum(head, X, y, clip=clip, clipping=clipping, gamma=gamma, xsq=xsq_all)
        elif idx.numel():
            gW, gb, _ = clipped_gradient_sum(head, X[idx], y[idx], clip=clip, clipping=clipping, gamma=gamma,
                                             xsq=xsq_all[idx])
        else:
            gW, gb = torch.zeros_like(head.weight), (torch.zeros_like(head.bias) if head.bias is not None else None)
        gW = gW + noise_multiplier * clip * torch.randn(gW.shape, generator=gen, dtype=gW.dtype)
        head.weight.grad = gW / expected
        if gb is not None:
            gb = gb + noise_multiplier * clip * torch.randn(gb.shape, generator=gen, dtype=gb.dtype)
            head.bias.grad = gb / expected
        opt.step()
        if eval_fn is not None and eval_every and ((t + 1) % eval_every == 0 or t + 1 == steps):
            hist["eval"].append({"step": t + 1, "accuracy": float(eval_fn(head))})
    hist["step"] = list(range(1, int(steps) + 1))
    hist["lr"] = [float(learning_rate)] * int(steps)
    if free_step and optimizer == "sgd" and momentum > 0:
        with torch.no_grad():
            for p in params:
                buf = opt.state[p].get("momentum_buffer")
                if buf is not None:
                    p.add_(buf, alpha=-learning_rate)
    for p in params:
        p.grad = None
    if sample_rate >= 1.0:
        events = [GaussianEvent(noise_multiplier=noise_multiplier, count=int(steps), label=label)]
    else:
        events = [DPSGDEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=int(steps),
                             sampling="poisson", label=label)]
    return HeadFit(head=head, events=events, history=hist)


def accuracy(head: LinearHead, X: torch.Tensor, y: torch.Tensor) -> float:
    """Plain accuracy (use only on public or reported splits)."""
    if X.shape[0] == 0:
        return math.nan
    return float((head.predict(X) == y).float().mean().item())


def normalize_rows(X: torch.Tensor) -> torch.Tensor:
    """Scale every feature row to unit L2 norm (a per-example, data-independent transform: free)."""
    return X / X.norm(dim=1, keepdim=True).clamp_min(1e-12)
