"""Noise calibration: the smallest σ that meets a target (ε, δ), verified before it is returned.

How the PLD calibration is fast *and* tight (dp_accounting's own ``calibrate_dp_mechanism``
with PLD spends ~5 s here because every bracket/Brent step rebuilds a fine PLD):

1. **Coarse solve.** Bracket and Brent root-find of log ε(log σ) on a coarse pessimistic PLD
   (value discretisation 1e-2, a few ms per evaluation).  A pessimistic PLD is an upper
   bound on ε at any discretisation, so the coarse root is already a *valid* (conservative)
   σ; it is only not tight.
2. **Fine solve.** Pick the discretisation that :func:`privtune.accounting.compute_epsilon`
   itself would use at that σ (chosen by target precision, ~0.1 % of ε), then a few
   safeguarded secant steps on that fine PLD, started from the coarse root with the coarse
   slope, aiming just below the target.
3. **Verification.** The final σ is evaluated with the *public* ``compute_epsilon`` (same
   accountant, same automatic pessimistic discretisation, same composition with
   ``spent_events``); if it exceeds the target (it should not), σ is moved up and re-verified.

Every PLD built on the way is cached (per σ, q, discretisation), so the verification and
repeated calibrations re-use work.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy import optimize

from privtune._validation import check_choice, check_delta, check_epsilon, check_real, check_sample_rate, check_steps
from privtune.accounting import accountant as acc
from privtune.accounting.events import DPSGDEvent, GaussianEvent, SAMPLING_SCHEMES
from privtune.errors import InfeasibleBudgetError, InvalidParameterError

#: Default ceiling on σ (noise std / clipping norm); a target that needs more is infeasible.
DEFAULT_MAX_NOISE_MULTIPLIER = 1000.0
#: Lower end of the σ search.
MIN_NOISE_MULTIPLIER = 1e-2
#: Relative gap to the target that the fine solve aims for (ε_fine ∈ [target·(1-gap), target]).
_FINE_GAP = 2e-4
_COARSE_INTERVAL = 1e-2


def make_final_event(noise_multiplier: float, sample_rate: float, steps: int, sampling: str,
                     assume_poisson: bool = False, label: str = "") -> DPSGDEvent:
    if sampling == "full_batch" or sample_rate >= 1.0:
        return DPSGDEvent(noise_multiplier, 1.0, steps, sampling="full_batch", label=label)
    return DPSGDEvent(noise_multiplier, sample_rate, steps, sampling=sampling,
                      assume_poisson=assume_poisson, label=label)


def _solve_increasing_gap(f: Callable[[float], float], lo: float, hi: float, *, xtol: float) -> float:
    """Root of f on [lo, hi] in log σ (f decreasing in σ): returns a point with f ≤ 0 (the hi side)."""
    g = lambda x: f(math.exp(x))  # noqa: E731
    a, b = math.log(lo), math.log(hi)
    x = optimize.brentq(g, a, b, xtol=xtol, maxiter=100)
    # brentq's x may sit on either side; step to the safe side.
    for _ in range(60):
        if g(x) <= 0:
            return math.exp(x)
        x += xtol
    return hi


def _bracket(f: Callable[[float], float], guess: float, ceiling: float) -> tuple[float, float]:
    """[lo, hi] with f(lo) > 0 ≥ f(hi), f decreasing; InfeasibleBudgetError above ceiling."""
    hi = min(max(guess, MIN_NOISE_MULTIPLIER), ceiling)
    if f(hi) > 0:
        lo = hi
        while True:
            if hi >= ceiling:
                raise _infeasible_ceiling(ceiling)
            lo, hi = hi, min(hi * 2.0, ceiling)
            if f(hi) <= 0:
                return lo, hi
    lo = hi
    while True:
        lo_new = lo / 2.0
        if lo_new < MIN_NOISE_MULTIPLIER:
            return MIN_NOISE_MULTIPLIER, lo  # f ≤ 0 already at the floor side handled by caller
        if f(lo_new) > 0:
            return lo_new, lo
        lo = lo_new


def _infeasible_ceiling(ceiling: float) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"`target_epsilon` cannot be met with noise_multiplier ≤ max_noise_multiplier = {ceiling:g}: "
        "the target is too small for this sample rate and number of steps. Increase the target ε, "
        "reduce steps or sample_rate, or raise max_noise_multiplier."
    )


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    *,
    spent_events=(),
    sampling: str = "poisson",
    assume_poisson: bool = False,
    max_noise_multiplier: float = DEFAULT_MAX_NOISE_MULTIPLIER,
    dataset_size: int | None = None,
) -> float:
    """Smallest noise multiplier σ for a final DP-SGD run that keeps the total within (ε, δ).

    σ is a *multiplier of the clipping norm*: each step adds N(0, σ²C²) to the sum of
    per-example gradients clipped to norm C.  The final run is
    ``DPSGDEvent(σ, sample_rate, steps, sampling)``; it is composed after ``spent_events``
    (e.g. tuning trials already run) and the whole composition must meet
    (``target_epsilon``, ``delta``).

    Contract: the returned σ, evaluated by ``compute_epsilon(spent_events + [final run], delta,
    accountant)``, gives ε ≤ ``target_epsilon`` (this is checked before returning); with PLD it
    is within ~0.1 % of the smallest such σ at dp_accounting's default discretisation.

    Args:
        target_epsilon: total ε > 0 for the whole composition.
        delta: δ in (0, 1) (< 1/n when ``dataset_size`` is given).
        sample_rate: Poisson sampling probability q in (0, 1]; 1 means full-batch DP-GD.
        steps: number of steps T ≥ 1 of the final run.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        spent_events: events already spent before the final run.
        sampling: ``"poisson"``, ``"shuffle"`` (no amplification unless ``assume_poisson``)
            or ``"full_batch"``.
        max_noise_multiplier: ceiling on σ; a target that needs more raises
            :class:`~privtune.errors.InfeasibleBudgetError`.

    Raises:
        InvalidParameterError: a bad argument.
        InfeasibleBudgetError: ``spent_events`` alone already reach the target, or no σ ≤ the
            ceiling reaches it.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta, dataset_size=dataset_size)
    q = check_sample_rate(sample_rate)
    T = check_steps(steps)
    accountant = check_choice(accountant, "accountant", acc.ACCOUNTANTS)
    sampling = check_choice(sampling, "sampling", SAMPLING_SCHEMES)
    ceiling = check_real(max_noise_multiplier, "max_noise_multiplier", low=MIN_NOISE_MULTIPLIER)
    if sampling == "full_batch" and q != 1.0:
        raise InvalidParameterError(
            f"`sample_rate` must be 1.0 when sampling='full_batch'. Got {sample_rate!r}."
        )
    spent = acc.as_event_list(spent_events)
    make = lambda s: make_final_event(s, q, T, sampling, assume_poisson)  # noqa: E731

    # spent alone must leave room
    if spent:
        spent_eps = acc.compute_epsilon(spent, delta, accountant)
        if spent_eps >= target:
            raise InfeasibleBudgetError(
                f"`spent_events` already cost ε = {spent_eps:.4g} at δ = {delta:g}, which is not below "
                f"`target_epsilon` = {target:g}: no final run fits. Raise the total ε or spend less "
                "on tuning."
            )

    def verified(sigma: float) -> float:
        return acc.compute_epsilon(spent + [make(sigma)], delta, accountant)

    guess = _initial_guess(target, delta, q if sampling != "shuffle" or assume_poisson else 1.0,
                           T if sampling != "shuffle" or assume_poisson else make(1.0).epochs)
    guess = min(max(guess, MIN_NOISE_MULTIPLIER), ceiling)
    low_spent = acc.lower_events(spent)

    def generic() -> float:
        sigma = _calibrate_generic(verified, target, ceiling, guess)
        for _ in range(20):  # verification pass (same public function)
            if verified(sigma) <= target:
                return sigma
            sigma *= 1.0 + 2e-5
        raise InfeasibleBudgetError(  # pragma: no cover - would be a bug
            f"calibration could not verify ε ≤ {target:g}; please report this with your arguments."
        )

    if accountant == "rdp" or low_spent.repeat_and_select:
        return generic()
    try:
        return _calibrate_pld(spent, make, target, delta, ceiling, guess, verified)
    except acc.PLDTooLargeError:
        # a PLD on the way would be too large to build (tiny σ or huge T): solve on
        # compute_epsilon itself, which falls back to RDP there and says so
        return generic()


