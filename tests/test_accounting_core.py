"""privtune.accounting core: golden values, agreement with dp_accounting, event lowering."""

import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import pld_privacy_accountant as pld_acc
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc

from privtune.accounting import (
    DPSGDEvent,
    GaussianEvent,
    RepeatAndSelectEvent,
    account,
    compute_delta,
    compute_epsilon,
    to_dp_event,
)
from privtune.errors import InvalidParameterError


def _dpa_poisson(sigma, q, T):
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), T)


def test_golden_values_issue_4():
    e = DPSGDEvent(noise_multiplier=1.0, sample_rate=0.01, steps=5000)
    assert compute_epsilon(e, 1e-5) == pytest.approx(4.20, abs=0.01)
    assert compute_epsilon(e, 1e-5, accountant="rdp") == pytest.approx(4.59, abs=0.01)


def test_pld_agrees_with_direct_dp_accounting_at_same_discretisation():
    e = DPSGDEvent(1.1, 0.01, 300)
    a = pld_acc.PLDAccountant(value_discretization_interval=1e-4)
    a.compose(_dpa_poisson(1.1, 0.01, 300))
    ref = a.get_epsilon(1e-5)
    ours = compute_epsilon(e, 1e-5, value_discretization_interval=1e-4)
    assert ours == pytest.approx(ref, rel=1e-9)
    # automatic discretisation: an upper bound as well, within ~0.2 % of the 1e-4 reference
    auto = compute_epsilon(e, 1e-5)
    assert ref * (1 - 1e-6) <= auto <= ref * 1.002


def test_rdp_agrees_with_direct_dp_accounting():
    events = [DPSGDEvent(1.1, 0.02, 800), GaussianEvent(4.0, 3), DPSGDEvent(0.9, 0.05, 100)]
    a = rdp_acc.RdpAccountant()
    a.compose(dpa.ComposedDpEvent([_dpa_poisson(1.1, 0.02, 800), dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(4.0), 3),
                                   _dpa_poisson(0.9, 0.05, 100)]))
    assert compute_epsilon(events, 1e-5, "rdp") == pytest.approx(a.get_epsilon(1e-5), rel=1e-9)


def test_heterogeneous_pld_agrees_with_dp_accounting_accountant():
    events = [DPSGDEvent(1.0, 0.01, 300), DPSGDEvent(1.3, 0.03, 200), GaussianEvent(6.0, 2), DPSGDEvent(1.0, 0.01, 100)]
    a = pld_acc.PLDAccountant(value_discretization_interval=1e-3)
    a.compose(dpa.ComposedDpEvent([_dpa_poisson(1.0, 0.01, 300), _dpa_poisson(1.3, 0.03, 200),
                                   dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(6.0), 2), _dpa_poisson(1.0, 0.01, 100)]))
    ours = compute_epsilon(events, 1e-5, value_discretization_interval=1e-3)
    assert ours == pytest.approx(a.get_epsilon(1e-5), rel=1e-5)


def test_anchor_values_from_digest():
    # dp_accounting PLD (1e-4): (q=0.04, σ=1.5, T=2250, δ=1e-5) → 6.768787; ours is an upper bound within 0.1 %
    e = DPSGDEvent(1.5, 0.04, 2250)
    assert 6.768787 - 1e-6 <= compute_epsilon(e, 1e-5) <= 6.768787 * 1.001
    # and dp_accounting RDP → 7.329335
    assert compute_epsilon(e, 1e-5, "rdp") == pytest.approx(7.329335, abs=2e-6)
    # dp_accounting test: q = 0.2, σ = 0.5, 3 compositions → δ(ε=1) = 0.15594
    assert compute_delta(DPSGDEvent(0.5, 0.2, 3), 1.0) == pytest.approx(0.15594, abs=1e-3)
    # exact GDP μ = 1 (q = 1, σ = 10, T = 100): ε(1e-5) = 4.3771780957; PLD is an upper bound, close
    full = DPSGDEvent(10.0, 1.0, 100, sampling="full_batch")
    eps = compute_epsilon(full, 1e-5)
    assert 4.3771780956 <= eps <= 4.3771780957 + 5e-3
    assert compute_delta(full, 1.0) == pytest.approx(0.1269367375066, abs=2e-4)


@pytest.mark.parametrize(
    "sigma,q,T,opacus_prv",
    [(0.8, 0.001, 100, 0.270403364058), (1.5, 0.001, 100, 0.039369419310),
     (0.8, 0.05, 100, 6.741051939414), (2.0, 0.2, 100, 5.672055608824)],
)
def test_tighter_than_opacus_prv_upper_bound(sigma, q, T, opacus_prv):
    eps = compute_epsilon(DPSGDEvent(sigma, q, T), 1e-6)
    assert eps <= opacus_prv + 1e-9
    assert eps >= opacus_prv - 0.011 - 1e-3  # Opacus adds eps_error = 0.01


def test_event_mapping_full_batch_and_gaussian():
    a = compute_epsilon(DPSGDEvent(3.0, 1.0, 40, sampling="full_batch"), 1e-5)
    b = compute_epsilon(GaussianEvent(3.0, count=40), 1e-5)
    c = compute_epsilon(DPSGDEvent(3.0, 1.0, 40), 1e-5)  # poisson with q = 1
    assert a == b == c


