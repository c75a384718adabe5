"""Shared pieces of every tuning strategy: budget plans, trial records, honest selection.

A strategy works in three phases, and this module holds what they share:

1. **Plan** (before any data is read): the trial events are fixed from data-independent
   choices (per-trial budgets, numbers of trials, scoring releases) and the final run's σ
   is derived by calibrating *inside the composition* with
   :func:`privtune.accounting.calibrate_noise_multiplier` (``spent_events=``), so the
   composed total meets the user's total (ε, δ).  An infeasible plan raises
   :class:`~privtune.errors.InfeasibleBudgetError` at once, with the numbers and a fix.
2. **Trials**, each scored by one :class:`Selector`: a validation split the user declared
   public (free), a private split through a noisy count whose cost is charged, or a
   privatised statistic of the training data.  The split used for the reported accuracy
   is never handed to a selector.
3. **Final run** with the remaining budget, then one certificate listing every event.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

import privtune.accounting as acct
from privtune._validation import check_delta, check_epsilon, check_int, check_real
from privtune.accounting.events import DPSGDEvent, Event, GaussianEvent, event_to_dict
from privtune.choices import SELECTIONS, TUNABLE_MODES
from privtune.engine.mechanisms import noisy_scalar
from privtune.engine.sampling import make_generator
from privtune.errors import InfeasibleBudgetError, InvalidParameterError
from privtune.hpo.recommend import recommend, steps_for_epochs

#: Where a trial's score comes from.  Written into the certificate metadata.
SELECTION_SOURCES = ("public_validation", "private_validation_noisy", "train_noisy", "train_loss_noisy", "none")
#: ``tune(selection=...)`` / ``--selection``: each user-facing name and the selection source it scores with
SELECTION_SOURCE_OF = {
    "public-validation": "public_validation",
    "private-validation": "private_validation_noisy",
    "train-accuracy": "train_noisy",
    "train-loss": "train_loss_noisy",
}

_SOURCE_TEXT = {
    "public_validation": "accuracy on a validation split the user declared PUBLIC (not charged)",
    "private_validation_noisy": "noisy accuracy on a PRIVATE validation split (Gaussian count, charged)",
    "train_noisy": "noisy accuracy on the private training data (Gaussian count, charged)",
    "train_loss_noisy": "privatised training loss (clipped loss sum + Gaussian noise, charged)",
    "none": "no data-dependent selection (no trials)",
}


def describe_selection(source: str) -> str:
    """One-line description of a selection source, for reports and the certificate."""
    return _SOURCE_TEXT.get(source, source)


# --------------------------------------------------------------------------------------
# accounting helpers (thin wrappers; all privacy maths lives in privtune.accounting)
# --------------------------------------------------------------------------------------


def noise_seed(rng) -> int:
    """A run's noise seed drawn from ``rng`` (a numpy Generator): 62 bits, like
    :func:`privtune.hpo._resume.derive_seed`.  The seed determines the noise; one from a space small enough to
    enumerate (2**31) would let anyone holding a released output search for the noise that produced it."""
    return int(rng.integers(2**62))


def epsilon_of(events: Sequence[Event], delta: float, accountant: str = "pld") -> float:
    """ε of the composition of ``events`` at ``delta`` (0 for no events)."""
    events = list(events)
    if not events:
        return 0.0
    return float(acct.compute_epsilon(events, delta, accountant=accountant))


def mu_from_epsilon(epsilon: float, delta: float) -> float:
    """μ of the Gaussian mechanism (μ-GDP) that is exactly (ε, δ)-DP; 1/σ for one full-batch release."""
    return float(acct.gdp.mu_from_epsilon(epsilon, delta))


def full_batch_event(mu: float, steps: int, label: str = "") -> GaussianEvent:
    """Full-batch DP-GD for ``steps`` steps at per-run privacy μ: ``GaussianEvent(σ=√T/μ, count=T)``."""
    return GaussianEvent(noise_multiplier=math.sqrt(steps) / mu, count=int(steps), label=label)


def calibrate_final(
    total_epsilon: float,
    delta: float,
    spent_events: Sequence[Event],
    *,
    sample_rate: float,
    steps: int,
    sampling: str = "poisson",
    accountant: str = "pld",
    what: str = "the final run",
    suggestion: str = "",
    max_noise_multiplier: float | None = None,
) -> float:
    """σ of the final run so that ``spent_events`` + the final DP-SGD run compose to ≤ total ε.

    Wraps :func:`privtune.accounting.calibrate_noise_multiplier` (``spent_events=``) and
    turns an infeasible budget into an :class:`InfeasibleBudgetError` that states the
    numbers (ε of the trials alone versus the total) and how to fix it.
    """
    spent = list(spent_events)
    kw = {}
    if max_noise_multiplier is None and (sampling == "full_batch" or sample_rate >= 1.0):
        # full batch: σ = √T/μ can legitimately be large (it is the per-step multiplier); the
        # ceiling must not reject a feasible μ after trials have run
        max_noise_multiplier = 1e6
    if max_noise_multiplier is not None:
        kw["max_noise_multiplier"] = max_noise_multiplier
    try:
        return float(
            acct.calibrate_noise_multiplier(
                total_epsilon, delta, sample_rate, steps, accountant=accountant,
                spent_events=spent, sampling=sampling, **kw,
            )
        )
    except InfeasibleBudgetError as exc:
        eps_spent = epsilon_of(spent, delta, accountant) if spent else 0.0
        if eps_spent < 0.5 * total_epsilon:
            raise InfeasibleBudgetError(
                f"Budget plan infeasible: {what} cannot meet the total `epsilon` = {total_epsilon:g} at δ = {delta:g} "
                f"(tuning spends ε = {eps_spent:.4g} of it) without noise above the ceiling: ε is too small for "
                f"this schedule (q = {sample_rate:.4g}, T = {steps}). Raise `epsilon`, or use fewer steps / a smaller "
                f"batch. (accounting: {exc})"
            ) from None
        msg = (
            f"Budget plan infeasible: the tuning trials alone cost ε = {eps_spent:.4g} at δ = {delta:g}, "
            f"which leaves no room for {what} within the total `epsilon` = {total_epsilon:g}."
        )
        if suggestion:
            msg += " " + suggestion
        else:
            msg += (
                f" Raise `epsilon` to at least {max(2 * eps_spent, 1.25 * eps_spent + 0.05):.3g}, or use a "
                "cheaper schedule (fewer trials or smaller per-trial budgets)."
            )
        msg += f" (accounting: {exc})"
        raise InfeasibleBudgetError(msg) from None


# --------------------------------------------------------------------------------------
# plan and trial records
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BudgetPlan:
    """What a strategy will spend, fixed before any data is read; immutable (a changed plan is a new object,
    :func:`dataclasses.replace`).  Each strategy plans a subclass holding its own typed fields.

    Attributes
    ----------
    strategy : the strategy's name.
    total_epsilon, delta : the user's total target.
    accountant : the accountant the plan was composed with.
    trial_events : planned events of all trials and scoring releases (data-independent).
    final_events : planned events of the final run.
    final_noise_multiplier : σ of the final run (multiplier of the clipping norm) as planned.
    notes : human-readable lines (budget split, per-trial ε, ...), printed before spending.
    config : the strategy's config the plan was made with (what its ``run`` executes).
    accounting : how the trials compose, when the strategy chooses (random search); "" otherwise.
    epsilon_cap, covered : set on a copy by :meth:`covered_by` once the plan is reserved: the ε (at ``delta``,
        with ``accountant``) that in-run calibrations must not exceed, and a predicate telling whether a list of
        events is covered by the ledger reservation (the ledger refuses larger commits).
    """

    strategy: str
    total_epsilon: float
    delta: float
    accountant: str
    trial_events: list = field(default_factory=list)
    final_events: list = field(default_factory=list)
    final_noise_multiplier: float | None = None
    notes: list = field(default_factory=list)
    config: Any = field(default=None, repr=False, compare=False)
    epsilon_cap: float | None = field(default=None, repr=False)
    covered: Callable[[list], bool] | None = field(default=None, repr=False, compare=False)
    #: how the trials compose, when the strategy chooses it: ``"composition"`` or ``"repeat-and-select"``
    accounting: str = ""

    def covered_by(self, epsilon_cap: float, covered: Callable[[list], bool]) -> "BudgetPlan":
        """A copy of this plan armed with the reservation's cap and cover predicate."""
        return dataclasses.replace(self, epsilon_cap=epsilon_cap, covered=covered)

    def trials_expected(self) -> int | None:
        """The number of trial runs, for the progress display (None: unknown, none, or not published)."""
        return None

    def strategy_details(self) -> dict[str, Any]:
        """The strategy's own planned quantities, as plain data (the plan's ``details`` in ``history.json``)."""
        base = {f.name for f in dataclasses.fields(BudgetPlan)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in base}

    def run_target(self) -> float:
        """The ε an in-run calibration targets: the total, or the reserved ε when that is smaller."""
        if self.epsilon_cap is None:
            return self.total_epsilon
        return min(self.total_epsilon, self.epsilon_cap)

    def fits(self, events: Sequence[Event]) -> bool:
        """True when ``events`` compose within the total and within the reservation (if any)."""
        events = list(events)
        if epsilon_of(events, self.delta, self.accountant) > self.run_target() * (1 + 1e-12):
            return False
        return True if self.covered is None else bool(self.covered(events))

    @property
    def events(self) -> list:
        """All planned events (trials, scoring, final run): what the ledger reserves."""
        return list(self.trial_events) + list(self.final_events)

    def planned_epsilon(self) -> float:
        """ε of the composition of all planned events."""
        return epsilon_of(self.events, self.delta, self.accountant)

    def trial_epsilon(self) -> float:
        """ε of the planned trial events alone."""
        return epsilon_of(self.trial_events, self.delta, self.accountant)

    def describe(self) -> str:
        lines = [f"budget plan ({self.strategy}): total ε = {self.total_epsilon:g}, δ = {self.delta:g}"]
        lines += ["  " + n for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        details = self.strategy_details()
        if self.accounting:
            details["accounting"] = self.accounting
        if self.config is not None:
            details["config"] = self.config
        return {
            "strategy": self.strategy,
            "total_epsilon": self.total_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "trial_events": [event_to_dict(e) for e in self.trial_events],
            "final_events": [event_to_dict(e) for e in self.final_events],
            "final_noise_multiplier": self.final_noise_multiplier,
            "notes": list(self.notes),
            "details": details,
        }


@dataclass
class TrialRecord:
    """One tuning trial: what was tried, what it cost, how it scored and where the score came from."""

    index: int
    hyperparameters: dict
    events: list
    score: float | None
    score_source: str
    phase: str = ""
    epsilon_after: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "hyperparameters": dict(self.hyperparameters),
            "events": [event_to_dict(e) for e in self.events],
            "score": self.score,
            "score_source": self.score_source,
            "epsilon_after": self.epsilon_after,
            **({"extra": self.extra} if self.extra else {}),
        }


