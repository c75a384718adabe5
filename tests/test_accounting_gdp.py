"""GDP helpers against closed forms (digest anchors_accounting_hpo §1.6, §2.2/2.3) and the seed 000 vector."""

import math

import pytest

from privtune.accounting import DPSGDEvent, GaussianEvent, compute_epsilon, joint_noise_multiplier
from privtune.accounting.gdp import (
    compose_mu,
    delta_from_mu,
    epsilon_from_mu,
    linear_scaling_total_epsilon,
    mu_from_epsilon,
    mu_full_batch,
    noise_multiplier_full_batch,
)
from privtune.errors import InvalidParameterError


def test_closed_form_anchors():
    assert epsilon_from_mu(1.0, 1e-5) == pytest.approx(4.3771780956812, abs=1e-9)
    assert delta_from_mu(1.0, 1.0) == pytest.approx(0.1269367375066, abs=1e-12)
    assert epsilon_from_mu(0.5, 1e-5) == pytest.approx(1.99309140, abs=1e-7)
    assert epsilon_from_mu(2.0, 1e-5) == pytest.approx(9.99725615, abs=1e-7)
    assert mu_from_epsilon(1.0, 1e-5) == pytest.approx(0.268051, abs=1e-6)
    assert mu_from_epsilon(8.0, 1e-5) == pytest.approx(1.666031, abs=1e-6)


def test_delta_formula_matches_textbook_form_and_inverse():
    from scipy.stats import norm

    for mu, eps in [(0.3, 0.5), (1.0, 2.0), (2.5, 4.0)]:
        naive = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        assert delta_from_mu(mu, eps) == pytest.approx(naive, rel=1e-9, abs=1e-15)
        assert delta_from_mu(mu, epsilon_from_mu(mu, 1e-6)) == pytest.approx(1e-6, rel=1e-6)
    assert delta_from_mu(1.0, 200.0) == 0.0  # no overflow at large ε


def test_mu_of_full_batch_and_composition():
    assert mu_full_batch(10.0, 100) == pytest.approx(1.0)
    assert compose_mu([0.6, 0.8]) == pytest.approx(1.0)
    assert compose_mu([]) == 0.0
    # σ for full batch at ε = 0.01, T = 100 is 2437.85 (digest 000 §1.6)
    assert noise_multiplier_full_batch(0.01, 1e-5, 100) == pytest.approx(2437.85, abs=0.01)


def test_seed000_linear_scaling_vector():
    # digest 000 §1.5: ε = (0.1, 0.2, 0.88), n = 3 sweeps of each tuning run, δ = 1e-5 → total 0.9963
    eps, mu = linear_scaling_total_epsilon([0.1, 0.2, 0.88], [3, 3, 1], 1e-5)
    assert round(eps, 4) == 0.9963
    assert mu == pytest.approx(0.267157, abs=1e-6)
    assert mu_from_epsilon(0.1, 1e-5) == pytest.approx(0.032521, abs=1e-6)
    assert mu_from_epsilon(0.2, 1e-5) == pytest.approx(0.061334, abs=1e-6)
    assert mu_from_epsilon(0.88, 1e-5) == pytest.approx(0.238568, abs=1e-6)
    # the printed Thm 4.1 (typo) would give 0.6355: make sure we are not computing that
    typo_mu = math.sqrt(3 * 0.032521**2 + 3 * 0.061334**2) + 0.238568**2
    assert epsilon_from_mu(typo_mu, 1e-5) == pytest.approx(0.6355, abs=1e-3)
    assert abs(eps - 0.6355) > 0.3


def test_seed000_through_events_and_pld():
    # the same procedure as privtune events: full-batch runs with T = 50 steps each, σ = √T / μ(ε_i)
    T = 50
    events = []
    for e, n in [(0.1, 3), (0.2, 3), (0.88, 1)]:
        s = math.sqrt(T) / mu_from_epsilon(e, 1e-5)
        events += [DPSGDEvent(s, 1.0, T, sampling="full_batch")] * n
    eps = compute_epsilon(events, 1e-5)
    exact = linear_scaling_total_epsilon([0.1, 0.2, 0.88], [3, 3, 1], 1e-5)[0]
    assert exact - 1e-9 <= eps <= exact + 2e-3
    assert round(eps, 3) == 0.996


def test_joint_noise_multiplier_formula():
    assert joint_noise_multiplier(1.0, 1.0, 3) == pytest.approx(0.5)
    assert joint_noise_multiplier(0.8786, 1.339, 3) == pytest.approx((0.8786**-2 + 3 * 1.339**-2) ** -0.5)
    assert joint_noise_multiplier(2.0, 5.0, 0) == pytest.approx(2.0)
    # GDP view: a joint step is exactly one Gaussian with μ² = σ_g⁻² + k σ_l⁻²
    se = joint_noise_multiplier(2.0, 3.0, 2)
    a = compute_epsilon(GaussianEvent(se, 10), 1e-5)
    b = compute_epsilon([GaussianEvent(2.0, 10), GaussianEvent(3.0, 20)], 1e-5)
    assert a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize(
    "call",
    [
        lambda: mu_full_batch(0.0, 10),
        lambda: mu_full_batch(1.0, 0),
        lambda: epsilon_from_mu(-1.0, 1e-5),
        lambda: epsilon_from_mu(1.0, 1.0),
        lambda: delta_from_mu(1.0, -0.1),
        lambda: mu_from_epsilon(0.0, 1e-5),
        lambda: mu_from_epsilon(math.nan, 1e-5),
        lambda: joint_noise_multiplier(1.0, 0.0, 3),
        lambda: joint_noise_multiplier(1.0, 1.0, -1),
        lambda: linear_scaling_total_epsilon([0.1, 0.2], [3], 1e-5),
    ],
)
def test_bad_gdp_inputs(call):
    with pytest.raises(InvalidParameterError):
        call()
