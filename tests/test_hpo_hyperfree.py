"""HyFreeDP (seed 001): the GeN η update on a quadratic, its guards, loss privatisation, joint accounting."""

from __future__ import annotations

import math

import pytest
import torch

from privtune.accounting import DPSGDEvent, compute_epsilon, joint_noise_multiplier
from privtune.errors import InfeasibleBudgetError, InvalidParameterError
from privtune.hpo import hyperfree as hf
from privtune.hpo.backends import FeatureBackend


def _quadratic(seed=0, d=5):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(d, d, generator=g, dtype=torch.float64)
    A = M @ M.T + d * torch.eye(d, dtype=torch.float64)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)
    return A, w_star, (lambda w: 0.5 * float((w - w_star) @ A @ (w - w_star)))


@pytest.mark.parametrize("probe", [1e-3, 0.05, 0.7])
def test_parabola_fit_is_exact_on_a_quadratic(probe):
    A, w_star, L = _quadratic()
    w = torch.zeros(5, dtype=torch.float64)
    grad = A @ (w - w_star)
    d = grad + 0.3 * torch.ones(5, dtype=torch.float64)  # any descent direction
    L0, Lm, Lp = L(w), L(w - probe * d), L(w + probe * d)
    a, b = hf.fit_parabola(L0, Lm, Lp, probe)
    assert b == pytest.approx(float(grad @ d), rel=1e-9)
    assert a == pytest.approx(float(d @ A @ d), rel=1e-9)
    s = b / a
    # the step minimises L along d: directional derivative zero afterwards
    assert float((A @ (w - s * d - w_star)) @ d) == pytest.approx(0.0, abs=1e-8)
    literal = hf.gen_lr_update(L0, Lm, Lp, probe, clamp_factor=math.inf, smoothing=0.0)
    assert literal.accepted and literal.lr == pytest.approx(s, rel=1e-9)


def test_guards_reject_clamp_and_smooth():
    A, w_star, L = _quadratic(1)
    w = torch.zeros(5, dtype=torch.float64)
    d = A @ (w - w_star)
    lr = 1e-4  # far below the optimum: the proposal is clamped to 2η, then smoothed
    u = hf.gen_lr_update(L(w), L(w - lr * d), L(w + lr * d), lr)
    assert u.accepted and u.proposal > 2 * lr
    assert u.lr == pytest.approx(0.9 * lr + 0.1 * 2 * lr)
    lr = 10.0  # far above: clamped to η/2
    u = hf.gen_lr_update(L(w), L(w - lr * d), L(w + lr * d), lr)
    assert u.accepted and u.lr == pytest.approx(0.9 * lr + 0.1 * lr / 2)
    # swapped probes (the classic sign bug) give b < 0: rejected, η unchanged
    sw = hf.gen_lr_update(L(w), L(w + 1e-2 * d), L(w - 1e-2 * d), 1e-2)
    assert not sw.accepted and sw.lr == 1e-2 and "slope" in sw.reason
    concave = hf.gen_lr_update(1.0, 0.5, 0.6, 0.1)  # Lp + Lm − 2 L0 < 0
    assert not concave.accepted and concave.lr == 0.1 and "curvature" in concave.reason
    nan = hf.gen_lr_update(1.0, float("nan"), 0.6, 0.1)
    assert not nan.accepted and nan.lr == 0.1
    floor = hf.gen_lr_update(1.0, 0.999999, 1.000001 + 1e3, 1e-9, lr_min=1e-8)
    assert floor.lr >= 1e-8


def test_privatized_loss_without_noise_and_its_noise_std():
    losses = torch.tensor([0.1, 0.5, 2.0, 7.0])
    assert hf.privatize_loss(losses, 1.0, 0.0, 4.0) == pytest.approx((0.1 + 0.5 + 1.0 + 1.0) / 4)
    g = torch.Generator().manual_seed(0)
    vals = torch.tensor([hf.privatize_loss(losses, 1.0, 3.0, 4.0, g) for _ in range(4000)])
    assert vals.std().item() == pytest.approx(3.0 * 1.0 / 4.0, rel=0.06)


