"""Hyperparameter-free DP training (Liu & Bu, "Towards Hyperparameter-Free
Optimization with Differential Privacy", HyFreeDP), with added guards.

* **AUTO-S clipping** on cached features: per-example gradients are normalised,
  g_i/(‖g_i‖ + γ), so there is no clipping threshold to tune (sensitivity ≤ 1).  On a model
  (bitfit, lora, full) the default is flat clipping at C = 1 (same sensitivity), because AUTO-S
  lost about 19 points on DP-BiTFiT of MiniLM at the same noise (``HyperfreeConfig.clipping``).
* **Automatic learning rate** from privatised losses: every K steps the loss is
  privatised at w, w − η·d and w + η·d on the *same* Poisson batch as the gradient
  (L̃ = (Σ clamp(ℓ_i, ±R_l) + σ_l·R_l·N(0, 1)) / B), a parabola is fitted and η moves
  towards its minimiser b/a (GeN, Bu & Xu 2024).
* **Joint accounting**: the gradient and the P loss releases of an
  update step use the same batch, so that step is one Poisson-subsampled Gaussian with
  σ_eff = (σ_g⁻² + P·σ_l⁻²)^(−1/2) (:func:`privtune.accounting.joint_noise_multiplier`);
  σ_g = γ·σ and σ_eff is calibrated inside the composition (no bisection loop needed).
  The paper's "independent releases" rule under-reports ε by about 2× and is not offered.
* **Guards** (from the GeN reference code): accept a fit only if
  a > 0 and b > 0; clamp the proposal to [η/2, 2η]; smooth η ← 0.9·η + 0.1·proposal;
  floor η; R_l ← max(R_min, L0 + Lm + Lp) (the paper's "conservative" rule).
* **η placement on a model** (bitfit, lora, full; privtune's addition): the guarded update
  moves η by at most about 1.1× per update, so from a fixed η0 a run cannot find the learning-rate
  *scale*.  Before the run, ``len(lr_trials)`` short charged trials (each ``trial_fraction`` of the
  final run's steps, at the final run's Poisson rate q, so at the same expected batch) train from η0·m
  for each multiplier m; the best by the selection score (public split: free; else a charged noisy
  score) gives the final run's η0 by the linear scaling rule of Panda et al. (the best r = η·T grows with ε:
  η·(T_t/T)·(ε_f/ε_t), at most the trial's η; :func:`lr_transfer`), which the guarded rule then refines.  The trials' events and
  scores are planned with the rest (they spend ``trial_share`` of ε), before any data is read.
* **η0 that does not stall heads**: the paper's η0 = 1e-4 never moves a zero-initialised
  head (measured in a pilot), so the default η0 depends on what is trained: 0.1 for a
  head on features, DP-BiTFiT's 5e-3 (Bu et al., DP-BiTFiT, Table 8: the DP learning rates used with
  DP-Adam(W); the zero-initialised head trains with them) and 5e-3 for the head of DP full
  fine-tuning, whose pre-trained weights step at α·η (α = 0.1: the pre-trained-layer multiplier of
  Mehta et al. (large-scale transfer), :data:`privtune.finetune.modes.DEFAULT_BACKBONE_LR_SCALES`), 1e-3
  for LoRA.  The guarded update moves η by at most about 1.1× per update, so η0 must already be in the
  right decade: measured on SST-2 (2,000 phrases, ε = 1, `bench/hpo.py --bitfit`), DP-BiTFiT from
  η0 = 1e-4 stayed at chance.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import privtune.accounting as acct
from privtune._validation import check_backbone_lr_scale, check_choice, check_int, check_real
from privtune.accounting.events import DPSGDEvent, GaussianEvent
from privtune.engine.mechanisms import noisy_scalar
from privtune.engine.private_gradient import CLIPPINGS
from privtune.engine.sampling import make_generator
from privtune.finetune.modes import default_backbone_lr_scale
from privtune.errors import InfeasibleBudgetError, InvalidParameterError
from privtune.hpo.common import (
    TUNABLE_MODES,
    BudgetPlan,
    PlanRequest,
    Strategy,
    StrategyOutcome,
    TrialRecord,
    choose_best,
    data_kind,
    epsilon_of,
    minibatch_schedule,
    noise_seed,
    set_override,
    statistical_ties,
)
from privtune.hpo.backends import HookContext, RunHooks
from privtune.training import LoopHook, fit, public_size
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec

NAME = "hyperfree"
#: base optimizers whose direction d the learning-rate rule scales (see :class:`HyperfreeConfig`)
OPTIMIZERS = ("adamw", "adam", "sgd")

#: multipliers of the mode's η0 tried by the η-placement trials on a model (HyperfreeConfig.lr_trials).  With
#: the default trial length and share the final run starts at the winning trial's η (:func:`lr_transfer`), so
#: the grid brackets η0 from above (DP-BiTFiT: 5e-3, 1.5e-2, 5e-2; bench/sst2.py's fixed 1e-2 lies between the
#: first two; short trials favour the larger η).  The earlier grid (3, 10, 30) with r kept (final η = trial
#: η·T_t/T) started full-size DP-BiTFiT at 1.5e-3: 78.6 % dev at ε = 1
DEFAULT_LR_TRIALS = (1.0, 3.0, 10.0)
#: the modes whose default grid differs.  Full fine-tuning tries η0 × (1, 3) only: its short trials favoured
#: 10 × η0 where the long run cannot take it (20,000 SST-2 phrases, ε = 1: the 6-step trials chose 5e-2 and
#: the run reached 66.3 %; from η0 = 5e-3 without trials, 80.4 %), and on 60,957 phrases the trials chose
#: 3 × η0 at every ε (84.4 / 85.8 / 85.4 % at ε = 1 / 3 / 8), 10 × η0 tying at ε = 1 and losing at 3 and 8
DEFAULT_LR_TRIALS_BY_MODE = {"full": (1.0, 3.0)}
#: the fewest steps of one η-placement trial
MIN_TRIAL_STEPS = 3

#: default initial learning rate per fine-tuning mode (Bu et al. (DP-BiTFiT), Table 8 for bitfit/full)
#: η0 by mode; for full fine-tuning the head's rate (the pre-trained weights step at α·η: DEFAULT_BACKBONE_LR_SCALES)
DEFAULT_LR0 = {"last-layer": 1e-1, "features": 1e-1, "bitfit": 5e-3, "full": 5e-3, "lora": 1e-3, "two-phase": 5e-4}
#: η0 of a head on a frozen image backbone's features (L2-normalised per example, finetune.head_input_normalization).
#: Chosen on the public split of the Fashion-MNIST bench (EfficientNet-Lite0, 2,000 images declared public): at
#: ε = 3 the public accuracy was 83.6 % with η0 = 0.1 and 85.6 % with 0.3 (docs/strategies/hyperfree.md); one
#: dataset and one backbone, so a default, not a law: ``strategy_options: {lr0: ...}`` sets another.
IMAGE_HEAD_LR0 = 3e-1
#: epochs of a run when none are given (batch size and steps follow from them: :func:`privtune.hpo.recommend`)
DEFAULT_EPOCHS = 3.0
#: epochs of a head on a frozen image backbone's cached features (a pass costs seconds there).  Chosen on the
#: public split of the Fashion-MNIST bench (EfficientNet-Lite0 at 128 px, 2,000 images declared public, seed 0):
#: public accuracy with 3 / 10 / 20 epochs 86.9 / 87.4 / 87.4 % at ε = 1, 87.2 / 88.7 / 88.7 % at ε = 3,
#: 88.2 / 89.2 / 89.5 % at ε = 8; one dataset and one backbone, so a default, not a law (``epochs=`` sets another)
IMAGE_HEAD_EPOCHS = 10.0


def default_lr0(mode: str, data_kind: str | None = None) -> float:
    """hyperfree's η0 for ``mode`` when none is given: :data:`IMAGE_HEAD_LR0` for a head on image features,
    else :data:`DEFAULT_LR0`."""
    if mode == "last-layer" and data_kind == "image":
        return IMAGE_HEAD_LR0
    return DEFAULT_LR0.get(mode, 1e-4)


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
                   generator: torch.Generator | None = None, weights: torch.Tensor | None = None) -> float:
    """Eq. (7) of Liu et al. (HyFreeDP): (Σ clamp(ℓ_i, −R_l, R_l) + σ_l·R_l·N(0, 1)) / B (a NaN or inf ℓ_i
    counts 0).

    The clipped sum has add/remove sensitivity R_l, so this is a Gaussian mechanism with
    noise multiplier ``noise_multiplier`` (σ_l), :func:`privtune.engine.mechanisms.noisy_scalar`.  B is the
    *expected* batch size.  ``weights`` (user level): the batch's row weights 1/m_u
    (:meth:`privtune.engine.units.UnitIndex.row_weights`), so a sampled unit adds the mean of its rows' clamped
    losses and the sensitivity stays R_l per unit; B is then the expected number of units.
    """
    # a NaN/inf loss adds nothing (as its gradient term in the engine): the sum stays in [−B·R_l, B·R_l]
    clamped = torch.where(torch.isfinite(losses), losses, 0.0).clamp(-R_l, R_l)
    if weights is not None:
        clamped = clamped.double() * weights.to(torch.float64)
    s = float(clamped.sum().item())
    # its event is not charged on its own: the release shares the update step's batch (joint accounting, σ_eff)
    return noisy_scalar(s, noise_multiplier, R_l, generator, label="hyperfree loss").value / expected_batch_size


# --------------------------------------------------------------------------------------
# joint calibration
# --------------------------------------------------------------------------------------


@dataclass
class HyperfreeConfig:
    """Parameters of HyFreeDP.

    interval : K, the η update interval in steps (default 5).
    probes : P, loss releases per update (3: {−η, 0, +η}).
    gamma_noise : γ = σ_g/σ (1.01): the share of the budget freed for the losses.
    lr0 : initial η, or None for the per-mode default (:func:`default_lr0`).
    R_l0, R_min : initial and minimum loss clipping threshold.
    clamp_factor, smoothing, lr_min : guards of the update (see :func:`gen_lr_update`).
    batch_size : expected batch size; None → :func:`privtune.hpo.recommend`.
    epochs : passes over the data; None → :data:`DEFAULT_EPOCHS` (3), or :data:`IMAGE_HEAD_EPOCHS` (10) for a
        head on image features (:meth:`epochs_for`).
    optimizer : the base optimizer giving the direction d: ``"adamw"`` (default; 0.9/0.999, decoupled
        weight decay ``weight_decay``), ``"adam"`` (0.9/0.999, ``weight_decay`` as an L2 term added to
        the noisy gradient) or ``"sgd"`` (d = noisy gradient + ``weight_decay``·w).
    auto_gamma : AUTO-S stability constant (0.01).
    clipping : per-example clipping, both at sensitivity 1: ``"automatic"`` (AUTO-S, the paper's choice)
        or ``"flat"`` (Abadi, C = 1).  ``None`` (default) = AUTO-S for a head on cached features and
        flat for a model (bitfit, lora, full): on DP-BiTFiT of MiniLM (2,000 SST-2 phrases, σ = 0.78,
        24 steps) AUTO-S reached 56.5 % dev accuracy against 75.2 % for flat clipping at the same σ
        (docs/strategies/hyperfree.md has the command).
    lr_trials : multipliers m of η0; on a model, one short charged trial per m places η before the run
        (η placement).  None (default) = :data:`DEFAULT_LR_TRIALS` on a model
        (:data:`DEFAULT_LR_TRIALS_BY_MODE` where a mode differs: ``full`` tries 1 and 3) and none on cached
        features (where the run alone already moves η enough); ``()`` turns placement off.
    trial_fraction : steps of each placement trial as a fraction of the final run's steps (0.1; at least
        :data:`MIN_TRIAL_STEPS`).
    trial_share : the share of the total ε the placement trials spend together (0.15), scores included
        in the composition; the final run is calibrated on the rest.
    backbone_lr_scale : α in (0, 1]: on a model, every trainable parameter outside the classification head
        steps at α·η, the head at η, in the η-placement trials and in the run (the pre-trained-layer
        multiplier of Mehta et al. (large-scale transfer); the learning-rate probe moves η and keeps the
        ratio).  None (default) = the mode's (:data:`privtune.finetune.modes.DEFAULT_BACKBONE_LR_SCALES`;
        1 where not listed).
    tie_tolerance : placement trials scoring within this of the best (0.005, i.e. half a point of
        accuracy), or within the selection split's statistical margin if larger
        (:meth:`privtune.hpo.common.Selector.tie_margin`: two standard errors of a difference; about 3 points
        on 2,000 public examples near 57 %), are ties, won by the η closest to η0 (then the smaller η).
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
    epochs: float | None = None
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    auto_gamma: float = 0.01
    clipping: str | None = None
    lr_trials: tuple | None = None
    trial_fraction: float = 0.1
    trial_share: float = 0.15
    tie_tolerance: float = 0.005
    backbone_lr_scale: float | None = None

    def backbone_lr_scale_for(self, mode: str) -> float:
        """α of a run in ``mode`` (see ``backbone_lr_scale``)."""
        if self.backbone_lr_scale is not None:
            return float(self.backbone_lr_scale)
        return default_backbone_lr_scale(mode)

    def epochs_for(self, mode: str, kind: str | None = None) -> float:
        """Epochs of a run in ``mode`` on rows of ``kind`` (``"text"``, ``"image"``; see ``epochs``)."""
        if self.epochs is not None:
            return float(self.epochs)
        return IMAGE_HEAD_EPOCHS if mode == "last-layer" and kind == "image" else DEFAULT_EPOCHS

    def trial_multipliers(self, mode: str) -> tuple:
        """Multipliers of η0 tried before a run in ``mode`` (see ``lr_trials``); none on cached features."""
        if self.lr_trials is not None:
            return tuple(float(m) for m in self.lr_trials)
        if data_kind(mode) == "features":
            return ()
        return DEFAULT_LR_TRIALS_BY_MODE.get(mode, DEFAULT_LR_TRIALS)

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

        check_choice(self.optimizer, "optimizer", OPTIMIZERS)
        if self.clipping is not None:
            check_choice(self.clipping, "clipping", CLIPPINGS)
        check_real(self.weight_decay, "weight_decay", low=0.0, low_inclusive=True)
        if self.lr_trials is not None:
            if isinstance(self.lr_trials, (str, bytes)) or not hasattr(self.lr_trials, "__iter__"):
                raise InvalidParameterError(
                    f"`lr_trials` must be a list of learning-rate multipliers, e.g. [1, 3, 10]; got "
                    f"{self.lr_trials!r}.")
            self.lr_trials = tuple(check_real(m, "lr_trials", low=0.0,
                                              fix="Each entry multiplies η0; pass e.g. [1, 3, 10], or [] for none.")
                                   for m in self.lr_trials)
        check_real(self.trial_fraction, "trial_fraction", low=0.0, high=1.0, high_inclusive=True)
        check_real(self.tie_tolerance, "tie_tolerance", low=0.0, low_inclusive=True)
        if self.backbone_lr_scale is not None:
            check_backbone_lr_scale(self.backbone_lr_scale)
        check_real(self.trial_share, "trial_share", low=0.0, high=1.0, high_inclusive=False,
                   fix="Pass the share of ε the η trials spend, e.g. 0.15.")


