"""Validated specifications of a run: what ``train`` and ``tune`` are asked to do, checked once.

:func:`privtune.train` and :func:`privtune.tune` keep their flat keyword arguments (the command line
and the docs use them); at the boundary they build these frozen objects, and the stages below them
(plan, reserve, run, certify) receive the objects instead of loose arguments.  Each object checks
its fields in ``__post_init__`` with :mod:`privtune._validation`, so a bad value is one
:class:`~privtune.errors.InvalidParameterError` naming the argument, what is allowed, what was given
and what to do, raised before any data is read or any budget is reserved.

A field left ``None`` means "the command's default": ``train`` fills it in from the mode (e.g. the
learning rate), ``tune`` leaves it to the strategy's recipe.

>>> from privtune.specs import PrivacySpec
>>> PrivacySpec(epsilon=1.0, delta=1e-5).epsilon
1.0
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from privtune._validation import (
    check_backbone_lr_scale,
    check_choice,
    check_delta,
    check_epsilon,
    check_int,
    check_noise_multiplier,
    check_real,
    check_sample_rate,
    check_steps,
    suggest_delta,
)
from privtune.accounting.accountant import ACCOUNTANTS
from privtune.accounting.calibration import calibrate_noise_multiplier
from privtune.accounting.events import SAMPLING_SCHEMES
from privtune.engine.private_gradient import CLIPPINGS
from privtune.engine.units import DEFAULT_MAX_ROWS_PER_UNIT
from privtune.errors import InvalidParameterError
from privtune.finetune.modes import DEFAULT_LEARNING_RATES, default_backbone_lr_scale
from privtune.optim import OPTIMIZERS

#: train()'s default optimizer, clipping norm and clipping rule (tune: the strategy's recipe decides)
DEFAULT_OPTIMIZER = "adam"
DEFAULT_CLIP = 1.0
DEFAULT_CLIPPING = "flat"
#: LoRA defaults: rank r and scaling α (the adapter's update is α/r · B A)
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 16.0


def _set(spec: Any, name: str, value: Any) -> None:
    """Store a checked (normalised) value on a frozen spec during ``__post_init__``."""
    object.__setattr__(spec, name, value)


def _check_flag(value: Any, name: str, fix: str = "") -> bool:
    if not isinstance(value, bool):
        raise InvalidParameterError(f"`{name}` must be True or False. Got {value!r}." + (f" {fix}" if fix else ""))
    return value


@dataclass(frozen=True)
class PrivacySpec:
    """The privacy target of a run.

    epsilon : the total ε (dimensionless, > 0) the run's events compose to at ``delta``; the noise is
        calibrated to it.  ``None`` when ``noise_multiplier`` fixes the noise instead (``train`` only).
    delta : δ in (0, 1), a probability; ``None`` = chosen from the data size N by :meth:`for_dataset`
        (min(1e-5, a power of ten below 1/(10·N))).  Once N is known it must be below 1/N.
    noise_multiplier : σ, the Gaussian noise's standard deviation divided by the clipping norm C
        (dimensionless, > 0), instead of ``epsilon``; then ε is computed and reported.
    accountant : how events compose into ε: one of :data:`privtune.accounting.accountant.ACCOUNTANTS`.
    """

    epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    accountant: str = "pld"

    def __post_init__(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise InvalidParameterError(
                "Pass exactly one of `epsilon` (with `delta`) or `noise_multiplier`. Got "
                f"epsilon={self.epsilon!r}, noise_multiplier={self.noise_multiplier!r}. E.g. epsilon=1.0, "
                "delta=1e-5 (CLI: --epsilon 1 --delta 1e-5, or --noise-multiplier S)."
            )
        if self.epsilon is not None:
            _set(self, "epsilon", check_epsilon(self.epsilon))
        if self.noise_multiplier is not None:
            _set(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        if self.delta is not None:
            _set(self, "delta", check_real(self.delta, "delta", low=0.0, high=1.0,
                                           fix="Pass e.g. 1e-5; δ should be well below 1/n."))
        _set(self, "accountant", check_choice(self.accountant, "accountant", ACCOUNTANTS))

    @classmethod
    def with_target(cls, epsilon: Any, delta: Any = None, accountant: Any = "pld") -> PrivacySpec:
        """A spec whose ε is required (tune: the total ε of trials, selection and final run together)."""
        return cls(epsilon=check_epsilon(epsilon), delta=delta, accountant=accountant)

    def for_dataset(self, n: int) -> PrivacySpec:
        """This spec for a training set of ``n`` rows (a public count): δ defaulted when ``None``, and
        refused when it is not below 1/n."""
        delta = min(1e-5, suggest_delta(n)) if self.delta is None else self.delta
        return replace(self, delta=check_delta(delta, dataset_size=n))


@dataclass(frozen=True)
class ScheduleSpec:
    """How long a run trains and how it draws its batches.

    epochs : passes over the training data (> 0); or ``steps``, not both.  ``None`` with ``steps=None``
        = the command's default (train: 3 epochs; tune: the strategy's recipe).
    steps : T, the number of optimizer steps (logical batches), an integer ≥ 1.
    batch_size : the expected (Poisson) batch size B in examples, ≥ 1; the sampling rate is q = B / N.
    sampling : how batches are drawn, one of :data:`privtune.accounting.events.SAMPLING_SCHEMES`
        ("poisson": each example independently with probability q).
    assume_poisson : with ``sampling="shuffle"`` only: account the shuffled batches AS IF Poisson
        sampled (an assumption that the certificate records).
    max_physical_batch_size : examples per forward/backward pass (memory only: the logical batch is
        accumulated over micro-batches, so it changes neither the result nor the privacy).
    """

    epochs: float | None = None
    steps: int | None = None
    batch_size: int | None = None
    sampling: str = "poisson"
    assume_poisson: bool = False
    max_physical_batch_size: int = 32

    def __post_init__(self) -> None:
        if self.epochs is not None and self.steps is not None:
            raise InvalidParameterError(
                f"Pass either `epochs` or `steps`, not both. Got epochs={self.epochs!r}, steps={self.steps!r}. "
                "Remove one of them (CLI: --epochs or --steps)."
            )
        if self.epochs is not None:
            _set(self, "epochs", check_real(self.epochs, "epochs", low=0.0,
                                            fix="Pass a positive number of passes over the data."))
        if self.steps is not None:
            _set(self, "steps", check_steps(self.steps))
        if self.batch_size is not None:
            _set(self, "batch_size", check_int(self.batch_size, "batch_size", low=1,
                                               fix="Pass the expected batch size, e.g. 256."))
        _set(self, "sampling", check_choice(self.sampling, "sampling", SAMPLING_SCHEMES))
        _check_flag(self.assume_poisson, "assume_poisson")
        if self.assume_poisson and self.sampling != "shuffle":
            raise InvalidParameterError(
                f"`assume_poisson` only applies to sampling='shuffle' (it accounts shuffled batches as if Poisson "
                f"sampled). Got sampling={self.sampling!r}, which is accounted as what it is. Drop assume_poisson, "
                "or pass sampling='shuffle' (CLI: --sampling shuffle)."
            )
        _set(self, "max_physical_batch_size", check_int(self.max_physical_batch_size, "max_physical_batch_size",
                                                        low=1))


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer of the private update.

    name : one of :data:`privtune.optim.OPTIMIZERS`; ``None`` = the command's default (train: "adam").
    learning_rate : step size (> 0, in units of the parameters per unit of the noisy mean gradient);
        ``None`` = the default of the mode (:data:`privtune.finetune.modes.DEFAULT_LEARNING_RATES`).
    momentum : μ in [0, 1) (SGD's heavy-ball coefficient).
    weight_decay : decoupled weight decay per step (≥ 0; 0 = none).
    backbone_lr_scale : α in (0, 1]: every trainable parameter outside the classification head steps at
        α·learning_rate (Mehta et al.'s pre-trained-layer multiplier; 1 = one rate for everything); ``None`` = the
        default of the mode (:data:`privtune.finetune.modes.DEFAULT_BACKBONE_LR_SCALES`).
    eps : the denominator constant of Adam/AdamW/LAMB (> 0, dimensionless).
    """

    name: str | None = DEFAULT_OPTIMIZER
    learning_rate: float | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    backbone_lr_scale: float | None = None
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name is not None:
            _set(self, "name", check_choice(self.name, "optimizer", OPTIMIZERS))
        if self.learning_rate is not None:
            _set(self, "learning_rate", check_real(self.learning_rate, "learning_rate", low=0.0,
                                                   fix="Pass a positive step size such as 1e-3."))
        _set(self, "momentum", check_real(self.momentum, "momentum", low=0.0, high=1.0, low_inclusive=True,
                                          fix="Momentum μ must be in [0, 1), e.g. 0.9."))
        _set(self, "weight_decay", check_real(self.weight_decay, "weight_decay", low=0.0, low_inclusive=True))
        if self.backbone_lr_scale is not None:
            _set(self, "backbone_lr_scale", check_backbone_lr_scale(self.backbone_lr_scale))
        _set(self, "eps", check_real(self.eps, "eps", low=0.0, fix="Pass a small positive constant such as 1e-8."))

    def for_mode(self, mode: str) -> OptimizerSpec:
        """This spec with every default filled in for training ``mode`` (name, learning rate and α)."""
        return replace(self, name=self.name or DEFAULT_OPTIMIZER,
                       learning_rate=(DEFAULT_LEARNING_RATES[mode] if self.learning_rate is None
                                      else self.learning_rate),
                       backbone_lr_scale=(default_backbone_lr_scale(mode) if self.backbone_lr_scale is None
                                          else self.backbone_lr_scale))


