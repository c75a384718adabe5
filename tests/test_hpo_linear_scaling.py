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


class _LandscapeBackend:
    """A fake backend whose trial score depends only on the trained r = η·T and the trial's per-run ε:
    the best r is exactly 40·ε (a linear rule), so the sweeps' argmax and the fit must recover it."""

    n = 1000

    def __init__(self, mus, epsilons, slope=40.0):
        self.mus, self.epsilons, self.slope = list(mus), list(epsilons), slope
        self.calls = []

    def run(self, hp, *, noise_multiplier, sample_rate, steps, learning_rate, seed=None, label="", **kw):
        from privtune.hpo.backends import TrialRun

        mu = math.sqrt(steps) / noise_multiplier  # full batch: √T/σ-GDP whatever (η, T)
        i = int(np.argmin([abs(math.log(mu / m)) for m in self.mus]))
        r = learning_rate * steps
        self.calls.append({"r": r, "eps": self.epsilons[i], "label": label})
        return TrialRun(state=(r, self.epsilons[i]), events=[ls.GaussianEvent(noise_multiplier, int(steps),
                                                                                label=label)])

    def logits(self, state, labels):
        r, eps = state
        acc = max(0.0, 1.0 - 0.2 * abs(math.log(r / (self.slope * eps))))
        k = int(round(acc * len(labels)))
        pred = labels.clone()
        pred[k:] = 1 - pred[k:]
        return torch.nn.functional.one_hot(pred, 2).float()


def test_fit_on_synthetic_trials_recovers_a_linear_rule():
    # synthetic landscape whose best r is exactly 40·ε: the real sweeps (sampling, decomposition into
    # (η, T), training, scoring, argmax) and the line through their winners must recover r* = 40·ε_f
    cfg = ls.LinearScalingConfig(sweep_epsilons=(0.01, 0.02), runs_per_sweep=150)
    p = ls.plan(cfg, 3.0, 1e-5)
    eps_f = p.final_epsilon
    mus = list(p.mu) + [p.final_mu]
    be = _LandscapeBackend(mus, [0.01, 0.02, eps_f])
    labels = torch.arange(1000) % 2
    out = ls.run(be, Selector("public_validation", labels, labels, name="public"), cfg, p, seed=0)
    # every trial trained exactly the r it reports (η·T, T from the grid)
    for t, call in zip(out.trials, be.calls):
        assert call["r"] == pytest.approx(t.hyperparameters["r"], rel=1e-12)
        assert t.hyperparameters["learning_rate"] * t.hyperparameters["steps"] == pytest.approx(call["r"])
    assert out.strategy_data["best_r"][0] == pytest.approx(40 * 0.01, rel=0.1)
    assert out.strategy_data["best_r"][1] == pytest.approx(40 * 0.02, rel=0.1)
    assert out.strategy_data["r_star"] == pytest.approx(40 * eps_f, rel=0.15)
    assert be.calls[-1]["eps"] == eps_f and be.calls[-1]["r"] == pytest.approx(out.strategy_data["r_star"])
    assert out.strategy_data["extrapolation"]["fallback"] is None


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
    assert p.final_epsilon == pytest.approx(0.8840, abs=2e-3)  # digest 000 §3.8
    assert p.planned_epsilon() <= 1.0 + 1e-9
    p5 = ls.plan(ls.LinearScalingConfig(sweep_epsilons=(0.1, 0.2)), 0.5, 1e-5)
    assert p5.final_epsilon == pytest.approx(0.2524, abs=3e-3)
    with pytest.raises(InfeasibleBudgetError, match=r"ε = 0\.4"):
        ls.plan(ls.LinearScalingConfig(sweep_epsilons=(0.1, 0.2)), 0.25, 1e-5)
    # "auto" scales the sweeps down so small totals stay feasible
    pa = ls.plan(ls.LinearScalingConfig(), 0.25, 1e-5)
    assert list(pa.sweep_epsilons) == [pytest.approx(0.025), pytest.approx(0.05)]


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