def calibrate_in_plan(p: BudgetPlan, spent_events: Sequence[Event], *, sample_rate: float, steps: int,
                      sampling: str = "poisson", what: str = "the final run") -> float:
    """σ of a final run calibrated *during* a strategy (e.g. after linear scaling's fit chose T).

    The composition ``spent_events`` + the final run meets :meth:`BudgetPlan.run_target` (the total,
    or the reserved ε when smaller) and is covered by the ledger reservation
    (:meth:`BudgetPlan.fits`); the target is lowered by tiny steps when the ledger's own measure
    (its δ and accountant) needs it.  Raises :class:`InfeasibleBudgetError` otherwise — before the
    final run reads any data.
    """
    spent = list(spent_events)
    target = p.run_target()
    last = None
    for shrink in (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2):
        sigma = calibrate_final(target * (1.0 - shrink), p.delta, spent, sample_rate=sample_rate, steps=steps,
                                sampling=sampling, accountant=p.accountant, what=what)
        if sampling == "full_batch" or sample_rate >= 1.0:
            final = GaussianEvent(sigma, int(steps), label="final run")
        else:
            final = DPSGDEvent(sigma, sample_rate, int(steps), label="final run")
        if p.fits(spent + [final]):
            return sigma
        last = epsilon_of(spent + [final], p.delta, p.accountant)
    raise InfeasibleBudgetError(
        f"{what} cannot be calibrated within the reserved budget (ε = {p.run_target():.6g}; best attempt "
        f"{last:.6g}). Nothing more was run; the reservation stays charged."
    )


