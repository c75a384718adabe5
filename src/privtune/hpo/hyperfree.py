"""Hyperparameter-free DP training (seed 001: Liu & Bu, "Towards Hyperparameter-Free
Optimization with Differential Privacy", HyFreeDP), with the digest's guards.

* **AUTO-S clipping** on cached features: per-example gradients are normalised,
  g_i/(‖g_i‖ + γ), so there is no clipping threshold to tune (sensitivity ≤ 1).  On a model
  (bitfit, lora, full) the default is flat clipping at C = 1 (same sensitivity), because AUTO-S
  lost about 19 points on DP-BiTFiT of MiniLM at the same noise (``HyperfreeConfig.clipping``).
* **Automatic learning rate** from privatised losses: every K steps the loss is
  privatised at w, w − η·d and w + η·d on the *same* Poisson batch as the gradient
  (L̃ = (Σ clamp(ℓ_i, ±R_l) + σ_l·R_l·N(0, 1)) / B), a parabola is fitted and η moves
  towards its minimiser b/a (GeN, Bu & Xu 2024).
* **Joint accounting** (digest 001 §4.5): the gradient and the P loss releases of an
  update step use the same batch, so that step is one Poisson-subsampled Gaussian with
  σ_eff = (σ_g⁻² + P·σ_l⁻²)^(−1/2) (:func:`privtune.accounting.joint_noise_multiplier`);
  σ_g = γ·σ and σ_eff is calibrated inside the composition (no bisection loop needed).
  The paper's "independent releases" rule under-reports ε by about 2× and is not offered.
* **Guards** (digest 001 §3.3/§9 D4, from the GeN reference code): accept a fit only if
  a > 0 and b > 0; clamp the proposal to [η/2, 2η]; smooth η ← 0.9·η + 0.1·proposal;
  floor η; R_l ← max(R_min, L0 + Lm + Lp) (the paper's "conservative" rule).
* **η0 that does not stall heads**: the paper's η0 = 1e-4 never moves a zero-initialised
  head (pilot, digest §8.3), so the default η0 depends on what is trained: 0.1 for a
  head on features, DP-BiTFiT's 5e-3 and DP full fine-tuning's 5e-4 (seed 004, Table 8: the
  DP learning rates used with DP-Adam(W); BiTFiT needs about 10× the full rate, and the
  zero-initialised head trains with them), 1e-3 for LoRA.  The guarded update moves η by at
  most about 1.1× per update, so η0 must already be in the right decade: measured on SST-2
  (2,000 phrases, ε = 1, `bench/hpo.py --bitfit`), DP-BiTFiT from η0 = 1e-4 stayed at chance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from privtune._validation import check_int, check_real
from privtune.accounting.events import DPSGDEvent
from privtune.engine.private_gradient import CLIPPINGS
from privtune.errors import InfeasibleBudgetError
from privtune.hpo._heads import LinearHead, clipped_gradient_sum, per_example_losses
from privtune.hpo.common import BudgetPlan, epsilon_of
from privtune.engine.sampling import make_generator, poisson_indices

NAME = "hyperfree"
#: base optimizers whose direction d the learning-rate rule scales (see :class:`HyperfreeConfig`)
OPTIMIZERS = ("adamw", "adam", "sgd")

#: default initial learning rate per fine-tuning mode (digest 001 §9 D22; seed 004 Table 8 for bitfit/full)
DEFAULT_LR0 = {"last-layer": 1e-1, "features": 1e-1, "bitfit": 5e-3, "full": 5e-4, "lora": 1e-3, "two-phase": 5e-4}


# --------------------------------------------------------------------------------------
# the η update rule and loss privatisation (pure functions, unit-tested)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LRUpdate:
    """One GeN-DP learning-rate update: the new η and why."""

    lr: float
    accepted: bool
    a: float
    b: float
    proposal: float | None
    reason: str


def fit_parabola(L0: float, Lm: float, Lp: float, lr: float) -> tuple[float, float]:
    """Directional slope b and curvature a from losses at w, w − η·d (Lm) and w + η·d (Lp).

    ``L(w − s·d) ≈ L0 − b·s + a·s²/2``, so ``b = (Lp − Lm)/(2η)`` and
    ``a = (Lp + Lm − 2·L0)/η²``; the minimiser along d is ``s* = b/a``.
    """
    b = (Lp - Lm) / (2.0 * lr)
    a = (Lp + Lm - 2.0 * L0) / (lr * lr)
    return a, b


def gen_lr_update(L0: float, Lm: float, Lp: float, lr: float, *, clamp_factor: float = 2.0,
                  smoothing: float = 0.9, lr_min: float = 1e-8, lr_max: float | None = None) -> LRUpdate:
    """The guarded GeN-DP learning-rate update.

    Accept only a > 0 and b > 0 (a convex fit along a descent direction); clamp the
    proposal b/a to [η/c, c·η]; smooth ``η ← smoothing·η + (1 − smoothing)·clamped``;
    keep η within [lr_min, lr_max].  A rejected fit keeps η unchanged.
    ``smoothing=0, clamp_factor=inf`` gives the literal (unguarded) update.
    """
    a, b = fit_parabola(L0, Lm, Lp, lr)
    if not (math.isfinite(a) and math.isfinite(b)):
        return LRUpdate(lr, False, a, b, None, "non-finite fit")
    if a <= 0:
        return LRUpdate(lr, False, a, b, None, "curvature a ≤ 0")
    if b <= 0:
        return LRUpdate(lr, False, a, b, None, "slope b ≤ 0 (not a descent direction)")
    prop = b / a
    clamped = min(max(prop, lr / clamp_factor), lr * clamp_factor)
    new = smoothing * lr + (1.0 - smoothing) * clamped
    new = max(lr_min, new)
    if lr_max is not None:
        new = min(lr_max, new)
    reason = "accepted" if clamped == prop else "accepted (clamped)"
    return LRUpdate(new, True, a, b, prop, reason)


def privatize_loss(losses: torch.Tensor, R_l: float, noise_multiplier: float, expected_batch_size: float,
                   generator: torch.Generator | None = None) -> float:
    """Eq. (7) of seed 001: (Σ clamp(ℓ_i, −R_l, R_l) + σ_l·R_l·N(0, 1)) / B.

    The clipped sum has add/remove sensitivity R_l, so this is a Gaussian mechanism with
    noise multiplier ``noise_multiplier`` (σ_l).  B is the *expected* batch size.
    """
    s = float(losses.clamp(-R_l, R_l).sum().item())
    if noise_multiplier > 0:
        s += noise_multiplier * R_l * float(torch.randn((), generator=generator, dtype=torch.float64).item())
    return s / expected_batch_size


# --------------------------------------------------------------------------------------
# joint calibration
# --------------------------------------------------------------------------------------


@dataclass
class HyperfreeConfig:
    """Parameters of HyFreeDP.

    interval : K, the η update interval in steps (default 5).
    probes : P, loss releases per update (3: {−η, 0, +η}).
    gamma_noise : γ = σ_g/σ (1.01): the share of the budget freed for the losses.
    lr0 : initial η, or None for the per-mode default (:data:`DEFAULT_LR0`).
    R_l0, R_min : initial and minimum loss clipping threshold.
    clamp_factor, smoothing, lr_min : guards of the update (see :func:`gen_lr_update`).
    batch_size, epochs : expected batch size and epochs; None → :func:`privtune.hpo.recommend`.
    optimizer : the base optimizer giving the direction d: ``"adamw"`` (default; 0.9/0.999, decoupled
        weight decay ``weight_decay``), ``"adam"`` (0.9/0.999, ``weight_decay`` as an L2 term added to
        the noisy gradient) or ``"sgd"`` (d = noisy gradient + ``weight_decay``·w).
    auto_gamma : AUTO-S stability constant (0.01).
    clipping : per-example clipping, both at sensitivity 1: ``"automatic"`` (AUTO-S, the paper's choice)
        or ``"flat"`` (Abadi, C = 1).  ``None`` (default) = AUTO-S for a head on cached features and
        flat for a model (bitfit, lora, full): on DP-BiTFiT of MiniLM (2,000 SST-2 phrases, σ = 0.78,
        24 steps) AUTO-S reached 56.5 % dev accuracy against 75.2 % for flat clipping at the same σ
        (docs/strategies/hyperfree.md has the command).
    """

    interval: int = 5
    probes: int = 3
    gamma_noise: float = 1.01
    lr0: float | None = None
    R_l0: float = 1.0
    R_min: float = 1e-3
    clamp_factor: float = 2.0
    smoothing: float = 0.9
    lr_min: float = 1e-8
    batch_size: int | None = None
    epochs: float = 3.0
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    auto_gamma: float = 0.01
    clipping: str | None = None

    def clipping_for(self, on_features: bool) -> str:
        """The clipping style a run uses (see ``clipping``)."""
        if self.clipping is not None:
            return self.clipping
        return "automatic" if on_features else "flat"

    def validate(self) -> None:
        check_int(self.interval, "interval", low=1)
        check_int(self.probes, "probes", low=3, fix="GeN needs at least the 3 points {−η, 0, +η}.")
        check_real(self.gamma_noise, "gamma_noise", low=1.0,
                   fix="γ = σ_g/σ must exceed 1 to leave budget for the loss releases; e.g. 1.01.")
        from privtune._validation import check_choice

        check_choice(self.optimizer, "optimizer", OPTIMIZERS)
        if self.clipping is not None:
            check_choice(self.clipping, "clipping", CLIPPINGS)
        check_real(self.weight_decay, "weight_decay", low=0.0, low_inclusive=True)


def calibrate_joint(total_epsilon: float, delta: float, sample_rate: float, steps: int, *, interval: int = 5,
                    probes: int = 3, gamma_noise: float = 1.01, spent_events=(), accountant: str = "pld",
                    sampling: str = "poisson") -> tuple[float, float, float, list]:
    """σ, σ_g, σ_l and the events of a HyFreeDP run meeting (ε, δ) with joint accounting.

    σ is the gradient-only σ for the budget; σ_g = γ·σ; n_upd = ⌈T/K⌉ update steps are
    each one subsampled Gaussian with σ_eff, calibrated inside the composition with the
    T − n_upd plain steps at σ_g; σ_l = sqrt(P / (σ_eff⁻² − σ_g⁻²)).
    Returns (σ, σ_g, σ_l, events).
    """
    import privtune.accounting as acct

    if gamma_noise <= 1.0:
        raise InfeasibleBudgetError(
            f"`gamma_noise` must be > 1 (got {gamma_noise!r}): with σ_g ≤ σ no budget is left for the loss releases."
        )
    spent = list(spent_events)
    sigma = float(acct.calibrate_noise_multiplier(total_epsilon, delta, sample_rate, steps, accountant=accountant,
                                                  spent_events=spent, sampling=sampling))
    sigma_g = gamma_noise * sigma
    n_upd = math.ceil(steps / interval)
    plain = steps - n_upd
    base = [DPSGDEvent(sigma_g, sample_rate, plain, sampling=sampling, label="hyperfree gradient steps")] if plain else []
    sigma_eff = float(acct.calibrate_noise_multiplier(total_epsilon, delta, sample_rate, n_upd, accountant=accountant,
                                                      spent_events=spent + base, sampling=sampling))
    if sigma_eff >= sigma_g:
        raise InfeasibleBudgetError(
            f"HyFreeDP calibration: the gradient steps at σ_g = {sigma_g:.4g} leave no budget for the loss releases "
            f"(σ_eff = {sigma_eff:.4g} ≥ σ_g). Increase `gamma_noise` (e.g. 1.05) or `interval`."
        )
    sigma_l = math.sqrt(probes / (sigma_eff ** -2 - sigma_g ** -2))
    check = float(acct.joint_noise_multiplier(sigma_g, sigma_l, probes))
    sigma_eff = max(sigma_eff, check)  # the event uses the joint σ actually implied by (σ_g, σ_l)
    events = base + [DPSGDEvent(sigma_eff, sample_rate, n_upd, sampling=sampling,
                                label=f"hyperfree update steps (gradient σ_g={sigma_g:.4g} + {probes} losses "
                                      f"σ_l={sigma_l:.4g}, joint)")]
    return sigma, sigma_g, sigma_l, events


def plan(config: HyperfreeConfig, total_epsilon: float, delta: float, *, sample_rate: float, steps: int,
         accountant: str = "pld", prefix_events=()) -> BudgetPlan:
    """Plan a HyFreeDP run: one run, no trials; all events fixed before data is read."""
    config.validate()
    sigma, sigma_g, sigma_l, events = calibrate_joint(
        total_epsilon, delta, sample_rate, steps, interval=config.interval, probes=config.probes,
        gamma_noise=config.gamma_noise, accountant=accountant, spent_events=prefix_events,
        sampling="full_batch" if sample_rate >= 1.0 else "poisson")
    p = BudgetPlan(strategy=NAME, total_epsilon=total_epsilon, delta=delta, accountant=accountant,
                   trial_events=list(prefix_events), final_events=events, final_noise_multiplier=sigma_g)
    p.details = {"sigma": sigma, "sigma_g": sigma_g, "sigma_l": sigma_l, "sample_rate": sample_rate,
                 "steps": steps, "interval": config.interval, "probes": config.probes}
    p.notes = [
        f"one run: T = {steps} Poisson steps at q = {sample_rate:.4g}; gradient-only σ = {sigma:.4g}",
        f"σ_g = {config.gamma_noise:g}·σ = {sigma_g:.4g}; loss releases σ_l = {sigma_l:.4g} every "
        f"{config.interval} steps ({config.probes} per update, joint accounting on the shared batch)",
        f"planned ε = {epsilon_of(list(prefix_events) + events, delta, accountant):.4g}",
    ]
    return p


# --------------------------------------------------------------------------------------
# HyFreeDP on a linear head over cached features
# --------------------------------------------------------------------------------------


def _report_step(progress, hist: dict, t: int, batch: int, eval_fn, eval_every: int, steps: int, evaluate) -> None:
    """After step t: public-split accuracy for the curves (every ``eval_every`` steps and at the end)
    and one progress update (batch size; the privatised loss L0 when step t released one)."""
    if eval_fn is not None and eval_every and ((t + 1) % eval_every == 0 or t + 1 == steps):
        hist["eval"].append({"step": t + 1, "accuracy": float(evaluate())})
    if progress is not None:
        fresh = bool(hist["train_loss_step"]) and hist["train_loss_step"][-1] == t
        progress.advance(1, examples=batch, loss=hist["train_loss"][-1] if fresh else None)


def _update_lr(L0: float, Lm: float, Lp: float, lr: float, t: int, config, hist: dict) -> tuple[float, float]:
    """One learning-rate update from the three privatised losses (guards of digest 001 §11), recorded in
    ``hist``; returns the new η and the new loss clipping bound R_l (the sum of the three losses)."""
    upd = gen_lr_update(L0, Lm, Lp, lr, clamp_factor=config.clamp_factor, smoothing=config.smoothing,
                        lr_min=config.lr_min)
    R_l = max(config.R_min, L0 + Lm + Lp)
    hist["train_loss"].append(L0)
    hist["train_loss_step"].append(t)
    hist["R_l"].append(R_l)
    hist["accepted"].append(upd.accepted)
    hist["reasons"].append(upd.reason)
    return upd.lr, R_l


def _adam_direction(g: torch.Tensor, state: dict, key: str, t: int, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay: float = 0.0, w: torch.Tensor | None = None) -> torch.Tensor:
    """AdamW direction d (a step is w ← w − η·d); updates the moments once."""
    m = state.setdefault(key + ".m", torch.zeros_like(g))
    v = state.setdefault(key + ".v", torch.zeros_like(g))
    m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    mh = m / (1 - betas[0] ** t)
    vh = v / (1 - betas[1] ** t)
    d = mh / (vh.sqrt() + eps)
    if weight_decay and w is not None:
        d = d + weight_decay * w
    return d


def _direction(config, g: torch.Tensor, state: dict, key: str, t: int, w: torch.Tensor | None) -> torch.Tensor:
    """The base optimizer's step direction d (a step is w ← w − η·d) for ``config.optimizer``."""
    wd = float(config.weight_decay) if w is not None else 0.0
    if config.optimizer == "adamw":
        return _adam_direction(g, state, key, t, weight_decay=wd, w=w)
    if config.optimizer == "adam":  # L2 in the gradient (torch.optim.Adam's weight_decay)
        return _adam_direction(g + wd * w if wd else g, state, key, t)
    return g + wd * w if wd else g.clone()  # sgd


def train_head_hyperfree(X: torch.Tensor, y: torch.Tensor, num_classes: int, *, steps: int, sample_rate: float,
                         sigma_g: float, sigma_l: float, config: HyperfreeConfig, lr0: float, seed: int | None = None,
                         bias: bool = True, progress=None, eval_fn=None, eval_every: int = 0):
    """HyFreeDP (Algorithm 1 of seed 001, guarded) on a zero-initialised linear head.

    Returns (head, history) where history holds the η and R_l trajectories, the privatised
    losses L0 (the only training-loss curve released) and the acceptance log.
    ``progress`` (anything with :meth:`privtune.report.progress.Progress.advance`) gets one update
    per step: the batch size and, at update steps, the privatised loss L0 (charged; never a loss
    computed without noise).  ``eval_fn(head)`` (accuracy on a PUBLIC split, never private data)
    is recorded in ``history["eval"]`` every ``eval_every`` steps and at the end.
    """
    n, d = X.shape
    gen = make_generator(seed)  # OS-seeded unless a seed is given
    head = LinearHead.zeros(d, num_classes, bias=bias, dtype=X.dtype)
    B = sample_rate * n
    lr, R_l = float(lr0), float(config.R_l0)
    state: dict = {}
    hist = {"step": [], "lr": [], "train_loss": [], "train_loss_step": [], "R_l": [], "accepted": [],
            "reasons": [], "train_loss_label": "privatised loss L0 (charged, joint accounting)", "eval": []}
    for t in range(int(steps)):
        idx = poisson_indices(n, sample_rate, gen)  # P(included) ≤ q exactly (integer threshold)
        Xb, yb = X[idx], y[idx]
        if idx.numel():
            gW, gb, _ = clipped_gradient_sum(head, Xb, yb, clip=1.0, clipping=config.clipping_for(True),
                                              gamma=config.auto_gamma)
        else:
            gW, gb = torch.zeros_like(head.weight), torch.zeros_like(head.bias) if head.bias is not None else None
        gW = (gW + sigma_g * torch.randn(gW.shape, generator=gen, dtype=gW.dtype)) / B
        dW = _direction(config, gW, state, "W", t + 1, w=head.weight)
        db = None
        if gb is not None:
            gb = (gb + sigma_g * torch.randn(gb.shape, generator=gen, dtype=gb.dtype)) / B
            db = _direction(config, gb, state, "b", t + 1, w=None)  # no weight decay on the bias
        if t % config.interval == 0:
            def loss_at(sign: float) -> torch.Tensor:
                h = LinearHead(head.weight + sign * lr * dW, None if head.bias is None else head.bias + sign * lr * db)
                return per_example_losses(h, Xb, yb) if idx.numel() else torch.zeros(0)
            L0 = privatize_loss(loss_at(0.0), R_l, sigma_l, B, gen)
            Lm = privatize_loss(loss_at(-1.0), R_l, sigma_l, B, gen)
            Lp = privatize_loss(loss_at(+1.0), R_l, sigma_l, B, gen)
            lr, R_l = _update_lr(L0, Lm, Lp, lr, t, config, hist)
        head.weight -= lr * dW
        if head.bias is not None:
            head.bias -= lr * db
        hist["step"].append(t + 1)
        hist["lr"].append(lr)
        _report_step(progress, hist, t, int(idx.numel()), eval_fn, eval_every, int(steps), lambda: eval_fn(head))
    n_upd = len(hist["accepted"])
    hist["acceptance_rate"] = (sum(hist["accepted"]) / n_upd) if n_upd else 0.0
    return head, hist


def run(backend, config: HyperfreeConfig, p: BudgetPlan, *, mode: str = "last-layer", seed: int | None = None,
        progress=None):
    """Execute a planned HyFreeDP run on ``backend`` (features or a model)."""
    from privtune.hpo.common import StrategyOutcome

    lr0 = config.lr0 if config.lr0 is not None else DEFAULT_LR0.get(mode, 1e-4)
    d = p.details
    if progress:
        progress(f"hyperfree: T={d['steps']} q={d['sample_rate']:.4g} σ_g={d['sigma_g']:.4g} σ_l={d['sigma_l']:.4g} "
                 f"η0={lr0:g}")
    state, hist = backend.run_hyperfree(steps=d["steps"], sample_rate=d["sample_rate"], sigma_g=d["sigma_g"],
                                        sigma_l=d["sigma_l"], config=config, lr0=lr0, seed=seed)
    lr_final = hist["lr"][-1] if hist["lr"] else lr0
    if progress:
        progress(f"hyperfree: η {lr0:g} → {lr_final:.4g}, acceptance {hist.get('acceptance_rate', 0):.0%}")
    data = {"name": NAME, "lr_trajectory": hist["lr"], "R_l_trajectory": hist.get("R_l", []),
            "acceptance_rate": hist.get("acceptance_rate"), "lr0": lr0, "sigma": d["sigma"],
            "sigma_g": d["sigma_g"], "sigma_l": d["sigma_l"], "interval": config.interval, "probes": config.probes,
            "accounting": "joint (shared batch): update steps are one Poisson Gaussian with σ_eff"}
    if hist.get("acceptance_rate", 1.0) < 0.25:
        data["warning"] = (f"only {hist.get('acceptance_rate', 0):.0%} of η fits accepted: the run was close to "
                           f"constant η ≈ η0 = {lr0:g}")
    hp = {"learning_rate_initial": lr0, "learning_rate_final": lr_final, "steps": d["steps"],
          "sample_rate": d["sample_rate"], "batch_size": round(d["sample_rate"] * backend.n),
          "noise_multiplier": d["sigma_g"], "loss_noise_multiplier": d["sigma_l"],
          "clipping": config.clipping_for(backend.kind != "model"),
          "optimizer": config.optimizer, "interval": config.interval}
    return StrategyOutcome(state=state, final_events=list(p.final_events), final_hyperparameters=hp, trials=[],
                           strategy_data=data, final_history=hist, selection_source="none")


# --------------------------------------------------------------------------------------
# HyFreeDP on a model (BiTFiT / LoRA / full), on privtune's engine
# --------------------------------------------------------------------------------------


def train_model_hyperfree(model, train_set, *, steps: int, sample_rate: float, sigma_g: float, sigma_l: float,
                          config: HyperfreeConfig, lr0: float, seed: int | None = None,
                          max_physical_batch_size: int = 32, progress=None, eval_fn=None, eval_every: int = 0):
    """HyFreeDP on a :class:`privtune.models.Classifier` whose trainable parameters are set.

    One backward per step through :class:`privtune.engine.PrivateGradient` (clipping
    ``config.clipping_for(False)``: flat at C = 1 by default, AUTO-S on request; noise σ_g);
    the base optimizer (``config.optimizer``: AdamW by default, Adam or SGD) gives the direction d via a
    single ``opt.step()`` (read back as
    d = (w_t − w_{t+1})/η); every K steps the losses at w_t, w_t − η·d and w_t + η·d are
    evaluated on the same batch in eval mode, privatised and fitted, and the step is re-applied
    with the new η.  Returns (model, history).  ``progress``, ``eval_fn(model)`` and ``eval_every``
    as in :func:`train_head_hyperfree` (the curve split must be PUBLIC; evaluation runs with the
    engine's hooks paused and does not touch any generator of the run).
    """
    import torch.nn.functional as F

    from privtune.engine import PoissonSampler, PrivateGradient

    labels = torch.as_tensor(train_set.labels).long()
    n = len(train_set)
    B = sample_rate * n
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr0, betas=(0.9, 0.999), weight_decay=config.weight_decay)
    elif config.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr0, betas=(0.9, 0.999), weight_decay=config.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr0, weight_decay=config.weight_decay)
    pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=sigma_g, expected_batch_size=B,
                         clipping=config.clipping_for(False), gamma=config.auto_gamma,
                         seed=None if seed is None else seed + 1)  # never the sampler's stream
    sampler = PoissonSampler(n, sample_rate, seed=seed)  # .sample(): one batch each, for any number of steps
    gen = make_generator(seed, offset=99)  # loss-release noise; OS-seeded unless a seed is given
    lr, R_l = float(lr0), float(config.R_l0)
    hist = {"step": [], "lr": [], "train_loss": [], "train_loss_step": [], "R_l": [], "accepted": [],
            "reasons": [], "train_loss_label": "privatised loss L0 (charged, joint accounting)", "eval": []}

    def evaluate_public():
        with torch.no_grad(), pg.paused():
            return eval_fn(model)

    def losses_at(idx) -> torch.Tensor:
        out = []
        with torch.no_grad(), pg.paused():
            for s in range(0, len(idx), max_physical_batch_size):
                part = idx[s:s + max_physical_batch_size]
                out.append(F.cross_entropy(model(**model.encode(train_set, part)).float(), labels[part],
                                           reduction="none"))
        return torch.cat(out) if out else torch.zeros(0)

    try:
        for t in range(int(steps)):
            idx = sampler.sample()
            model.train()
            for s in range(0, len(idx), max_physical_batch_size):
                part = idx[s:s + max_physical_batch_size]
                logits = model(**model.encode(train_set, part))
                pg.backward(F.cross_entropy(logits.float(), labels[part], reduction="none"))
            pg.release()
            w0 = [p.detach().clone() for p in params]
            for gpar in opt.param_groups:
                gpar["lr"] = lr
            opt.step()
            d = [(a - p.detach()) / lr for a, p in zip(w0, params)]
            if t % config.interval == 0:
                model.eval()

                def at(sign: float):
                    with torch.no_grad():
                        for p, a, dd in zip(params, w0, d):
                            p.copy_(a + sign * lr * dd)
                    return privatize_loss(losses_at(idx), R_l, sigma_l, B, gen)

                L0, Lm, Lp = at(0.0), at(-1.0), at(+1.0)
                lr, R_l = _update_lr(L0, Lm, Lp, lr, t, config, hist)
                with torch.no_grad():  # apply the step with the (possibly new) η
                    for p, a, dd in zip(params, w0, d):
                        p.copy_(a - lr * dd)
            hist["step"].append(t + 1)
            hist["lr"].append(lr)
            _report_step(progress, hist, t, int(len(idx)), eval_fn, eval_every, int(steps), evaluate_public)
    finally:
        pg.close()
        for p in params:
            p.grad = None
    n_upd = len(hist["accepted"])
    hist["acceptance_rate"] = (sum(hist["accepted"]) / n_upd) if n_upd else 0.0
    return model, hist
