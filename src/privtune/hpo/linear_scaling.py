"""Linear-scaling HPO (Panda, Tang et al., "A New Linear Scaling Rule for Private
Adaptive Hyperparameter Optimization", Algorithm 2), with engineering fixes.

One meta-hyperparameter is tuned: the total step size ``r = η·T`` (learning rate on the
mean gradient times optimizer steps).  Two cheap sweeps at small per-run budgets ε₁ < ε₂
find the best r at each; a line r(ε) through the two points is extrapolated to the final
run's per-run ε_f; one final run at ε_f uses r*.

Fixes over the paper / reference code:

* r is sampled **log-uniformly**; sweep 1 on [r_min, r_max/10], sweep 2 on
  **[r₁*, r_max]** (the reference code's r_max/5 cap put winners on the edge).
* η is **capped** (``lr_bounds``): r is split as (η = r/T, T from the grid with η inside
  the bounds), so T grows when r needs it instead of η exploding.
* r* is **clamped** to the searched range; a **negative slope** or r* ≤ 0 falls back to
  the best r of sweep 2; the fit is in **ε-space** by default, μ-space optional.
* Full-batch runs are exact GDP (μ = √T/σ) and compose in μ; mini-batch runs are
  Poisson-subsampled DP-SGD events composed with PLD.  T is counted in optimizer steps.
* The final run's σ is calibrated *inside the composition* of all trial events.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from privtune._validation import check_choice, check_int, check_real
from privtune.accounting import calibrate_noise_multiplier
from privtune.accounting.events import DPSGDEvent, GaussianEvent
from privtune.errors import InfeasibleBudgetError, InvalidParameterError
from privtune.hpo.executors import TrialCall, run_trials
from privtune.hpo.common import (
    TUNABLE_MODES,
    BudgetPlan,
    PlanRequest,
    Strategy,
    StrategyOutcome,
    TrialRecord,
    calibrate_final,
    calibrate_in_plan,
    choose_best,
    epsilon_of,
    minibatch_schedule,
    mu_from_epsilon,
    noise_seed,
)

NAME = "linear-scaling"

#: default search box of the full-batch variant (a linear head on cached features, mean-gradient η)
DEFAULT_LR_BOUNDS = (0.01, 10.0)
DEFAULT_STEPS_GRID = (5, 10, 20, 40, 80, 150)
#: default η box of the full-batch variant for a head on a frozen image backbone's features (L2-normalised per
#: example, centred; finetune.head_input_normalization).  Ten classes on such inputs need a larger r = η·T than
#: a text head: on the public split of the Fashion-MNIST bench (EfficientNet-Lite0, 64 px, 2,000 images) the grid
#: oracle over DEFAULT_LR_BOUNDS scored best at its corner r = 1,500 at every ε (85.8 / 86.4 / 86.3 % at
#: ε = 1 / 3 / 8), rising steadily towards it; the same box shifted up a decade holds the optimum inside it
IMAGE_HEAD_LR_BOUNDS = (0.1, 100.0)
#: default η box of the mini-batch variant (Adam on transformer fine-tuning, mean-gradient convention)
MINIBATCH_LR_BOUNDS = (1e-4, 5e-2)


def default_lr_bounds(data_kind: str | None = None) -> tuple[float, float]:
    """The full-batch η box when none is given: :data:`IMAGE_HEAD_LR_BOUNDS` for a head on image features
    (``data_kind == "image"``), else :data:`DEFAULT_LR_BOUNDS`.  Shared by linear scaling, random search and the
    grid oracle, so that their columns search the same space."""
    return IMAGE_HEAD_LR_BOUNDS if data_kind == "image" else DEFAULT_LR_BOUNDS


# --------------------------------------------------------------------------------------
# search space, sampling and decomposition
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchSpace:
    """Bounds of the search: η ∈ [lr_min, lr_max] (mean-gradient step size), T ∈ steps_grid.

    ``r_min = lr_min · min(T)`` and ``r_max = lr_max · max(T)``.  The default box is a
    narrow box for a linear head under the mean convention (η ∈ [0.01, 10],
    T ∈ {5, …, 150}, r ∈ [0.05, 1500]); a wider box hurt Algorithm 2 in the pilot.
    """

    lr_min: float = 0.01
    lr_max: float = 10.0
    steps_grid: tuple = (5, 10, 20, 40, 80, 150)

    def __post_init__(self) -> None:
        check_real(self.lr_min, "lr_bounds[0]", low=0.0)
        check_real(self.lr_max, "lr_bounds[1]", low=0.0)
        if not self.lr_min < self.lr_max:
            raise InvalidParameterError(
                f"`lr_bounds` must satisfy 0 < lr_min < lr_max. Got ({self.lr_min}, {self.lr_max})."
            )
        grid = tuple(sorted({check_int(t, "steps_grid", low=1) for t in self.steps_grid}))
        if not grid:
            raise InvalidParameterError("`steps_grid` must contain at least one step count ≥ 1. Got ().")
        object.__setattr__(self, "steps_grid", grid)

    @property
    def r_min(self) -> float:
        return self.lr_min * self.steps_grid[0]

    @property
    def r_max(self) -> float:
        return self.lr_max * self.steps_grid[-1]

    def to_dict(self) -> dict:
        return {"lr_bounds": [self.lr_min, self.lr_max], "steps_grid": list(self.steps_grid)}


def search_space(lr_bounds: Any, steps_grid: Any, data_kind: str | None = None) -> SearchSpace:
    """The full-batch box from a strategy's options: ``lr_bounds`` (None: :func:`default_lr_bounds` of
    ``data_kind``) and ``steps_grid`` (None: :data:`DEFAULT_STEPS_GRID`), validated."""
    lo, hi = _bounds(lr_bounds, default_lr_bounds(data_kind))
    grid = DEFAULT_STEPS_GRID if steps_grid is None else steps_grid
    try:
        grid = tuple(grid)
    except TypeError:
        raise InvalidParameterError(f"`steps_grid` must be a list of step counts. Got {steps_grid!r}.") from None
    return SearchSpace(lo, hi, grid)


def sample_r(rng: np.random.Generator, low: float, high: float, n: int, method: str = "log_uniform") -> list[float]:
    """Draw ``n`` values of r in [low, high]: ``"log_uniform"`` (default) or ``"uniform"`` (paper)."""
    check_choice(method, "r_sampling", ("log_uniform", "uniform"))
    low, high = float(low), float(max(high, low))
    if method == "uniform" or high == low:
        return [float(v) for v in rng.uniform(low, high, size=n)]
    return [float(v) for v in np.exp(rng.uniform(math.log(low), math.log(high), size=n))]


def decompose(r: float, space: SearchSpace, rng: np.random.Generator | None = None,
              prefer: str = "random") -> tuple[float, int, str]:
    """Split r into (η, T) with η = r/T exactly, T in the grid and η within the bounds.

    ``prefer="random"``: T uniform among the feasible grid values (the default);
    ``"fewest_steps"``: the smallest feasible T (η as large as allowed: cheapest).
    An r outside [r_min, r_max] is clamped first (the note says so).  Always terminates.
    Returns (η, T, note).
    """
    note = ""
    if not math.isfinite(r) or r < space.r_min:
        note = f"r={r:.4g} below r_min={space.r_min:.4g}: clamped"
        r = space.r_min
    elif r > space.r_max:
        note = f"r={r:.4g} above r_max={space.r_max:.4g}: clamped"
        r = space.r_max
    tol = 1e-12
    feasible = [t for t in space.steps_grid if space.lr_min * (1 - tol) <= r / t <= space.lr_max * (1 + tol)]
    if not feasible:  # gap between grid values: take the T whose η is closest to the box
        def dist(t: int) -> float:
            lr = r / t
            return math.log(space.lr_min / lr) if lr < space.lr_min else math.log(lr / space.lr_max)
        t = min(space.steps_grid, key=dist)
        lr = min(max(r / t, space.lr_min), space.lr_max)
        return lr, t, (note + "; " if note else "") + f"no grid T gives η in bounds; used T={t}, η={lr:.4g}"
    if prefer == "fewest_steps" or rng is None:
        t = feasible[0]
    elif prefer == "random":
        t = int(feasible[int(rng.integers(len(feasible)))])
    else:
        raise InvalidParameterError(f"`decomposition` must be 'random' or 'fewest_steps'. Got {prefer!r}.")
    return r / t, int(t), note


# --------------------------------------------------------------------------------------
# the r(ε) fit and extrapolation
# --------------------------------------------------------------------------------------


@dataclass
class Extrapolation:
    """Outcome of the r(ε) fit: r*, the line, and what guards fired."""

    r_star: float
    slope: float
    intercept: float
    space: str
    x_points: list
    r_points: list
    x_final: float
    amplification: float
    proportional_estimate: float
    fallback: str | None = None
    clamped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "r_star": self.r_star, "slope": self.slope, "intercept": self.intercept, "space": self.space,
            "x_points": self.x_points, "r_points": self.r_points, "x_final": self.x_final,
            "amplification": self.amplification, "proportional_estimate": self.proportional_estimate,
            "fallback": self.fallback, "clamped": self.clamped,
        }


def fit_line(xs: Sequence[float], rs: Sequence[float]) -> tuple[float, float]:
    """Least-squares line r = slope·x + intercept (exact through two points)."""
    xs = np.asarray(xs, float)
    rs = np.asarray(rs, float)
    if xs.size < 2 or np.ptp(xs) == 0:
        raise InvalidParameterError("the r-fit needs at least two distinct sweep budgets.")
    slope, intercept = np.polyfit(xs, rs, 1)
    return float(slope), float(intercept)


def extrapolate_r(
    epsilons: Sequence[float],
    best_rs: Sequence[float],
    final_epsilon: float,
    *,
    delta: float | None = None,
    fit_space: str = "epsilon",
    r_bounds: tuple[float, float] = (0.0, math.inf),
    proportional_cap: float | None = None,
) -> Extrapolation:
    """Fit r against ε (or μ) and evaluate at the final run's per-run ε, with guards.

    * ``fit_space="epsilon"`` (default; Section 4.2 and the reference code) or ``"mu"``
      (Algorithm 2 as printed; needs ``delta``).
    * Negative slope or r* ≤ 0 → fall back to the best r at the largest sweep budget.
    * r* is clamped to ``r_bounds`` (the searched range), and optionally to
      ``proportional_cap · r₂ · x_f / x₂`` (the pure r ∝ ε prior times a factor).
    """
    check_choice(fit_space, "fit_space", ("epsilon", "mu"))
    if fit_space == "mu":
        if delta is None:
            raise InvalidParameterError("`delta` is required for fit_space='mu'.")
        xs = [mu_from_epsilon(e, delta) for e in epsilons]
        xf = mu_from_epsilon(final_epsilon, delta)
    else:
        xs, xf = [float(e) for e in epsilons], float(final_epsilon)
    slope, intercept = fit_line(xs, best_rs)
    i_last = int(np.argmax(xs))
    r_last, x_last = float(best_rs[i_last]), float(xs[i_last])
    span = max(xs) - min(xs)
    amp = (xf - min(xs)) / span if span > 0 else math.nan
    prop = r_last * xf / x_last if x_last > 0 else math.nan
    r_star = slope * xf + intercept
    fallback = None
    if not math.isfinite(r_star) or slope < 0 or r_star <= 0:
        fallback = (
            f"slope {slope:.4g} {'< 0' if slope < 0 else ''} / r*={r_star:.4g}: fell back to the best r of the "
            f"last sweep ({r_last:.4g})"
        )
        r_star = r_last
    clamped = None
    lo, hi = r_bounds
    if proportional_cap is not None and math.isfinite(prop) and r_star > proportional_cap * prop:
        clamped = f"r*={r_star:.4g} capped at {proportional_cap:g}×proportional estimate {prop:.4g}"
        r_star = proportional_cap * prop
    if r_star > hi:
        clamped = f"r*={r_star:.4g} clamped to the searched maximum {hi:.4g}"
        r_star = hi
    elif r_star < lo:
        clamped = f"r*={r_star:.4g} clamped to the searched minimum {lo:.4g}"
        r_star = lo
    return Extrapolation(
        r_star=float(r_star), slope=slope, intercept=intercept, space=fit_space, x_points=list(map(float, xs)),
        r_points=list(map(float, best_rs)), x_final=float(xf), amplification=float(amp),
        proportional_estimate=float(prop), fallback=fallback, clamped=clamped,
    )


# --------------------------------------------------------------------------------------
# the strategy
# --------------------------------------------------------------------------------------


@dataclass
class LinearScalingConfig:
    """Parameters of linear-scaling HPO.

    sweep_epsilons : per-run ε of sweep 1 and sweep 2 (at the common δ), or ``"auto"``:
        (min(0.1, 0.1·ε_total), min(0.2, 0.2·ε_total)), the paper's (0.1, 0.2) at ε ≥ 1.
    runs_per_sweep : n trials per sweep (paper: 3).
    lr_bounds : the η box; ``None`` = :func:`default_lr_bounds` for full-batch runs on features ((0.01, 10);
        (0.1, 100) for image features) and
        :data:`MINIBATCH_LR_BOUNDS` (1e-4, 5e-2) for the mini-batch variant (bitfit/lora/full).
    steps_grid : the T grid of the full-batch variant (``None`` = (5, 10, 20, 40, 80, 150)); the
        mini-batch variant uses the schedule's T and rejects an explicit grid.
    r_sampling : ``"log_uniform"`` (default) or ``"uniform"`` (paper).
    fit_space : ``"epsilon"`` (default) or ``"mu"``.
    decomposition : ``"random"`` (T uniform among feasible) or ``"fewest_steps"``.
    sweep1_fraction : sweep 1 searches [r_min, sweep1_fraction · r_max] (code prior 1/10).
    momentum, clip, free_step : the fixed full-batch recipe (SGD 0.9, C = 1, one free step);
        the mini-batch variant trains with the model's optimizer and rejects non-default values.
    proportional_cap : optional cap r* ≤ cap · r₂ · ε_f / ε₂.
    """

    sweep_epsilons: Any = "auto"
    runs_per_sweep: int = 3
    lr_bounds: tuple | None = None
    steps_grid: tuple | None = None
    r_sampling: str = "log_uniform"
    fit_space: str = "epsilon"
    decomposition: str = "random"
    sweep1_fraction: float = 0.1
    momentum: float = 0.9
    clip: float = 1.0
    free_step: bool = True
    proportional_cap: float | None = None

    def space(self, data_kind: str | None = None) -> SearchSpace:
        """The full-batch search box (defaults filled in for features of ``data_kind``)."""
        return search_space(self.lr_bounds, self.steps_grid, data_kind)

    def minibatch_lr_bounds(self) -> tuple[float, float]:
        """The η box of the mini-batch variant; refuses options that only the full-batch recipe uses."""
        if self.steps_grid is not None:
            raise InvalidParameterError(
                "`steps_grid` does not apply to linear-scaling's mini-batch variant (mode bitfit/lora/full): every "
                "sweep run uses the schedule's T, so r = η·T varies through η alone. Remove `steps_grid`; choose T "
                "with steps=, epochs= or batch_size=."
            )
        for name, default in (("decomposition", "random"), ("momentum", 0.9), ("free_step", True)):
            if getattr(self, name) != default:
                raise InvalidParameterError(
                    f"`{name}` does not apply to linear-scaling's mini-batch variant (mode bitfit/lora/full): it "
                    "belongs to the full-batch SGD recipe on cached features (mode='last-layer'); mini-batch runs "
                    f"use the model's optimizer. Remove `{name}` or use mode='last-layer'."
                )
        lo, hi = _bounds(self.lr_bounds, MINIBATCH_LR_BOUNDS)
        SearchSpace(lo, hi, (1,))  # validates 0 < lo < hi
        return lo, hi

    def validate(self) -> None:
        check_int(self.runs_per_sweep, "runs_per_sweep", low=1)
        check_real(self.sweep1_fraction, "sweep1_fraction", low=0.0, high=1.0, high_inclusive=True,
                   fix="Sweep 1 searches [r_min, sweep1_fraction·r_max]; pass a fraction in (0, 1], e.g. 0.1.")
        check_choice(self.r_sampling, "r_sampling", ("log_uniform", "uniform"))
        check_choice(self.fit_space, "fit_space", ("epsilon", "mu"))

    def resolve_sweep_epsilons(self, total_epsilon: float) -> tuple[float, float]:
        if self.sweep_epsilons == "auto":
            return (min(0.1, 0.1 * total_epsilon), min(0.2, 0.2 * total_epsilon))
        try:
            e1, e2 = (float(v) for v in self.sweep_epsilons)
        except Exception:
            raise InvalidParameterError(
                f"`sweep_epsilons` must be 'auto' or two numbers (ε₁ < ε₂). Got {self.sweep_epsilons!r}."
            ) from None
        if not 0 < e1 < e2:
            raise InvalidParameterError(f"`sweep_epsilons` must satisfy 0 < ε₁ < ε₂. Got ({e1}, {e2}).")
        return e1, e2


def _bounds(value: Any, default: tuple) -> tuple[float, float]:
    if value is None:
        return float(default[0]), float(default[1])
    try:
        lo, hi = (float(v) for v in value)
    except Exception:
        raise InvalidParameterError(f"`lr_bounds` must be two numbers (lr_min, lr_max). Got {value!r}.") from None
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class LinearScalingPlan(BudgetPlan):
    """Two sweeps of ``runs_per_sweep`` runs at per-run ε ``sweep_epsilons`` (ε₁, ε₂), then the final run at
    per-run ``final_epsilon``; the sweeps alone cost ``trial_epsilon``.  ``prefix_events``: what was spent before
    the sweeps (``--mode auto`` pilots, a private feature centre).  Full-batch runs (cached features): ``mu``
    (μ₁, μ₂) and ``final_mu`` are the runs' GDP parameters."""

    sweep_epsilons: tuple[float, float]
    runs_per_sweep: int
    final_epsilon: float
    trial_epsilon: float
    prefix_events: list = field(default_factory=list)
    mu: tuple[float, float] | None = None
    final_mu: float | None = None

    def trials_expected(self) -> int | None:
        return 2 * int(self.runs_per_sweep)