def fill_epsilon_after(trials: Sequence[TrialRecord], delta: float, accountant: str = "pld",
                       prefix_events: Sequence[Event] = ()) -> None:
    """Set each trial's ``epsilon_after``: cumulative ε of all events up to and including it."""
    acc = list(prefix_events)
    for t in trials:
        acc += list(t.events)
        t.epsilon_after = epsilon_of(acc, delta, accountant) if acc else 0.0


# --------------------------------------------------------------------------------------
# honest selection
# --------------------------------------------------------------------------------------


@dataclass
class Selector:
    """Scores a trial's predictions honestly.

    ``source`` is one of :data:`SELECTION_SOURCES`:

    * ``"public_validation"``: accuracy on ``labels`` of a split the user declared public;
      post-processing of public data, no privacy cost.
    * ``"private_validation_noisy"`` / ``"train_noisy"``: the number of correct
      predictions on private examples (sensitivity 1 under add/remove) is released with
      Gaussian noise of standard deviation ``noise_std`` (so the noise multiplier is
      ``noise_std``); each score is a :class:`GaussianEvent` that is charged.

    ``data`` is whatever the backend's ``predict`` takes (a feature matrix or a dataset);
    ``name`` identifies it in the selection log used by the honesty tests.  ``public_size``: the
    number of scored rows as published, when the realised one is private (a private validation
    split drawn at random): scores are normalised by it, never by ``len(labels)``.
    """

    source: str
    data: Any
    labels: torch.Tensor
    noise_std: float = 0.0
    name: str = ""
    seed: int | None = None
    loss_clip: float = 3.0
    log: list = field(default_factory=list)
    public_size: int | None = None
    #: user level: (n,) weights 1/c_u of the scored rows (privtune.engine.units.UnitIndex.mean_weights), so that
    #: each privacy unit adds the mean of its rows' terms and a charged score's sensitivity is per unit; None: 1
    row_weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.source not in SELECTION_SOURCES or self.source == "none":
            raise InvalidParameterError(
                f"`selection` must be one of {SELECTION_SOURCES[:-1]}. Got {self.source!r}."
            )
        if self.source != "public_validation":
            check_real(self.noise_std, "selection_noise", low=0.0,
                       fix="A charged selection score needs Gaussian noise; pass e.g. selection_noise=20.")
        self.labels = torch.as_tensor(self.labels).long()
        self._gen = make_generator(self.seed, offset=7919)  # score noise; OS-seeded unless a seed is given

    @property
    def charged(self) -> bool:
        return self.source != "public_validation"

    def score_event(self, label: str = "") -> GaussianEvent | None:
        """The event one score costs (None when the split is public): what :meth:`score` returns with it."""
        if not self.charged:
            return None
        return GaussianEvent(noise_multiplier=self.noise_std, count=1, label=self._label(label))

    def _label(self, label: str) -> str:
        return label or f"score ({self.source})"

    def tie_margin(self, score: float) -> float:
        """How far apart two scores near ``score`` must be before one is better than the other, in score
        units: :data:`TIE_STANDARD_ERRORS` standard errors of the difference of two scores on this split.

        An accuracy p on n examples has sampling variance p(1 − p)/n (two trials' scores: twice that); a
        charged score adds its noise, variance (σ/n)² per score (σ·loss_clip/n for the loss score).  The
        split is public input and σ is planned, so the margin depends on the released score only.
        Without it, short trials at chance look different by noise alone (measured: three η trials on
        2,000 public phrases scored 57.95 %, 56.10 % and 56.00 %, and the first picked an η 10× too small).
        """
        n = self._normaliser()
        noise = (self.noise_std * (self.loss_clip if self.source == "train_loss_noisy" else 1.0) / n) ** 2
        p = min(max(float(score), 0.0), 1.0) if self.source != "train_loss_noisy" else 0.5
        sampling = p * (1.0 - p) / n if self.source != "train_loss_noisy" else 0.0
        return TIE_STANDARD_ERRORS * math.sqrt(2.0 * (sampling + noise))

    def _normaliser(self) -> int:
        """The number of scored rows a score is divided by: :attr:`public_size` when set, else the split's."""
        return max(1, int(self.public_size if self.public_size is not None else self.labels.shape[0]))

    def _weighted(self, terms: torch.Tensor) -> torch.Tensor:
        """Per-row terms times :attr:`row_weights` (user level), else unchanged."""
        return terms if self.row_weights is None else terms.double() * self.row_weights.to(torch.float64)

    def score(self, outputs: torch.Tensor, label: str = "") -> tuple[float, list]:
        """Return (score, events charged) for a trial's outputs on ``data``.

        ``outputs`` are logits (n, K) or predicted labels (n,).  Accuracy sources count
        correct predictions (sensitivity 1); ``"train_loss_noisy"`` releases the sum of
        cross-entropies clipped at ``loss_clip`` (sensitivity ``loss_clip``) and scores
        the negative privatised mean loss.  Public splits are scored exactly and free.
        """
        out = torch.as_tensor(outputs)
        n = self._normaliser()
        if out.shape[0] != self.labels.shape[0]:
            raise InvalidParameterError(
                f"outputs have {out.shape[0]} rows but the selection split has {self.labels.shape[0]}."
            )
        self.log.append(self.name)
        if self.source == "train_loss_noisy":
            if out.dim() != 2:
                raise InvalidParameterError("selection='train-loss' needs logits, not labels.")
            losses = torch.nn.functional.cross_entropy(out.float(), self.labels, reduction="none")
            total = float(self._weighted(losses.clamp(0.0, self.loss_clip)).sum().item())
            released = noisy_scalar(total, self.noise_std, self.loss_clip, self._gen, label=self._label(label))
            return -released.value / n, [released.event]
        pred = out.argmax(dim=1) if out.dim() == 2 else out.long().view(-1)
        correct = float(self._weighted((pred == self.labels).double()).sum().item())
        if not self.charged:
            return correct / n, []
        released = noisy_scalar(correct, self.noise_std, 1.0, self._gen, label=self._label(label))
        return released.value / n, [released.event]