def calibrate_joint(total_epsilon: float, delta: float, sample_rate: float, steps: int, *, interval: int = 5,
                    probes: int = 3, gamma_noise: float = 1.01, spent_events=(), accountant: str = "pld",
                    sampling: str = "poisson") -> tuple[float, float, float, list]:
    """σ, σ_g, σ_l and the events of a HyFreeDP run meeting (ε, δ) with joint accounting.

    σ is the gradient-only σ for the budget; σ_g = γ·σ; n_upd = ⌈T/K⌉ update steps are
    each one subsampled Gaussian with σ_eff, calibrated inside the composition with the
    T − n_upd plain steps at σ_g; σ_l = sqrt(P / (σ_eff⁻² − σ_g⁻²)).
    Returns (σ, σ_g, σ_l, events).
    """
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


def plan_lr_trials(config: HyperfreeConfig, total_epsilon: float, delta: float, *, sample_rate: float, steps: int,
                   multipliers: tuple, score_sigma: float | None = None, accountant: str = "pld") -> dict | None:
    """The η-placement trials of a run of ``steps`` steps at rate ``sample_rate`` (None when there are none).

    One trial per multiplier, each ``max(MIN_TRIAL_STEPS, ⌈trial_fraction·T⌉)`` steps at the final run's q
    (the same expected batch, so the η found transfers); σ_t is calibrated so that all trials together
    (as one composition of k·T_t steps) spend ``trial_share``·ε; a charged score (σ ``score_sigma``) per
    trial is added to the events.  Everything here depends on public sizes only."""
    k = len(multipliers)
    if k == 0 or sample_rate >= 1.0:
        return None
    t_steps = max(MIN_TRIAL_STEPS, math.ceil(config.trial_fraction * steps))
    target = config.trial_share * total_epsilon
    sigma_t = float(acct.calibrate_noise_multiplier(target, delta, sample_rate, k * t_steps, accountant=accountant))
    events = []
    for i, m in enumerate(multipliers):
        events.append(DPSGDEvent(sigma_t, sample_rate, t_steps, label=f"planned η trial {i} (η0×{m:g})"))
        if score_sigma:
            events.append(GaussianEvent(score_sigma, 1, label=f"planned score η trial {i}"))
    return {"multipliers": tuple(multipliers), "steps": t_steps, "noise_multiplier": sigma_t,
            "sample_rate": sample_rate, "events": events}


