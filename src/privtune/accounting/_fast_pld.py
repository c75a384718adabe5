"""Faster construction of dp_accounting's subsampled-Gaussian PLD (same numbers).

``dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism`` builds the
connect-the-dots PMF by calling ``GaussianPrivacyLoss.get_delta_for_epsilon`` on a grid of
~(loss range / interval) privacy-loss values; that method inverts the privacy loss with a
Python-level loop (``[self.inverse_privacy_loss(eps) for eps in ...]``), which is >90 % of
the construction time.  :class:`VectorizedGaussianPrivacyLoss` overrides only that method
and evaluates dp_accounting's own closed-form inverse (Gaussian: x = −Δ/2 − ℓσ²/Δ; Poisson
subsampling: ℓ_ws = log(1 + (e^ℓ − 1)/q) for REMOVE, −log(1 + (e^−ℓ − 1)/q) for ADD) with
numpy.  The mathematics, the discretisation, the pessimistic rounding and the tail handling
all remain dp_accounting's; the test suite checks equality with the public constructor.

If dp_accounting's private helpers change, :func:`gaussian_pld` silently uses the public
``from_gaussian_mechanism`` instead (same result, slower).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pldlib
from dp_accounting.pld import privacy_loss_mechanism as plm

AdjacencyType = plm.AdjacencyType


class VectorizedGaussianPrivacyLoss(plm.GaussianPrivacyLoss):
    """``GaussianPrivacyLoss`` with a vectorised ``get_delta_for_epsilon`` (ADD/REMOVE only)."""

    def _inverse_vec(self, eps: np.ndarray) -> np.ndarray:
        q = self.sampling_prob
        s2 = self._standard_deviation ** 2
        d = self.sensitivity

        def inv_ws_remove(l):
            return -0.5 * d - l * s2 / d

        if q == 1.0:
            if self.adjacency_type == AdjacencyType.ADD:
                return d + inv_ws_remove(eps)
            return inv_ws_remove(eps)
        log_q = math.log(q)
        log_c = math.log(1.0 / q - 1.0)  # log|1 − 1/q|
        out = np.empty_like(eps, dtype=float)
        if self.adjacency_type == AdjacencyType.REMOVE:
            bound = math.log(1 - q)
            close = np.isclose(eps, bound, rtol=1e-9, atol=0.0)
            dd = eps - log_q  # log(a e^b), a = 1/q
            with np.errstate(divide="ignore", invalid="ignore"):
                lws = dd + np.log1p(-np.exp(log_c - dd))
            out[:] = inv_ws_remove(lws)
            out[close] = inv_ws_remove(-math.inf)
            return out
        # ADD
        bound = -math.log(1 - q)
        close = np.isclose(eps, bound, rtol=1e-9, atol=0.0)
        dd = -eps - log_q
        with np.errstate(divide="ignore", invalid="ignore"):
            lws = -(dd + np.log1p(-np.exp(log_c - dd)))
        out[:] = d + inv_ws_remove(lws)
        out[close] = d + inv_ws_remove(math.inf)
        return out

    def get_delta_for_epsilon(self, epsilon):  # noqa: D401 - same contract as the parent
        if self.adjacency_type not in (AdjacencyType.ADD, AdjacencyType.REMOVE):
            return super().get_delta_for_epsilon(epsilon)
        is_scalar = isinstance(epsilon, numbers.Number)
        epsilons = np.array([epsilon], dtype=float) if is_scalar else np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.sampling_prob == 1.0:
            inv = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == AdjacencyType.ADD:
            inv = epsilons < -math.log1p(-self.sampling_prob)
        else:
            inv = epsilons > math.log1p(-self.sampling_prob)
            other = np.logical_not(inv)
            deltas[other] = -np.expm1(epsilons[other])
        x = self._inverse_vec(epsilons[inv])
        deltas[inv] = self.mu_upper_cdf(x) - np.exp(epsilons[inv] + self.mu_lower_log_cdf(x))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas


def _fast_gaussian_pld(sigma: float, q: float, interval: float):
    def single(adjacency_type):
        return pldlib._create_pld_pmf_from_monotone_privacy_loss(  # noqa: SLF001
            VectorizedGaussianPrivacyLoss(
                sigma, sensitivity=1.0, pessimistic_estimate=True, sampling_prob=q,
                adjacency_type=adjacency_type),
            pessimistic_estimate=True,
            value_discretization_interval=interval,
            use_connect_dots=True,
        )

    return pldlib._pld_for_subsampled_mechanism(single, q)  # noqa: SLF001


def gaussian_pld(sigma: float, q: float, interval: float):
    """Pessimistic connect-the-dots PLD of the Poisson-subsampled Gaussian (add/remove)."""
    try:
        return _fast_gaussian_pld(sigma, q, interval)
    except (AttributeError, TypeError):  # pragma: no cover - dp_accounting internals changed
        return public_gaussian_pld(sigma, q, interval)


def public_gaussian_pld(sigma: float, q: float, interval: float):
    """The same PLD through dp_accounting's public constructor (reference)."""
    return pldlib.from_gaussian_mechanism(
        standard_deviation=sigma, sensitivity=1.0, pessimistic_estimate=True,
        value_discretization_interval=interval, sampling_prob=q,
    )


