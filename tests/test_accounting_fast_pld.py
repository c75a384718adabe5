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


# --------------------------------------------------------------------------- run-time self-check


def _clear_caches():
    from privtune.accounting import accountant as acc

    for f in (acc._base_pld, acc._segment_pld, acc._composed_pld):
        f.cache_clear()


@pytest.fixture
def fresh_self_check():
    """Each test starts with no self-check result and empty PLD caches, and leaves none behind."""
    fp._reset_self_check()
    _clear_caches()
    yield
    fp._reset_self_check()
    _clear_caches()


def _public_epsilon(sigma, q, h, T, delta=1e-5):
    return fp.public_self_compose(fp.public_gaussian_pld(sigma, q, h), T).get_epsilon_for_delta(delta)


def test_self_check_passes_on_this_dp_accounting(fresh_self_check):
    assert fp.self_check() is None
    assert fp.ensure_checked() is True
    assert fp.fast_path_status() == {"checked": True, "fast": True, "reason": None}


def test_wrong_fast_construction_is_caught_and_the_public_path_used(fresh_self_check, monkeypatch):
    import warnings

    from privtune.accounting import DPSGDEvent, compute_epsilon

    # a fast construction that silently drifts (as if dp_accounting's internals had changed meaning)
    monkeypatch.setattr(fp, "_fast_gaussian_pld", lambda s, q, h: fp.public_gaussian_pld(s * 1.01, q, h))
    with pytest.warns(RuntimeWarning, match=r"fast PLD path .* construction .* public"):
        eps = compute_epsilon(DPSGDEvent(1.0, 0.01, 500), 1e-5, value_discretization_interval=1e-3)
    assert eps == pytest.approx(_public_epsilon(1.0, 0.01, 1e-3, 500), rel=1e-12)
    assert eps > _public_epsilon(1.01, 0.01, 1e-3, 500) * 1.001  # not the drifted (optimistic) value
    status = fp.fast_path_status()
    assert status["checked"] and not status["fast"] and "construction" in status["reason"]
    with warnings.catch_warnings():  # warned once per process, not on every call
        warnings.simplefilter("error")
        eps2 = compute_epsilon(DPSGDEvent(1.3, 0.02, 300), 1e-5, value_discretization_interval=1e-3)
    assert eps2 == pytest.approx(_public_epsilon(1.3, 0.02, 1e-3, 300), rel=1e-12)


def test_wrong_fast_self_composition_is_caught(fresh_self_check, monkeypatch):
    from privtune.accounting import DPSGDEvent, compute_epsilon

    real = fp._fast_self_compose
    monkeypatch.setattr(fp, "_fast_self_compose", lambda pld, T, tail=1e-15: real(pld, T + 1, tail))
    with pytest.warns(RuntimeWarning, match="self-composition"):
        eps = compute_epsilon(DPSGDEvent(1.0, 0.01, 800), 1e-5, value_discretization_interval=1e-3)
    assert eps == pytest.approx(_public_epsilon(1.0, 0.01, 1e-3, 800), rel=1e-12)
    assert not fp.fast_path_status()["fast"]


def test_fast_path_that_raises_falls_back_with_the_reason(fresh_self_check, monkeypatch):
    def broken(*_args):
        raise AttributeError("module 'dp_accounting.pld.privacy_loss_distribution' has no attribute '_x'")

    monkeypatch.setattr(fp, "_fast_gaussian_pld", broken)
    with pytest.warns(RuntimeWarning, match="raised AttributeError"):
        pld = fp.gaussian_pld(1.0, 0.01, 1e-2)
    ref = fp.public_gaussian_pld(1.0, 0.01, 1e-2)
    assert pld.get_epsilon_for_delta(1e-5) == ref.get_epsilon_for_delta(1e-5)


# --------------------------------------------------------------------------- size limits