def lr_transfer(lr_trials: dict, final_events, steps: int, delta: float, accountant: str = "pld") -> dict:
    """How a placement trial's η carries to the final run: the linear scaling rule of Panda et al.

    The best total step r = η·T grows about linearly with ε (Panda et al. (linear scaling); here the "proportional"
    extrapolation, a line through the origin fitted in ε, each run's own ε at the common δ), so the final run
    takes r_f = r_t·ε_f/ε_t, i.e. η_f = η_t·(T_t/T)·(ε_f/ε_t).  Keeping r alone (η_t·T_t/T) ignores that the
    final run has about ten times a trial's ε; measured at full SST-2 size it started DP-BiTFiT at 1.5e-3 and
    reached 78.6 % dev where a fixed η of 1e-2 reached 81.8 %.  Public sizes and the plan only.
    Returns ``final_scale`` (η_f/η_t), ``trial_epsilon`` (one trial's gradient steps, score excluded) and
    ``final_epsilon`` (the final run's events, loss releases included)."""
    eps_trial = epsilon_of([DPSGDEvent(lr_trials["noise_multiplier"], lr_trials["sample_rate"], lr_trials["steps"])],
                           delta, accountant)
    eps_final = epsilon_of(list(final_events), delta, accountant)
    # capped at 1 (the extrapolation is clamped): the trials measured no η above their own, so the
    # final run never starts above the winning trial's η (short runs, e.g. T = 6 with 3-step trials, would
    # otherwise extrapolate to about 6× it)
    # (a trial whose ε rounds to 0, at a tiny total ε, measured nothing to extrapolate from: the cap applies)
    scale = min(1.0, lr_trials["steps"] / steps * eps_final / eps_trial) if eps_trial > 0 else 1.0
    return {"final_scale": scale, "trial_epsilon": eps_trial, "final_epsilon": eps_final}


