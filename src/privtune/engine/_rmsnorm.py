"""RMSNorm (LLaMA-family models): per-example gradients of the scale vector, which are small (B × d).

``y = w ∘ x̂`` with ``x̂ = x / √(mean(x²) + ε)`` over the last dimension, so example i's gradient of ``w`` is
``Σ_t x̂_t ∘ g_t``.  Only modules whose forward is known to be exactly that are handled here: ``nn.RMSNorm`` and
Hugging Face ``LlamaRMSNorm`` (which normalises in float32 and casts x̂ back to the input dtype before the
product); any other RMSNorm variant keeps the exact ``torch.func`` fallback.
"""

from __future__ import annotations

import torch
from torch import nn

from privtune.engine._layers import _MaterialisingHandler

#: Hugging Face RMSNorm classes whose forward is ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)``
HF_RMSNORM_CLASSES = ("LlamaRMSNorm",)


def is_rmsnorm(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm this handler computes exactly (a 1-D ``weight``, no bias)."""
    rms = getattr(nn, "RMSNorm", None)
    if rms is not None and isinstance(module, rms):
        return module.weight is not None and len(module.normalized_shape) == 1
    return type(module).__name__ in HF_RMSNORM_CLASSES and hasattr(module, "variance_epsilon")


class RMSNormHandler(_MaterialisingHandler):
    """Per-example ``∂/∂w = Σ_t x̂_t ∘ g_t``, x̂ recomputed from the stored input as the module does."""

    kind = "rmsnorm"

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if isinstance(m, getattr(nn, "RMSNorm", ())):
            eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x32 = x.to(torch.float32) if x.dtype != torch.float64 else x
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)).to(x.dtype)

    def per_example(self, records):
        w = self.params["weight"]
        out = 0
        for r in records:
            g = r.grads[0]
            xhat = self._normalised(r.act)
            out = out + (xhat * g).reshape(g.shape[0], -1, g.shape[-1]).sum(1)
        return {w: out}