@dataclass(frozen=True)
class ClippingSpec:
    """Per-example gradient clipping.

    clip : the clipping norm C (> 0, in units of the gradient's L2 norm); ``None`` = the command's
        default (train: 1.0; tune: the strategy's).
    clipping : the clipping rule, one of :data:`privtune.engine.private_gradient.CLIPPINGS` ("flat":
        g·min(1, C/‖g‖)); ``None`` = the command's default (train: "flat").
    per_layer : clip each layer's gradient at C/√L instead of the whole gradient at C.
    gamma : the AUTO-S stability constant γ of ``clipping="automatic"`` (factor C/(‖g‖ + γ); > 0, in units of
        the gradient's L2 norm).
    """

    clip: float | None = DEFAULT_CLIP
    clipping: str | None = DEFAULT_CLIPPING
    per_layer: bool = False
    gamma: float = 0.01

    def __post_init__(self) -> None:
        if self.clip is not None:
            _set(self, "clip", check_real(self.clip, "clip", low=0.0,
                                          fix="Pass the per-example clipping norm C, e.g. clip=1.0."))
        if self.clipping is not None:
            _set(self, "clipping", check_choice(self.clipping, "clipping", CLIPPINGS))
        _check_flag(self.per_layer, "per_layer_clipping")
        _set(self, "gamma", check_real(self.gamma, "gamma", low=0.0))

    def with_defaults(self) -> ClippingSpec:
        """This spec with train()'s defaults filled in (C = 1.0, flat clipping)."""
        return replace(self, clip=DEFAULT_CLIP if self.clip is None else self.clip,
                       clipping=self.clipping or DEFAULT_CLIPPING)


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapters of ``mode="lora"``.

    rank : r, the rank of each adapter (an integer ≥ 1).
    alpha : α > 0; the adapter's update is α/r · B A.
    target_modules : names of the modules that get adapters (a list, or one comma-separated string);
        ``None`` = the default of the architecture (e.g. ``query,value`` for BERT).
    """

    rank: int = DEFAULT_LORA_RANK
    alpha: float = DEFAULT_LORA_ALPHA
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _set(self, "rank", check_int(self.rank, "lora_rank", low=1, fix="The LoRA rank r must be at least 1, e.g. 8."))
        _set(self, "alpha", check_real(self.alpha, "lora_alpha", low=0.0,
                                       fix="LoRA scales its update by alpha/r; pass e.g. lora_alpha=16."))
        targets = self.target_modules
        if targets is not None:
            if isinstance(targets, str):
                targets = [t.strip() for t in targets.split(",")]
            if not isinstance(targets, (list, tuple)) or not targets or not all(
                    isinstance(t, str) and t.strip() for t in targets):
                raise InvalidParameterError(
                    "`lora_target_modules` must be a non-empty list of module names (or one comma-separated "
                    f"string, CLI: --lora-target-modules query,value). Got {self.target_modules!r}."
                )
            _set(self, "target_modules", tuple(t.strip() for t in targets))

    @classmethod
    def for_mode(cls, mode: str, rank: int | None = None, alpha: float | None = None,
                 target_modules: Sequence[str] | str | None = None) -> LoraSpec | None:
        """The LoRA spec of a run in ``mode`` from its flat options (``None`` = default), or None for a
        mode without adapters; a LoRA option given with another mode is refused."""
        given = [name for name, v in (("lora_rank", rank), ("lora_alpha", alpha),
                                      ("lora_target_modules", target_modules)) if v is not None]
        if given and mode != "lora":
            raise InvalidParameterError(
                f"`{given[0]}` only applies to mode='lora'. Got mode={mode!r}. Drop the LoRA option(s) {given}, or "
                "pass mode='lora' (CLI: --mode lora)."
            )
        if mode != "lora":
            return None
        return cls(rank=DEFAULT_LORA_RANK if rank is None else rank,
                   alpha=DEFAULT_LORA_ALPHA if alpha is None else alpha, target_modules=target_modules)


@dataclass(frozen=True)
class NoiseSpec:
    """The DP-SGD mechanism of one :func:`privtune.training.fit` (what its privacy events account).

    noise_multiplier : σ ≥ 0, the Gaussian noise's standard deviation divided by the clipping norm C
        (dimensionless; σ = 0 is NOT PRIVATE, for references only).
    sample_rate : q in (0, 1], each example's (Poisson) inclusion probability per step; the expected batch
        size is q·N.  ``sampling="full_batch"`` needs q = 1.
    steps : T, the number of optimizer steps (logical batches), an integer ≥ 1 (both phases of two-phase).
    sampling : how batches are drawn, one of :data:`privtune.accounting.events.SAMPLING_SCHEMES`.
    assume_poisson : with ``sampling="shuffle"`` only: account the shuffled batches AS IF Poisson sampled.
    privacy_unit : None (one example is the unit), or the unit of every row (user-level DP;
        :mod:`privtune.engine.units`), with at most ``max_rows_per_unit`` rows (k ≥ 1) of a unit per step.
    delta, accountant : δ in (0, 1) (a probability) and the accountant of the ε these events compose to: what a
        progress display shows, and the claim an audit (:func:`privtune.audit.audit_dp_step`) tests; they change
        nothing that is trained or charged.

    >>> NoiseSpec.for_epsilon(1.0, delta=1e-5, sample_rate=1.0, steps=10).sampling
    'full_batch'
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    sampling: str = "poisson"
    assume_poisson: bool = False
    privacy_unit: Any = None
    max_rows_per_unit: int = DEFAULT_MAX_ROWS_PER_UNIT
    delta: float | None = None
    accountant: str = "pld"

    def __post_init__(self) -> None:
        _set(self, "noise_multiplier", check_real(self.noise_multiplier, "noise_multiplier", low=0.0,
                                                  low_inclusive=True,
                                                  fix="σ is the noise std divided by C; σ = 0 means no privacy."))
        _set(self, "sample_rate", check_sample_rate(self.sample_rate))
        _set(self, "steps", check_steps(self.steps))
        _set(self, "sampling", check_choice(self.sampling, "sampling", SAMPLING_SCHEMES))
        _check_flag(self.assume_poisson, "assume_poisson")
        _set(self, "max_rows_per_unit", check_int(self.max_rows_per_unit, "max_rows_per_unit", low=1,
                                                  fix="Pass the most rows one unit may contribute to a step."))
        if self.delta is not None:
            _set(self, "delta", check_real(self.delta, "delta", low=0.0, high=1.0, fix="Pass e.g. delta=1e-5."))
        _set(self, "accountant", check_choice(self.accountant, "accountant", ACCOUNTANTS))

    @classmethod
    def for_epsilon(cls, epsilon: float, *, delta: float, sample_rate: float, steps: int,
                    sampling: str | None = None, accountant: str = "pld", **options: Any) -> NoiseSpec:
        """The mechanism whose T = ``steps`` steps at rate q = ``sample_rate`` compose to ``epsilon`` at
        ``delta``: σ calibrated by the accountant.  ``sampling=None`` = "full_batch" at q = 1, else "poisson";
        ``options``: the other fields (``max_rows_per_unit``, ...)."""
        q, T = check_sample_rate(sample_rate), check_steps(steps)
        sampling = ("full_batch" if q == 1.0 else "poisson") if sampling is None else sampling
        sigma = calibrate_noise_multiplier(check_epsilon(epsilon), check_real(delta, "delta", low=0.0, high=1.0),
                                           sample_rate=q, steps=T, accountant=accountant, sampling=sampling)
        return cls(noise_multiplier=sigma, sample_rate=q, steps=T, sampling=sampling, delta=delta,
                   accountant=accountant, **options)