@runtime_checkable
class Scorer(Protocol):
    """What strategies need of a selector: :class:`Selector`, or the run journal's wrapper of one."""

    #: one of :data:`SELECTION_SOURCES`
    source: str
    #: what the backend's ``predict``/``logits`` take (a feature matrix or a dataset)
    data: Any
    #: (n,) labels of the scored split
    labels: torch.Tensor

    @property
    def charged(self) -> bool:
        """Whether a score costs privacy (False on a public split)."""

    def score(self, outputs: torch.Tensor, label: str = "") -> tuple[float, list]:
        """(score, events charged) of a trial's outputs on :attr:`data`."""

    def score_event(self, label: str = "") -> GaussianEvent | None:
        """The event one score costs (None when the split is public)."""

    def tie_margin(self, score: float) -> float:
        """Score difference below which two scores near ``score`` are a tie."""


#: score differences within this many standard errors of a difference are ties (:meth:`Selector.tie_margin`)
TIE_STANDARD_ERRORS = 2.0


def default_selection_noise(n: int) -> float:
    """Default σ of a charged count score: accuracy noise std ≈ 0.5 % of n, at least 5 (μ ≤ 0.2)."""
    return float(max(5.0, 0.005 * n))


def statistical_ties(records: Sequence[TrialRecord], selector: Selector | None, tolerance: float = 0.0) -> list:
    """The records whose score is within ``selector.tie_margin`` (at least ``tolerance``) of the best one:
    the candidates the selection split cannot tell apart (all of them when no score is finite)."""
    finite = [r for r in records if r.score is not None and math.isfinite(r.score)]
    if not finite:
        return list(records)
    top = max(r.score for r in finite)
    margin = max(tolerance, selector.tie_margin(top) if selector is not None else 0.0)
    return [r for r in finite if r.score >= top - margin]


