"""Grid oracle — NOT PRIVATE.  A reference to compare private tuners against, never a way
to pick a released model.

Every configuration of a grid over (η, T) is trained at the *whole* budget (each run alone
is (ε, δ)-DP) and the best by the selection split is reported.  The tuning itself is
**not charged**: the composition of all grid runs is far above ε.  This is what most DP
papers report as "the" accuracy at ε; privtune reports it only as an upper reference,
labelled NOT PRIVATE in every output, and :func:`privtune.hpo.tune` refuses to release
its model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privtune.hpo.common import (
    BudgetPlan,
    PlanRequest,
    Strategy,
    StrategyOutcome,
    TrialRecord,
    calibrate_final,
    choose_best,
    noise_seed,
)
from privtune.hpo.executors import TrialCall, run_trials
from privtune.hpo.linear_scaling import search_space

NAME = "grid-oracle"
LABEL = "NOT PRIVATE"


@dataclass
class GridOracleConfig:
    """Grid: ``lr_points`` η values log-spaced over ``lr_bounds`` × every T of ``steps_grid``; ``lr_bounds=None``
    is linear scaling's default for the features (:func:`privtune.hpo.linear_scaling.default_lr_bounds`)."""

    lr_bounds: tuple | None = None
    lr_points: int = 7
    steps_grid: tuple = (5, 10, 20, 40, 80, 150)
    momentum: float = 0.9
    clip: float = 1.0
    free_step: bool = True

    def grid(self, data_kind: str | None = None) -> list[tuple[float, int]]:
        space = search_space(self.lr_bounds, self.steps_grid, data_kind)
        lrs = np.geomspace(space.lr_min, space.lr_max, int(self.lr_points))
        return [(float(lr), int(T)) for lr in lrs for T in space.steps_grid]


@dataclass
class OracleResult:
    """The NOT PRIVATE reference: best grid point by the selection score and all scores."""

    hyperparameters: dict
    score: float
    state: object
    trials: list
    label: str = LABEL

    def to_dict(self) -> dict:
        return {"label": self.label, "hyperparameters": self.hyperparameters, "score": self.score,
                "trials": [t.to_dict() for t in self.trials],
                "note": "tuning NOT charged: each grid run alone is (ε, δ)-DP, their composition is not"}


def run(backend, selector, config: GridOracleConfig, epsilon: float, delta: float, *, seed: int | None = None,
        accountant: str = "pld", progress=None) -> OracleResult:
    """Train every grid point at the full budget and return the best (NOT PRIVATE)."""
    rng = np.random.default_rng(seed)
    grid = config.grid(getattr(backend, "data_kind", None))
    calls = []
    for i, (lr, T) in enumerate(grid):  # σ and seeds fixed here, in the driver, whatever executor runs the grid
        sigma = calibrate_final(epsilon, delta, [], sample_rate=1.0, steps=T, sampling="full_batch",
                                accountant=accountant, what="one grid run")
        calls.append(TrialCall({"learning_rate": lr, "steps": T}, dict(
            noise_multiplier=sigma, sample_rate=1.0, steps=T, learning_rate=lr, optimizer="sgd",
            momentum=config.momentum, clip=config.clip, free_step=config.free_step, seed=noise_seed(rng),
            label=f"grid-oracle run {i} ({LABEL})")))
    trials, states = [], {}

    def score_run(fit, call):  # uncharged: scored without noise on the selection split, whatever its status
        i, lr, T = len(trials), call.hp["learning_rate"], call.hp["steps"]
        pred = backend.predict(fit.state, selector.data)
        score = float((pred.long() == selector.labels).float().mean().item())
        trials.append(TrialRecord(index=i, phase="grid (NOT PRIVATE)", hyperparameters={
            "learning_rate": lr, "steps": T, "r": lr * T, "noise_multiplier": call.kwargs["noise_multiplier"]},
            events=list(fit.events), score=score, score_source=f"{selector.source} without noise ({LABEL})"))
        states[i] = fit.state
        if progress and (i + 1) % 7 == 0:
            progress(f"grid oracle ({LABEL}) {i + 1}/{len(grid)}")

    run_trials(backend, calls, score_run)
    best = choose_best(trials, tie=lambda r: r.hyperparameters["r"])
    return OracleResult(hyperparameters=dict(best.hyperparameters), score=float(best.score or math.nan),
                        state=states[best.index], trials=trials)


class GridOracle(Strategy):
    """NOT PRIVATE reference: every grid run at the full budget, the best chosen without charge; no model."""

    name = NAME
    modes = ("last-layer",)
    Config = GridOracleConfig
    overrides = {"features": frozenset()}
    not_private = True
    independent_trials = True

    def plan(self, cfg, mode: str, request: PlanRequest) -> BudgetPlan:
        # nothing is planned against the budget (NOT PRIVATE)
        notes = [f"NOT PRIVATE: {len(cfg.grid())} grid runs, each alone at ε = {request.total_epsilon:g}; "
                 "their composition is NOT within the budget and no model is released"]
        return BudgetPlan(strategy=self.name, total_epsilon=request.total_epsilon, delta=request.delta,
                          accountant=request.accountant, trial_events=list(request.prefix_events), notes=notes,
                          config=cfg)

    def run(self, backend, selector, plan: BudgetPlan, *, mode: str, seed=None, progress=None):
        res = run(backend, selector, plan.config, plan.total_epsilon, plan.delta, seed=seed, accountant=plan.accountant,
                  progress=progress)
        # the best grid point's head (NOT PRIVATE): tune scores it on the reported split and never releases it
        return StrategyOutcome(state=res.state, final_events=[], final_hyperparameters=res.hyperparameters,
                               trials=res.trials, strategy_data={"name": self.name, "label": "NOT PRIVATE",
                                                                 "best": res.to_dict()["hyperparameters"],
                                                                 "best_score": res.score},
                               selection_source=selector.source)
