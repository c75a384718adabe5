"""Random search, honestly charged: the baseline every private tuner must beat.

k configurations (η log-uniform in the box, T uniform in the grid, drawn independently
as in the baseline code of Panda et al., linear scaling) are trained; the best one by the
selection score is released as the model (no separate final run).  Its cost is accounted
whichever way is tighter:

* **plain composition** of all k trials (and their charged scores), each trial getting
  per-run μ_t = √((μ_total² − scores)/k) in GDP (exact for full batch), PLD-verified; or
* **Papernot & Steinke (ICLR 2022) repeat-and-select**: the number of trials K is random,
  truncated negative binomial with mean k (``shape`` 0 = logarithmic), and only the best
  is released; accounted with RDP through ``RepeatAndSelectEvent``.  "Truncated" is the
  paper's: K = 0 is excluded.  K is **never capped** from above: the theorem holds only for
  the untruncated distribution (a cap at 100 would break it with probability ≈ 0.5 % at mean
  10).  Compute is bounded honestly instead: a mean above :data:`MAX_MEAN_TRIALS` is refused
  at plan time, and the plan states the probability that K exceeds 10× its mean.

Under repeat-and-select the theorem covers releasing the **selected trial only**, so that is all
:func:`run` returns: the selected trial's hyperparameters, events and score (its score is part of
the repeated run's output, hence covered), never the realised K nor another trial's score or
hyperparameters (:data:`PUBLISHED_UNDER_PS` says so in the report).  Progress messages say nothing
per trial either.  With composition every trial is composed, so every trial is published.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from privtune._validation import check_choice, check_int, check_real
from privtune.accounting.calibration import calibrate
from privtune.accounting.events import GaussianEvent, RepeatAndSelectEvent
from privtune.errors import InfeasibleBudgetError
from privtune.hpo.common import (
    BudgetPlan,
    PlanRequest,
    Strategy,
    StrategyOutcome,
    TrialRecord,
    choose_best,
    epsilon_of,
    mu_from_epsilon,
    noise_seed,
)
from privtune.hpo.executors import TrialCall, run_trials
from privtune.hpo.linear_scaling import SearchSpace, search_space

NAME = "random-search"
#: what a repeat-and-select run publishes (strategy data, certificate, report)
PUBLISHED_UNDER_PS = ("selected trial only: Papernot & Steinke's repeat-and-select bound covers releasing the best "
                      "trial, so the number of trials run (random), the other trials' scores and their hyperparameters "
                      "are not published")
#: label of the selected trial's events under repeat-and-select (never its position among the K trials)
SELECTED_TRIAL_LABEL = "selected trial (repeat-and-select)"
#: largest expected number of trials accepted for repeat-and-select (K itself is not capped)
MAX_MEAN_TRIALS = 100


@dataclass
class RandomSearchConfig:
    """Parameters of honest random search.

    trials : k, the (expected) number of configurations; at most :data:`MAX_MEAN_TRIALS` with
        repeat-and-select accounting (the realised K is random and never capped).
    accounting : ``"auto"`` (tighter of the two), ``"composition"`` or ``"repeat-and-select"``.
    shape : η of the truncated negative binomial for repeat-and-select (0 = logarithmic).
    lr_bounds, steps_grid : the search box; ``lr_bounds=None`` is linear scaling's default for the features
        (:func:`privtune.hpo.linear_scaling.default_lr_bounds`).
    momentum, clip, free_step : the fixed full-batch recipe.
    """

    trials: int = 10
    accounting: str = "auto"
    shape: float = 0.0
    lr_bounds: tuple | None = None
    steps_grid: tuple = (5, 10, 20, 40, 80, 150)
    momentum: float = 0.9
    clip: float = 1.0
    free_step: bool = True

    def space(self, data_kind: str | None = None) -> SearchSpace:
        """The search box, with the default η box of features of ``data_kind`` when ``lr_bounds`` is None."""
        return search_space(self.lr_bounds, self.steps_grid, data_kind)


def _shrink_to_fit(make_events, mu0: float, total: float, delta: float, accountant: str) -> float:
    """Largest μ ≤ mu0 (down to 0.45·mu0) whose events meet the total ε under ``accountant``."""
    try:
        return calibrate(make_events, total, delta, bracket=(mu0 * 0.998 ** 400, mu0), accountant=accountant,
                         increasing=True, tolerance=1e-4, guess=mu0, name="per-trial μ")
    except InfeasibleBudgetError:
        raise InfeasibleBudgetError(f"random search: no per-trial μ ≤ {mu0:.4g} meets ε = {total:g}.") from None


def _ps_mu(k: float, shape: float, score_sigma: float | None, total: float, delta: float) -> float | None:
    """Largest per-trial μ for repeat-and-select whose RDP ε meets the total (None if infeasible)."""
    def events(mu: float) -> list:
        inner = [GaussianEvent(1.0 / mu, 1)] + ([GaussianEvent(score_sigma, 1)] if score_sigma else [])
        return [RepeatAndSelectEvent(events=tuple(inner), mean=k, shape=shape)]
    try:
        return calibrate(events, total, delta, bracket=(1e-4, mu_from_epsilon(total, delta)), accountant="rdp",
                         increasing=True, tolerance=1e-9, name="per-trial μ")
    except InfeasibleBudgetError:
        return None


@dataclass(frozen=True, kw_only=True)
class RandomSearchPlan(BudgetPlan):
    """``trials`` full-batch runs (the mean number under repeat-and-select, where the number is random), each at
    per-run μ ``trial_mu``; ``accounting`` says which composition won (``composition_mu`` against
    ``repeat_and_select_mu``, None when not feasible); ``shape`` and ``p_trials_above_10x_mean``: the
    repeat-and-select distribution of the number of trials and its tail (None under composition)."""

    trials: int
    trial_mu: float
    composition_mu: float | None
    repeat_and_select_mu: float | None
    shape: float
    p_trials_above_10x_mean: float | None = None

    def trials_expected(self) -> int | None:
        return int(self.trials) if self.accounting == "composition" and self.trials else None


def plan(config: RandomSearchConfig, total_epsilon: float, delta: float, *, score_sigma: float | None = None,
         accountant: str = "pld", prefix_events=()) -> RandomSearchPlan:
    """Choose the tighter accounting and the per-trial μ, before any data is read."""
    k = check_int(config.trials, "trials", low=1)
    check_real(config.shape, "shape", low=0.0, low_inclusive=True)

    check_choice(config.accounting, "accounting", ("auto", "composition", "repeat-and-select"))
    config.space()  # validates the search box before anything is planned
    if config.accounting == "repeat-and-select" and k > MAX_MEAN_TRIALS:
        raise InfeasibleBudgetError(
            f"random search: repeat-and-select with a mean of {k} trials is refused (limit {MAX_MEAN_TRIALS}): its "
            "number of trials is random and cannot be capped without breaking the guarantee, so the compute is "
            f"unbounded in the tail. Use trials ≤ {MAX_MEAN_TRIALS}, or accounting='composition' (exactly k trials)."
        )
    prefix = list(prefix_events)
    mu_total = mu_from_epsilon(total_epsilon, delta)
    if prefix:  # budget left after the prefix (e.g. --mode auto pilots), in GDP terms, PLD-verified below
        eps_prefix = epsilon_of(prefix, delta, accountant)
        if eps_prefix >= total_epsilon:
            raise InfeasibleBudgetError(f"random search: the pilots alone cost ε = {eps_prefix:.4g} ≥ {total_epsilon:g}.")
        mu_total = math.sqrt(max(1e-12, mu_total ** 2 - mu_from_epsilon(eps_prefix, delta) ** 2))
    score_mu2 = k / score_sigma ** 2 if score_sigma else 0.0
    comp_mu = None
    if mu_total ** 2 > score_mu2:
        def comp_events(mu: float) -> list:
            evs = prefix + [GaussianEvent(1.0 / mu, 1, label=f"planned random-search trial {i}") for i in range(k)]
            if score_sigma:
                evs += [GaussianEvent(score_sigma, 1, label=f"score trial {i}") for i in range(k)]
            return evs
        comp_mu = _shrink_to_fit(comp_events, math.sqrt((mu_total ** 2 - score_mu2) / k), total_epsilon, delta,
                                 accountant)
    ps_mu = None
    if config.accounting in ("auto", "repeat-and-select") and k <= MAX_MEAN_TRIALS:
        ps_mu = None if prefix else _ps_mu(k, config.shape, score_sigma, total_epsilon, delta)
    if config.accounting == "composition":
        ps_mu = None
    if config.accounting == "repeat-and-select":
        comp_mu = None
    if comp_mu is None and ps_mu is None:
        raise InfeasibleBudgetError(
            f"Budget plan infeasible: {k} random-search trials{' with charged scores' if score_sigma else ''} do not "
            f"fit in ε = {total_epsilon:g}. Use fewer `trials`, a public validation split, or a larger `epsilon`."
        )
    use_ps = ps_mu is not None and (comp_mu is None or ps_mu > comp_mu)
    tail = None
    if use_ps:
        inner = [GaussianEvent(1.0 / ps_mu, 1)] + ([GaussianEvent(score_sigma, 1)] if score_sigma else [])
        trial_events = prefix + [RepeatAndSelectEvent(events=tuple(inner), mean=float(k), shape=float(config.shape),
                                               label="random search (repeat-and-select)")]
        mu = ps_mu
        tail = _tail_probability(float(k), float(config.shape), 10 * k)
    else:
        trial_events = comp_events(comp_mu)
        mu = comp_mu
    accounting = "repeat-and-select" if use_ps else "composition"
    notes = [
        f"{k} {'expected ' if use_ps else ''}trials, each a full-batch run at per-run μ = {mu:.4g}",
        f"accounting: {accounting} (per-trial μ: composition {comp_mu or float('nan'):.4g}, "
        f"repeat-and-select {ps_mu or float('nan'):.4g}; the larger μ, i.e. less noise, wins)",
        "the best trial is released; no separate final run",
    ]
    if use_ps:
        notes.append(f"the number of trials K is random (mean {k}, never capped: the guarantee needs the whole "
                     f"distribution); P(K > {10 * k}) = {tail:.2g}")
    return RandomSearchPlan(strategy=NAME, total_epsilon=total_epsilon, delta=delta,
                            accountant="rdp" if use_ps else accountant, trial_events=trial_events, notes=notes,
                            accounting=accounting, trials=k, trial_mu=mu, composition_mu=comp_mu,
                            repeat_and_select_mu=ps_mu, shape=config.shape, p_trials_above_10x_mean=tail)


def _k_distribution(mean: float, shape: float):
    """(pmf over k ≥ 1 as a callable, γ) of dp_accounting's truncated negative binomial."""
    # Lazy: dp_accounting internals only for the negative binomial K (see docstring).
    from dp_accounting.rdp.rdp_privacy_accountant import _gamma_truncated_negative_binomial
    from scipy import stats

    gamma = _gamma_truncated_negative_binomial(shape, mean)
    if shape == 0:
        return stats.logser(1 - gamma), gamma
    return stats.nbinom(shape, gamma), gamma