def choose_best(records: Sequence[TrialRecord], key: Callable[[TrialRecord], float] | None = None,
                tie: Callable[[TrialRecord], float] | None = None) -> TrialRecord:
    """Best trial by score (ties broken by ``tie`` ascending, e.g. smaller r); NaN scores lose."""
    if not records:
        raise InvalidParameterError("no trials to choose from.")

    def k(r: TrialRecord):
        s = key(r) if key else r.score
        s = -math.inf if s is None or not math.isfinite(s) else s
        return (-s, tie(r) if tie else r.index)

    return sorted(records, key=k)[0]


@dataclass
class StrategyOutcome:
    """What a strategy returns to :func:`privtune.hpo.tune`."""

    state: Any                       # the trained final model / head
    final_events: list
    final_hyperparameters: dict
    trials: list                     # TrialRecord
    strategy_data: dict = field(default_factory=dict)
    final_history: dict = field(default_factory=dict)
    selection_source: str = "none"
    certificate_events: list | None = None  # when not the plain concatenation (repeat-and-select)


def validate_total_budget(epsilon: Any, delta: Any, dataset_size: int | None = None) -> tuple[float, float]:
    """Validate the user's total (ε, δ)."""
    return check_epsilon(epsilon), check_delta(delta, dataset_size=dataset_size)


