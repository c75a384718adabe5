"""Extreme inputs: a tiny σ or a huge T is answered quickly, honestly (never optimistically) and
with a stated reason; never a MemoryError/OverflowError traceback or a hang."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdplib

from privtune.accounting import (
    Certificate,
    DPSGDEvent,
    GaussianEvent,
    account,
    calibrate_noise_multiplier,
    compute_delta,
    compute_epsilon,
    verify_certificate,
)
from privtune.accounting import _fast_pld as fp
from privtune.accounting import accountant as acc


def _rdp_epsilon(sigma, q, T, delta=1e-5):
    """dp_accounting's RDP, called directly (the reference for the fallback)."""
    a = rdplib.RdpAccountant()
    a.compose(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), T))
    return a.get_epsilon(delta)


def _clear_caches():
    for f in (acc._base_pld, acc._segment_pld, acc._composed_pld):
        f.cache_clear()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sigma", [1e-300, 1e-10, 5e-7])
def test_sigma_below_the_floor_gives_infinite_epsilon_with_a_reason(sigma):
    for ev in (DPSGDEvent(sigma, 0.01, 5000), GaussianEvent(sigma, 3), DPSGDEvent(sigma, 0.1, 50, sampling="shuffle")):
        for accountant in ("pld", "rdp"):
            res = account(ev, 1e-5, accountant)
            assert res.epsilon == math.inf
            assert any("below 1e-06" in n and "infinite" in n for n in res.notes), res.notes
        assert compute_delta(ev, 1.0) == 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sigma", [1e-5, 1e-3])
def test_tiny_sigma_falls_back_to_rdp_and_says_why(sigma):
    res = account(DPSGDEvent(sigma, 0.01, 5000), 1e-5)
    assert res.accountant == "rdp" and res.requested_accountant == "pld"
    assert res.epsilon == pytest.approx(_rdp_epsilon(sigma, 0.01, 5000), rel=1e-12)
    assert any("accounted with RDP" in n and "grid points" in n for n in res.notes), res.notes
    assert res.value_discretization_interval is None
    assert 0.0 < compute_delta(DPSGDEvent(sigma, 0.01, 5000), 100.0) <= 1.0


@pytest.mark.timeout(60)
def test_huge_number_of_steps_falls_back_to_rdp():
    ev = DPSGDEvent(1.0, 0.01, 10**9)
    res = account(ev, 1e-5)
    assert res.accountant == "rdp" and res.epsilon == pytest.approx(_rdp_epsilon(1.0, 0.01, 10**9), rel=1e-12)
    assert any("self-compositions" in n for n in res.notes)
    d = compute_delta(ev, 1e5)
    assert 0.0 <= d <= 1.0
    # a certificate of such a run verifies (it records the accountant actually used)
    cert = Certificate.from_events([ev], 1e-5)
    assert cert.accountant == "rdp"


@pytest.mark.timeout(120)
def test_refinement_stopped_by_the_size_limit_is_an_upper_bound_and_noted(monkeypatch, tmp_path):
    ev = DPSGDEvent(1.0, 0.01, 5000)
    reference = compute_epsilon(ev, 1e-5, value_discretization_interval=acc.REFERENCE_PLD_INTERVAL)
    _clear_caches()
    monkeypatch.setattr(fp, "MAX_COMPOSED_POINTS", 20_000)  # the 1e-3 level (~24,700 points) no longer fits
    try:
        res = account(ev, 1e-5)
        assert any(n.startswith("PLD refinement stopped at interval 0.003") for n in res.notes), res.notes
        assert res.accountant == "pld" and res.value_discretization_interval == 0.003
        assert res.epsilon >= reference * (1 - 1e-9)  # coarser pessimistic PLD: looser, never optimistic
        assert res.epsilon <= _rdp_epsilon(1.0, 0.01, 5000)  # else RDP would have been reported
        path = Certificate.from_events([ev], 1e-5).save(tmp_path / "c.json")
        assert verify_certificate(path).epsilon == pytest.approx(res.epsilon, rel=1e-12)
    finally:
        _clear_caches()


def test_rdp_overflow_is_reported_as_infinite_not_raised(monkeypatch):
    class Broken:
        def get_epsilon(self, delta):
            raise ZeroDivisionError("float division by zero")

        def get_delta(self, epsilon):
            raise OverflowError("math range error")

    monkeypatch.setattr(acc, "_rdp_accountant", lambda events: Broken())
    res = account(DPSGDEvent(1.0, 0.01, 100), 1e-5, "rdp")
    assert res.epsilon == math.inf and any("not finite" in n and "ZeroDivisionError" in n for n in res.notes)
    assert compute_delta(DPSGDEvent(1.0, 0.01, 100), 1.0, "rdp") == 1.0


@pytest.mark.timeout(120)
def test_calibration_when_the_pld_would_be_too_large():
    # a huge target needs a tiny σ, whose PLD does not fit: calibration still returns a verified σ
    sigma = calibrate_noise_multiplier(1e6, 1e-5, 0.01, 5000)
    assert compute_epsilon(DPSGDEvent(sigma, 0.01, 5000), 1e-5) <= 1e6


def test_grouping_tiny_full_batch_gaussians_does_not_divide_by_zero():
    segs = acc.merge_segments([acc.Segment(1e-300, 1.0, 2), acc.Segment(2.0, 1.0, 3)])
    assert segs == [acc.Segment(0.0, 1.0, 1)]
    assert compute_epsilon([GaussianEvent(1e-300, 2), GaussianEvent(2.0, 3)], 1e-5) == math.inf


def test_no_certificate_for_an_infinite_epsilon():
    from privtune.errors import CertificateError

    with pytest.raises(CertificateError, match="no finite ε.*below 1e-06"):
        Certificate.from_events([DPSGDEvent(1e-10, 0.01, 10)], 1e-5)