@dataclass(frozen=True, kw_only=True)
class HyperfreePlan(BudgetPlan):
    """A HyFreeDP plan: the final run's schedule and noise, and the η-placement trials (if any).

    sigma : the gradient-only σ the joint calibration started from; sigma_g, sigma_l : the gradient and loss
    noise multipliers of the run; sample_rate, steps : its Poisson schedule (q, T); interval, probes : a
    learning-rate update every ``interval`` steps, with ``probes`` loss releases; lr_trials : the planned
    η-placement trials (:func:`plan_lr_trials` with :func:`lr_transfer`'s scale), None when there are none.
    """

    sigma: float
    sigma_g: float
    sigma_l: float
    sample_rate: float
    steps: int
    interval: int
    probes: int
    lr_trials: dict | None = None


def plan(config: HyperfreeConfig, total_epsilon: float, delta: float, *, sample_rate: float, steps: int,
         accountant: str = "pld", prefix_events=(), lr_trials: dict | None = None) -> HyperfreePlan:
    """Plan a HyFreeDP run (and its η-placement trials, from :func:`plan_lr_trials`); every event is
    fixed before data is read, the final run calibrated on what the prefix and the trials leave."""
    config.validate()
    trial_events = list(prefix_events) + (list(lr_trials["events"]) if lr_trials else [])
    sigma, sigma_g, sigma_l, events = calibrate_joint(
        total_epsilon, delta, sample_rate, steps, interval=config.interval, probes=config.probes,
        gamma_noise=config.gamma_noise, accountant=accountant, spent_events=trial_events,
        sampling="full_batch" if sample_rate >= 1.0 else "poisson")
    if lr_trials:
        lr_trials = dict(lr_trials, **lr_transfer(lr_trials, events, steps, delta, accountant))
    notes = []
    if lr_trials:
        notes.append(f"η placement: {len(lr_trials['multipliers'])} trials at η0 × "
                       f"{', '.join(f'{m:g}' for m in lr_trials['multipliers'])}, each T = {lr_trials['steps']} "
                       f"Poisson steps at q = {sample_rate:.4g}, σ = {lr_trials['noise_multiplier']:.4g} "
                       f"(ε of the trials with their scores = "
                       f"{epsilon_of(lr_trials['events'], delta, accountant):.4g}); the final run starts at the "
                       f"best trial's η × {lr_trials['final_scale']:.3g} (r ∝ ε: T_t/T = "
                       f"{lr_trials['steps']}/{steps}, ε_f/ε_t = {lr_trials['final_epsilon']:.3g}/"
                       f"{lr_trials['trial_epsilon']:.3g})")
    notes += [
        f"final run: T = {steps} Poisson steps at q = {sample_rate:.4g}; gradient-only σ = {sigma:.4g}",
        f"σ_g = {config.gamma_noise:g}·σ = {sigma_g:.4g}; loss releases σ_l = {sigma_l:.4g} every "
        f"{config.interval} steps ({config.probes} per update, joint accounting on the shared batch)",
        f"planned ε = {epsilon_of(trial_events + events, delta, accountant):.4g}",
    ]
    return HyperfreePlan(strategy=NAME, total_epsilon=total_epsilon, delta=delta, accountant=accountant,
                         trial_events=trial_events, final_events=events, final_noise_multiplier=sigma_g, notes=notes,
                         sigma=sigma, sigma_g=sigma_g, sigma_l=sigma_l, sample_rate=sample_rate, steps=steps,
                         interval=config.interval, probes=config.probes, lr_trials=lr_trials)


