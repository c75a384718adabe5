"""Validated specifications of an audit: the white-box probe and the configuration an audit tests.

Like :mod:`privtune.specs`, each object checks its fields in ``__post_init__``, so a bad value is one
:class:`~privtune.errors.InvalidParameterError` naming the argument, raised before any data is read or any
budget is reserved.

* :class:`ProbeSpec`: the gradient canaries and the linear probe of :func:`privtune.audit.audit_dp_step`.
* :class:`ExposureSpec`: the secret canaries of the memorisation audit of a causal language model (prompt →
  response data, :mod:`privtune.audit.exposure`).
* :class:`AuditSpec`: what :func:`privtune.audit.audit` audits (the training configuration, the canaries,
  which audits run); :meth:`AuditSpec.create` builds it from flat keywords (those of ``privtune audit``).

>>> ProbeSpec(num_canaries=100).width
50
>>> AuditSpec.create(epsilon=8.0, delta=1e-5, mode="last-layer", steps=100).schedule.steps
100
>>> AuditSpec.create(epsilon=8.0, canary_digits=4, reference=False).exposure
ExposureSpec(canary_digits=4, candidates=2000, reference=False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from privtune._validation import check_accounted_noise_multiplier, check_choice, check_int, check_real
from privtune.engine.units import DEFAULT_MAX_ROWS_PER_UNIT, check_max_rows_per_unit
from privtune.errors import InvalidParameterError
from privtune.specs import ClippingSpec, OptimizerSpec, PrivacySpec, ScheduleSpec

__all__ = ["ProbeSpec", "ExposureSpec", "AuditSpec", "AUDITED_MODES", "GENERATION_AUDITED_MODES", "CANARY_KINDS"]

# two-phase switches the trainable set mid-run (two events); audit each phase's mode on its own
AUDITED_MODES = ("full", "bitfit", "last-layer", "lora")
#: the modes of a causal language model (privtune.models.generator.GENERATION_MODES)
GENERATION_AUDITED_MODES = ("lora", "full", "bitfit")
#: the data kind's defaults of an AuditSpec left at None: (mode, canaries) of a classifier and of a causal LM
DEFAULTS = {"classifier": ("bitfit", 1000), "generation": ("lora", 100)}
#: default secret length (digits, |R| = 10^6) and secrets scored per rank of the memorisation audit
DEFAULT_CANARY_DIGITS, DEFAULT_CANDIDATES = 6, 2000
#: the white-box canaries: one probe coordinate each, or random unit directions
CANARY_KINDS = ("dirac", "random")


def _set(spec: object, name: str, value: object) -> None:
    object.__setattr__(spec, name, value)


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameterError(f"`{name}` must be True or False. Got {value!r}.")
    return value


def _check_canaries(m: object) -> int:
    return check_int(m, "num_canaries", low=10, fix="Use at least 10 canaries (CLI: --canaries; 1000 is a good default).")


def _check_confidence(confidence: object) -> float:
    return check_real(confidence, "confidence", low=0.0, high=1.0, fix="Pass e.g. confidence=0.95.")


@dataclass(frozen=True)
class ProbeSpec:
    """The white-box audit's probe: a bias-free linear layer W (``num_classes`` × ``width``) and its canaries.

    num_canaries : m ≥ 10 gradient canaries, each included with probability 1/2.
    canary : ``"dirac"`` (canary c owns one coordinate of W, so ``width · num_classes`` ≥ m) or ``"random"``
        (random unit directions, slightly overlapping).
    num_features : d, the probe's input features (an integer ≥ 1); ``None`` = the smallest d with d·K ≥ m for
        Dirac canaries, 64 for random ones (:attr:`width`).
    num_classes : K ≥ 2, the rows of W.
    background_examples : synthetic Gaussian examples (cross-entropy loss) trained alongside the canaries (≥ 0).
    max_physical_batch_size : examples per micro-batch (≥ 1); the logical batch is split into micro-batches.
    learning_rate : the probe's SGD step size (> 0, parameter units per unit of noisy mean gradient); the
        scores are normalised by it.
    rows_per_unit : r ≥ 1; r > 1 audits the user-level step with canary *units* of r rows, all pulling the
        canary's direction (the worst case: their clipped gradients add up), sampled and weighted like training.
    """

    num_canaries: int = 1000
    canary: str = "dirac"
    num_features: int | None = None
    num_classes: int = 2
    background_examples: int = 0
    max_physical_batch_size: int = 64
    learning_rate: float = 1.0
    rows_per_unit: int = 1

    def __post_init__(self) -> None:
        _set(self, "num_canaries", _check_canaries(self.num_canaries))
        _set(self, "canary", check_choice(self.canary, "canary", CANARY_KINDS))
        _set(self, "num_classes", check_int(self.num_classes, "num_classes", low=2))
        _set(self, "background_examples", check_int(self.background_examples, "background_examples", low=0))
        _set(self, "max_physical_batch_size", check_int(self.max_physical_batch_size, "max_physical_batch_size",
                                                        low=1))
        _set(self, "learning_rate", check_real(self.learning_rate, "learning_rate", low=0.0))
        _set(self, "rows_per_unit", check_int(self.rows_per_unit, "rows_per_unit", low=1,
                                              fix="Pass the rows of each canary unit, e.g. 4."))
        if self.num_features is not None:
            _set(self, "num_features", check_int(self.num_features, "num_features", low=1))
        m, K, d = self.num_canaries, self.num_classes, self.width
        if self.canary == "dirac" and d * K < m:
            raise InvalidParameterError(
                f"Dirac canaries need one probe coordinate each: num_features · num_classes ≥ num_canaries. Got "
                f"{d} · {K} < {m}. Pass num_features ≥ {math.ceil(m / K)}, or canary='random'."
            )

    @property
    def width(self) -> int:
        """d, the probe's input features: ``num_features``, or its default (see the class docstring)."""
        if self.num_features is not None:
            return self.num_features
        return math.ceil(self.num_canaries / self.num_classes) if self.canary == "dirac" else 64


