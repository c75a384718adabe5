"""The vectorised PLD construction/composition must give dp_accounting's own numbers."""

import pytest

from privtune.accounting import _fast_pld as fp


@pytest.mark.parametrize("sigma,q,h", [(0.8, 0.005, 1e-3), (2.0, 0.3, 1e-3), (0.5, 0.2, 3e-3), (3.0, 1.0, 1e-3),
                                       (0.7, 0.0001, 1e-3), (1.0, 0.01, 1e-2)])
def test_construction_matches_public_from_gaussian_mechanism(sigma, q, h):
    a = fp.gaussian_pld(sigma, q, h)
    b = fp.public_gaussian_pld(sigma, q, h)
    for eps in (0.0, 0.3, 1.0, 3.0):
        assert a.get_delta_for_epsilon(eps) == pytest.approx(b.get_delta_for_epsilon(eps), rel=1e-9, abs=1e-15)
    for delta in (1e-3, 1e-5, 1e-8):
        assert a.get_epsilon_for_delta(delta) == pytest.approx(b.get_epsilon_for_delta(delta), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("sigma,q,h,T", [(0.8, 0.005, 1e-3, 50), (1.0, 0.01, 1e-3, 2000), (2.0, 0.3, 1e-3, 100),
                                         (0.5, 0.2, 3e-3, 3), (3.0, 1.0, 1e-3, 7), (0.7, 0.001, 1e-2, 1000)])
def test_self_compose_matches_dp_accounting(sigma, q, h, T):
    base = fp.gaussian_pld(sigma, q, h)
    a = fp.self_compose(base, T)
    b = base.self_compose(T)
    assert a.get_epsilon_for_delta(1e-5) == pytest.approx(b.get_epsilon_for_delta(1e-5), rel=1e-9)
    assert a.get_delta_for_epsilon(1.0) == pytest.approx(b.get_delta_for_epsilon(1.0), rel=1e-8, abs=1e-15)


def test_compose_matches_dp_accounting():
    parts = [fp.self_compose(fp.gaussian_pld(s, q, 1e-3), T)
             for s, q, T in [(1.0, 0.01, 300), (1.3, 0.03, 200), (6.0, 1.0, 2), (0.9, 0.05, 100), (2.0, 0.5, 1)]]
    a = b = parts[0]
    for p in parts[1:]:
        a = fp.compose(a, p)
        b = b.compose(p)
    assert a.get_epsilon_for_delta(1e-5) == pytest.approx(b.get_epsilon_for_delta(1e-5), rel=1e-9)
    assert a.get_delta_for_epsilon(2.0) == pytest.approx(b.get_delta_for_epsilon(2.0), rel=1e-8, abs=1e-15)