# --------------------------------------------------------------------------------------
# HyFreeDP as a hook on privtune's one DP loop (heads on features and models alike)
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
    """One guarded learning-rate update from the three privatised losses (see the module docstring), recorded in
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


class LearningRateProbe(LoopHook):
    """GeN-DP's learning-rate update as a :class:`privtune.training.LoopHook`.

    Every ``config.interval`` steps, after the optimizer step on a Poisson batch, the hook reads the
    step direction d = (w_t − w_{t+1})/η, releases the three clamped, noised losses at w_t, w_t − η·d
    and w_t + η·d on the SAME batch (σ_l, its own generator), moves η with the guarded update and
    re-applies the step with the new η.  These releases are what the plan's joint events charge
    (σ_eff of the update steps); the loop's own events cover only the gradients and are not used.

    ``evaluate`` (no argument; accuracy on a PUBLIC split, never private data) is called every
    ``eval_every`` steps and at the end; ``progress`` gets one update per step with the privatised
    loss L0 at update steps (never a loss computed without noise).
    """

    def __init__(self, config: "HyperfreeConfig", *, lr0: float, sigma_l: float, expected_batch_size: float,
                 steps: int, seed: int | None, evaluate=None, eval_every: int = 0, progress=None):
        self.config, self.sigma_l, self.B, self.steps = config, float(sigma_l), float(expected_batch_size), int(steps)
        self.gen = make_generator(seed, offset=99)  # loss-release noise; OS-seeded unless a seed is given
        self.lr, self.R_l = float(lr0), float(config.R_l0)
        self.evaluate, self.eval_every, self.progress = evaluate, int(eval_every), progress
        self.t = 0
        self._w0: list[torch.Tensor] | None = None
        self._losses_at_w0: torch.Tensor | None = None
        self.history = {"step": [], "lr": [], "train_loss": [], "train_loss_step": [], "R_l": [], "accepted": [],
                        "reasons": [], "train_loss_label": "privatised loss L0 (charged, joint accounting)",
                        "eval": []}

    def before_step(self, loop, batch: torch.Tensor) -> None:
        self._w0 = ([p.detach().clone() for p in loop.params] if self.t % self.config.interval == 0 else None)
        losses = getattr(loop, "last_batch_losses", None)
        self._losses_at_w0 = losses if losses is not None and losses.numel() == batch.numel() else None

    def after_step(self, loop, batch: torch.Tensor) -> None:
        t, hist = self.t, self.history
        if self._w0 is not None:
            lr, w0 = self.lr, self._w0
            d = [(a - p.detach()) / lr for a, p in zip(w0, loop.params)]

            def loss_at(sign: float) -> float:
                with torch.no_grad():
                    for p, a, dd in zip(loop.params, w0, d):
                        p.copy_(a + sign * lr * dd)
                return privatize_loss(loop.per_example_losses(batch), self.R_l, self.sigma_l, self.B, self.gen,
                                      weights)

            weights = loop.unit_weights(batch)  # user level: 1/m_u per row (one unit, one bounded term); else None
            # the losses at w_t on this batch were computed by the step's own forward pass: reused, so an
            # update costs two extra forward passes instead of three (same values, same release)
            at_w0 = self._losses_at_w0
            L0 = (privatize_loss(at_w0, self.R_l, self.sigma_l, self.B, self.gen, weights) if at_w0 is not None
                  else loss_at(0.0))
            Lm, Lp = loss_at(-1.0), loss_at(+1.0)
            self.lr, self.R_l = _update_lr(L0, Lm, Lp, lr, t, self.config, hist)
            with torch.no_grad():  # the step with the (possibly new) η
                for p, a, dd in zip(loop.params, w0, d):
                    p.copy_(a - self.lr * dd)
            loop.set_learning_rate(self.lr)
            self._w0 = None
        hist["step"].append(t + 1)
        hist["lr"].append(self.lr)

        def evaluate_public():
            with torch.no_grad(), loop.paused():
                return self.evaluate()

        _report_step(self.progress, hist, t, int(batch.numel()), self.evaluate, self.eval_every, self.steps,
                     evaluate_public)
        self.t += 1

    def on_end(self, loop) -> None:
        n_upd = len(self.history["accepted"])
        self.history["acceptance_rate"] = (sum(self.history["accepted"]) / n_upd) if n_upd else 0.0


def train_hyperfree(model, train_set, *, steps: int, sample_rate: float, sigma_g: float, sigma_l: float,
                    config: HyperfreeConfig, lr0: float, seed: int | None = None,
                    max_physical_batch_size: int | None = None, progress=None, evaluate=None, eval_every: int = 0,
                    device=None, backbone_lr_scale: float = 1.0) -> dict:
    """HyFreeDP (Algorithm 1 of Liu et al., guarded) through :func:`privtune.training.fit`, the one DP loop.

    ``model`` is a Classifier whose trainable parameters are set (bitfit, lora, full) with a text or
    image ``train_set``, or a zero-initialised ``nn.Linear`` head with a
    :class:`~privtune.finetune.FeatureSet`.  Gradient: clipping ``config.clipping_for(on_features)`` at
    C = 1 (AUTO-S on features, flat on a model by default), noise σ_g, optimizer ``config.optimizer``
    from :func:`privtune.optim.make_optimizer`; the learning rate moves by :class:`LearningRateProbe`.
    Sampler seed ``seed``, gradient noise seed + 1, loss noise its own stream (offset 99).
    Trains ``model`` in place on ``device`` and returns the history (η and R_l trajectories, the
    privatised losses L0, the acceptance log, public-split accuracy from ``evaluate``).
    """
    on_features = getattr(train_set, "kind", None) == "features"
    probe = LearningRateProbe(config, lr0=lr0, sigma_l=sigma_l, expected_batch_size=sample_rate * public_size(train_set),
                              steps=steps, seed=seed, evaluate=evaluate, eval_every=eval_every, progress=progress)
    o = final_run_options(config, on_features)
    fit(model, train_set, noise=NoiseSpec(noise_multiplier=sigma_g, sample_rate=sample_rate, steps=int(steps)),
        optimizer=OptimizerSpec(name=o["optimizer"], learning_rate=lr0, momentum=o["momentum"],
                                weight_decay=o["weight_decay"], backbone_lr_scale=backbone_lr_scale),
        clipping=ClippingSpec(clip=o["clip"], clipping=o["clipping"], gamma=o["gamma"]),
        options=LoopOptions(seed=seed, max_physical_batch_size=max_physical_batch_size,
                            nonfinite_features="drop"),  # features were cached after the reservation
        hooks=[probe], device=device)
    return probe.history


def final_run_options(config: HyperfreeConfig, on_features: bool) -> dict:
    """The loop options of a HyFreeDP run (gradient clipping at C = 1, the base optimizer, no momentum): the same
    for :func:`train_hyperfree` and for the strategy's run through a backend."""
    return {"clip": 1.0, "clipping": config.clipping_for(on_features), "gamma": config.auto_gamma,
            "optimizer": config.optimizer, "weight_decay": config.weight_decay, "momentum": 0.0}