@dataclass(frozen=True)
class LoopOptions:
    """How :func:`privtune.training.fit` runs its steps; none of these changes the privacy events.

    seed : seeds the sampler (seed) and the noise (seed + 1) for reproducible experiments; None draws both
        from the OS.
    max_physical_batch_size : examples per forward/backward pass (memory only; None: 32 for a model, 65536
        for cached features).
    mode : ``"two-phase"`` runs ``phase1_steps`` DP full fine-tuning steps at ``phase1_learning_rate``
        (default: the learning rate / 10), then DP-BiTFiT; any other value only labels the events.
    eval_every : evaluate ``eval_set`` every this many steps (and at the end); None: at the end only.
    clipping_diagnostics : collect per-example gradient norms (NOT PRIVATE, labelled so in the result).
    fast_head : on cached features, compute the linear head's clipped gradients in closed form.
    nonfinite_features : cached features with a NaN or inf value: ``"refuse"`` (an error) or ``"drop"``
        (such an example adds nothing to the clipped sum).
    """

    seed: int | None = None
    max_physical_batch_size: int | None = None
    mode: str | None = None
    phase1_steps: int | None = None
    phase1_learning_rate: float | None = None
    eval_every: int | None = None
    clipping_diagnostics: bool = False
    fast_head: bool = True
    nonfinite_features: str = "refuse"

    def __post_init__(self) -> None:
        if self.max_physical_batch_size is not None:
            _set(self, "max_physical_batch_size", check_int(self.max_physical_batch_size, "max_physical_batch_size",
                                                            low=1))
        if self.eval_every is not None:
            _set(self, "eval_every", check_int(self.eval_every, "eval_every", low=1))
        _set(self, "nonfinite_features", check_choice(self.nonfinite_features, "nonfinite_features",
                                                      ("refuse", "drop")))


__all__ = ["PrivacySpec", "ScheduleSpec", "OptimizerSpec", "ClippingSpec", "LoraSpec", "NoiseSpec", "LoopOptions"]
