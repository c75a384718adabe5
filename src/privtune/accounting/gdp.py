"""Gaussian differential privacy (μ-GDP) helpers: exact closed forms for full-batch runs.

A Gaussian mechanism with noise multiplier σ (noise std / L2 sensitivity) is exactly
(1/σ)-GDP; T adaptive compositions of it (full-batch DP-GD for T steps) are √T/σ-GDP; GDP
mechanisms compose as μ = √(Σ μᵢ²) (Dong, Roth & Su 2019/2022, Cor. 3.3).  A μ-GDP mechanism
is (ε, δ(ε))-DP for every ε ≥ 0 with

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε · Φ(−ε/μ − μ/2)

(Dong et al. Cor. 2.13), which is the analytic Gaussian mechanism of Balle & Wang (2018) with
σ = 1/μ; we evaluate it with ``dp_accounting.get_epsilon_gaussian`` /
``get_sigma_gaussian`` (numerically stable, log-space) rather than re-deriving it.

These closed forms are exact for *full-batch* (q = 1) Gaussian releases only.  For Poisson
subsampling, GDP is a CLT approximation that can *under*-report ε; use the PLD accountant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import dp_accounting
from scipy.stats import norm

from privtune._validation import check_delta, check_epsilon, check_int, check_real, check_steps
from privtune.errors import InvalidParameterError


def _check_mu(mu, name: str = "mu") -> float:
    return check_real(mu, name, low=0.0, fix="μ is the GDP parameter, e.g. √T/σ for full-batch DP-GD.")


def mu_full_batch(noise_multiplier: float, steps: int) -> float:
    """μ of full-batch DP-GD: T Gaussian steps with noise multiplier σ are √T/σ-GDP."""
    s = check_real(noise_multiplier, "noise_multiplier", low=0.0)
    t = check_steps(steps)
    return math.sqrt(t) / s


def compose_mu(mus: Iterable[float]) -> float:
    """GDP composition: μ_total = √(Σ μᵢ²)."""
    vals = [check_real(m, "mus", low=0.0, low_inclusive=True) for m in mus]
    return math.sqrt(sum(m * m for m in vals))


def delta_from_mu(mu: float, epsilon: float) -> float:
    """δ(ε) of a μ-GDP mechanism: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (log-space, stable)."""
    mu = _check_mu(mu)
    eps = check_real(epsilon, "epsilon", low=0.0, low_inclusive=True)
    a = norm.logcdf(-eps / mu + mu / 2)
    b = eps + norm.logcdf(-eps / mu - mu / 2)
    if b >= a:
        return 0.0
    return float(math.exp(a) * -math.expm1(b - a))


def epsilon_from_mu(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε; μ) ≤ δ for a μ-GDP mechanism (exact conversion, dp_accounting's
    analytic Gaussian ``get_epsilon_gaussian(1/μ, δ)``)."""
    mu = _check_mu(mu)
    delta = check_delta(delta)
    return float(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta))


def mu_from_epsilon(epsilon: float, delta: float) -> float:
    """The μ whose μ-GDP guarantee is exactly (ε, δ)-DP: 1/``get_sigma_gaussian(ε, δ)``."""
    eps = check_epsilon(epsilon)
    delta = check_delta(delta)
    return 1.0 / float(dp_accounting.get_sigma_gaussian(eps, delta))


def noise_multiplier_full_batch(epsilon: float, delta: float, steps: int) -> float:
    """Exact σ for full-batch DP-GD: σ = √T / μ(ε, δ).

    A closed form, not a factory over :func:`privtune.accounting.calibration.calibrate`.  T full-batch
    Gaussian steps are exactly (√T/σ)-GDP, and μ(ε, δ) is the exact inverse of the GDP trade-off
    (dp_accounting's ``get_sigma_gaussian``), so a search could only add rounding and cost.  The PLD
    calibration of the same run (``calibrate_noise_multiplier(..., sample_rate=1.0)``) agrees to within
    its pessimistic discretisation (tests/test_accounting_calibration.py::test_full_batch_matches_exact_gdp)."""
    return math.sqrt(check_steps(steps)) / mu_from_epsilon(epsilon, delta)


def joint_noise_multiplier(grad_noise_multiplier: float, loss_noise_multiplier: float, loss_releases: int) -> float:
    """Liu et al. (HyFreeDP): one step releasing a gradient (σ_g) and k losses (σ_l) on the *same* batch is one
    Gaussian mechanism with σ_eff = (σ_g⁻² + k·σ_l⁻²)^(−1/2) (per step, before subsampling)."""
    sg = check_real(grad_noise_multiplier, "grad_noise_multiplier", low=0.0)
    sl = check_real(loss_noise_multiplier, "loss_noise_multiplier", low=0.0)
    k = check_int(loss_releases, "loss_releases", low=0)
    return (sg**-2 + k * sl**-2) ** -0.5


def linear_scaling_total_epsilon(trial_epsilons: Iterable[float], runs_per_trial: int | Iterable[int],
                                 delta: float) -> tuple[float, float]:
    """Total ε of the full-batch sweeps of Panda et al. (linear scaling): each run budgeted ε_i at δ is
    μ_i = μ(ε_i, δ)-GDP; n_i runs of each compose to μ_total = √(Σ n_i μ_i²).

    Returns ``(epsilon_total, mu_total)``.  Example: ε = (0.1, 0.2, 0.88), n = (3, 3, 1),
    δ = 1e-5 → ε_total = 0.9963 (the paper's (1, 1e-5)-DP).
    """
    eps = [check_epsilon(e, "trial_epsilons") for e in trial_epsilons]
    if isinstance(runs_per_trial, int):
        ns = [runs_per_trial] * len(eps)
    else:
        ns = [check_int(n, "runs_per_trial", low=1) for n in runs_per_trial]
    if len(ns) != len(eps):
        raise InvalidParameterError(
            f"`runs_per_trial` must have one entry per trial ε ({len(eps)}). Got {len(ns)}."
        )
    mu = math.sqrt(sum(n * mu_from_epsilon(e, delta) ** 2 for e, n in zip(eps, ns)))
    return epsilon_from_mu(mu, delta), mu


__all__ = [
    "mu_full_batch",
    "compose_mu",
    "delta_from_mu",
    "epsilon_from_mu",
    "mu_from_epsilon",
    "noise_multiplier_full_batch",
    "joint_noise_multiplier",
    "linear_scaling_total_epsilon",
]
