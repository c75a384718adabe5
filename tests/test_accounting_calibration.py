"""Calibration of σ: never under-noised, tight, inside compositions; seed 001 loss noise."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privtune.accounting import (
    DPSGDEvent,
    GaussianEvent,
    RepeatAndSelectEvent,
    calibrate_loss_noise_multiplier,
    calibrate_noise_multiplier,
    compute_epsilon,
    joint_release_events,
)
from privtune.errors import InfeasibleBudgetError, InvalidParameterError

# Tight reference: dp_accounting.calibrate_dp_mechanism(PLDAccountant (interval 1e-4), tol=1e-5) for
# ε = 1, δ = 1e-5, q = 0.01, T = 5000 (computed once; takes ~2 s, so not recomputed here).
REFERENCE_SIGMA_1_1e5_001_5000 = 2.752653392953275


def test_calibration_contract_issue_case():
    s = calibrate_noise_multiplier(1.0, 1e-5, 0.01, 5000)
    assert compute_epsilon(DPSGDEvent(s, 0.01, 5000), 1e-5) <= 1.0
    assert abs(s / REFERENCE_SIGMA_1_1e5_001_5000 - 1) <= 0.005
    # far tighter than RDP (≈ 8 % more noise)
    s_rdp = calibrate_noise_multiplier(1.0, 1e-5, 0.01, 5000, "rdp")
    assert compute_epsilon(DPSGDEvent(s_rdp, 0.01, 5000), 1e-5, "rdp") <= 1.0
    assert 1.05 < s_rdp / s < 1.12


def test_full_batch_matches_exact_gdp():
    from privtune.accounting.gdp import noise_multiplier_full_batch

    exact = noise_multiplier_full_batch(1.0, 1e-5, 100)  # 37.31 (digest 000 §3.7)
    assert exact == pytest.approx(37.31, abs=0.01)
    s = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 100)
    assert exact <= s <= exact * 1.002
    s2 = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 100, sampling="full_batch")
    assert s2 == s


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    eps=st.floats(0.3, 8.0),
    q=st.sampled_from([0.002, 0.01, 0.05, 0.2, 1.0]),
    T=st.integers(1, 400),
    accountant=st.sampled_from(["pld", "pld", "rdp"]),
)
def test_property_calibrate_then_compute_never_exceeds_target(eps, q, T, accountant):
    s = calibrate_noise_multiplier(eps, 1e-5, q, T, accountant)
    e = compute_epsilon(DPSGDEvent(s, q, T), 1e-5, accountant)
    assert e <= eps
    assert e >= eps * 0.99  # and not wastefully loose


def test_calibration_inside_a_composition():
    spent = [DPSGDEvent(2.0, 0.01, 500), GaussianEvent(20.0, 4)]
    total = 2.0
    s = calibrate_noise_multiplier(total, 1e-5, 0.02, 300, spent_events=spent)
    assert compute_epsilon(spent + [DPSGDEvent(s, 0.02, 300)], 1e-5) <= total
    alone = calibrate_noise_multiplier(total, 1e-5, 0.02, 300)
    assert s > alone
    # a slightly smaller σ would break the total
    assert compute_epsilon(spent + [DPSGDEvent(s * 0.99, 0.02, 300)], 1e-5) > total


def test_calibration_with_repeat_and_select_spent_uses_rdp():
    spent = [RepeatAndSelectEvent(events=(DPSGDEvent(3.0, 0.01, 100),), mean=3, shape=1)]
    s = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 200, spent_events=spent)
    assert compute_epsilon(spent + [DPSGDEvent(s, 0.01, 200)], 1e-5) <= 3.0


def test_shuffle_calibration_without_amplification():
    s = calibrate_noise_multiplier(2.0, 1e-5, 0.1, 30, sampling="shuffle")  # 3 epochs, no amplification
    assert compute_epsilon(DPSGDEvent(s, 0.1, 30, sampling="shuffle"), 1e-5) <= 2.0
    s_assumed = calibrate_noise_multiplier(2.0, 1e-5, 0.1, 30, sampling="shuffle", assume_poisson=True)
    assert s_assumed < s


def test_infeasible_spent_events():
    spent = [DPSGDEvent(0.8, 0.05, 1000)]
    with pytest.raises(InfeasibleBudgetError, match="`spent_events` already cost"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, spent_events=spent)


def test_infeasible_ceiling():
    with pytest.raises(InfeasibleBudgetError, match="max_noise_multiplier = 5"):
        calibrate_noise_multiplier(0.01, 1e-5, 1.0, 1000, max_noise_multiplier=5)


@pytest.mark.parametrize(
    "args,name",
    [
        ((0.0, 1e-5, 0.01, 100), "target_epsilon"),
        ((-1.0, 1e-5, 0.01, 100), "target_epsilon"),
        ((math.nan, 1e-5, 0.01, 100), "target_epsilon"),
        ((math.inf, 1e-5, 0.01, 100), "target_epsilon"),
        ((1.0, 0.0, 0.01, 100), "delta"),
        ((1.0, 1.0, 0.01, 100), "delta"),
        ((1.0, 1e-5, 0.0, 100), "sample_rate"),
        ((1.0, 1e-5, 1.5, 100), "sample_rate"),
        ((1.0, 1e-5, 0.01, 0), "steps"),
        ((1.0, 1e-5, 0.01, 10.5), "steps"),
    ],
)
def test_bad_calibration_inputs(args, name):
    with pytest.raises(InvalidParameterError, match=f"`{name}`"):
        calibrate_noise_multiplier(*args)


def test_bad_calibration_keywords():
    with pytest.raises(InvalidParameterError, match="`delta` must be < 1/n"):
        calibrate_noise_multiplier(1.0, 1e-3, 0.01, 100, dataset_size=1000)
    with pytest.raises(InvalidParameterError, match="`sampling`"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, sampling="uniform")
    with pytest.raises(InvalidParameterError, match="`sample_rate` must be 1.0"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, sampling="full_batch")
    with pytest.raises(InvalidParameterError, match="`accountant`"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, accountant="prv")


# ---------------------------------------------------------------- seed 001 (HyFreeDP) joint release
Q, T, K = 0.02, 150, 5
DELTA_001 = 50000 ** -1.1


def _indep_events(sg, sl):
    # the paper's rule: T gradient steps and 3T/K loss releases, each independently Poisson sampled
    return [DPSGDEvent(sg, Q, T), DPSGDEvent(sl, Q, 3 * T // K)]


def test_seed001_shared_batch_vs_paper_rule_reference_numbers():
    # digest 001 §4.5: σ_g = 0.8786, σ_l = 1.339: the paper's rule claims ε = 3.000 (RDP) / 2.466 (PLD),
    # the shared batch really costs 6.370 (RDP) / 5.171 (PLD).
    shared = joint_release_events(0.8786, 1.339, Q, T, K, 3)
    assert compute_epsilon(shared, DELTA_001, "rdp") == pytest.approx(6.370, abs=0.01)
    assert compute_epsilon(shared, DELTA_001) == pytest.approx(5.171, abs=0.01)
    assert compute_epsilon(_indep_events(0.8786, 1.339), DELTA_001, "rdp") == pytest.approx(3.000, abs=0.01)
    assert compute_epsilon(_indep_events(0.8786, 1.339), DELTA_001) == pytest.approx(2.466, abs=0.01)
    # σ_l = 5.473 (the shared-batch solution for ε = 3): 3.000 (RDP) / 2.443 (PLD)
    shared2 = joint_release_events(0.8786, 5.473, Q, T, K, 3)
    assert compute_epsilon(shared2, DELTA_001, "rdp") == pytest.approx(3.000, abs=0.01)
    assert compute_epsilon(shared2, DELTA_001) == pytest.approx(2.443, abs=0.01)


@pytest.mark.parametrize("eps,sigma_g,sigma_l", [(1, 1.4195, 9.478), (3, 0.8786, 5.473), (8, 0.6099, 3.664)])
def test_seed001_shared_batch_loss_noise_calibration(eps, sigma_g, sigma_l):
    # digest 001 §11 item 10 (RDP, γ = 1.01): shared-batch σ_l = 9.48 / 5.47 / 3.66 at ε = 1 / 3 / 8
    sl = calibrate_loss_noise_multiplier(eps, DELTA_001, sigma_g, Q, T, K, 3, accountant="rdp")
    assert sl == pytest.approx(sigma_l, rel=0.01)
    assert compute_epsilon(joint_release_events(sigma_g, sl, Q, T, K, 3), DELTA_001, "rdp") <= eps


def test_seed001_gradient_only_sigma_reference():
    # digest 001 §4.4: gradient-only σ for ε = 3 (RDP) is 0.8699
    assert calibrate_noise_multiplier(3.0, DELTA_001, Q, T, "rdp") == pytest.approx(0.8699, abs=1e-3)


def test_loss_noise_infeasible_when_gradient_alone_exceeds():
    with pytest.raises(InfeasibleBudgetError, match="gradient releases alone"):
        calibrate_loss_noise_multiplier(3.0, DELTA_001, 0.8699 * 0.99, Q, T, K, 3, accountant="rdp")
