"""Linear-scaling HPO (seed 000): r sampling, decomposition, the r(ε) fit and its guards, the plan."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privtune.accounting import compute_epsilon
from privtune.errors import InfeasibleBudgetError, InvalidParameterError
from privtune.hpo import linear_scaling as ls
from privtune.hpo.backends import FeatureBackend
from privtune.hpo.common import Selector, epsilon_of


def test_fit_reproduces_paper_lines():
    # digest 000 §7.2 item 7: WikiText-2, Enron and SST-2 points from the paper's tables
    e = ls.extrapolate_r([0.2, 0.5], [0.008, 0.02], 1.0)
    assert e.r_star == pytest.approx(0.04)
    assert ls.extrapolate_r([0.2, 0.5], [0.008, 0.02], 3.0).r_star == pytest.approx(0.12)
    assert ls.extrapolate_r([0.1, 0.2], [0.10, 0.58], 0.5).r_star == pytest.approx(2.02)
    assert ls.extrapolate_r([0.1, 0.2], [0.10, 0.58], 1.0).r_star == pytest.approx(4.42)
    sst = ls.extrapolate_r([0.1, 0.2], [0.975, 1.95], 0.88)
    assert sst.slope == pytest.approx(9.75) and sst.intercept == pytest.approx(0.0, abs=1e-9)
    assert sst.fallback is None and sst.clamped is None
    assert sst.amplification == pytest.approx(7.8)


def test_fit_in_mu_space_differs_from_epsilon_space():
    e = ls.extrapolate_r([0.1, 0.2], [1.0, 2.0], 0.88, delta=1e-5, fit_space="epsilon")
    m = ls.extrapolate_r([0.1, 0.2], [1.0, 2.0], 0.88, delta=1e-5, fit_space="mu")
    assert e.amplification == pytest.approx(7.8)
    assert m.amplification == pytest.approx(7.151, rel=2e-3)  # digest 000 §8 D5
    assert m.r_star < e.r_star


def test_negative_slope_falls_back_and_r_star_is_clamped():
    neg = ls.extrapolate_r([0.1, 0.2], [50.0, 10.0], 0.88)
    assert neg.fallback is not None and neg.r_star == pytest.approx(10.0)
    big = ls.extrapolate_r([0.1, 0.2], [10.0, 500.0], 0.88, r_bounds=(0.05, 1500.0))
    assert big.r_star == pytest.approx(1500.0) and "clamped" in big.clamped
    cap = ls.extrapolate_r([0.1, 0.2], [10.0, 100.0], 0.88, proportional_cap=1.0)
    assert cap.r_star == pytest.approx(100.0 * 0.88 / 0.2)
    with pytest.raises(InvalidParameterError):
        ls.extrapolate_r([0.1, 0.1], [1.0, 2.0], 0.88)


def test_fit_on_synthetic_trials_recovers_a_linear_rule():
    # synthetic landscape whose best r is exactly 40·ε: the sweeps' argmax and the line recover it
    rng = np.random.default_rng(0)
    space = ls.SearchSpace(0.01, 10.0, (5, 10, 20, 40, 80, 150))
    best = []
    for eps in (0.1, 0.2):
        rs = ls.sample_r(rng, space.r_min, space.r_max, 400)
        rs = [ls.decompose(r, space, rng)[0] * ls.decompose(r, space, rng)[1] for r in rs]
        score = [-abs(math.log(r / (40 * eps))) for r in rs]
        best.append(rs[int(np.argmax(score))])
    e = ls.extrapolate_r([0.1, 0.2], best, 0.88)
    assert e.r_star == pytest.approx(40 * 0.88, rel=0.1)


def test_sampling_and_decomposition():
    rng = np.random.default_rng(1)
    space = ls.SearchSpace()
    draws = ls.sample_r(rng, 0.05, 150.0, 2000)
    assert min(draws) >= 0.05 and max(draws) <= 150.0
    # log-uniform: about half the draws below the geometric mean
    assert 0.45 < np.mean(np.array(draws) < math.sqrt(0.05 * 150.0)) < 0.55
    for r in [0.05, 0.3, 1.0, 7.7, 99.0, 1500.0]:
        for prefer in ("random", "fewest_steps"):
            lr, T, note = ls.decompose(r, space, rng, prefer)
            assert lr * T == pytest.approx(r) and T in space.steps_grid and note == ""
            assert space.lr_min <= lr * (1 + 1e-9) and lr <= space.lr_max * (1 + 1e-9)
    lr, T, note = ls.decompose(1e-6, space, rng)  # below r_min (the reference code loops forever here)
    assert lr * T == pytest.approx(space.r_min) and "clamped" in note
    lr, T, note = ls.decompose(1e9, space, rng)
    assert lr == pytest.approx(space.lr_max) and T == max(space.steps_grid) and "clamped" in note
    with pytest.raises(InvalidParameterError):
        ls.SearchSpace(1.0, 0.5)


def test_plan_budget_split_matches_the_paper_and_fails_clearly():
    p = ls.plan(ls.LinearScalingConfig(sweep_epsilons=(0.1, 0.2)), 1.0, 1e-5)
    assert p.details["final_epsilon"] == pytest.approx(0.8840, abs=2e-3)  # digest 000 §3.8
    assert p.planned_epsilon() <= 1.0 + 1e-9
    p5 = ls.plan(ls.LinearScalingConfig(sweep_epsilons=(0.1, 0.2)), 0.5, 1e-5)
    assert p5.details["final_epsilon"] == pytest.approx(0.2524, abs=3e-3)
    with pytest.raises(InfeasibleBudgetError, match=r"ε = 0\.4"):
        ls.plan(ls.LinearScalingConfig(sweep_epsilons=(0.1, 0.2)), 0.25, 1e-5)
    # "auto" scales the sweeps down so small totals stay feasible
    pa = ls.plan(ls.LinearScalingConfig(), 0.25, 1e-5)
    assert pa.details["sweep_epsilons"] == [pytest.approx(0.025), pytest.approx(0.05)]


def _blobs(n, d=16, seed=0, shift=2.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    X = torch.randn(n, d, generator=g) + shift * (2 * y[:, None] - 1) * torch.ones(d) / math.sqrt(d)
    return X / X.norm(dim=1, keepdim=True), y


def test_end_to_end_on_features_certificate_is_the_composition():
    X, y = _blobs(1500)
    Xv, yv = _blobs(300, seed=1)
    be = FeatureBackend(X, y, 2)
    sel = Selector("public_validation", Xv, yv, name="public")
    cfg = ls.LinearScalingConfig(steps_grid=(5, 10, 20))
    p = ls.plan(cfg, 1.0, 1e-5)
    out = ls.run(be, sel, cfg, p, seed=0)
    assert len(out.trials) == 6 and be.runs == 7
    events = [e for t in out.trials for e in t.events] + out.final_events
    eps = compute_epsilon(events, 1e-5)
    assert eps <= 1.0 + 1e-9 and eps == pytest.approx(1.0, abs=5e-3)
    assert out.strategy_data["fit"]["space"] == "epsilon"
    lo, hi = out.strategy_data["search_space"]["r_min"], out.strategy_data["search_space"]["r_max"]
    assert lo <= out.strategy_data["r_star"] <= hi
    acc = (be.predict(out.state, Xv) == yv).float().mean().item()
    assert acc > 0.75
    # sweep 2 searches between sweep 1's best r and r_max
    assert all(t.hyperparameters["r"] >= out.strategy_data["best_r"][0] * (1 - 1e-9)
               for t in out.trials if t.phase == "sweep2")


def test_charged_scores_are_in_the_plan_and_the_events():
    X, y = _blobs(800)
    be = FeatureBackend(X, y, 2)
    sel = Selector("train_noisy", X, y, noise_std=10.0, name="train")
    cfg = ls.LinearScalingConfig(steps_grid=(5, 10))
    p = ls.plan(cfg, 2.0, 1e-5, score_event=sel.score_event())
    out = ls.run(be, sel, cfg, p, seed=0)
    events = [e for t in out.trials for e in t.events] + out.final_events
    assert sum(1 for e in events if "score" in e.label) == 6
    assert epsilon_of(events, 1e-5) <= 2.0 + 1e-9