def final_run_hooks(config: HyperfreeConfig, *, lr0: float, sigma_g: float, sigma_l: float, sample_rate: float,
                    steps: int, phase: str) -> tuple[RunHooks, list]:
    """The :class:`~privtune.hpo.backends.RunHooks` of a HyFreeDP run through a backend: one
    :class:`LearningRateProbe` (seeded by the run's seed), its joint events, and a list that receives the probe
    (read its ``history`` after the run)."""
    made: list = []
    s_eff = float(acct.joint_noise_multiplier(sigma_g, sigma_l, config.probes))

    def make(ctx: HookContext) -> list:
        probe = LearningRateProbe(config, lr0=lr0, sigma_l=sigma_l, expected_batch_size=ctx.expected_batch_size,
                                  steps=steps, seed=ctx.seed, evaluate=ctx.evaluate, eval_every=ctx.eval_every,
                                  progress=ctx.progress)
        made.append(probe)
        return [probe]

    def events_at(k: int) -> list:
        """The first k steps: plain gradient steps at σ_g, and the update steps (one in ``interval``) as one
        Poisson Gaussian at σ_eff (gradient and the probe's loss releases of the same batch, joint)."""
        n_upd = math.ceil(k / config.interval)
        return _steps_events(sigma_g, sample_rate, k - n_upd) + _steps_events(s_eff, sample_rate, n_upd)

    return RunHooks(make=make, events_at=events_at, phase=phase, loss_label="privatised loss"), made


