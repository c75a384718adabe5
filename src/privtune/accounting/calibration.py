"""Calibration: the parameter whose events meet a target (ε, δ), verified before it is returned.

There is one calibrator, :func:`calibrate` (dp_accounting's ``calibrate_dp_mechanism`` shape): it
takes a function from a parameter (σ, μ, ...) to the list of events a mechanism would spend, a
bracket, the target (ε, δ), the accountant, the direction in which ε moves with the parameter and a
tolerance, and returns the parameter on the *safe side*: ε ≤ target, evaluated with the public
:func:`privtune.accounting.compute_epsilon` on exactly the events returned by the function (so the
whole composition, spent events included, is what is checked).  Every other calibrator in privtune
is a small factory over it: :func:`calibrate_noise_multiplier` (DP-SGD σ inside a composition),
:func:`calibrate_loss_noise_multiplier` (HyFreeDP loss noise), ``hpo.common.calibrate_final`` /
``calibrate_in_plan`` and ``hpo.hyperfree.calibrate_joint`` (through
:func:`calibrate_noise_multiplier`), random search's per-trial μ.  The closed forms of
:mod:`privtune.accounting.gdp` (full-batch σ = √T/μ(ε, δ), exact, no search needed) are kept as
closed forms.

How the PLD calibration of σ is fast *and* tight (dp_accounting's own ``calibrate_dp_mechanism``
with PLD spends ~5 s here because every step rebuilds a fine PLD): :func:`calibrate` is run twice.
First on a coarse pessimistic PLD (a fixed value discretisation of ≈ ε/300; a few ms per
evaluation; a pessimistic PLD is an upper bound at any discretisation, so that solve is only
loose, never unsafe), to ~1 %.  Then on ``compute_epsilon`` itself (its automatic, ~0.1 %-precise
discretisation), started from the coarse answer, to the final tolerance.  Every PLD built on the
way is cached (per σ, q, discretisation), so the verification re-uses work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from privtune._validation import check_choice, check_delta, check_epsilon, check_real, check_sample_rate, check_steps
from privtune.accounting import accountant as acc
from privtune.accounting.events import SAMPLING_SCHEMES, DPSGDEvent, Event, GaussianEvent
from privtune.accounting.gdp import joint_noise_multiplier, mu_from_epsilon
from privtune.errors import InfeasibleBudgetError, InvalidParameterError

#: Default ceiling on σ (noise std / clipping norm); a target that needs more is infeasible.
DEFAULT_MAX_NOISE_MULTIPLIER = 1000.0
#: Lower end of the σ search.
MIN_NOISE_MULTIPLIER = 1e-2
#: Default relative tolerance of :func:`calibrate` (see its docstring).
DEFAULT_TOLERANCE = 1e-4
#: Tolerance of σ calibrations: ε of the returned σ lies in [target·(1 − 1e-4), target] (or σ is
#: within a factor 1 + 1e-4 of an evaluated σ that misses the target).
_SIGMA_TOLERANCE = 1e-4
#: Tolerance of the first, coarse PLD solve (only a starting point for the final one).
_COARSE_TOLERANCE = 1e-2
#: Largest first step (in log p) away from a guess when looking for the other side of the target.
_FIRST_MAX_STEP = math.log(2.0)
_MAX_EVALUATIONS = 200


def calibrate(
    make_events: Callable[[float], Sequence[Event]],
    target_epsilon: float,
    delta: float,
    *,
    bracket: tuple[float, float],
    accountant: str = "pld",
    increasing: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
    guess: float | None = None,
    value_discretization_interval: float | None = None,
    name: str = "parameter",
) -> float:
    """The best parameter in ``bracket`` whose events meet (``target_epsilon``, ``delta``), checked.

    ``make_events(p)`` returns the complete list of events to account for parameter ``p`` (events
    already spent included); ε(p) is ``compute_epsilon(make_events(p), delta, accountant)``.

    Args:
        make_events: parameter -> list of privtune events.
        target_epsilon: the ε that the composition must not exceed (> 0).
        delta: δ in (0, 1) at which ε is evaluated.
        bracket: ``(low, high)`` with 0 < low < high, in the parameter's own units (σ is a
            multiplier of the sensitivity, μ is the GDP parameter, ...).
        accountant: ``"pld"`` (default) or ``"rdp"``.
        increasing: the monotonicity direction, which fixes the safe side.  ``False`` (σ: more
            noise, smaller ε): the safe side is *above* the boundary and the smallest safe
            parameter is returned.  ``True`` (μ, a number of steps: larger means more privacy loss):
            the safe side is *below* and the largest safe parameter is returned.
        tolerance: relative, > 0 and < 1.  The search stops at a safe p (ε(p) ≤ target, always)
            once either ε(p) ≥ (1 − tolerance)·target, or a parameter within a factor
            (1 + tolerance) of p on the unsafe side was evaluated and misses the target.
        guess: optional starting point (a good one saves evaluations); else the search starts
            at the safe end of the bracket.
        value_discretization_interval: PLD only: a fixed discretisation passed to
            :func:`~privtune.accounting.account` (pessimistic, so ε is still an upper bound).
            ``None`` (default): the automatic one, i.e. exactly the public ``compute_epsilon``.
        name: the parameter's name, for error messages.

    Returns:
        The parameter p, with ε(p) ≤ ``target_epsilon`` checked before returning.  When even the
        unsafe end of the bracket meets the target, that end is returned.

    Raises:
        InvalidParameterError: a bad argument.
        InfeasibleBudgetError: even the safe end of the bracket misses the target.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    accountant = check_choice(accountant, "accountant", acc.ACCOUNTANTS)
    if not callable(make_events):
        raise InvalidParameterError(
            f"`make_events` must be a function from the {name} to a list of events. Got {make_events!r}."
        )
    low, high = _check_bracket(bracket, name)
    tol = check_real(tolerance, "tolerance", low=0.0, high=1.0, high_inclusive=False,
                     fix="Pass a relative tolerance such as 1e-4.")
    vdi = value_discretization_interval
    values: dict[float, float] = {}

    def epsilon_at(p: float) -> float:
        if p not in values:
            if len(values) >= _MAX_EVALUATIONS:  # pragma: no cover - ε not monotone in the parameter
                raise InfeasibleBudgetError(
                    f"calibration of the {name} did not converge in {_MAX_EVALUATIONS} evaluations "
                    f"(target ε = {target:g}); is ε monotone in the {name}? Please report this with your arguments."
                )
            values[p] = float(acc.account(list(make_events(p)), delta, accountant,
                                          value_discretization_interval=vdi).epsilon)
        return values[p]

    safe_end, unsafe_end = (low, high) if increasing else (high, low)

    ok, bad = _find_sides(epsilon_at, target, safe_end, unsafe_end, guess, low, high, increasing, tol, name,
                          delta, accountant)
    # bad is None: already done (the unsafe end of the bracket meets the target, or ok is close enough)
    last_moved, repeats = None, 0
    while bad is not None and epsilon_at(ok) < (1.0 - tol) * target and abs(math.log(ok / bad)) > math.log1p(tol):
        # safeguard: after the same end moved three times in a row, bisect
        recent = tuple(values)[-2:] if len(values) >= 2 else (ok, bad)
        new_ok, new_bad = _narrow(epsilon_at, recent, target, ok, bad, tol, bisect=repeats >= 3)
        moved = "ok" if new_ok != ok else "bad"
        repeats = repeats + 1 if moved == last_moved else 1
        last_moved, ok, bad = moved, new_ok, new_bad
        if ok == bad:
            break
    if not epsilon_at(ok) <= target:  # pragma: no cover - a safe point is only ever an evaluated one
        raise InfeasibleBudgetError(f"calibration could not verify ε ≤ {target:g}; please report this.")
    return ok