def test_gaussians_merge_exactly_into_one_gdp_mechanism():
    # 10 releases at σ=5 and 30 at σ=5√3... compose to μ² = 10/25 + 30/75 = 0.8
    events = [GaussianEvent(5.0, 10), GaussianEvent(5.0 * math.sqrt(3), 30)]
    from privtune.accounting.gdp import epsilon_from_mu

    exact = epsilon_from_mu(math.sqrt(0.8), 1e-5)
    eps = compute_epsilon(events, 1e-5)
    assert exact <= eps <= exact * 1.002


def test_shuffle_gets_no_amplification_unless_assumed():
    shuffled = DPSGDEvent(1.0, 0.1, 25, sampling="shuffle")  # 3 epochs
    res = account(shuffled, 1e-5)
    # per epoch, adding/removing one example changes two batch sums (by ≤ 2C and ≤ C): multiplier σ/√5
    assert res.epsilon == compute_epsilon(GaussianEvent(1.0 / math.sqrt(5.0), 3), 1e-5)
    two_releases = compute_epsilon([GaussianEvent(0.5, 3), GaussianEvent(1.0, 3)], 1e-5)  # 2C and C per epoch
    assert res.epsilon == pytest.approx(two_releases, rel=2e-3)
    assert res.epsilon > compute_epsilon(GaussianEvent(1.0, 3), 1e-5)  # never the old one-batch bound
    assert any("no privacy amplification" in n for n in res.notes)
    assumed = account(DPSGDEvent(1.0, 0.1, 25, sampling="shuffle", assume_poisson=True), 1e-5)
    assert assumed.epsilon == compute_epsilon(DPSGDEvent(1.0, 0.1, 25), 1e-5)
    assert assumed.epsilon < res.epsilon
    assert any("ASSUMED" in a for a in assumed.sampling_assumptions)
    assert any("assume_poisson=True" in n for n in assumed.notes)


def test_identical_events_are_grouped():
    a = compute_epsilon([DPSGDEvent(1.0, 0.01, 500)] * 2, 1e-5, value_discretization_interval=1e-3)
    b = compute_epsilon(DPSGDEvent(1.0, 0.01, 1000), 1e-5, value_discretization_interval=1e-3)
    assert a == b


def test_repeat_and_select_uses_rdp_and_says_so():
    base = DPSGDEvent(1.0, 0.01, 1000)
    rs = RepeatAndSelectEvent(events=(base,), mean=10, shape=1)
    res = account(rs, 1e-5)  # PLD asked
    assert res.accountant == "rdp" and res.requested_accountant == "pld"
    assert any("only supported by dp_accounting's RDP" in n for n in res.notes)
    # digest anchors_accounting_hpo §3.5: mean 10, geometric → 4.103271; logarithmic → 3.522633
    assert res.epsilon == pytest.approx(4.103271, abs=2e-6)
    log = RepeatAndSelectEvent(events=(base,), mean=10, shape=0)
    assert compute_epsilon(log, 1e-5, "rdp") == pytest.approx(3.522633, abs=2e-6)
    ev = to_dp_event([rs])
    assert isinstance(ev.events[0], dpa.dp_event.RepeatAndSelectDpEvent)


def test_rdp_and_pld_names_reported():
    e = DPSGDEvent(1.0, 0.01, 100)
    assert account(e, 1e-5).accountant == "pld"
    assert account(e, 1e-5, "rdp").accountant == "rdp"


@pytest.mark.parametrize("delta", [0, 1, 1.5, -1e-5, math.nan, math.inf, "1e-5"])
def test_bad_delta(delta):
    with pytest.raises(InvalidParameterError, match="`delta`"):
        compute_epsilon(DPSGDEvent(1.0, 0.01, 10), delta)


def test_delta_at_least_one_over_n_is_an_error():
    with pytest.raises(InvalidParameterError, match=r"`delta` must be < 1/n"):
        account(DPSGDEvent(1.0, 0.01, 10), 1e-3, dataset_size=1000)


@pytest.mark.parametrize("eps", [-1.0, math.nan, math.inf])
def test_bad_epsilon_for_delta(eps):
    with pytest.raises(InvalidParameterError, match="`epsilon`"):
        compute_delta(DPSGDEvent(1.0, 0.01, 10), eps)


def test_bad_accountant_and_events():
    with pytest.raises(InvalidParameterError, match="`accountant`.*Did you mean 'pld'"):
        compute_epsilon(DPSGDEvent(1.0, 0.01, 10), 1e-5, accountant="pdl")
    with pytest.raises(InvalidParameterError, match="`events`"):
        compute_epsilon([1.0], 1e-5)
    with pytest.raises(InvalidParameterError, match="`events`"):
        compute_epsilon("dpsgd", 1e-5)
    for kw in (dict(noise_multiplier=0, sample_rate=0.1, steps=1), dict(noise_multiplier=1, sample_rate=0, steps=1),
               dict(noise_multiplier=1, sample_rate=1.01, steps=1), dict(noise_multiplier=1, sample_rate=0.1, steps=0),
               dict(noise_multiplier=1, sample_rate=0.1, steps=1.5)):
        with pytest.raises(InvalidParameterError):
            DPSGDEvent(**kw)


def test_empty_composition_is_free():
    assert compute_epsilon([], 1e-5) == 0.0