class _MinibatchBackend:
    """Fake mini-batch backend: records every run; accuracy grows with η (so r* wants to leave the box)."""

    n = 1000

    def __init__(self):
        self.calls = []

    def run(self, hp, *, noise_multiplier, sample_rate, steps, learning_rate, seed=None, label="", **kw):
        from privtune.accounting import DPSGDEvent
        from privtune.hpo.backends import TrialRun

        self.calls.append({"lr": learning_rate, "steps": steps, "sigma": noise_multiplier, "label": label})
        return TrialRun(state=learning_rate, events=[DPSGDEvent(noise_multiplier, sample_rate, int(steps),
                                                                label=label)])

    def logits(self, lr, labels):
        k = int(round(min(1.0, 0.5 + 10.0 * lr) * len(labels)))
        pred = labels.clone()
        pred[k:] = 1 - pred[k:]
        return torch.nn.functional.one_hot(pred, 2).float()


def _minibatch(cfg, q=0.05, T=40, total=4.0):
    p = ls.plan_minibatch(cfg, total, 1e-5, sample_rate=q, steps=T)
    be = _MinibatchBackend()
    labels = torch.arange(1000) % 2
    out = ls.run_minibatch(be, Selector("public_validation", labels, labels, name="public"), cfg, p, seed=0)
    return p, be, out


def test_minibatch_uses_the_given_lr_bounds_and_clamps_r_star_to_the_searched_range():
    cfg = ls.LinearScalingConfig(lr_bounds=(1e-3, 2e-2))
    p, be, out = _minibatch(cfg)
    T = p.steps
    sweeps, final = be.calls[:-1], be.calls[-1]
    assert len(sweeps) == 6 and all(c["steps"] == T for c in be.calls)
    assert all(1e-3 * (1 - 1e-9) <= c["lr"] <= 2e-2 * (1 + 1e-9) for c in be.calls)  # the user's box, not a default
    # sweep 1 searches [r_min, sweep1_fraction·r_max] exactly (no hidden widening)
    assert all(c["lr"] * T <= 0.1 * 2e-2 * T * (1 + 1e-9) for c in sweeps[:3])
    # accuracy grows with η, so the line extrapolates past the box: r* is clamped to the searched maximum
    assert out.strategy_data["r_star"] == pytest.approx(2e-2 * T)
    assert "clamped to the searched maximum" in out.strategy_data["extrapolation"]["clamped"]
    assert final["lr"] == pytest.approx(2e-2) and final["steps"] == T
    assert out.strategy_data["search_space"]["lr_bounds"] == [1e-3, 2e-2]
    # the final run is exactly the planned one
    assert final["sigma"] == pytest.approx(p.final_noise_multiplier)
    events = [e for t in out.trials for e in t.events] + out.final_events
    assert epsilon_of(events, 1e-5) <= 4.0 + 1e-9


def test_minibatch_default_box_and_refused_full_batch_options():
    p, be, _ = _minibatch(ls.LinearScalingConfig())
    assert all(ls.MINIBATCH_LR_BOUNDS[0] * (1 - 1e-9) <= c["lr"] <= ls.MINIBATCH_LR_BOUNDS[1] * (1 + 1e-9)
               for c in be.calls)
    assert ls.LinearScalingConfig().space().lr_min == 0.01  # the full-batch default is unchanged
    for bad, match in (({"steps_grid": (5, 10)}, "steps_grid"), ({"momentum": 0.5}, "momentum"),
                       ({"free_step": False}, "free_step"), ({"decomposition": "fewest_steps"}, "decomposition"),
                       ({"lr_bounds": (0.1, 0.01)}, "lr_bounds"), ({"sweep1_fraction": 2.0}, "sweep1_fraction")):
        with pytest.raises(InvalidParameterError, match=match):
            ls.plan_minibatch(ls.LinearScalingConfig(**bad), 4.0, 1e-5, sample_rate=0.05, steps=40)