@dataclass(frozen=True)
class ExposureSpec:
    """The memorisation audit's secret canaries (prompt → response data only; ignored on labelled text).

    canary_digits : k, each secret's digits, 1 to 12 (the candidate space R has 10^k secrets).
    candidates : secrets scored to rank each canary, 100 to 10⁶ (every secret of R when |R| is no larger: an
        exact rank; otherwise a uniform sample, extrapolated by a skew-normal fit in the tail).
    reference : also fine-tune a non-private reference model on the same data and canaries and report its
        exposures (NOT PRIVATE: not charged, never released).
    """

    canary_digits: int = DEFAULT_CANARY_DIGITS
    candidates: int = DEFAULT_CANDIDATES
    reference: bool = True

    def __post_init__(self) -> None:
        _set(self, "canary_digits", check_int(self.canary_digits, "canary_digits", low=1, high=12,
                                              fix="Pass 4 to 8 digits (6 is the default)."))
        _set(self, "candidates", check_int(self.candidates, "candidates", low=100, high=10**6,
                                           fix="Pass e.g. 2000 secrets to score per model."))
        _check_flag(self.reference, "reference")

    @property
    def space_size(self) -> int:
        """|R| = 10^k, the number of possible secrets."""
        return 10 ** self.canary_digits

    def check_canaries(self, m: int) -> None:
        """m distinct secrets, with room to spare (|R| ≥ 2m), must exist."""
        if self.space_size < 2 * m:
            raise InvalidParameterError(
                f"`canary_digits` {self.canary_digits}: 10^{self.canary_digits} secrets are too few for {m} distinct "
                "canaries. Pass more digits or fewer canaries.")