def test_joint_calibration_meets_the_budget_and_is_joint():
    q, T = 0.02, 150
    sigma, sg, sl, events = hf.calibrate_joint(3.0, 1e-5, q, T, interval=5)
    assert sg == pytest.approx(1.01 * sigma)
    assert sum(e.steps for e in events) == T and events[-1].steps == math.ceil(T / 5)
    eps = compute_epsilon(events, 1e-5)
    assert eps <= 3.0 + 1e-9 and eps == pytest.approx(3.0, rel=5e-3)
    # the update-step event is the joint Gaussian of the gradient and 3 loss releases
    assert events[-1].noise_multiplier == pytest.approx(joint_noise_multiplier(sg, sl, 3), rel=1e-6)
    # accounting the losses as independent releases would claim less: the joint rule is never below it
    indep = [DPSGDEvent(sg, q, T)] + [DPSGDEvent(sl, q, math.ceil(T / 5))] * 3
    assert compute_epsilon(indep, 1e-5) <= eps + 1e-6
    with pytest.raises(InfeasibleBudgetError):
        hf.calibrate_joint(3.0, 1e-5, q, T, gamma_noise=1.0)
    with pytest.raises(InvalidParameterError):
        hf.HyperfreeConfig(gamma_noise=0.99).validate()


def test_hyperfree_on_features_learns_and_records_trajectories():
    g = torch.Generator().manual_seed(0)
    n, d = 2000, 16
    y = torch.randint(0, 2, (n,), generator=g)
    X = torch.randn(n, d, generator=g) + 1.5 * (2 * y[:, None] - 1) * torch.ones(d) / math.sqrt(d)
    X = X / X.norm(dim=1, keepdim=True)
    cfg = hf.HyperfreeConfig()
    p = hf.plan(cfg, 2.0, 1e-5, sample_rate=200 / n, steps=40)
    out = hf.run(FeatureBackend(X, y, 2), cfg, p, mode="last-layer", seed=0)
    traj = out.strategy_data["lr_trajectory"]
    assert len(traj) == 40 and traj[0] == pytest.approx(hf.DEFAULT_LR0["last-layer"], rel=0.2)
    assert all(t > 0 for t in traj)
    assert len(out.final_history["train_loss"]) == math.ceil(40 / 5)
    acc = (out.state.predict(X) == y).float().mean().item()
    assert acc > 0.8
    assert compute_epsilon(out.final_events, 1e-5) <= 2.0 + 1e-9


def test_the_optimizer_option_is_honoured_or_refused(monkeypatch):
    # the direction d comes from privtune.optim.make_optimizer (no hand-written Adam): spy on the factory
    import privtune.optim as optim

    built = []
    real = optim.make_optimizer

    def spy(name, params, **kw):
        built.append((name, kw.get("weight_decay")))
        return real(name, params, **kw)

    monkeypatch.setattr(optim, "make_optimizer", spy)
    with pytest.raises(InvalidParameterError, match="optimizer"):
        hf.HyperfreeConfig(optimizer="nadam").validate()

    gen = torch.Generator().manual_seed(0)
    n = 600
    y = torch.randint(0, 2, (n,), generator=gen)
    X = torch.randn(n, 8, generator=gen) + (2 * y[:, None] - 1) * 0.5
    X = X / X.norm(dim=1, keepdim=True)
    heads = {}
    for opt in ("adamw", "sgd"):
        cfg = hf.HyperfreeConfig(optimizer=opt)
        p = hf.plan(cfg, 2.0, 1e-5, sample_rate=0.2, steps=10)
        out = hf.run(FeatureBackend(X, y, 2), cfg, p, mode="last-layer", seed=0)
        assert out.final_hyperparameters["optimizer"] == opt
        assert built[-1] == (opt, cfg.weight_decay)
        heads[opt] = out.state.weight
    assert not torch.allclose(heads["adamw"], heads["sgd"])  # the option changes what is trained