def as_plain(obj: Any) -> Any:
    """Convert dataclasses / tensors / numpy scalars into JSON-friendly values."""
    if hasattr(obj, "__dataclass_fields__"):
        return as_plain(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): as_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except Exception:  # pragma: no cover
            return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


__all__ = [
    "SELECTION_SOURCES",
    "SELECTION_SOURCE_OF",
    "SELECTIONS",
    "TUNABLE_MODES",
    "BudgetPlan",
    "TrialRecord",
    "StrategyOutcome",
    "Scorer",
    "Selector",
    "calibrate_final",
    "calibrate_in_plan",
    "choose_best",
    "default_selection_noise",
    "describe_selection",
    "epsilon_of",
    "noise_seed",
    "fill_epsilon_after",
    "full_batch_event",
    "mu_from_epsilon",
    "validate_total_budget",
    "DPSGDEvent",
    "GaussianEvent",
]


# --------------------------------------------------------------------------------------
# the strategy interface (the registry of implementations is privtune.hpo.registry)
# --------------------------------------------------------------------------------------

#: every tune() override a strategy may take; each strategy lists the ones it uses in ``overrides``
OVERRIDE_NAMES = ("trials", "epochs", "steps", "batch_size", "optimizer")


def data_kind(mode: str) -> str:
    """``"features"`` (the last layer, trained on cached features) or ``"model"`` (bitfit/lora/full)."""
    return "features" if mode == "last-layer" else "model"


@dataclass
class PlanRequest:
    """Everything a strategy's :meth:`Strategy.plan` may use: data-independent choices and public sizes only.

    total_epsilon, delta : the user's total budget.
    n_train : number of training rows (public by declaration: the data size).
    accountant : ``"pld"`` or ``"rdp"``.
    prefix_events : events spent before the strategy (private centring, mode pilots), composed first.
    score_sigma : σ of a charged trial score (noise std of the correct-count), or None for free scores.
    epochs, steps, batch_size : schedule overrides of tune() (None = the strategy's default).
    data_kind : what the rows are, ``"text"`` or ``"image"`` (public: the type of the data), or None; a strategy's
        default may depend on it.
    """

    total_epsilon: float
    delta: float
    n_train: int
    accountant: str = "pld"
    prefix_events: list = field(default_factory=list)
    score_sigma: float | None = None
    epochs: float | None = None
    steps: int | None = None
    batch_size: int | None = None
    data_kind: str | None = None

    def score_event(self) -> GaussianEvent | None:
        return GaussianEvent(self.score_sigma, 1, label="trial score (charged)") if self.score_sigma else None


