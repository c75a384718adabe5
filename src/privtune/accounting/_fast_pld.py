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

**Run-time self-check.**  The first time a process uses this module, :func:`ensure_checked`
compares the fast construction, self-composition and composition with dp_accounting's public
``from_gaussian_mechanism`` / ``self_compose`` / ``compose`` on small cases (interval 1e-2,
T = 50; ~20 ms).  If any ε or δ differs by more than 1e-9 relative (or a private helper is
missing or has changed its signature), the public functions are used for the rest of the process
(same numbers, slower) and one ``RuntimeWarning`` states the reason.  The check does not cover huge T,
where any FFT power (this one or dp_accounting's) carries a rounding error growing ~T·u; the accountant
adds a measured relative margin to ε above ``accountant.LARGE_T_EXACT_UP_TO`` steps (see there).

**Size limits.**  The number of grid points of a PLD grows like (loss range)/(interval): about
(10/σ + 1/(2σ²))/interval for the subsampled Gaussian, and with T for a self-composition.  Before
allocating anything, :func:`gaussian_pld`, :func:`self_compose` and :func:`compose` predict the
size (dp_accounting's own ``connect_dots_bounds`` and Chernoff truncation bounds) and raise
:class:`PLDTooLargeError` above :data:`MAX_PLD_POINTS` / :data:`MAX_COMPOSED_POINTS`, so that a
tiny σ or a huge T is answered by the caller (coarser interval, or RDP) in seconds instead of a
MemoryError or an hour of FFTs.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pldlib
from dp_accounting.pld import privacy_loss_mechanism as plm

from privtune.errors import PrivtuneError

AdjacencyType = plm.AdjacencyType

#: Largest base PLD (grid points of one direction's PMF) that is built (~1.3 s to construct).
MAX_PLD_POINTS = 1_000_000
#: Largest composed/self-composed PMF (grid points) that is computed (an FFT of this length, ~0.2 s;
#: reading ε off it with dp_accounting's Python loop can take ~1 s).
MAX_COMPOSED_POINTS = 1 << 21


class PLDTooLargeError(PrivtuneError):
    """The PLD at the requested discretisation would need more grid points than allowed.

    Raised *before* anything large is allocated; the accountant catches it and uses a coarser
    interval or the RDP accountant (with a note saying so)."""

    def __init__(self, what: str, points: float, limit: int):
        self.points = points
        self.limit = limit
        size = "an unbounded number of" if not math.isfinite(points) else f"about {points:.3g}"
        super().__init__(f"the PLD of {what} would need {size} grid points (limit {limit:.3g})")


def predicted_points(sigma: float, q: float, interval: float) -> float:
    """Grid points of the larger direction of ``gaussian_pld(sigma, q, interval)`` (inf if unbounded).

    Uses dp_accounting's public ``GaussianPrivacyLoss.connect_dots_bounds`` (the loss range that
    ``from_gaussian_mechanism`` discretises); costs ~1 ms and allocates nothing large."""
    if not (sigma > 0.0 and interval > 0.0):
        return math.inf
    worst = 0.0
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for adjacency_type in (AdjacencyType.REMOVE, AdjacencyType.ADD):
                bounds = plm.GaussianPrivacyLoss(
                    sigma, sensitivity=1.0, pessimistic_estimate=True, sampling_prob=q,
                    adjacency_type=adjacency_type).connect_dots_bounds()
                width = float(bounds.epsilon_upper) - float(bounds.epsilon_lower)
                worst = max(worst, width / interval + 1.0)
    except (ArithmeticError, ValueError):
        return math.inf
    return worst if math.isfinite(worst) else math.inf


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


def _fast_or_public(fast, public, what: str):
    """``fast()`` when the run-time self-check passed, else (or if dp_accounting's internals changed
    under it) ``public()``: the public dp_accounting path gives the same numbers, only slower."""
    if not ensure_checked():
        return public()
    try:
        return fast()
    except (AttributeError, TypeError) as exc:  # pragma: no cover - dp_accounting internals changed
        _disable_fast(f"{what} raised {type(exc).__name__}: {exc}")
        return public()


def gaussian_pld(sigma: float, q: float, interval: float):
    """Pessimistic connect-the-dots PLD of the Poisson-subsampled Gaussian (add/remove).

    Raises :class:`PLDTooLargeError` (before allocating) above :data:`MAX_PLD_POINTS` grid points."""
    points = predicted_points(sigma, q, interval)
    if points > MAX_PLD_POINTS:
        raise PLDTooLargeError(f"the Gaussian with σ = {sigma:.3g}, q = {q:.3g} at interval {interval:g}",
                               points, MAX_PLD_POINTS)
    return _fast_or_public(lambda: _fast_gaussian_pld(sigma, q, interval),
                           lambda: public_gaussian_pld(sigma, q, interval), "the fast PLD construction")


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


def _stays_sparse(pmf, num_times: int) -> bool:
    """dp_accounting's test ``size ** num_times <= _MAX_PMF_SPARSE_SIZE`` without building a
    huge integer (568 ** 10**9 alone takes minutes and gigabytes)."""
    size = pmf.size
    return size <= 1 or (num_times < 64 and size ** num_times <= _pmflib._MAX_PMF_SPARSE_SIZE)  # noqa: SLF001


def _check_self_compose_size(pmf, num_times: int, tail_mass_truncation: float) -> None:
    """Raise PLDTooLargeError if the self-composed PMF would exceed MAX_COMPOSED_POINTS."""
    if num_times == 1 or (isinstance(pmf, _pmflib.SparsePLDPmf) and _stays_sparse(pmf, num_times)):
        return
    dense = pmf if isinstance(pmf, _pmflib.DensePLDPmf) else pmf.to_dense_pmf()
    lo, hi = _self_convolve_bounds(np.asarray(dense._probs, dtype=float), num_times,  # noqa: SLF001
                                   tail_mass_truncation)
    size = max(hi - lo + 1, dense.size)
    if size > MAX_COMPOSED_POINTS:
        count = str(num_times) if num_times < 10**12 else f"~1e{len(str(num_times)) - 1}"
        raise PLDTooLargeError(f"{count} self-compositions", float(size), MAX_COMPOSED_POINTS)


def _pmf_self_compose(pmf, num_times: int, tail_mass_truncation: float = 1e-15):
    if num_times == 1:
        return pmf
    if isinstance(pmf, _pmflib.SparsePLDPmf):
        if _stays_sparse(pmf, num_times):
            return pmf.self_compose(num_times, tail_mass_truncation)
        pmf = pmf.to_dense_pmf()
    if isinstance(pmf, _pmflib.DensePLDPmf):
        return _dense_self_compose(pmf, num_times, tail_mass_truncation)
    return pmf.self_compose(num_times, tail_mass_truncation)  # pragma: no cover


def _public_pmf_self_compose(pmf, num_times: int, tail_mass_truncation: float):
    """dp_accounting's own ``PLDPmf.self_compose`` (its sparse → dense switch, without the big integer)."""
    if isinstance(pmf, _pmflib.SparsePLDPmf) and not _stays_sparse(pmf, num_times):
        pmf = pmf.to_dense_pmf()
    return pmf.self_compose(num_times, tail_mass_truncation)


def _fast_self_compose(pld, num_times: int, tail_mass_truncation: float = 1e-15):
    rem = _pmf_self_compose(pld._pmf_remove, num_times, tail_mass_truncation)  # noqa: SLF001
    if pld._symmetric:  # noqa: SLF001
        return pldlib.PrivacyLossDistribution(rem)
    add = _pmf_self_compose(pld._pmf_add, num_times, tail_mass_truncation)  # noqa: SLF001
    return pldlib.PrivacyLossDistribution(rem, add)


def public_self_compose(pld, num_times: int, tail_mass_truncation: float = 1e-15):
    """The same self-composition through dp_accounting's ``PLDPmf.self_compose`` (reference)."""
    try:
        rem = _public_pmf_self_compose(pld._pmf_remove, num_times, tail_mass_truncation)  # noqa: SLF001
        if pld._symmetric:  # noqa: SLF001
            return pldlib.PrivacyLossDistribution(rem)
        add = _public_pmf_self_compose(pld._pmf_add, num_times, tail_mass_truncation)  # noqa: SLF001
        return pldlib.PrivacyLossDistribution(rem, add)
    except AttributeError:  # pragma: no cover - dp_accounting internals changed
        return pld.self_compose(num_times, tail_mass_truncation)


def self_compose(pld, num_times: int, tail_mass_truncation: float = 1e-15):
    """``pld.self_compose(num_times)`` with the same result, computed faster (see above).

    Raises :class:`PLDTooLargeError` (before the FFT) if the result would exceed
    :data:`MAX_COMPOSED_POINTS` grid points."""
    try:
        pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]  # noqa: SLF001
    except AttributeError:  # pragma: no cover - dp_accounting internals changed
        _disable_fast("dp_accounting's PrivacyLossDistribution has no _pmf_remove/_pmf_add")
        return pld.self_compose(num_times, tail_mass_truncation)
    for pmf in pmfs:
        _check_self_compose_size(pmf, num_times, tail_mass_truncation)
    return _fast_or_public(lambda: _fast_self_compose(pld, num_times, tail_mass_truncation),
                           lambda: public_self_compose(pld, num_times, tail_mass_truncation),
                           "the fast self-composition")


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


def _fast_compose(p1, p2, tail_mass_truncation: float = 1e-15):
    rem = _pmf_compose(p1._pmf_remove, p2._pmf_remove, tail_mass_truncation)  # noqa: SLF001
    if p1._symmetric and p2._symmetric:  # noqa: SLF001
        return pldlib.PrivacyLossDistribution(rem)
    add = _pmf_compose(p1._pmf_add, p2._pmf_add, tail_mass_truncation)  # noqa: SLF001
    return pldlib.PrivacyLossDistribution(rem, add)


def compose(p1, p2, tail_mass_truncation: float = 1e-15):
    """``p1.compose(p2)`` with the same result (vectorised tail truncation).

    Raises :class:`PLDTooLargeError` (before the FFT) if the convolution would exceed
    :data:`MAX_COMPOSED_POINTS` grid points."""
    try:
        size = max(p1._pmf_remove.size + p2._pmf_remove.size, p1._pmf_add.size + p2._pmf_add.size) - 1  # noqa: SLF001
    except AttributeError:  # pragma: no cover - dp_accounting internals changed
        _disable_fast("dp_accounting's PrivacyLossDistribution has no _pmf_remove/_pmf_add")
        return p1.compose(p2, tail_mass_truncation)
    if size > MAX_COMPOSED_POINTS:
        raise PLDTooLargeError("the composition", float(size), MAX_COMPOSED_POINTS)
    return _fast_or_public(lambda: _fast_compose(p1, p2, tail_mass_truncation),
                           lambda: p1.compose(p2, tail_mass_truncation), "the fast composition")


# ---------------------------------------------------------------------------------------------
# run-time self-check (once per process)
# ---------------------------------------------------------------------------------------------
#: Relative tolerance of the self-check (the test suite finds agreement to ~1e-10).
SELF_CHECK_RTOL = 1e-9
_CHECK_LOCK = threading.Lock()
_STATE: dict = {"checked": False, "fast": True, "reason": None}


def _disable_fast(reason: str) -> None:
    """Use dp_accounting's public functions for the rest of the process; warn once."""
    with _CHECK_LOCK:
        already_off = not _STATE["fast"] and _STATE["checked"]
        _STATE.update(checked=True, fast=False, reason=reason)
    if not already_off:
        warnings.warn(
            "privtune: the fast PLD path (privtune/accounting/_fast_pld.py) does not reproduce "
            f"dp_accounting's public functions: {reason}. Using dp_accounting's public "
            "from_gaussian_mechanism/self_compose/compose for the rest of this process (same "
            "guarantees, slower). Please report this with your dp-accounting version.",
            RuntimeWarning, stacklevel=3,
        )


def _agree(what: str, fast, public) -> str | None:
    checks = [("ε at δ = 1e-5", fast.get_epsilon_for_delta(1e-5), public.get_epsilon_for_delta(1e-5), 1e-12),
              ("δ at ε = 0.5", fast.get_delta_for_epsilon(0.5), public.get_delta_for_epsilon(0.5), 1e-15)]
    for label, a, b, atol in checks:
        a, b = float(a), float(b)
        if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > SELF_CHECK_RTOL * abs(b) + atol:
            return f"{what}: {label} is {a!r} (fast) vs {b!r} (dp_accounting)"
    return None


def self_check() -> str | None:
    """Compare the fast path with dp_accounting's public functions on small cases (~20 ms).

    Returns ``None`` when every ε and δ agrees to :data:`SELF_CHECK_RTOL` (relative), else the
    first disagreement (or the exception the fast path raised)."""
    try:
        for sigma, q in ((1.0, 0.01), (2.0, 1.0)):
            bad = _agree(f"construction (σ = {sigma:g}, q = {q:g}, interval 1e-2)",
                         _fast_gaussian_pld(sigma, q, 1e-2), public_gaussian_pld(sigma, q, 1e-2))
            if bad:
                return bad
        base = public_gaussian_pld(1.0, 0.01, 1e-2)
        fast50, public50 = _fast_self_compose(base, 50), public_self_compose(base, 50)
        bad = _agree("self-composition (σ = 1, q = 0.01, T = 50)", fast50, public50)
        if bad:
            return bad
        return _agree("composition", _fast_compose(public50, base), public50.compose(base))
    except Exception as exc:  # noqa: BLE001 - any failure of the fast path means: do not use it
        return f"the fast path raised {type(exc).__name__}: {exc}"


def ensure_checked() -> bool:
    """Run :func:`self_check` once per process; return True if the fast path may be used."""
    if _STATE["checked"]:
        return _STATE["fast"]
    with _CHECK_LOCK:
        if _STATE["checked"]:
            return _STATE["fast"]
        reason = self_check()
        if reason is None:
            _STATE.update(checked=True, fast=True, reason=None)
            return True
    _disable_fast(reason)
    return False


def fast_path_status() -> dict:
    """``{"checked": bool, "fast": bool, "reason": str | None}`` for this process."""
    return dict(_STATE)


def _reset_self_check() -> None:
    """Forget the self-check result (tests only)."""
    with _CHECK_LOCK:
        _STATE.update(checked=False, fast=True, reason=None)