def _initial_guess(target: float, delta: float, q: float, T: int) -> float:
    """A starting σ: exact for q = 1 (GDP), the GDP-CLT value μ = q√(T(e^{1/σ²}−1)) otherwise.

    Only a starting point for the root finder (the CLT value under-reports ε)."""
    from privtune.accounting.gdp import mu_from_epsilon

    try:
        mu = mu_from_epsilon(target, delta)
    except Exception:  # pragma: no cover - extreme inputs
        return 1.0
    if q >= 1.0:
        return math.sqrt(T) / mu
    x = math.log1p(mu * mu / (q * q * T))
    return 1.0 / math.sqrt(x) if x > 0 else 1.0


def _calibrate_generic(eps_of: Callable[[float], float], target: float, ceiling: float,
                       guess: float = 1.0) -> float:
    """Smallest σ ≤ ceiling with eps_of(σ) ≤ target: safeguarded secant (few evaluations),
    Brent's method on a bracket as the fallback."""
    f = lambda s: eps_of(s) - target  # noqa: E731
    if f(ceiling) > 0:
        raise _infeasible_ceiling(ceiling)
    s = _secant_down(eps_of, target, guess, ceiling, gap=2e-4)
    if eps_of(s) <= target:
        return s
    lo, hi = _bracket(f, guess, ceiling)  # pragma: no cover - secant failed to converge
    if f(lo) <= 0:
        return lo
    return _solve_increasing_gap(f, lo, hi, xtol=5e-5)