# ---------------------------------------------------------------------------------------------
# self-composition
# ---------------------------------------------------------------------------------------------
# dp_accounting's DensePLDPmf.self_compose = common.self_convolve (FFT power of the PMF) with
# truncation bounds from a Chernoff bound evaluated at 40 orders; the bound is computed with 40
# separate scipy.special.logsumexp calls whose per-call overhead dominates for large PMFs.  The
# functions below compute the *same* bound (same orders, same formula) with plain numpy and the
# same FFT power (real FFT), then build dp_accounting's DensePLDPmf with the same lower loss and
# the same pessimistic infinity mass.  Sparse PMFs that stay sparse use dp_accounting directly.
from dp_accounting.pld import pld_pmf as _pmflib  # noqa: E402
from scipy import fft as _fft  # noqa: E402

_ORDERS = np.concatenate((np.arange(-20, 0), np.arange(1, 21))).astype(float)


def _self_convolve_bounds(probs: np.ndarray, num_times: int, tail_mass_truncation: float) -> tuple[int, int]:
    n = len(probs)
    upper, lower = (n - 1) * num_times, 0
    if tail_mass_truncation == 0:
        return lower, upper
    idx = np.arange(n, dtype=float)
    with np.errstate(divide="ignore"):
        logp = np.log(probs)
    log2t = math.log(2 / tail_mass_truncation)
    for o in _ORDERS / n:
        a = idx * o + logp
        m = np.max(a)
        if not np.isfinite(m):
            continue
        log_mgf = m + math.log(np.sum(np.exp(a - m)))
        bound = (num_times * log_mgf + log2t) / o
        if not math.isfinite(bound):
            continue
        if o > 0:
            upper = min(upper, math.ceil(bound))
        else:
            lower = max(lower, math.floor(bound))
    return lower, upper


def _dense_self_compose(pmf, num_times: int, tail_mass_truncation: float):
    probs = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    lo, hi = _self_convolve_bounds(probs, num_times, tail_mass_truncation)
    out_len = hi - lo + 1
    n_fft = _fft.next_fast_len(max(out_len, len(probs)), real=True)
    conv = _fft.irfft(_fft.rfft(probs, n_fft) ** num_times, n_fft)
    conv = np.roll(conv, -lo)[:out_len]
    inf_prob = tail_mass_truncation - math.expm1(num_times * math.log1p(-pmf._infinity_mass))  # noqa: SLF001
    return _pmflib.DensePLDPmf(pmf._discretization, pmf._lower_loss * num_times + lo, conv,  # noqa: SLF001
                               inf_prob, pmf._pessimistic_estimate)  # noqa: SLF001