def test_clipping_defaults_to_auto_s_on_features_and_flat_on_a_model(monkeypatch):
    cfg = hf.HyperfreeConfig()
    assert cfg.clipping_for(True) == "automatic" and cfg.clipping_for(False) == "flat"
    assert hf.HyperfreeConfig(clipping="automatic").clipping_for(False) == "automatic"
    with pytest.raises(InvalidParameterError, match="clipping"):
        hf.HyperfreeConfig(clipping="per-layer").validate()

    # the model path hands the chosen style to the DP step (spy on PrivateGradient)
    from privtune import engine
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset

    seen = []
    real = engine.PrivateGradient

    def spy(*args, **kwargs):
        seen.append(kwargs.get("clipping"))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "PrivateGradient", spy)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        m = load_classifier(make_tiny_text_model(Path(tmp) / "m", sentence_transformers=True), seed=0)
    apply_mode(m, "bitfit", zero_init_head=True)
    data = make_toy_text_dataset(24, seed=0)
    for style, expected in ((None, "flat"), ("automatic", "automatic")):
        hf.train_model_hyperfree(m, data, steps=2, sample_rate=0.5, sigma_g=1.0, sigma_l=5.0,
                                 config=hf.HyperfreeConfig(clipping=style), lr0=1e-3, seed=0)
        assert seen[-1] == expected


# ------------------------------------------------------------------ η placement on a model (issue 15)