def _coarse_interval(target: float) -> float:
    """Coarsest PLD level with interval ≤ ε/300 (≈5 % ε error: enough for a starting point),
    but not finer than 1e-4."""
    for h in acc.PLD_LEVELS:
        if h <= max(target / 300.0, 1e-4):
            return h
    return acc.PLD_LEVELS[-1]


def _calibrate_pld(spent, make, target: float, delta: float, ceiling: float, guess: float,
                   verified: Callable[[float], float]) -> float:
    spent_segments = acc.lower_events(spent).segments

    def segs_of(sigma: float):
        return acc.group_segments(spent_segments + acc.lower_events([make(sigma)]).segments)

    def eps_at(sigma: float, h: float) -> float:
        return acc.pld_epsilon_at(segs_of(sigma), delta, h)

    # 1. coarse: a valid (upper-bound) but loose PLD, solved to ~1 %
    hc = _coarse_interval(target)
    if eps_at(ceiling, max(hc, 1e-3)) > target:
        # maybe infeasible: decide with the accountant itself (the public compute_epsilon)
        if verified(ceiling) > target:
            raise _infeasible_ceiling(ceiling)
        sigma = ceiling
    else:
        sigma = _secant_down(lambda s: eps_at(s, hc), target, guess, ceiling, gap=1e-2)

    # 2. fine: secant at the discretisation compute_epsilon chooses near the answer;
    # 3. verify with compute_epsilon itself; if its chosen discretisation moved, solve again there.
    for _ in range(4):
        h, _ = acc.choose_pld_interval(segs_of(sigma), delta)
        sigma = _secant_down(lambda s: eps_at(s, h), target, sigma, ceiling, gap=_FINE_GAP)
        if verified(sigma) <= target:
            return sigma
    for _ in range(50):  # pragma: no cover - defensive: walk up until verified
        sigma *= 1.0 + 1e-4
        if sigma > ceiling:
            raise _infeasible_ceiling(ceiling)
        if verified(sigma) <= target:
            return sigma
    raise InfeasibleBudgetError(  # pragma: no cover - would be a bug
        f"calibration could not verify ε ≤ {target:g}; please report this with your arguments."
    )


def _secant_down(eps_fn: Callable[[float], float], target: float, s0: float, ceiling: float,
                 gap: float = _FINE_GAP) -> float:
    """Smallest-ish σ with eps_fn(σ) ≤ target, starting from s0 (usually feasible).

    Safeguarded secant in (log σ, log ε); keeps a feasible point (ε ≤ target) and an
    infeasible one; stops when the feasible point is within _FINE_GAP of the target.
    """
    aim = math.log(target * (1.0 - gap / 2))
    good = bad = None  # (log σ, log ε)
    x = math.log(s0)
    e = eps_fn(s0)
    pts = []
    for _ in range(30):
        le = math.log(e) if e > 0 else -50.0
        pts.append((x, le))
        if e <= target:
            if good is None or x < good[0]:
                good = (x, le)
            if e >= target * (1.0 - gap):
                return math.exp(x)
        elif bad is None or x > bad[0]:
            bad = (x, le)
        # next point: secant through the last two, else a slope guess of -1.5
        if len(pts) >= 2 and pts[-1][0] != pts[-2][0]:
            slope = (pts[-1][1] - pts[-2][1]) / (pts[-1][0] - pts[-2][0])
        else:
            slope = -1.5
        if not (slope < 0) or not math.isfinite(slope):
            slope = -1.5
        x_new = x + (aim - le) / slope
        if good is not None and bad is not None:
            lo_x, hi_x = bad[0], good[0]
            if not (lo_x < x_new < hi_x):
                x_new = 0.5 * (lo_x + hi_x)
            if hi_x - lo_x < 1e-7:
                return math.exp(good[0])
        elif good is None:  # still infeasible: go up at least a bit
            if x >= math.log(ceiling) - 1e-12:
                return ceiling
            x_new = max(x_new, x + 1e-4)
        else:  # only feasible points: go down, not too far
            x_new = min(x_new, x - 1e-6)
            x_new = max(x_new, x - 0.5)
        x_new = min(x_new, math.log(ceiling))
        x = x_new
        e = eps_fn(math.exp(x))
    if good is not None:
        return math.exp(good[0])
    return math.exp(x)