def _tail_probability(mean: float, shape: float, k: int) -> float:
    """P(K > k) for the truncated (K ≥ 1) negative binomial with the given mean and shape."""
    dist, _ = _k_distribution(mean, shape)
    p0 = 0.0 if shape == 0 else float(dist.pmf(0))
    return float(dist.sf(k)) / (1.0 - p0)


def _draw_k(rng: np.random.Generator, mean: float, shape: float) -> int:
    """Draw K from the truncated negative binomial with the given mean (dp_accounting's γ)."""
    # Lazy: dp_accounting internals only for the negative binomial K (see docstring).
    from dp_accounting.rdp.rdp_privacy_accountant import _gamma_truncated_negative_binomial

    gamma = _gamma_truncated_negative_binomial(shape, mean)
    while True:  # rejection of K = 0 is the definition of the (zero-)truncated distribution; no upper cap
        if shape == 0:
            kk = int(rng.logseries(1 - gamma))
        elif shape == 1:
            kk = int(rng.geometric(gamma))
        else:
            kk = int(rng.negative_binomial(shape, gamma))
        if kk > 0:
            return kk


def run(backend, selector, config: RandomSearchConfig, p: RandomSearchPlan, *, seed: int | None = None,
        progress=None) -> StrategyOutcome:
    rng = np.random.default_rng(seed)
    space = config.space(getattr(backend, "data_kind", None))
    mu = p.trial_mu
    use_ps = p.accounting == "repeat-and-select"
    # repeat-and-select: K drawn from the untruncated-above distribution the accounting assumes
    k = _draw_k(rng, float(p.trials), float(config.shape)) if use_ps else p.trials
    # every trial's hyperparameters and seed are drawn here, in the driver, in the order the one-by-one loop drew
    # them, so that where the trials run (hpo.executors) changes nothing they compute
    calls = []
    for i in range(k):
        lr = float(math.exp(rng.uniform(math.log(space.lr_min), math.log(space.lr_max))))
        T = int(space.steps_grid[int(rng.integers(len(space.steps_grid)))])
        calls.append(TrialCall({"learning_rate": lr, "steps": T}, dict(
            noise_multiplier=math.sqrt(T) / mu, sample_rate=1.0, steps=T, learning_rate=lr, optimizer="sgd",
            momentum=config.momentum, clip=config.clip, free_step=config.free_step, seed=noise_seed(rng),
            label=f"random-search trial {i}", record=True)))
    trials, states = [], {}

    def score_trial(fit, call: TrialCall):  # in the driver, in trial order: the selection noise never leaves it
        i, lr, T = len(trials), call.hp["learning_rate"], call.hp["steps"]
        score, score_events = selector.score(backend.logits(fit.state, selector.data), label=call.label + " score")
        trials.append(TrialRecord(index=i, phase="random", hyperparameters={"learning_rate": lr, "steps": T,
                                  "r": lr * T, "noise_multiplier": call.kwargs["noise_multiplier"]},
                                  events=list(fit.events) + score_events, score=score, score_source=selector.source))
        states[i] = fit
        if progress and not use_ps:  # under repeat-and-select even the count of trials stays inside the process
            progress(f"random search trial {i + 1}/{k}: η={lr:.3g} T={T} score={score:.4f}")

    run_trials(backend, calls, score_trial)
    best = choose_best(trials)
    fit = states[best.index]
    final_hp = dict(best.hyperparameters, optimizer="sgd", momentum=config.momentum, clip=config.clip, batch="full")
    if use_ps:
        if progress:
            progress("random search (repeat-and-select): the selected trial is released; " + PUBLISHED_UNDER_PS)
        # relabelled: the run's own labels name its position ("random-search trial 2"), a lower bound on K
        selected_events = [dataclasses.replace(e, label=SELECTED_TRIAL_LABEL) for e in best.events]
        selected = TrialRecord(index=0, phase="selected trial (repeat-and-select)",
                               hyperparameters=dict(best.hyperparameters), events=selected_events,
                               score=best.score, score_source=best.score_source)
        data = {"name": NAME, "accounting": p.accounting, "trial_mu": mu, "published": PUBLISHED_UNDER_PS,
                "search_space": space.to_dict(),
                "certificate_events": "repeat-and-select event replaces per-trial composition",
                "notes": [PUBLISHED_UNDER_PS]}
        out = StrategyOutcome(state=fit.state, final_events=[], final_hyperparameters=final_hp, trials=[selected],
                              strategy_data=data, final_history=fit.history, selection_source=selector.source)
        out.certificate_events = [e for e in p.trial_events if isinstance(e, RepeatAndSelectEvent)]
        return out
    data = {"name": NAME, "scores": [t.score for t in trials], "accounting": p.accounting, "search_space": space.to_dict(),
            "trial_mu": mu, "realised_trials": k, "best_index": best.index, "published": "every trial (composition)"}
    return StrategyOutcome(state=fit.state, final_events=[], final_hyperparameters=dict(final_hp,
                           selected_trial=best.index), trials=trials, strategy_data=data,
                           final_history=fit.history, selection_source=selector.source)


class RandomSearch(Strategy):
    """Random search: trials with random hyperparameters on cached features, the best one selected."""

    name = NAME
    modes = ("last-layer",)
    Config = RandomSearchConfig
    overrides = {"features": frozenset({"trials"})}
    independent_trials = True

    def apply_overrides(self, cfg, *, trials=None, optimizer=None) -> None:
        if trials is not None:
            cfg.trials = int(trials)

    def plan(self, cfg, mode: str, request: PlanRequest) -> BudgetPlan:
        p = plan(cfg, request.total_epsilon, request.delta, score_sigma=request.score_sigma,
                 accountant=request.accountant, prefix_events=request.prefix_events)
        return dataclasses.replace(p, config=cfg)

    def run(self, backend, selector, plan: RandomSearchPlan, *, mode: str, seed=None, progress=None):
        return run(backend, selector, plan.config, plan, seed=seed, progress=progress)