@dataclass(frozen=True, kw_only=True)
class LinearScalingMinibatchPlan(LinearScalingPlan):
    """The mini-batch variant (a model): every run is ``DPSGDEvent(σᵢ, q, T)`` with σᵢ = ``sigmas``, at
    ``sample_rate`` q and ``steps`` T; η searched within ``lr_bounds``."""

    sigmas: tuple[float, float]
    sample_rate: float
    steps: int
    lr_bounds: tuple[float, float]
    minibatch: bool = True


def plan(config: LinearScalingConfig, total_epsilon: float, delta: float, *, score_event: GaussianEvent | None = None,
         accountant: str = "pld", prefix_events: Sequence = ()) -> LinearScalingPlan:
    """Plan every release before data is read (full-batch runs: exact GDP in μ).

    Each sweep run is a μᵢ-GDP release (μᵢ = μ(εᵢ, δ)) whatever its (η, T), since
    σ = √T/μᵢ; planned as ``GaussianEvent(1/μᵢ)``, it composes exactly like the actual
    ``GaussianEvent(√T/μᵢ, count=T)``.  The final run's μ_f is calibrated inside the
    composition; infeasible → :class:`InfeasibleBudgetError` with numbers and a fix.
    """
    config.validate()
    config.space()  # validates the box before anything is planned
    n = check_int(config.runs_per_sweep, "runs_per_sweep", low=1)
    e1, e2 = config.resolve_sweep_epsilons(total_epsilon)
    mu1, mu2 = mu_from_epsilon(e1, delta), mu_from_epsilon(e2, delta)
    trial_events: list = list(prefix_events)
    for s, mu in ((1, mu1), (2, mu2)):
        for i in range(n):
            trial_events.append(GaussianEvent(1.0 / mu, 1, label=f"planned sweep{s} trial {i}"))
            if score_event is not None:
                trial_events.append(score_event)
    eps_trials = epsilon_of(trial_events, delta, accountant)
    suggestion = (
        f"The sweeps ({n} runs at ε₁={e1:g} and {n} at ε₂={e2:g}{', plus charged scores' if score_event else ''}) "
        f"cost ε = {eps_trials:.4g}. Raise `epsilon`, or pass sweep_epsilons smaller than ({e1:g}, {e2:g}), "
        "fewer runs_per_sweep, a public validation split, or use strategy='single-step' (no trials)."
    )
    sigma_f1 = calibrate_final(total_epsilon, delta, trial_events, sample_rate=1.0, steps=1, sampling="full_batch",
                               accountant=accountant, what="the final run", suggestion=suggestion)
    mu_f = 1.0 / sigma_f1
    eps_f = epsilon_of([GaussianEvent(sigma_f1, 1)], delta, accountant)
    if eps_f < e2:
        raise InfeasibleBudgetError(
            f"Budget plan infeasible: after the sweeps the final run would get a per-run ε_f = {eps_f:.4g}, below "
            f"sweep 2's ε₂ = {e2:g}, which defeats the purpose of tuning. {suggestion}"
        )
    notes = [
        f"sweep 1: {n} full-batch runs at per-run ε₁ = {e1:g} (μ = {mu1:.4g})",
        f"sweep 2: {n} full-batch runs at per-run ε₂ = {e2:g} (μ = {mu2:.4g})",
        f"final run: per-run ε_f = {eps_f:.4g} (μ = {mu_f:.4g}); the sweeps alone cost ε = {eps_trials:.4g}",
        "composition in μ (exact GDP for full batch), then PLD-verified by the certificate",
    ]
    if score_event is not None:
        notes.append(f"each trial score is a charged Gaussian count (σ = {score_event.noise_multiplier:g})")
    return LinearScalingPlan(strategy=NAME, total_epsilon=total_epsilon, delta=delta, accountant=accountant,
                             trial_events=trial_events,
                             final_events=[GaussianEvent(sigma_f1, 1, label="planned final run")],
                             final_noise_multiplier=sigma_f1, notes=notes, sweep_epsilons=(e1, e2),
                             runs_per_sweep=n, final_epsilon=eps_f, trial_epsilon=eps_trials,
                             prefix_events=list(prefix_events), mu=(mu1, mu2), final_mu=mu_f)