def calibrate_loss_noise_multiplier(
    target_epsilon: float,
    delta: float,
    grad_noise_multiplier: float,
    sample_rate: float,
    steps: int,
    update_every: int,
    loss_releases: int = 3,
    accountant: str = "pld",
    *,
    spent_events=(),
    max_noise_multiplier: float = 1e4,
) -> float:
    """Seed 001 (HyFreeDP) shared-batch calibration of the loss-noise multiplier σ_l.

    A run of ``steps`` Poisson steps with gradient noise σ_g releases, every ``update_every``
    steps (at t = 0, K, 2K, ...: ⌈T/K⌉ update steps), ``loss_releases`` privatised losses on the
    *same* batch as the gradient.  Those steps are one subsampled Gaussian with
    σ_eff = (σ_g⁻² + k·σ_l⁻²)^(-1/2) (:func:`joint_noise_multiplier`); the others use σ_g.
    Returns the smallest σ_l (multiplier of the loss clipping bound R_l) meeting the target,
    verified with ``compute_epsilon``.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    sg = check_real(grad_noise_multiplier, "grad_noise_multiplier", low=0.0)
    q = check_sample_rate(sample_rate)
    T = check_steps(steps)
    K = check_steps(update_every, "update_every")
    k = check_steps(loss_releases, "loss_releases")
    spent = acc.as_event_list(spent_events)

    def events(sl: float):
        return spent + joint_release_events(sg, sl, q, T, K, k)

    base = acc.compute_epsilon(spent + [DPSGDEvent(sg, q, T)] if q < 1 else spent + [GaussianEvent(sg, T)],
                               delta, accountant)
    if base >= target:
        raise InfeasibleBudgetError(
            f"the gradient releases alone (grad_noise_multiplier = {sg:g}) already cost ε = {base:.4g} ≥ "
            f"target_epsilon = {target:g}; no loss noise fits. Increase grad_noise_multiplier "
            "(e.g. 1.01× the gradient-only σ) or the target."
        )
    eps_of = lambda sl: acc.compute_epsilon(events(sl), delta, accountant)  # noqa: E731
    sl = _calibrate_generic(eps_of, target, max_noise_multiplier, guess=min(4.0 * sg, max_noise_multiplier))
    for _ in range(20):
        if eps_of(sl) <= target:
            return sl
        sl *= 1 + 2e-4
    raise InfeasibleBudgetError(f"could not verify ε ≤ {target:g} for the loss noise.")  # pragma: no cover


def joint_release_events(grad_noise_multiplier: float, loss_noise_multiplier: float, sample_rate: float,
                         steps: int, update_every: int, loss_releases: int = 3) -> list:
    """Events of a HyFreeDP-style run whose loss probes share the gradient's batch (seed 001 §4.5 (A))."""
    from privtune.accounting.gdp import joint_noise_multiplier

    T = check_steps(steps)
    K = check_steps(update_every, "update_every")
    n_upd = math.ceil(T / K)
    s_eff = joint_noise_multiplier(grad_noise_multiplier, loss_noise_multiplier, loss_releases)
    q = check_sample_rate(sample_rate)
    out = []
    if T - n_upd > 0:
        out.append(make_final_event(grad_noise_multiplier, q, T - n_upd, "poisson", label="gradient-only steps"))
    out.append(make_final_event(s_eff, q, n_upd, "poisson", label=f"gradient + {loss_releases} losses (shared batch)"))
    return out


__all__ = [
    "calibrate_noise_multiplier",
    "calibrate_loss_noise_multiplier",
    "joint_release_events",
    "make_final_event",
    "DEFAULT_MAX_NOISE_MULTIPLIER",
]