class Strategy(abc.ABC):
    """A tuning strategy: one class per ``hpo/<name>.py``, registered in :mod:`privtune.hpo.registry`.

    Class attributes (read by tune(), the config schema and the CLI instead of re-declaring them):

    name : the ``--strategy`` value.
    modes : the modes it trains (``--mode auto`` pilots only these).
    Config : its config dataclass; its fields are the keys ``strategy_options`` accepts.
    overrides : ``{"features" | "model": names}``: the tune() overrides it uses in each data kind;
        any other override given is refused.
    clipping_kinds : the data kinds where ``clipping=`` applies (empty: refused).
    fixed_clip : the clipping norm it requires, or None when ``clip=`` may set it.
    selects : whether it scores trials with a selector (False: no selection, nothing charged for it).
    not_private : NOT PRIVATE reference: nothing reserved or released, no model.
    independent_trials : its trials run through :func:`privtune.hpo.executors.run_trials`, so they may run
        in parallel (``executor="ray"``); False: one run, and ``executor="ray"`` is refused.

    :meth:`plan` fixes every event before any data is read; :meth:`run` spends at most those events.
    """

    name: str = ""
    modes: tuple = ()
    Config: type = type(None)
    overrides: dict = {}
    clipping_kinds: frozenset = frozenset()
    fixed_clip: float | None = None
    selects: bool = True
    not_private: bool = False
    independent_trials: bool = False

    def make_config(self, options: dict, *, trials=None, optimizer=None, clip=None, clipping=None):
        """The strategy's config from ``strategy_options`` plus tune()'s overrides (unknown keys refused)."""
        cfg = config_from_options(self.Config, options)
        set_override(cfg, "clip", clip)
        set_override(cfg, "clipping", clipping)
        self.apply_overrides(cfg, trials=trials, optimizer=optimizer)
        return cfg

    def apply_overrides(self, cfg, *, trials=None, optimizer=None) -> None:
        """Set tune()'s ``trials``/``optimizer`` into ``cfg`` (only those listed in ``overrides`` reach here)."""

    @abc.abstractmethod
    def plan(self, cfg, mode: str, request: PlanRequest) -> BudgetPlan:
        """The privacy events of the whole strategy, from public sizes only (before any data is read)."""

    @abc.abstractmethod
    def run(self, backend, selector, plan: BudgetPlan, *, mode: str, seed: int | None = None,
            progress=None) -> StrategyOutcome:
        """Run the planned trials and final run through ``backend`` (the one loop; a
        :class:`~privtune.hpo.backends.Backend`), scored by ``selector`` (a :class:`Scorer`), as ``plan`` (made by
        :meth:`plan`; its ``config`` is the strategy config it was planned with); return their events."""


def config_from_options(cls, options: dict):
    """``cls(**options)``, refusing unknown keys with the valid ones (and a close match) in the message."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(names), n=1)
        raise InvalidParameterError(
            f"`strategy_options` has unknown key(s) {unknown} for {cls.__name__}. Valid keys: {sorted(names)}."
            + (f" Did you mean {close[0]!r}?" if close else "")
        )
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"`strategy_options` for {cls.__name__}: {exc}") from None


def set_override(cfg, name: str, value) -> None:
    """tune(name=...) sets the strategy config's field; a different strategy_options value is a conflict."""
    fields = type(cfg).__dataclass_fields__
    if value is None or name not in fields:
        return
    current = getattr(cfg, name)
    if current != fields[name].default and current != value:
        raise InvalidParameterError(
            f"`{name}`={value!r} conflicts with strategy_options {name}={current!r}; pass one of them.")
    setattr(cfg, name, value)


def planned_examples(events: Sequence[Event], n: int) -> float:
    """Expected training examples the planned gradient steps in ``events`` process (Σ q·n·T over their
    DP-SGD events; 0 for scores and other single releases): public, from the plan, for time-left estimates."""
    return float(sum(min(1.0, e.sample_rate) * n * e.steps for e in events if isinstance(e, DPSGDEvent)))


#: the expected batch sizes that tune's recommendation chooses among (those below n)
RECOMMENDED_BATCH_CANDIDATES = (64, 128, 256, 512, 1024, 2048, 4096)


def recommended_schedule(epsilon: float, delta: float, n: int, epochs: float, accountant: str = "pld"):
    """Rehn et al.'s batch size as ``tune`` applies it, for classifiers and generators alike: among
    :data:`RECOMMENDED_BATCH_CANDIDATES` below ``n`` (else n // 4), the smallest on the noise plateau of
    (ε, δ, n, ``epochs``) with at least 20 steps (:func:`privtune.hpo.recommend.recommend`).  Public sizes only."""
    cands = [b for b in RECOMMENDED_BATCH_CANDIDATES if b < n] or [max(1, n // 4)]
    return recommend(epsilon, delta, n, float(epochs), candidates=cands, min_steps=20, accountant=accountant)


def minibatch_schedule(request: PlanRequest, epochs: float) -> tuple[float, int]:
    """(sample rate q, steps T) of a mini-batch run: tune()'s batch_size/steps, else
    :func:`recommended_schedule`'s."""
    n, steps = request.n_train, request.steps
    if request.batch_size is not None:
        b = check_int(request.batch_size, "batch_size", low=1)
        q = min(1.0, b / n)
        if steps is None:
            steps = steps_for_epochs(n, b, float(epochs))
        return q, int(steps)
    rec = recommended_schedule(request.total_epsilon, request.delta, n, epochs, accountant=request.accountant)
    return rec.sample_rate, int(steps if steps is not None else rec.steps)