def run(backend, selector, config: LinearScalingConfig, p: LinearScalingPlan, *, seed: int | None = None,
        progress=None) -> StrategyOutcome:
    """Execute the plan: two sweeps, the fit, the final run (full batch on ``backend``)."""
    rng = np.random.default_rng(seed)
    space = config.space(getattr(backend, "data_kind", None))
    n = p.runs_per_sweep
    e1, e2 = p.sweep_epsilons
    mus = p.mu
    trials: list[TrialRecord] = []
    best_rs: list[float] = []
    lo = space.r_min
    for s, (eps_s, mu_s) in enumerate([(e1, mus[0]), (e2, mus[1])], start=1):
        if s == 1:
            r_lo, r_hi = space.r_min, max(space.r_min, config.sweep1_fraction * space.r_max)
        else:  # a fix over the reference code: sweep 2 searches between sweep 1's best r and r_max
            r_lo, r_hi = best_rs[0], space.r_max
        # the sweep's draws (r, its split into (η, T), the seed) are made here, in the one-by-one order, before
        # its runs start: where they run (hpo.executors) changes nothing they compute
        calls = []
        for i, r in enumerate(sample_r(rng, r_lo, r_hi, n, config.r_sampling)):
            lr, T, note = decompose(r, space, rng, config.decomposition)
            calls.append(TrialCall({"learning_rate": lr, "steps": T}, dict(
                noise_multiplier=math.sqrt(T) / mu_s, sample_rate=1.0, steps=T, learning_rate=lr, optimizer="sgd",
                momentum=config.momentum, clip=config.clip, free_step=config.free_step,
                seed=noise_seed(rng), label=f"linear-scaling sweep{s} trial {i}"), extra={
                    "r_sampled": r, **({"note": note} if note else {})}))
        sweep_records = []

        def score_trial(fit, call, s=s, eps_s=eps_s, sweep_records=sweep_records):  # in the driver, in order
            lr, T = call.hp["learning_rate"], call.hp["steps"]
            score, score_events = selector.score(backend.logits(fit.state, selector.data), label=call.label + " score")
            rec = TrialRecord(index=len(trials), phase=f"sweep{s}",
                              hyperparameters={"r": lr * T, "learning_rate": lr, "steps": T,
                                               "noise_multiplier": call.kwargs["noise_multiplier"],
                                               "trial_epsilon": eps_s},
                              events=list(fit.events) + list(score_events), score=score,
                              score_source=selector.source, extra=dict(call.extra))
            trials.append(rec)
            sweep_records.append(rec)
            if progress:
                progress(f"sweep {s} trial {len(sweep_records)}/{n}: r={lr * T:.4g} (η={lr:.3g}, T={T}) "
                         f"score={score:.4f}")

        run_trials(backend, calls, score_trial)
        best = choose_best(sweep_records, tie=lambda r: r.hyperparameters["r"])
        best_rs.append(float(best.hyperparameters["r"]))
    ext = extrapolate_r([e1, e2], best_rs, p.final_epsilon, delta=p.delta, fit_space=config.fit_space,
                        r_bounds=(lo, space.r_max), proportional_cap=config.proportional_cap)
    lr_f, T_f, note_f = decompose(ext.r_star, space, rng, config.decomposition)
    spent = list(p.prefix_events) + [e for t in trials for e in t.events]
    sigma_f = calibrate_in_plan(p, spent, sample_rate=1.0, steps=T_f, sampling="full_batch")
    if progress:
        progress(f"fit ({ext.space}-space): r* = {ext.r_star:.4g} → final run η={lr_f:.3g}, T={T_f}, σ={sigma_f:.4g}")
    ((final, _),) = run_trials(backend, [TrialCall({"learning_rate": lr_f, "steps": T_f}, dict(
        noise_multiplier=sigma_f, sample_rate=1.0, steps=T_f, learning_rate=lr_f, optimizer="sgd",
        momentum=config.momentum, clip=config.clip, free_step=config.free_step, seed=noise_seed(rng),
        label="linear-scaling final run", record=True))])
    data = {
        "name": NAME,
        "trial_epsilons": [e1, e2],
        "runs_per_sweep": n,
        "best_r": best_rs,
        "fit": {"slope": ext.slope, "intercept": ext.intercept, "space": ext.space},
        "extrapolation": ext.to_dict(),
        "r_star": ext.r_star,
        "final_epsilon": p.final_epsilon,
        "search_space": {**space.to_dict(), "r_min": space.r_min, "r_max": space.r_max,
                         "r_sampling": config.r_sampling},
        "notes": [x for x in (ext.fallback, ext.clamped, note_f) if x],
    }
    return StrategyOutcome(
        state=final.state, final_events=list(final.events),
        final_hyperparameters={"learning_rate": lr_f, "steps": T_f, "r": lr_f * T_f, "noise_multiplier": sigma_f,
                               "optimizer": "sgd", "momentum": config.momentum, "clip": config.clip,
                               "batch": "full", "free_step": config.free_step},
        trials=trials, strategy_data=data, final_history=final.history, selection_source=selector.source,
    )