def test_predicted_points_match_the_built_pld():
    for sigma, q, h in [(1.0, 0.01, 1e-2), (0.3, 0.01, 1e-3), (0.5, 1.0, 1e-2), (3.0, 0.3, 1e-2)]:
        pld = fp.gaussian_pld(sigma, q, h)
        built = max(pld._pmf_remove.size, pld._pmf_add.size)
        assert fp.predicted_points(sigma, q, h) == pytest.approx(built, rel=0.01, abs=5)
    for sigma in (1e-5, 1e-10, 1e-300):
        assert fp.predicted_points(sigma, 0.01, 1e-2) > fp.MAX_PLD_POINTS


@pytest.mark.timeout(60)
def test_too_large_plds_are_refused_before_allocating():
    with pytest.raises(fp.PLDTooLargeError, match="grid points"):
        fp.gaussian_pld(1e-5, 0.01, 1e-2)  # 5e11 points: numpy MemoryError before the size check
    with pytest.raises(fp.PLDTooLargeError, match="unbounded"):
        fp.gaussian_pld(1e-300, 0.01, 1e-2)  # inf range: OverflowError before the size check
    base = fp.gaussian_pld(1.0, 0.01, 1e-2)  # sparse, 568 points
    with pytest.raises(fp.PLDTooLargeError, match="self-compositions"):
        fp.self_compose(base, 10**12)  # size ** T alone used to hang
    big = fp.self_compose(fp.gaussian_pld(1.0, 0.01, 1e-3), 10**6)
    with pytest.raises(fp.PLDTooLargeError, match="composition"):
        for _ in range(20):
            big = fp.compose(big, big)


# --------------------------------------------------------------------------- huge T (issue 13, fast PLD)


def test_huge_t_epsilon_carries_the_fft_rounding_margin(fresh_self_check):
    """Above LARGE_T_EXACT_UP_TO steps the FFT power's rounding (measured up to 7.5e-5 relative at T = 1e8, both signs)
    is covered by a relative margin on ε, with a note; δ(ε) is consistent with it."""
    from privtune.accounting import DPSGDEvent, account, compute_delta
    from privtune.accounting import accountant as acc

    T = 2 * acc.LARGE_T_EXACT_UP_TO
    base = fp.gaussian_pld(1.0, 1e-4, 1e-2)
    raw = fp.self_compose(base, T).get_epsilon_for_delta(1e-5)
    res = account(DPSGDEvent(1.0, 1e-4, T), 1e-5, value_discretization_interval=1e-2)
    assert res.accountant == "pld"
    assert res.epsilon == pytest.approx(raw * (1 + acc.LARGE_T_MARGIN), rel=1e-12)
    assert any("safety margin" in n for n in res.notes)
    d = compute_delta(DPSGDEvent(1.0, 1e-4, T), res.epsilon, value_discretization_interval=1e-2)
    assert d == pytest.approx(1e-5, rel=1e-3) and d <= 1e-5 * (1 + 1e-3)
    # at or below the threshold nothing changes
    small = acc.LARGE_T_EXACT_UP_TO
    res_small = account(DPSGDEvent(1.0, 1e-4, small), 1e-5, value_discretization_interval=1e-2)
    assert res_small.epsilon == pytest.approx(fp.self_compose(base, small).get_epsilon_for_delta(1e-5), rel=1e-12)
    assert not any("safety margin" in n for n in res_small.notes)


def test_huge_t_margin_dominates_the_measured_fft_disagreement(fresh_self_check):
    """The margin is ≥ 10× the fast-vs-dp_accounting disagreement at T = 10⁷ (two independent FFT-power
    evaluations of the same convolution); the full measurement is bench/fast_pld_large_t.py."""
    from privtune.accounting import accountant as acc

    base = fp.public_gaussian_pld(1.0, 1e-4, 3e-3)
    a = fp._fast_self_compose(base, 10**7).get_epsilon_for_delta(1e-5)
    b = fp.public_self_compose(base, 10**7).get_epsilon_for_delta(1e-5)
    assert abs(a - b) / b * 10 <= acc.LARGE_T_MARGIN
