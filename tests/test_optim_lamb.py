"""make_optimizer and DPLAMB (seed 002 trust-ratio conventions)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privtune.errors import InvalidParameterError
from privtune.optim import DPLAMB, make_optimizer


def _pair(shape, init):
    a = nn.Parameter(init(shape).double())
    b = nn.Parameter(a.detach().clone())
    return a, b


def test_lamb_equals_adam_when_weights_are_zero():
    """A zero-initialised head: trust ratio 1, so the first LAMB step is exactly an Adam step."""
    a, b = _pair((3, 4), torch.zeros)
    g = torch.randn(3, 4, dtype=torch.float64)
    lamb = DPLAMB([a], lr=0.01, eps=1e-6)
    adam = torch.optim.Adam([b], lr=0.01, eps=1e-6)
    a.grad, b.grad = g.clone(), g.clone()
    lamb.step()
    adam.step()
    assert torch.allclose(a, b, rtol=0, atol=1e-15)
    assert lamb.state[a]["trust_ratio"] == 1.0
    assert a.abs().sum() > 0  # the zero head moved (a naive ‖θ‖/‖r‖ = 0 would freeze it)


def test_lamb_trust_ratio_scales_update_to_weight_norm():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5, 6, dtype=torch.float64) * 3)
    before = a.detach().clone()
    opt = DPLAMB([a], lr=0.1)
    a.grad = torch.randn(5, 6, dtype=torch.float64)
    opt.step()
    step = (a.detach() - before).norm()
    assert step == pytest.approx(0.1 * before.norm().item(), rel=1e-10)
    assert opt.state[a]["trust_ratio"] != 1.0


def test_lamb_ratio_one_for_zero_update_and_excluded_tensors():
    w = nn.Parameter(torch.ones(4, 4, dtype=torch.float64))
    bias = nn.Parameter(torch.full((4,), -10.0, dtype=torch.float64))
    opt = DPLAMB([w, bias], lr=0.01)
    w.grad = torch.zeros(4, 4, dtype=torch.float64)
    bias.grad = torch.ones(4, dtype=torch.float64)
    opt.step()
    assert opt.state[w]["trust_ratio"] == 1.0 and torch.equal(w.detach(), torch.ones(4, 4, dtype=torch.float64))
    assert opt.state[bias]["trust_ratio"] == 1.0  # 1-D: excluded from adaptation (would be ≈10 otherwise)
    assert torch.allclose(bias.detach(), torch.full((4,), -10.01, dtype=torch.float64))
    opt2 = DPLAMB([{"params": [w], "adapt": False}], lr=0.01)
    w.grad = torch.randn(4, 4, dtype=torch.float64)
    opt2.step()
    assert opt2.state[w]["trust_ratio"] == 1.0


@pytest.mark.parametrize("name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                      ("adamw", torch.optim.AdamW), ("lamb", DPLAMB)])
def test_make_optimizer(name, cls):
    p = nn.Parameter(torch.ones(3))
    opt = make_optimizer(name, [p], learning_rate=0.5, momentum=0.9 if name == "sgd" else 0.0)
    assert isinstance(opt, cls)
    p.grad = torch.ones(3)
    opt.step()
    assert (p.detach() < 1).all()


def test_make_optimizer_bad_inputs():
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(InvalidParameterError, match="optimizer"):
        make_optimizer("adamm", p, learning_rate=0.1)
    with pytest.raises(InvalidParameterError, match="learning_rate"):
        make_optimizer("sgd", p, learning_rate=0)
    with pytest.raises(InvalidParameterError, match="momentum"):
        make_optimizer("sgd", p, learning_rate=0.1, momentum=1.0)
    with pytest.raises(InvalidParameterError, match="betas"):
        make_optimizer("adam", p, learning_rate=0.1, betas=(0.9,))
    with pytest.raises(InvalidParameterError, match="params"):
        make_optimizer("adam", [], learning_rate=0.1)
