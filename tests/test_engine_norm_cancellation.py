"""Per-example norms are certified upper bounds, whatever the data (issue 13, item 5).

The audit's crafted example: one example, two tokens with equal inputs a (‖a‖ = s) and output gradients
u and −(1+d)u (‖u‖ = s).  Its weight gradient is −d·u aᵀ, of norm s²·d, but the float32 ghost sum
Σ_{t,s}(a_t·a_s)(g_t·g_s) of four terms of size s⁴ cancelled to ≤ 0: reported norm 0, factor 1, and the
example went in unclipped (10⁴·C at s = 1e4, d = 1e-4).  Now the released contribution is ≤ C up to the
rounding of the result to float32 (relative 2⁻²³; the test allows 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privtune.engine import PrivateGradient

TOLERANCE = 1e-6  # relative, above C: rounding of the released float32 gradient


def _unit(n: int, scale: float, seed: int) -> torch.Tensor:
    v = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * scale


def _released_contribution(module: nn.Module, inputs: torch.Tensor, out_grad: torch.Tensor):
    pg = PrivateGradient(module, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
    loss = (module(inputs) * out_grad).sum(tuple(range(1, out_grad.dim())))
    norms = pg.backward(loss)
    pg.release()
    pg.close()
    released = torch.cat([p.grad.reshape(-1).double() for p in module.parameters()]).norm()
    return float(norms[0]), float(released)


def _crafted(s: float, d: float, width_in: int, width_out: int):
    a, u = _unit(width_in, s, 0), _unit(width_out, s, 1)
    x = torch.stack([a, a]).unsqueeze(0).float()                     # (1, 2, d_in): two equal tokens
    g = torch.stack([u, -(1 + d) * u]).unsqueeze(0).float()          # nearly opposite output gradients
    exact = float((g[0].double().t() @ x[0].double()).norm())
    return x, g, exact


@pytest.mark.parametrize("s, d", [(1e4, 1e-4), (1e5, 1e-4), (1e4, 1e-3), (1e5, 1e-7)])
@pytest.mark.parametrize("width", [4, 2])  # 4: ghost form (2T² < p·d); 2: per-example form
@pytest.mark.parametrize("bias", [False, True])
def test_cancelling_tokens_are_clipped(s, d, width, bias):
    torch.manual_seed(0)
    lin = nn.Linear(width, width, bias=bias)
    x, g, exact = _crafted(s, d, width, width)
    reported, released = _released_contribution(lin, x, g)
    assert reported >= exact * (1 - 1e-6)  # the reported norm never understates the true one ...
    assert released <= 1.0 + TOLERANCE     # ... so the released contribution is at most C
    if d >= 1e-4:
        assert released >= 0.999          # and a truly large gradient is clipped to C, not to ~0
        assert reported <= exact * 1.001


def test_cancelling_embedding_lookups_are_clipped():
    # the same token twice with nearly opposite output gradients: the embedding's ghost sum cancels too
    emb = nn.Embedding(10, 4)
    u = _unit(4, 1e8, 2)
    g = torch.stack([u, -(1 + 1e-4) * u]).unsqueeze(0).float()
    reported, released = _released_contribution(emb, torch.tensor([[3, 3]]), g)
    assert reported == pytest.approx(float((g[0, 0].double() + g[0, 1].double()).norm()), rel=1e-3)
    assert 0.999 <= released <= 1.0 + TOLERANCE


def test_natural_norms_are_unchanged_to_float_precision():
    # the certificate costs nothing on ordinary data: norms equal the exact per-example norms
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(5, 6, 16)
    pg = PrivateGradient(lin, max_grad_norm=1e9, noise_multiplier=0.0, expected_batch_size=1.0)
    norms = pg.backward(lin(x).pow(2).sum((1, 2)))
    pg.close()
    exact = []
    for i in range(5):
        lin.zero_grad()
        lin(x[i:i + 1]).pow(2).sum().backward()
        exact.append(torch.cat([lin.weight.grad.reshape(-1), lin.bias.grad]).double().norm())
    assert torch.allclose(norms.double(), torch.stack(exact), rtol=1e-5)
    assert bool((norms.double() >= torch.stack(exact) * (1 - 1e-6)).all())


@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_materialised_norms_bound_the_exact_sum_of_squares(layout):
    """``example_sq_norms`` (the norms of materialised per-example gradients: convolutions, normalisation
    layers, the fallback) is never below the exact sum of squares of a row, even where a float64 running sum
    drops small terms next to a large one, and exceeds it by a rounding margin only.  The exact value: squares
    of float32 numbers are exact in float64, and math.fsum sums them with one rounding."""
    import math

    from privtune.engine._layers import example_sq_norms

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 3, 5, 7, generator=g)
    rows[1] = 1.0
    rows[1, 0, 0, 0] = 1e8                       # 1e16 plus 104 ones: a float64 running sum may drop them
    rows[2] *= 1e-20                             # squares near the bottom of float64's normal range
    rows[3, :, :, 1:] = 0.0
    t = rows if layout == "contiguous" else rows.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    assert t.is_contiguous() == (layout == "contiguous")
    got = example_sq_norms(t)
    for i in range(4):
        exact = math.fsum(float(v) ** 2 for v in rows[i].double().reshape(-1).tolist())
        assert float(got[i]) >= exact
        assert float(got[i]) <= exact * (1 + 1e-9)