# --------------------------------------------------------------------------------------
# mini-batch variant (BiTFiT / LoRA / full fine-tuning through privtune.training.fit)
# --------------------------------------------------------------------------------------

def plan_minibatch(config: LinearScalingConfig, total_epsilon: float, delta: float, *, sample_rate: float,
                   steps: int, score_event: GaussianEvent | None = None, accountant: str = "pld",
                   prefix_events: Sequence = ()) -> LinearScalingMinibatchPlan:
    """Plan for Poisson-subsampled runs: every sweep run is ``DPSGDEvent(σᵢ, q, T)`` with σᵢ
    calibrated to the per-run εᵢ; the final σ is calibrated inside the PLD composition.

    T is the schedule's (fixed for every run): r = η·T varies through η in ``lr_bounds``
    (default :data:`MINIBATCH_LR_BOUNDS`), r* is clamped to the searched range [η_min·T, η_max·T],
    and the final run is exactly the planned ``DPSGDEvent(σ_f, q, T)``.  Options of the full-batch
    recipe (``steps_grid``, ``decomposition``, ``momentum``, ``free_step``) are refused, not ignored.
    """
    config.validate()
    lr_lo, lr_hi = config.minibatch_lr_bounds()
    n = check_int(config.runs_per_sweep, "runs_per_sweep", low=1)
    e1, e2 = config.resolve_sweep_epsilons(total_epsilon)
    sig = [float(calibrate_noise_multiplier(e, delta, sample_rate, steps, accountant=accountant)) for e in (e1, e2)]
    trial_events = list(prefix_events)
    for s, sg in ((1, sig[0]), (2, sig[1])):
        for i in range(n):
            trial_events.append(DPSGDEvent(sg, sample_rate, steps, label=f"planned sweep{s} trial {i}"))
            if score_event is not None:
                trial_events.append(score_event)
    eps_trials = epsilon_of(trial_events, delta, accountant)
    suggestion = (f"The sweeps cost ε = {eps_trials:.4g}. Raise `epsilon`, pass smaller sweep_epsilons or fewer "
                  "runs_per_sweep, or use strategy='hyperfree' (no trials).")
    sigma_f = calibrate_final(total_epsilon, delta, trial_events, sample_rate=sample_rate, steps=steps,
                              accountant=accountant, suggestion=suggestion)
    eps_f = epsilon_of([DPSGDEvent(sigma_f, sample_rate, steps)], delta, accountant)
    if eps_f < e2:
        raise InfeasibleBudgetError(f"Budget plan infeasible: the final run would get per-run ε_f = {eps_f:.4g} < "
                                    f"ε₂ = {e2:g}. {suggestion}")
    notes = [f"sweeps: {n} + {n} Poisson runs (q = {sample_rate:.4g}, T = {steps}) at per-run ε = {e1:g}, {e2:g} "
               f"(σ = {sig[0]:.4g}, {sig[1]:.4g})",
             f"final run: per-run ε_f = {eps_f:.4g} (σ = {sigma_f:.4g}); the sweeps cost ε = {eps_trials:.4g}"]
    return LinearScalingMinibatchPlan(
        strategy=NAME, total_epsilon=total_epsilon, delta=delta, accountant=accountant, trial_events=trial_events,
        final_events=[DPSGDEvent(sigma_f, sample_rate, steps, label="planned final run")],
        final_noise_multiplier=sigma_f, notes=notes, sweep_epsilons=(e1, e2), runs_per_sweep=n, final_epsilon=eps_f,
        trial_epsilon=eps_trials, prefix_events=list(prefix_events), sigmas=tuple(sig), sample_rate=sample_rate,
        steps=steps, lr_bounds=(lr_lo, lr_hi))