def _steps_events(sigma: float, q: float, k: int) -> list:
    if k <= 0:
        return []
    return [GaussianEvent(sigma, k)] if q >= 1.0 else [DPSGDEvent(sigma, q, k)]


def train_model_hyperfree(model, train_set, *, steps: int, sample_rate: float, sigma_g: float, sigma_l: float,
                          config: HyperfreeConfig, lr0: float, seed: int | None = None,
                          max_physical_batch_size: int = 32, progress=None, eval_fn=None, eval_every: int = 0,
                          device=None, backbone_lr_scale: float = 1.0):
    """HyFreeDP on a :class:`privtune.models.Classifier` (see :func:`train_hyperfree`); returns
    (model, history).  ``eval_fn(model)`` is accuracy on a PUBLIC split."""
    hist = train_hyperfree(model, train_set, steps=steps, sample_rate=sample_rate, sigma_g=sigma_g, sigma_l=sigma_l,
                           config=config, lr0=lr0, seed=seed, max_physical_batch_size=max_physical_batch_size,
                           progress=progress, evaluate=None if eval_fn is None else (lambda: eval_fn(model)),
                           eval_every=eval_every, device=device, backbone_lr_scale=backbone_lr_scale)
    return model, hist


def place_learning_rate(backend, selector, config: HyperfreeConfig, trials_plan: dict, lr0: float, *,
                        seed: int | None = None, progress=None, final_scale: float = 1.0) -> tuple[float, list]:
    """Run the planned η-placement trials (:func:`plan_lr_trials`) on ``backend``; return the final run's η,
    the best trial's η × ``final_scale`` (the plan's :func:`lr_transfer` scale), by
    ``selector``'s score (ties: see ``tie_tolerance``), and the trial records (their events as planned)."""
    import numpy as np

    rng = np.random.default_rng(seed)  # OS entropy without a seed, like every other strategy's trials
    records = []
    # α applies to a model's trials (a head on cached features is all head)
    alpha = ({"backbone_lr_scale": config.backbone_lr_scale_for(backend.mode)}
             if getattr(backend, "kind", None) == "model" else {})
    for i, m in enumerate(trials_plan["multipliers"]):
        lr = lr0 * m
        label = f"hyperfree η trial {i}"
        if progress:
            progress(f"hyperfree η placement {i + 1}/{len(trials_plan['multipliers'])}: η = {lr:.3g}, "
                     f"{trials_plan['steps']} steps")
        run_i = backend.run({"learning_rate": lr}, noise_multiplier=trials_plan["noise_multiplier"],
                            sample_rate=trials_plan["sample_rate"], steps=trials_plan["steps"], learning_rate=lr,
                            optimizer=config.optimizer, clipping=config.clipping_for(False),
                            seed=noise_seed(rng), label=label, **alpha)
        score, score_events = selector.score(backend.logits(run_i.state, selector.data), label=label + " score")
        records.append(TrialRecord(index=i, phase="η placement", score=score, score_source=selector.source,
                                   hyperparameters={"learning_rate": lr, "lr0_multiplier": m, **alpha,
                                                    "steps": trials_plan["steps"],
                                                    "sample_rate": trials_plan["sample_rate"],
                                                    "noise_multiplier": trials_plan["noise_multiplier"]},
                                   events=list(run_i.events) + list(score_events)))
    # scores the selection split cannot tell apart are ties (short noisy trials often all sit near chance:
    # Selector.tie_margin, at least tie_tolerance); a tie goes to the final η closest to η0 (in log scale),
    # then to the smaller η
    tied = statistical_ties(records, selector, config.tie_tolerance)
    best = choose_best(tied or records, key=lambda r: 0.0,
                       tie=lambda r: (abs(math.log(r.hyperparameters["lr0_multiplier"] * final_scale)),
                                      r.hyperparameters["learning_rate"]))
    return float(best.hyperparameters["learning_rate"]) * final_scale, records