def _pmf_self_compose(pmf, num_times: int, tail_mass_truncation: float = 1e-15):
    if num_times == 1:
        return pmf
    if isinstance(pmf, _pmflib.SparsePLDPmf):
        if pmf.size ** num_times <= _pmflib._MAX_PMF_SPARSE_SIZE:  # noqa: SLF001
            return pmf.self_compose(num_times, tail_mass_truncation)
        pmf = pmf.to_dense_pmf()
    if isinstance(pmf, _pmflib.DensePLDPmf):
        return _dense_self_compose(pmf, num_times, tail_mass_truncation)
    return pmf.self_compose(num_times, tail_mass_truncation)  # pragma: no cover


def self_compose(pld, num_times: int, tail_mass_truncation: float = 1e-15):
    """``pld.self_compose(num_times)`` with the same result, computed faster (see above)."""
    try:
        rem = _pmf_self_compose(pld._pmf_remove, num_times, tail_mass_truncation)  # noqa: SLF001
        if pld._symmetric:  # noqa: SLF001
            return pldlib.PrivacyLossDistribution(rem)
        add = _pmf_self_compose(pld._pmf_add, num_times, tail_mass_truncation)  # noqa: SLF001
        return pldlib.PrivacyLossDistribution(rem, add)
    except AttributeError:  # pragma: no cover - dp_accounting internals changed
        return pld.self_compose(num_times, tail_mass_truncation)


# ---------------------------------------------------------------------------------------------
# pairwise composition
# ---------------------------------------------------------------------------------------------
# DensePLDPmf.compose = scipy.signal.fftconvolve + _truncate_tails, whose prefix search is a
# Python loop over the array.  Same computation, with the prefix search done by np.cumsum.
from scipy import signal as _signal  # noqa: E402


def _truncate_tails(probs: np.ndarray, tail: float):
    """dp_accounting ``pld_pmf._truncate_tails`` (pessimistic) with a vectorised prefix search."""
    if tail == 0:
        return 0, probs, 0.0
    thr = tail / 2
    c = np.cumsum(probs)
    left = int(np.searchsorted(c > thr, True)) if c[-1] > thr else len(probs)
    cr = np.cumsum(probs[::-1])
    right = len(probs) - (int(np.searchsorted(cr > thr, True)) if cr[-1] > thr else len(probs))
    right = max(right, left + 1)
    left_mass = float(np.sum(probs[:left]))
    right_mass = float(np.sum(probs[right:]))
    out = probs[left:right]
    out[0] += left_mass
    return left, out, right_mass


def _dense_compose(a, b, tail: float):
    probs = _signal.fftconvolve(a._probs, b._probs)  # noqa: SLF001
    inf = a._infinity_mass + b._infinity_mass - a._infinity_mass * b._infinity_mass  # noqa: SLF001
    offset, probs, right = _truncate_tails(probs, tail)
    return _pmflib.DensePLDPmf(a._discretization, a._lower_loss + b._lower_loss + offset, probs,  # noqa: SLF001
                               inf + right, a._pessimistic_estimate)  # noqa: SLF001


def _pmf_compose(a, b, tail: float):
    if isinstance(a, _pmflib.DensePLDPmf) or isinstance(b, _pmflib.DensePLDPmf) or \
            a.size * b.size > _pmflib._MAX_PMF_SPARSE_SIZE:  # noqa: SLF001
        da = a if isinstance(a, _pmflib.DensePLDPmf) else a.to_dense_pmf()
        db = b if isinstance(b, _pmflib.DensePLDPmf) else b.to_dense_pmf()
        da.validate_composable(db)
        return _dense_compose(da, db, tail)
    return _pmflib.compose_pmfs(a, b, tail)


def compose(p1, p2, tail_mass_truncation: float = 1e-15):
    """``p1.compose(p2)`` with the same result (vectorised tail truncation)."""
    try:
        rem = _pmf_compose(p1._pmf_remove, p2._pmf_remove, tail_mass_truncation)  # noqa: SLF001
        if p1._symmetric and p2._symmetric:  # noqa: SLF001
            return pldlib.PrivacyLossDistribution(rem)
        add = _pmf_compose(p1._pmf_add, p2._pmf_add, tail_mass_truncation)  # noqa: SLF001
        return pldlib.PrivacyLossDistribution(rem, add)
    except AttributeError:  # pragma: no cover - dp_accounting internals changed
        return p1.compose(p2, tail_mass_truncation)