@dataclass(frozen=True)
class AuditSpec:
    """What :func:`privtune.audit.audit` audits: one ``privtune train`` configuration and the audit's canaries.

    Build it from its parts (only ``privacy`` is required; the rest default to ``privtune audit``'s defaults), or
    with :meth:`create` from the flat keywords of ``privtune audit``.

    privacy : the claim: ε (σ is calibrated for the union of the data and the included canaries) or σ (≥ 1e-6,
        ε is computed); δ (``None`` = from the data size) and the accountant.
    mode : what is trained, one of :data:`AUDITED_MODES` (two-phase is audited phase by phase; a causal language
        model takes "lora", "full" or "bitfit"); ``None`` = the data's default: "bitfit" on labelled text, "lora"
        on prompt → response data (:meth:`for_data`).
    schedule : epochs or steps, the expected batch size B (examples, or units at user level; ``None`` =
        min(N, 256)), sampling ("poisson" or "full_batch") and the micro-batch size (examples per pass).
    optim, clipping : the optimizer (name, learning rate; ``None`` = the mode's default) and the clipping (C in
        units of the gradient's L2 norm, the rule), as for :func:`privtune.train`.
    num_canaries : m ≥ 10 canaries per audit, each included with probability 1/2; ``None`` = the data's default:
        1000 on labelled text, 100 on prompt → response data.
    exposure : the secret digit canaries of prompt → response data (:class:`ExposureSpec`).
    whitebox, blackbox : which audits run (at least one): the white-box audit of the DP step (no user data) and
        the black-box audit (one real training run on the data plus the included canaries).
    public_data : the data is declared public: the black-box run is not charged to the ledger.
    confidence : 1 − β of the lower bounds, in (0, 1).
    seed : an integer in [0, 2⁶²] seeding canaries, membership, the probe and the training run; ``None`` = OS
        entropy (and the training run's seeds are never recorded).
    privacy_unit : ``None`` (example level) or the column naming each row's unit (user level).
    max_rows_per_unit : k ≥ 1, the public cap on one unit's rows per step (default 8; user level only).
    canary_rows : r ≥ 1 rows of each canary unit, in or out whole (default k; user level only).

    A user-level audit (``privacy_unit``) inserts canary units of r rows, in or out whole: on labelled text r
    random texts of one label, on prompt → response data the same secret r times (a person who repeats it).
    """

    privacy: PrivacySpec
    mode: str | None = None
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    optim: OptimizerSpec = field(default_factory=OptimizerSpec)
    clipping: ClippingSpec = field(default_factory=ClippingSpec)
    num_canaries: int | None = None
    exposure: ExposureSpec = field(default_factory=ExposureSpec)
    whitebox: bool = True
    blackbox: bool = True
    public_data: bool = False
    confidence: float = 0.95
    seed: int | None = None
    privacy_unit: str | None = None
    max_rows_per_unit: int | None = None
    canary_rows: int | None = None

    @classmethod
    def create(cls, *, epsilon: float | None = None, noise_multiplier: float | None = None,
               delta: float | None = None, accountant: str = "pld", mode: str | None = None,
               epochs: float | None = None, steps: int | None = None, batch_size: int | None = None,
               sampling: str = "poisson", max_physical_batch_size: int = 32, optimizer: str = "adam",
               learning_rate: float | None = None, clip: float = 1.0, clipping: str = "flat",
               **fields: Any) -> AuditSpec:
        """An :class:`AuditSpec` from flat keywords, those of ``privtune audit`` and :func:`privtune.train`.

        The keywords of the nested specs are spelled out: ``epsilon``, ``noise_multiplier``, ``delta``,
        ``accountant`` (:class:`~privtune.specs.PrivacySpec`); ``epochs``, ``steps``, ``batch_size``, ``sampling``,
        ``max_physical_batch_size`` (:class:`~privtune.specs.ScheduleSpec`); ``optimizer``, ``learning_rate``
        (:class:`~privtune.specs.OptimizerSpec`); ``clip``, ``clipping`` (:class:`~privtune.specs.ClippingSpec`).
        ``canary_digits``, ``candidates`` and ``reference`` build the :class:`ExposureSpec`.  ``mode`` and
        ``fields`` are this class's own fields (``num_canaries``, ``whitebox``, ``blackbox``, ``public_data``,
        ``confidence``, ``seed``, ``privacy_unit``, ``max_rows_per_unit``, ``canary_rows``).  Every value is
        checked here, as when the class is built directly.
        """
        unknown = sorted(set(fields) - set(_OWN_FIELDS) - set(_EXPOSURE_FIELDS))
        if unknown:
            raise InvalidParameterError(
                f"AuditSpec.create() does not take {', '.join(f'`{k}`' for k in unknown)}. It takes the privacy, "
                f"schedule, optimizer and clipping keywords, `mode` and: {', '.join(_OWN_FIELDS + _EXPOSURE_FIELDS)}.")
        exposure = ExposureSpec(**{k: fields.pop(k) for k in _EXPOSURE_FIELDS if k in fields})
        return cls(
            privacy=PrivacySpec(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier, accountant=accountant),
            mode=mode,
            schedule=ScheduleSpec(epochs=epochs, steps=steps, batch_size=batch_size, sampling=sampling,
                                  max_physical_batch_size=max_physical_batch_size),
            optim=OptimizerSpec(name=optimizer, learning_rate=learning_rate),
            clipping=ClippingSpec(clip=clip, clipping=clipping), exposure=exposure, **fields)

    def __post_init__(self) -> None:
        if not isinstance(self.privacy, PrivacySpec):
            raise InvalidParameterError(
                f"`privacy` must be a PrivacySpec, e.g. PrivacySpec(epsilon=1.0, delta=1e-5). Got "
                f"{type(self.privacy).__name__}. Or build the spec with AuditSpec.create(epsilon=..., delta=...).")
        for name, kind in (("schedule", ScheduleSpec), ("optim", OptimizerSpec), ("clipping", ClippingSpec)):
            if not isinstance(getattr(self, name), kind):
                raise InvalidParameterError(f"`{name}` must be a {kind.__name__}. Got "
                                            f"{type(getattr(self, name)).__name__}.")
        if not (_check_flag(self.whitebox, "whitebox") | _check_flag(self.blackbox, "blackbox")):
            raise InvalidParameterError("Nothing to audit: `whitebox` and `blackbox` are both False. Enable one.")
        if self.privacy.noise_multiplier is not None:
            check_accounted_noise_multiplier(self.privacy.noise_multiplier)
        if self.mode is not None:
            _set(self, "mode", check_choice(self.mode, "mode", AUDITED_MODES))
        check_choice(self.schedule.sampling, "sampling", ("poisson", "full_batch"))
        _set(self, "clipping", self.clipping.with_defaults())
        if self.num_canaries is not None:
            _set(self, "num_canaries", _check_canaries(self.num_canaries))
        if not isinstance(self.exposure, ExposureSpec):
            raise InvalidParameterError(f"`exposure` must be an ExposureSpec, e.g. ExposureSpec(canary_digits=6). "
                                        f"Got {type(self.exposure).__name__}.")
        # the secrets must suffice for the canaries of prompt → response data (explicit m, or its default)
        self.exposure.check_canaries(self.num_canaries or DEFAULTS["generation"][1])
        _set(self, "confidence", _check_confidence(self.confidence))
        _check_flag(self.public_data, "public_data")
        if self.seed is not None:
            _set(self, "seed", check_int(self.seed, "seed", low=0, high=2**62))
        self._check_unit()

    def _check_unit(self) -> None:
        if self.privacy_unit is None:
            if self.max_rows_per_unit is not None or self.canary_rows is not None:
                raise InvalidParameterError("`max_rows_per_unit` and `canary_rows` apply only with `privacy_unit` "
                                            "(--privacy-unit COLUMN). Add it, or drop them.")
            return
        if not isinstance(self.privacy_unit, str):
            raise InvalidParameterError(
                f"`privacy_unit` must name a column of the data. Got {type(self.privacy_unit).__name__}.")
        k = check_max_rows_per_unit(DEFAULT_MAX_ROWS_PER_UNIT if self.max_rows_per_unit is None
                                    else self.max_rows_per_unit)
        _set(self, "max_rows_per_unit", k)
        _set(self, "canary_rows", check_int(k if self.canary_rows is None else self.canary_rows, "canary_rows",
                                            low=1, fix="Pass the rows of each canary unit, e.g. the cap k."))

    def for_data(self, generation: bool) -> AuditSpec:
        """This spec with the data kind's defaults filled in (``mode``, ``num_canaries``; see :data:`DEFAULTS`)
        and checked against that kind: prompt → response data (a causal language model) takes the modes of
        :data:`GENERATION_AUDITED_MODES`."""
        mode, m = DEFAULTS["generation" if generation else "classifier"]
        spec = replace(self, mode=self.mode if self.mode is not None else mode,
                       num_canaries=self.num_canaries if self.num_canaries is not None else m)
        if generation:
            check_choice(spec.mode, "mode", GENERATION_AUDITED_MODES)
        return spec


#: AuditSpec's own fields that AuditSpec.create takes as they are (the nested specs' are spelled out)
_OWN_FIELDS = ("num_canaries", "whitebox", "blackbox", "public_data", "confidence", "seed", "privacy_unit",
               "max_rows_per_unit", "canary_rows")
#: the flat keywords of AuditSpec.create that build its ExposureSpec (those of ExposureSpec itself)
_EXPOSURE_FIELDS = ("canary_digits", "candidates", "reference")