def _check_bracket(bracket, name: str) -> tuple[float, float]:
    try:
        low, high = (float(b) for b in bracket)
    except (TypeError, ValueError):
        raise InvalidParameterError(
            f"`bracket` must be a pair (low, high) of numbers bounding the {name}. Got {bracket!r}."
        ) from None
    if not (0.0 < low < high < math.inf):
        raise InvalidParameterError(
            f"`bracket` must satisfy 0 < low < high < inf. Got ({low!r}, {high!r}) for the {name}."
        )
    return low, high


def _find_sides(epsilon_at, target, safe_end, unsafe_end, guess, low, high, increasing, tol, name, delta,
                accountant):
    """(safe point, unsafe point), or (safe point, None) when the search is already done: evaluated
    points on both sides of the target."""
    def infeasible() -> InfeasibleBudgetError:
        return InfeasibleBudgetError(
            f"No {name} in [{low:g}, {high:g}] meets the target ε = {target:g} at δ = {delta:g} with the "
            f"{accountant} accountant: at the safe end ({name} = {safe_end:g}) the events cost "
            f"ε = {epsilon_at(safe_end):.4g}. Raise the target ε, spend less elsewhere, or widen the bracket."
        )

    def close(p: float) -> bool:  # safe and within the tolerance of the target: nothing left to do
        return (1.0 - tol) * target <= epsilon_at(p) <= target

    if guess is None:
        if epsilon_at(safe_end) > target:
            raise infeasible()
        if epsilon_at(unsafe_end) <= target:
            return unsafe_end, None
        return safe_end, unsafe_end
    p = min(max(float(guess), low), high)
    if close(p):
        return p, None
    start_safe = epsilon_at(p) <= target
    # walk away from the guess towards the target: up in p when (safe and ε increases) or (unsafe and
    # ε decreases).  The first step assumes ε ∝ p^±1, later ones follow the secant through the last two
    # points; each is at least a factor 1 + tol and at most a factor that grows with every step (so a
    # bad slope can neither stall the walk nor throw it far away)
    up = start_safe == increasing
    prev, max_step = None, _FIRST_MAX_STEP
    while True:
        step = _secant_step(epsilon_at, prev, p, target, tol, max_step)
        q = min(p * math.exp(step), high) if up else max(p * math.exp(-step), low)
        if q == p:  # hit the end of the bracket
            if start_safe:
                return p, None
            raise infeasible()
        if (epsilon_at(q) <= target) != start_safe:
            return (p, q) if start_safe else (q, p)
        if close(q):
            return q, None
        prev, p, max_step = p, q, 4.0 * max_step