def run(backend, config: HyperfreeConfig, p: HyperfreePlan, *, mode: str = "last-layer", seed: int | None = None,
        progress=None, selector=None):
    """Execute a planned HyFreeDP run on ``backend`` (features or a model), after its η-placement
    trials when the plan has them (scored by ``selector``)."""
    lr0 = config.lr0 if config.lr0 is not None else default_lr0(mode, getattr(backend, "data_kind", None))
    trials: list = []
    lr_default = lr0
    if p.lr_trials:
        if selector is None:  # tune() always passes one to a selecting strategy; kept as a guard
            raise InvalidParameterError("hyperfree's η placement needs a selector (public split or charged score).")
        lr0, trials = place_learning_rate(backend, selector, config, p.lr_trials, lr0,
                                          seed=None if seed is None else seed + 5, progress=progress,
                                          final_scale=p.lr_trials["final_scale"])
        if progress:
            progress("hyperfree η placement: scores "
                     + ", ".join(f"η={t.hyperparameters['learning_rate']:.3g}: {t.score:.4f}" for t in trials)
                     + f"; the run starts at η0 = {lr0:.3g}")
    if progress:
        progress(f"hyperfree: T={p.steps} q={p.sample_rate:.4g} σ_g={p.sigma_g:.4g} σ_l={p.sigma_l:.4g} "
                 f"η0={lr0:g}")
    on_features = backend.kind != "model"
    hooks, probes = final_run_hooks(config, lr0=lr0, sigma_g=p.sigma_g, sigma_l=p.sigma_l,
                                    sample_rate=p.sample_rate, steps=p.steps,
                                    phase=f"final run (hyperfree, {backend.kind})")
    alpha = {} if on_features else {"backbone_lr_scale": config.backbone_lr_scale_for(backend.mode)}
    final = backend.run({"learning_rate": lr0}, noise_multiplier=p.sigma_g, sample_rate=p.sample_rate,
                        steps=p.steps, learning_rate=lr0, bias=True, seed=seed, label="final run (hyperfree)",
                        hooks=hooks, **alpha, **final_run_options(config, on_features))
    state, hist = final.state, probes[0].history
    lr_final = hist["lr"][-1] if hist["lr"] else lr0
    if progress:
        progress(f"hyperfree: η {lr0:g} → {lr_final:.4g}, acceptance {hist.get('acceptance_rate', 0):.0%}")
    data = {"name": NAME, "lr_trajectory": hist["lr"], "R_l_trajectory": hist.get("R_l", []),
            "acceptance_rate": hist.get("acceptance_rate"), "lr0": lr0, "sigma": p.sigma,
            "sigma_g": p.sigma_g, "sigma_l": p.sigma_l, "interval": config.interval, "probes": config.probes,
            "accounting": "joint (shared batch): update steps are one Poisson Gaussian with σ_eff"}
    if hist.get("acceptance_rate", 1.0) < 0.25:
        data["warning"] = (f"only {hist.get('acceptance_rate', 0):.0%} of η fits accepted: the run was close to "
                           f"constant η ≈ η0 = {lr0:g}")
    hp = {"learning_rate_initial": lr0, "learning_rate_final": lr_final, "steps": p.steps,
          "sample_rate": p.sample_rate, "batch_size": round(p.sample_rate * backend.n),
          "noise_multiplier": p.sigma_g, "loss_noise_multiplier": p.sigma_l,
          "clipping": config.clipping_for(backend.kind != "model"),
          "optimizer": config.optimizer, "interval": config.interval}
    if backend.kind == "model":
        hp["backbone_lr_scale"] = config.backbone_lr_scale_for(backend.mode)
    if trials:
        lt = p.lr_trials
        data["lr_placement"] = {"default_lr0": lr_default, "chosen_lr0": lr0,
                                "scores": {f"{t.hyperparameters['learning_rate']:.4g}": t.score for t in trials},
                                "transfer": {"rule": "r ∝ ε (Panda, Tang et al.'s linear scaling), capped at the trial's η",
                                             "scale": lt["final_scale"], "trial_epsilon": lt["trial_epsilon"],
                                             "final_epsilon": lt["final_epsilon"]}}
    return StrategyOutcome(state=state, final_events=list(p.final_events), final_hyperparameters=hp, trials=trials,
                           strategy_data=data, final_history=hist,
                           selection_source=selector.source if trials else "none")


class Hyperfree(Strategy):
    """Hyperparameter-free (Liu et al., HyFreeDP): no trials; the learning rate is set from privatised losses."""

    name = NAME
    modes = TUNABLE_MODES
    Config = HyperfreeConfig
    overrides = {"features": frozenset({"epochs", "steps", "batch_size", "optimizer"}),
                 "model": frozenset({"epochs", "steps", "batch_size", "optimizer"})}
    clipping_kinds = frozenset({"features", "model"})
    fixed_clip = 1.0
    selects = True  # the η-placement trials on a model are scored (on cached features nothing is scored)

    def apply_overrides(self, cfg, *, trials=None, optimizer=None) -> None:
        set_override(cfg, "optimizer", optimizer)
        cfg.validate()

    def plan(self, cfg, mode: str, request: PlanRequest) -> BudgetPlan:
        r = request
        if r.batch_size is None and cfg.batch_size is not None:
            r = dataclasses.replace(r, batch_size=cfg.batch_size)
        q, T = minibatch_schedule(r, r.epochs if r.epochs is not None else cfg.epochs_for(mode, r.data_kind))
        cfg.validate()
        trials = plan_lr_trials(cfg, r.total_epsilon, r.delta, sample_rate=q, steps=T,
                                multipliers=cfg.trial_multipliers(mode),
                                score_sigma=r.score_sigma, accountant=r.accountant)
        p = plan(cfg, r.total_epsilon, r.delta, sample_rate=q, steps=T, accountant=r.accountant,
                 prefix_events=r.prefix_events, lr_trials=trials)
        return dataclasses.replace(p, config=cfg)

    def run(self, backend, selector, plan: HyperfreePlan, *, mode: str, seed=None, progress=None):
        return run(backend, plan.config, plan, mode=mode, seed=seed, progress=progress, selector=selector)
