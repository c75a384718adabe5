"""Each Gaussian mechanism of ``engine/mechanisms.py``: its noise has the claimed scale, and the event it returns
is the Gaussian event of that scale (a NonPrivateEvent without noise)."""

from __future__ import annotations

import math

import pytest
import torch

from privtune.accounting.events import GaussianEvent, NonPrivateEvent
from privtune.engine.mechanisms import noisy_feature_sum, noisy_scalar, privatise_sum


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_privatise_sum_noise_scale_divisor_and_event():
    sums = [torch.zeros(20000, dtype=torch.float64), torch.full((3, 100), 8.0, dtype=torch.float64)]
    out = privatise_sum(sums, 1.5, 2.0, 4.0, _gen())
    noise = out.value[0]
    assert float(noise.mean()) == pytest.approx(0.0, abs=0.03)  # 5 standard errors
    assert float(noise.std()) == pytest.approx(1.5 * 2.0 / 4.0, rel=0.03)  # σ·C / expected batch size
    assert float(out.value[1].mean()) == pytest.approx(2.0, abs=0.1)
    assert out.event == GaussianEvent(1.5, 1, label="clipped gradient sum")
    single = privatise_sum(torch.zeros(5), 1.5, 2.0, 4.0, _gen())
    assert isinstance(single.value, torch.Tensor) and single.event == out.event


def test_privatise_sum_without_noise_is_not_private():
    out = privatise_sum([torch.ones(4)], 0.0, 1.0, 2.0, _gen())
    torch.testing.assert_close(out.value[0], torch.full((4,), 0.5))
    assert isinstance(out.event, NonPrivateEvent)


def test_noisy_scalar_scale_and_event():
    g = _gen(1)
    vals = torch.tensor([noisy_scalar(10.0, 3.0, 0.5, g, label="x").value for _ in range(8000)])
    assert float(vals.mean()) == pytest.approx(10.0, abs=0.05)
    assert float(vals.std()) == pytest.approx(3.0 * 0.5, rel=0.04)  # σ·Δ
    assert noisy_scalar(1.0, 3.0, 0.5, g, label="x").event == GaussianEvent(3.0, 1, label="x")
    exact = noisy_scalar(7.0, 0.0, 1.0, g)
    assert exact.value == 7.0 and isinstance(exact.event, NonPrivateEvent)


def test_noisy_scalar_draws_one_float64_normal():
    """The draw is one standard normal of the generator, scaled by σΔ (reproducible runs depend on the order)."""
    z = float(torch.randn((), generator=_gen(5), dtype=torch.float64))
    assert noisy_scalar(2.0, 4.0, 0.25, _gen(5)).value == 2.0 + 4.0 * 0.25 * z


def test_noisy_feature_sum_bounds_rows_and_adds_noise_of_sigma():
    X = torch.tensor([[3.0, 4.0], [0.3, 0.4]])  # the first row is scaled to norm 1, the second kept
    exact = noisy_feature_sum(X, 0.0, _gen())
    torch.testing.assert_close(exact.value, torch.tensor([0.6 + 0.3, 0.8 + 0.4]))
    assert isinstance(exact.event, NonPrivateEvent)
    wide = torch.zeros(1, 20000)
    out = noisy_feature_sum(wide, 2.5, _gen(2))
    assert float(out.value.std()) == pytest.approx(2.5, rel=0.03)
    assert out.event == GaussianEvent(2.5, 1, label="private feature mean (centering)")
    # sensitivity 1: adding any row moves the exact sum by at most 1
    big = torch.cat([X, torch.tensor([[100.0, -100.0]])])
    diff = noisy_feature_sum(big, 0.0, _gen()).value - exact.value
    assert float(diff.norm()) <= 1.0 + 1e-6 and math.isfinite(float(diff.norm()))