def _secant_step(epsilon_at, prev: float | None, p: float, target: float, tol: float, max_step: float) -> float:
    """|log step| from p that the secant through (prev, p) in (log p, log ε) predicts for ε = target·(1 − tol/2),
    clipped to [log(1 + tol), max_step]; max_step when the secant is of no use."""
    e_p = epsilon_at(p)
    e_prev = e_p * math.e if prev is None else epsilon_at(prev)  # no previous point: unit slope
    if not (0.0 < e_prev < math.inf and 0.0 < e_p < math.inf) or e_prev == e_p:
        return max_step
    slope = 1.0 if prev is None else (math.log(e_p) - math.log(e_prev)) / (math.log(p) - math.log(prev))
    step = abs((math.log(target * (1.0 - tol / 2.0)) - math.log(e_p)) / slope)
    return min(max(step, math.log1p(tol)), max_step)


def _narrow(epsilon_at, recent: tuple[float, float], target: float, ok: float, bad: float, tol: float, *,
            bisect: bool = False) -> tuple[float, float]:
    """One safeguarded secant step in (log p, log ε) through the two most ``recent`` points, aiming just
    inside the safe side and kept inside the bracket (ok, bad); returns the new (safe, unsafe) pair."""
    x_ok, x_bad = math.log(ok), math.log(bad)
    x = 0.5 * (x_ok + x_bad)
    (p1, p2), (e1, e2) = recent, (epsilon_at(recent[0]), epsilon_at(recent[1]))
    if not bisect and 0.0 < e1 < math.inf and 0.0 < e2 < math.inf and e1 != e2 and p1 != p2:
        aim = math.log(target * (1.0 - tol / 2.0))
        x1, x2 = math.log(p1), math.log(p2)
        x_sec = x2 + (aim - math.log(e2)) * (x2 - x1) / (math.log(e2) - math.log(e1))
        lo_x, hi_x = min(x_ok, x_bad), max(x_ok, x_bad)
        margin = min(0.02 * (hi_x - lo_x), 0.25 * math.log1p(tol))
        if math.isfinite(x_sec):
            x = min(max(x_sec, lo_x + margin), hi_x - margin)
    p = math.exp(x)
    if p in (ok, bad):  # no representable point in between
        return ok, ok
    return (p, bad) if epsilon_at(p) <= target else (ok, p)