def test_eta_placement_on_a_model_is_planned_charged_and_starts_the_run_at_the_best_trial(tmp_path, monkeypatch):
    """From a fixed η0 the guarded rule cannot find the learning-rate scale (≈ 1.1× per update), so on a model
    hyperfree first runs short charged trials at η0 × m; the run starts at the best trial's η."""
    import json

    import privtune
    from privtune.accounting import event_from_dict
    from privtune.hpo import common
    from privtune.models.testing import make_toy_text_files

    files = make_toy_text_files(tmp_path, {"train": ("train.tsv", 120, 0), "public": ("public.tsv", 40, 1),
                                           "dev": ("dev.tsv", 30, 2)})
    real_score = common.Selector.score
    wanted = 4  # the score favours the second η trial (η0 × 2), whatever the trials learned

    def score(self, outputs, label=""):
        s, evs = real_score(self, outputs, label)
        return (1.0 if label == f"hyperfree η trial {wanted - 3} score" else 0.0), evs

    monkeypatch.setattr(common.Selector, "score", score)
    r = privtune.tune(files["train"], eval_data=files["dev"], public_eval_data=files["public"], model=files["model"],
                      mode="bitfit", epochs=2, batch_size=30, epsilon=2.0, delta=1e-3, seed=0, quiet=True,
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run")
    trials = [t for t in r.trials if t["phase"] == "η placement"]
    lr0 = hf.DEFAULT_LR0["bitfit"]
    assert [t["hyperparameters"]["learning_rate"] for t in trials] == pytest.approx(
        [lr0 * m for m in hf.DEFAULT_LR_TRIALS])
    # the final run scales the best trial's total step r = η·T with ε (seed 000's linear rule, capped at the
    # trial's η): η_final = η_trial · min(1, (T_trial/T)·(ε_final/ε_trial)), each run's own ε
    hp, t_steps = r.metrics["hyperparameters"], trials[0]["hyperparameters"]["steps"]
    eps_trial = compute_epsilon([DPSGDEvent(trials[0]["hyperparameters"]["noise_multiplier"],
                                            trials[0]["hyperparameters"]["sample_rate"], t_steps)], 1e-3)
    eps_final = compute_epsilon(list(r.plan.final_events), 1e-3)
    scale = min(1.0, t_steps / hp["steps"] * eps_final / eps_trial)
    assert r.plan.lr_trials["final_scale"] == pytest.approx(scale, rel=1e-6)
    assert hp["learning_rate_initial"] == pytest.approx(lr0 * hf.DEFAULT_LR_TRIALS[1] * scale)
    assert r.history["strategy"]["lr_placement"]["transfer"]["scale"] == pytest.approx(scale, rel=1e-6)
    # the trials were planned (before any data was read) and their events are in the certificate
    assert sum("planned η trial" in e.label for e in r.plan.trial_events) == 3
    cert = json.loads((r.run_dir / "certificate.json").read_text())
    events = [event_from_dict(e) for e in cert["events"]]
    assert sum("η trial" in e.label for e in events) == 3
    assert compute_epsilon(events, 1e-3) <= 2.0 + 1e-9
    assert r.plan.planned_epsilon() <= 2.0 + 1e-9
    assert compute_epsilon(events, 1e-3) <= r.plan.planned_epsilon() * (1 + 1e-9)


def test_eta_transfer_scales_the_total_step_with_epsilon_not_only_with_steps():
    """Seed 000: the best r = η·T grows about linearly with ε, so a trial's η carries to the final run as
    η·(T_t/T)·(ε_f/ε_t).  At full SST-2 size (60,957 phrases, B = 2,048, 90 steps, ε = 1) the trials have ε ≈ 0.087
    each and the final run ≈ 0.988, so keeping r alone (× 9/90 = 0.1, the previous rule: DP-BiTFiT started at
    1.5e-3 and reached 78.6 %) under-steps about 11×; the scale is capped at the trial's own η."""
    cfg = hf.HyperfreeConfig()
    q, T = 2048 / 60957, 90
    trials = hf.plan_lr_trials(cfg, 1.0, 1e-5, sample_rate=q, steps=T, multipliers=(1, 3, 10))
    p = hf.plan(cfg, 1.0, 1e-5, sample_rate=q, steps=T, lr_trials=trials)
    lt = p.lr_trials
    assert lt["steps"] == 9 and lt["trial_epsilon"] == pytest.approx(0.0868, abs=1e-3)
    assert lt["final_epsilon"] == pytest.approx(0.988, abs=2e-3)
    assert 9 / 90 * lt["final_epsilon"] / lt["trial_epsilon"] == pytest.approx(1.14, abs=0.01)
    assert lt["final_scale"] == 1.0  # capped: no η above the winning trial's
    assert "× 1" in p.notes[0] and "ε_f/ε_t" in p.notes[0]
    # shorter trials (5 % of the steps) at the same ε: below the cap, the proportional rule itself
    cfg = hf.HyperfreeConfig(trial_fraction=0.05)
    trials = hf.plan_lr_trials(cfg, 1.0, 1e-5, sample_rate=q, steps=T, multipliers=(1, 3, 10))
    lt = hf.plan(cfg, 1.0, 1e-5, sample_rate=q, steps=T, lr_trials=trials).lr_trials
    eps_t = compute_epsilon([DPSGDEvent(trials["noise_multiplier"], q, 5)], 1e-5)
    assert lt["trial_epsilon"] == pytest.approx(eps_t, rel=1e-6)
    assert lt["final_scale"] == pytest.approx(5 / 90 * lt["final_epsilon"] / eps_t, rel=1e-9)
    assert 0.5 < lt["final_scale"] < 0.7


def test_eta_placement_is_off_on_features_and_when_asked():
    cfg = hf.HyperfreeConfig()
    assert cfg.trial_multipliers("last-layer") == () and cfg.trial_multipliers("bitfit") == hf.DEFAULT_LR_TRIALS
    assert hf.HyperfreeConfig(lr_trials=[]).trial_multipliers("bitfit") == ()
    # full fine-tuning tries η0 × (1, 3): its short trials favoured 10 × η0, which the long run cannot take
    assert cfg.trial_multipliers("full") == (1.0, 3.0) and cfg.trial_multipliers("lora") == hf.DEFAULT_LR_TRIALS
    assert hf.HyperfreeConfig(lr_trials=[1, 10]).trial_multipliers("full") == (1.0, 10.0)  # asked for: kept
    off = hf.plan_lr_trials(cfg, 1.0, 1e-5, sample_rate=0.05, steps=60, multipliers=())
    assert off is None
    on = hf.plan_lr_trials(cfg, 1.0, 1e-5, sample_rate=0.05, steps=60, multipliers=(0.5, 2.0), score_sigma=5.0)
    assert on["steps"] == 6 and len(on["events"]) == 4  # two trials, each with its charged score
    # the trials alone spend about trial_share of ε (their scores on top)
    trial_only = [e for e in on["events"] if isinstance(e, DPSGDEvent)]
    assert compute_epsilon(trial_only, 1e-5) == pytest.approx(cfg.trial_share * 1.0, rel=1e-2)
    with pytest.raises(InvalidParameterError, match="lr_trials"):
        hf.HyperfreeConfig(lr_trials="0.5,2").validate()
    with pytest.raises(InvalidParameterError, match="trial_share"):
        hf.HyperfreeConfig(trial_share=1.0).validate()


def test_the_learning_rate_probe_reuses_the_losses_of_the_step():
    """Each η update releases L0, L− and L+ on the step's batch; L0 (at w_t) is what the step's own forward
    computed, so the probe runs two extra forward passes per update, not three."""
    from privtune import training

    calls = []
    real = training._Loop.per_example_losses

    def counting(self, idx):
        calls.append(int(idx.numel()))
        return real(self, idx)

    g = torch.Generator().manual_seed(0)
    n = 400
    y = torch.randint(0, 2, (n,), generator=g)
    X = torch.randn(n, 8, generator=g) + (2 * y[:, None] - 1) * 0.5
    cfg = hf.HyperfreeConfig()
    p = hf.plan(cfg, 2.0, 1e-5, sample_rate=0.25, steps=10)
    mp = pytest.MonkeyPatch()
    mp.setattr(training._Loop, "per_example_losses", counting)
    try:
        out = hf.run(FeatureBackend(X, y, 2), cfg, p, mode="last-layer", seed=0)
    finally:
        mp.undo()
    updates = len(out.final_history["train_loss"])
    assert updates == 2 and len(calls) == 2 * updates


@pytest.mark.parametrize("scores,chosen,chosen_scaled", [
    ((0.60, 0.70, 0.65), 3.0, 3.0),      # a clear winner
    ((0.56, 0.56, 0.56), 1.0, 10.0),     # all at chance: the final run starts at η0
    ((0.700, 0.703, 0.60), 1.0, 3.0),    # within the tie tolerance of the best: the final η closest to η0
    ((0.50, 0.60, float("nan")), 3.0, 3.0),  # a NaN score loses
])
def test_eta_placement_picks_the_best_trial_and_breaks_ties_towards_eta0(scores, chosen, chosen_scaled):
    from privtune.hpo.backends import TrialRun

    class Backend:
        def run(self, hp, **kw):
            return TrialRun(state=hp["learning_rate"], events=[DPSGDEvent(3.0, 0.1, kw["steps"])], history={})

        def logits(self, state, data):
            return state

    class Selector:
        source, data = "public_validation", None

        def score(self, lr, label=""):
            return dict(zip((1e-3, 3e-3, 1e-2), scores))[round(lr, 6)], []

        def tie_margin(self, score):  # a split so large that only tie_tolerance counts
            return 0.0

    plan = {"multipliers": (1.0, 3.0, 10.0), "steps": 3, "noise_multiplier": 3.0, "sample_rate": 0.1}
    lr, records = hf.place_learning_rate(Backend(), Selector(), hf.HyperfreeConfig(), plan, 1e-3, seed=0)
    assert lr == pytest.approx(1e-3 * chosen) and len(records) == 3
    # with a final scale of 0.1 (e.g. r kept over a 10× longer run) the tie goes to trial η0×10 (final η0)
    lr, _ = hf.place_learning_rate(Backend(), Selector(), hf.HyperfreeConfig(), plan, 1e-3, seed=0, final_scale=0.1)
    assert lr == pytest.approx(1e-3 * chosen_scaled * 0.1)
    assert [r.phase for r in records] == ["η placement"] * 3


def test_eta_placement_treats_differences_within_the_public_splits_noise_as_ties():
    """Measured on the --quick split (2,000 public phrases): trials at 57.95 %, 56.10 %, 56.00 % (all near the
    56 % majority class) made the smallest η win by noise; two standard errors of a difference (≈ 3.1 points
    here) make them ties, and the final η keeps η0's scale."""
    from privtune.hpo.backends import TrialRun
    from privtune.hpo.common import Selector

    labels = torch.tensor([1] * 1120 + [0] * 880)  # 2,000 public labels, 56 % majority
    scores = {1.5e-2: 0.5795, 5e-2: 0.5610, 1.5e-1: 0.5600}

    class Backend:
        def run(self, hp, **kw):
            return TrialRun(state=hp["learning_rate"], events=[DPSGDEvent(3.0, 0.1, kw["steps"])], history={})

        def logits(self, lr, data):  # predictions reaching the trial's accuracy exactly
            k = round(scores[round(lr, 6)] * 2000)
            pred = labels.clone()
            pred[k:] = 1 - pred[k:]
            return pred

    sel = Selector("public_validation", None, labels)
    assert sel.tie_margin(0.5795) == pytest.approx(2 * (2 * 0.5795 * 0.4205 / 2000) ** 0.5)
    plan = {"multipliers": (3.0, 10.0, 30.0), "steps": 6, "noise_multiplier": 5.0, "sample_rate": 0.05}
    lr, records = hf.place_learning_rate(Backend(), sel, hf.HyperfreeConfig(), plan, 5e-3, seed=0,
                                         final_scale=6 / 59)
    assert [r.score for r in records] == pytest.approx([0.5795, 0.5610, 0.5600])
    assert lr == pytest.approx(5e-2 * 6 / 59)  # the tie goes to the final η closest to η0 (not 1.5e-2 · 6/59)
    clear = {1.5e-2: 0.70, 5e-2: 0.56, 1.5e-1: 0.56}  # a 14-point lead is a real winner
    scores.update(clear)
    lr, _ = hf.place_learning_rate(Backend(), sel, hf.HyperfreeConfig(), plan, 5e-3, seed=0, final_scale=6 / 59)
    assert lr == pytest.approx(1.5e-2 * 6 / 59)


def test_tie_margin_counts_a_charged_scores_noise():
    from privtune.hpo.common import Selector, TrialRecord, statistical_ties

    labels = torch.zeros(1000, dtype=torch.long)
    public = Selector("public_validation", None, labels)
    noisy = Selector("private_validation_noisy", None, labels, noise_std=20.0)
    assert noisy.tie_margin(0.8) > public.tie_margin(0.8) > 0  # noise std 20/1000 = 2 points per score
    assert noisy.tie_margin(0.8) == pytest.approx(2 * (2 * (0.8 * 0.2 / 1000 + (20 / 1000) ** 2)) ** 0.5)
    recs = [TrialRecord(index=i, phase="t", score=s, hyperparameters={}, events=[], score_source="public_validation") for i, s in enumerate((0.80, 0.78, 0.75))]
    assert [r.index for r in statistical_ties(recs, public)] == [0, 1]
    assert [r.index for r in statistical_ties(recs, noisy)] == [0, 1, 2]
    assert [r.index for r in statistical_ties(recs, None)] == [0]
