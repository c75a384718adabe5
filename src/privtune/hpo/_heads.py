"""The state of a head trial on cached features: :class:`LinearHead` (W, b as plain tensors), what
tuning's trials return, journal and compare.

Head trials are trained by :func:`privtune.training.fit` (the one DP loop) with the closed-form clipped
head gradient of :class:`privtune.finetune.LinearHeadGradient` (see
:class:`privtune.hpo.backends.FeatureBackend`): the full-batch SGD-momentum head with its free step of
Panda et al. (linear scaling), the single full-batch DP-Adam step of Mehta et al. (large-scale transfer)
and the AUTO-S Poisson head of Liu et al. (HyFreeDP) all run there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


def accuracy(head: LinearHead, X: torch.Tensor, y: torch.Tensor) -> float:
    """Plain accuracy (use only on public or reported splits)."""
    if X.shape[0] == 0:
        return math.nan
    return float((head.predict(X) == y).float().mean().item())


def normalize_rows(X: torch.Tensor) -> torch.Tensor:
    """Scale every feature row to unit L2 norm (a per-example, data-independent transform: free)."""
    return X / X.norm(dim=1, keepdim=True).clamp_min(1e-12)