def make_final_event(noise_multiplier: float, sample_rate: float, steps: int, sampling: str,
                     assume_poisson: bool = False, label: str = "") -> DPSGDEvent:
    if sampling == "full_batch" or sample_rate >= 1.0:
        return DPSGDEvent(noise_multiplier, 1.0, steps, sampling="full_batch", label=label)
    return DPSGDEvent(noise_multiplier, sample_rate, steps, sampling=sampling,
                      assume_poisson=assume_poisson, label=label)


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

    # spent alone must leave room
    if spent:
        spent_eps = acc.compute_epsilon(spent, delta, accountant)
        if spent_eps >= target:
            raise InfeasibleBudgetError(
                f"`spent_events` already cost ε = {spent_eps:.4g} at δ = {delta:g}, which is not below "
                f"`target_epsilon` = {target:g}: no final run fits. Raise the total ε or spend less "
                "on tuning."
            )

    def events(sigma: float) -> list:
        return spent + [make_final_event(sigma, q, T, sampling, assume_poisson)]

    amplified = sampling != "shuffle" or assume_poisson
    guess = _initial_guess(target, delta, q if amplified else 1.0,
                           T if amplified else make_final_event(1.0, q, T, sampling).epochs)
    guess = min(max(guess, MIN_NOISE_MULTIPLIER), ceiling)
    solve = lambda **kw: calibrate(events, target, delta, bracket=(MIN_NOISE_MULTIPLIER, ceiling),  # noqa: E731
                                   accountant=accountant, increasing=False, name="noise_multiplier", **kw)
    try:
        if accountant == "pld" and not acc.lower_events(spent).repeat_and_select:
            guess = _pld_guess(solve, events, target, delta, guess, ceiling)
        return solve(tolerance=_SIGMA_TOLERANCE, guess=guess)
    except InfeasibleBudgetError:
        raise _infeasible_ceiling(ceiling) from None


def _pld_guess(solve, events, target: float, delta: float, guess: float, ceiling: float) -> float:
    """A σ close to the answer, found cheaply: solved on a coarse pessimistic PLD (~1 %), then on the
    one discretisation that ``compute_epsilon`` chooses there (one PLD per σ instead of several).
    The final solve on ``compute_epsilon`` itself then usually only confirms it."""
    try:
        guess = solve(tolerance=_COARSE_TOLERANCE, guess=guess, value_discretization_interval=_coarse_interval(target))
    except InfeasibleBudgetError:
        return ceiling  # the coarse PLD is looser: let the final solve decide
    interval = acc.account(events(guess), delta, "pld").value_discretization_interval
    if interval is None:  # compute_epsilon fell back to RDP there: nothing to gain
        return guess
    try:
        return solve(tolerance=_SIGMA_TOLERANCE, guess=guess, value_discretization_interval=interval)
    except InfeasibleBudgetError:
        return ceiling


def _initial_guess(target: float, delta: float, q: float, T: int) -> float:
    """A starting σ: exact for q = 1 (GDP), the GDP-CLT value μ = q√(T(e^{1/σ²}−1)) otherwise.

    Only a starting point for the root finder (the CLT value under-reports ε)."""
    try:
        mu = mu_from_epsilon(target, delta)
    except Exception:  # pragma: no cover - extreme inputs
        return 1.0
    if q >= 1.0:
        return math.sqrt(T) / mu
    x = math.log1p(mu * mu / (q * q * T))
    return 1.0 / math.sqrt(x) if x > 0 else 1.0


def _coarse_interval(target: float) -> float:
    """Coarsest PLD level with interval ≤ ε/300 (≈5 % ε error: enough for a starting point),
    but not finer than 1e-4."""
    for h in acc.PLD_LEVELS:
        if h <= max(target / 300.0, 1e-4):
            return h
    return acc.PLD_LEVELS[-1]


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
    """Liu et al. (HyFreeDP): shared-batch calibration of the loss-noise multiplier σ_l.

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
    ceiling = check_real(max_noise_multiplier, "max_noise_multiplier", low=MIN_NOISE_MULTIPLIER)
    try:
        return calibrate(events, target, delta, bracket=(MIN_NOISE_MULTIPLIER, ceiling), accountant=accountant,
                         increasing=False, tolerance=_SIGMA_TOLERANCE, guess=min(4.0 * sg, ceiling),
                         name="loss_noise_multiplier")
    except InfeasibleBudgetError:
        raise _infeasible_ceiling(ceiling) from None


def joint_release_events(grad_noise_multiplier: float, loss_noise_multiplier: float, sample_rate: float,
                         steps: int, update_every: int, loss_releases: int = 3) -> list:
    """Events of a HyFreeDP-style run whose loss probes share the gradient's batch (Liu & Bu, §4.5 (A))."""
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
    "calibrate",
    "calibrate_noise_multiplier",
    "calibrate_loss_noise_multiplier",
    "joint_release_events",
    "make_final_event",
    "DEFAULT_MAX_NOISE_MULTIPLIER",
]