def run_minibatch(backend, selector, config: LinearScalingConfig, p: LinearScalingMinibatchPlan, *, seed: int | None = None,
                  progress=None) -> StrategyOutcome:
    """Algorithm 2 with Poisson mini-batches on a model backend (T fixed in the sweeps)."""
    rng = np.random.default_rng(seed)

    q, T = p.sample_rate, p.steps
    lr_lo, lr_hi = config.minibatch_lr_bounds()
    r_min, r_max = lr_lo * T, lr_hi * T
    n = p.runs_per_sweep
    e1, e2 = p.sweep_epsilons
    trials: list[TrialRecord] = []
    best_rs: list[float] = []
    for s, (eps_s, sig) in enumerate(zip((e1, e2), p.sigmas), start=1):
        # sweep 1 on [r_min, sweep1_fraction·r_max] (the code's prior, as in the full-batch variant);
        # sweep 2 between sweep 1's best r and r_max (a fix over the reference code)
        lo, hi = (r_min, max(r_min, config.sweep1_fraction * r_max)) if s == 1 else (best_rs[0], r_max)
        calls = [TrialCall({"learning_rate": r / T, "steps": T}, dict(
            noise_multiplier=sig, sample_rate=q, steps=T, learning_rate=r / T, clip=config.clip,
            seed=noise_seed(rng), label=f"linear-scaling sweep{s} trial {i}"), extra={"r": r})
            for i, r in enumerate(sample_r(rng, lo, hi, n, config.r_sampling))]
        recs = []

        def score_trial(fit, call, s=s, eps_s=eps_s, sig=sig, recs=recs):  # in the driver, in trial order
            r, lr = call.extra["r"], call.hp["learning_rate"]
            score, sev = selector.score(backend.logits(fit.state, selector.data), label=call.label + " score")
            rec = TrialRecord(index=len(trials), phase=f"sweep{s}", hyperparameters={
                "r": r, "learning_rate": lr, "steps": T, "sample_rate": q, "noise_multiplier": sig,
                "trial_epsilon": eps_s}, events=list(fit.events) + sev, score=score, score_source=selector.source)
            trials.append(rec)
            recs.append(rec)
            if progress:
                progress(f"sweep {s} trial {len(recs)}/{n}: η={lr:.3g} (r={r:.4g}) score={score:.4f}")

        run_trials(backend, calls, score_trial)
        best_rs.append(float(choose_best(recs, tie=lambda r: r.hyperparameters["r"]).hyperparameters["r"]))
    ext = extrapolate_r([e1, e2], best_rs, p.final_epsilon, delta=p.delta, fit_space=config.fit_space,
                        r_bounds=(r_min, r_max), proportional_cap=config.proportional_cap)
    T_f = T  # r* lies in the searched range [η_min·T, η_max·T], so η = r*/T is inside the box
    lr_f = min(max(ext.r_star / T, lr_lo), lr_hi)
    spent = list(p.prefix_events) + [e for t in trials for e in t.events]
    sigma_f = float(p.final_noise_multiplier)  # the planned final run (the trials ran exactly as planned)
    if not p.fits(spent + [DPSGDEvent(sigma_f, q, T_f)]):  # pragma: no cover - guard; trials differ from the plan
        sigma_f = calibrate_in_plan(p, spent, sample_rate=q, steps=T_f)
    if progress:
        progress(f"fit: r* = {ext.r_star:.4g} → final η={lr_f:.3g}, T={T_f}, σ={sigma_f:.4g}")
    ((final, _),) = run_trials(backend, [TrialCall({"learning_rate": lr_f, "steps": T_f}, dict(
        noise_multiplier=sigma_f, sample_rate=q, steps=T_f, learning_rate=lr_f, clip=config.clip,
        seed=noise_seed(rng), label="linear-scaling final run", record=True))])
    data = {"name": NAME, "trial_epsilons": [e1, e2], "best_r": best_rs, "r_star": ext.r_star,
            "fit": {"slope": ext.slope, "intercept": ext.intercept, "space": ext.space},
            "extrapolation": ext.to_dict(), "final_epsilon": p.final_epsilon, "minibatch": True,
            "search_space": {"lr_bounds": [lr_lo, lr_hi], "steps": T, "r_min": r_min, "r_max": r_max,
                             "r_sampling": config.r_sampling, "sweep1": [r_min, max(r_min, config.sweep1_fraction
                                                                                   * r_max)]},
            "notes": [x for x in (ext.fallback, ext.clamped) if x]}
    return StrategyOutcome(state=final.state, final_events=list(final.events),
                           final_hyperparameters={"learning_rate": lr_f, "steps": T_f, "r": lr_f * T_f,
                                                  "sample_rate": q, "noise_multiplier": sigma_f, "clip": config.clip},
                           trials=trials, strategy_data=data, final_history=final.history,
                           selection_source=selector.source)


class LinearScaling(Strategy):
    """Linear scaling of Panda et al.: two sweeps of cheap trials, a fitted line, one final run at the rest."""

    name = NAME
    modes = TUNABLE_MODES
    Config = LinearScalingConfig
    overrides = {"features": frozenset({"trials"}),
                 "model": frozenset({"trials", "epochs", "steps", "batch_size", "optimizer"})}
    clipping_kinds = frozenset({"model"})
    independent_trials = True

    def apply_overrides(self, cfg, *, trials=None, optimizer=None) -> None:
        if trials is not None:
            # two sweeps of the same size: an odd count cannot be split, and used to be rounded down silently
            t = check_int(trials, "trials", low=2)
            if t % 2:
                raise InvalidParameterError(
                    f"`trials` must be even for strategy='linear-scaling': it runs two sweeps of trials/2 runs each "
                    f"(the paper: 2 × 3). Got {t}. Pass {t - 1} or {t + 1}."
                )
            cfg.runs_per_sweep = t // 2

    def plan(self, cfg, mode: str, request: PlanRequest) -> BudgetPlan:
        r = request
        if mode == "last-layer":
            p = plan(cfg, r.total_epsilon, r.delta, score_event=r.score_event(), accountant=r.accountant,
                     prefix_events=r.prefix_events)
        else:
            q, T = minibatch_schedule(r, r.epochs if r.epochs is not None else 1.0)
            p = plan_minibatch(cfg, r.total_epsilon, r.delta, sample_rate=q, steps=T, score_event=r.score_event(),
                               accountant=r.accountant, prefix_events=r.prefix_events)
        return dataclasses.replace(p, config=cfg)

    def run(self, backend, selector, plan: LinearScalingPlan, *, mode: str, seed=None, progress=None):
        if mode == "last-layer":
            return run(backend, selector, plan.config, plan, seed=seed, progress=progress)
        return run_minibatch(backend, selector, plan.config, plan, seed=seed, progress=progress)
