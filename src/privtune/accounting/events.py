"""Privacy events: what a mechanism released, as data.

A run (a training run, a tuning trial, a release of noisy losses) is described by a list
of events.  Events are frozen dataclasses holding exactly the parameters an accountant
needs; they serialise to plain dicts (for certificates and the ledger) and convert to
``dp_accounting`` events, which is where all privacy mathematics happens.

Conventions, shared by every event:

* Neighbouring relation: add/remove one example.
* ``noise_multiplier`` (σ) is dimensionless: the Gaussian noise's standard deviation
  divided by the L2 sensitivity of the released sum (the clipping norm C for clipped
  gradient sums).  A release with noise N(0, σ²C²) of a sum whose per-example
  contributions have norm ≤ C is one :class:`GaussianEvent` with that σ.
* ``sample_rate`` (q) is the Poisson sampling probability of each example per step.
* A release without a finite guarantee (no noise, or no clipping) is a :class:`NonPrivateEvent`:
  it composes to ε = ∞ in every accountant, so it can never hide inside a composition.

Rules for evolving events (as in dp_accounting): an event's meaning never changes, new
fields are optional, and ``from_dict`` rejects unknown kinds and fields instead of
dropping them, so that an old certificate never silently loses privacy cost.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from privtune._validation import check_int, check_noise_multiplier, check_real, check_sample_rate, check_steps
from privtune.choices import SAMPLING_SCHEMES
from privtune.errors import CertificateError, InvalidParameterError



@dataclass(frozen=True)
class GaussianEvent:
    """``count`` releases of a Gaussian mechanism on the full dataset (no subsampling).

    Each release adds N(0, σ²Δ²) to a statistic of L2 sensitivity Δ; ``noise_multiplier`` is σ.
    Full-batch DP-GD for T steps is ``GaussianEvent(σ, count=T)``; it is exactly
    μ-GDP with μ = √T/σ.  A privatised validation metric or loss released once is
    ``GaussianEvent(σ, 1)``.
    """

    kind: ClassVar[str] = "gaussian"
    noise_multiplier: float
    count: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "count", check_int(self.count, "count", low=1))


@dataclass(frozen=True)
class DPSGDEvent:
    """``steps`` steps of a sampled Gaussian mechanism on clipped per-example gradients.

    Each step samples a batch, sums per-example contributions of norm ≤ C and adds
    N(0, σ²C²).  ``sampling`` says how batches were drawn:

    * ``"poisson"``: each example independently with probability ``sample_rate``; the
      accountant uses privacy amplification by subsampling.
    * ``"shuffle"``: a random permutation cut into batches.  No amplification is
      claimed: the event is accounted as ``epochs = ceil(steps · sample_rate)`` Gaussian
      releases of multiplier σ/√5 (adding or removing one example changes at most two batch
      sums of an epoch, by ≤ 2C and ≤ C).  Valid only for batches of B = q·N from N examples
      with N mod B ∉ {0, 1}, so that a neighbour has the same number of batches per epoch
      ⌈N/B⌉ (``privtune.fit``/``train`` refuse other N; see
      ``privtune.engine.sampling.check_shuffle_batching``), unless
      ``assume_poisson`` is True, in which case it is accounted as Poisson and the
      certificate says that this was an assumption.
    * ``"full_batch"``: every example every step (``sample_rate`` must be 1).
    """

    kind: ClassVar[str] = "dpsgd"
    noise_multiplier: float
    sample_rate: float
    steps: int
    sampling: str = "poisson"
    assume_poisson: bool = False
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        object.__setattr__(self, "steps", check_steps(self.steps))
        if self.sampling not in SAMPLING_SCHEMES:
            raise InvalidParameterError(
                f"`sampling` must be one of {SAMPLING_SCHEMES}. Got {self.sampling!r}."
            )
        if self.sampling == "full_batch" and self.sample_rate != 1.0:
            raise InvalidParameterError(
                f"`sample_rate` must be 1.0 when sampling='full_batch'. Got {self.sample_rate!r}."
            )
        if self.assume_poisson and self.sampling != "shuffle":
            raise InvalidParameterError("`assume_poisson` only applies to sampling='shuffle'.")

    @property
    def epochs(self) -> int:
        """Number of passes over the data that the steps make (rounded up)."""
        return max(1, math.ceil(self.steps * self.sample_rate - 1e-9))


@dataclass(frozen=True)
class RepeatAndSelectEvent:
    """Run a mechanism a random number of times and release only the best run.

    Papernot & Steinke (ICLR 2022): the number of repetitions K is drawn from a
    truncated negative binomial distribution with ``mean`` and ``shape`` (shape 0 is
    logarithmic, shape 1 geometric); the cost is accounted with Rényi DP through
    ``dp_accounting.dp_event.RepeatAndSelectDpEvent``.  ``events`` is the inner
    mechanism (one tuning trial) as a list of events.  Only the RDP accountant
    supports this event; asking PLD for it falls back to RDP with a stated reason.
    """

    kind: ClassVar[str] = "repeat_and_select"
    events: tuple = ()
    mean: float = 1.0
    shape: float = 1.0
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        if not self.events:
            raise InvalidParameterError("`events` of a RepeatAndSelectEvent must not be empty.")
        for e in self.events:
            if not isinstance(e, PRIMITIVE_EVENT_TYPES):
                raise InvalidParameterError(
                    f"RepeatAndSelectEvent can only repeat primitive events "
                    f"(GaussianEvent, DPSGDEvent); got {type(e).__name__}."
                )
        object.__setattr__(self, "mean", check_real(self.mean, "mean", low=0.0))
        object.__setattr__(self, "shape", check_real(self.shape, "shape", low=0.0, low_inclusive=True))


@dataclass(frozen=True)
class NonPrivateEvent:
    """A release with no differential-privacy guarantee: ε = ∞ (δ = 1) in every accountant.

    Emitted by every path that releases something computed from private data without noise or
    without a sensitivity bound, e.g. ``fit`` with ``NoiseSpec(noise_multiplier=0, ...)`` and ``fit_nonprivate``.  It
    is dp_accounting's ``NonPrivateDpEvent``: any composition containing it has ε = ∞, so a
    non-private step can never look free (an empty event list composes to ε = 0).  ``reason``
    says what was released without protection; it appears in notes and certificates.  It
    serialises as ``{"kind": "non_private", "reason": ..., "label": ...}`` (no infinite
    number is written, so the JSON stays standard).  The budget ledger refuses to charge it.
    """

    kind: ClassVar[str] = "non_private"
    reason: str = ""
    label: str = ""

    def __post_init__(self) -> None:
        for name in ("reason", "label"):
            if not isinstance(getattr(self, name), str):
                raise InvalidParameterError(
                    f"`{name}` of a NonPrivateEvent must be a string. Got {type(getattr(self, name)).__name__}."
                )


PRIMITIVE_EVENT_TYPES = (GaussianEvent, DPSGDEvent)
EVENT_TYPES = {cls.kind: cls for cls in (GaussianEvent, DPSGDEvent, RepeatAndSelectEvent, NonPrivateEvent)}
Event = GaussianEvent | DPSGDEvent | RepeatAndSelectEvent | NonPrivateEvent

#: DP-SGD sampling schemes whose runs compose additively (T₁ + T₂ steps of the same (σ, q) are one run of
#: T₁ + T₂ steps).  Shuffled runs are not: each is charged ⌈T·q⌉ whole epochs, and merging two half-epoch
#: runs would count one epoch where there are two.
_ADDITIVE_SAMPLING = ("poisson", "full_batch")


def group_events(events) -> list:
    """Merge events whose composition is *exactly* additive; keep first-occurrence order.

    The one event grouper (dp_accounting's ``DpEventBuilder`` role), used by the accountant before
    lowering and by the ledger before composing or comparing plans:

    * ``GaussianEvent(σ, a)`` and ``GaussianEvent(σ, b)`` -> ``GaussianEvent(σ, a + b)``;
    * ``DPSGDEvent(σ, q, T1, s)`` and ``DPSGDEvent(σ, q, T2, s)`` -> ``DPSGDEvent(σ, q, T1 + T2, s)`` for
      ``s`` in ``"poisson"``, ``"full_batch"`` (never for shuffled batches, see ``_ADDITIVE_SAMPLING``);
    * any number of :class:`NonPrivateEvent` s -> the first one (∞ composed with ∞ is ∞).

    Repeat-and-select events are kept as they are.  Labels never affect privacy and are dropped
    from merged events.  Grouping never changes ε: each merge is self-composition, which is what
    a count means.
    """
    merged: dict[tuple, Any] = {}  # insertion-ordered: first occurrence decides the position
    for i, e in enumerate(events):
        if isinstance(e, GaussianEvent):
            key: tuple = ("gaussian", e.noise_multiplier)
            prev = merged.get(key)
            merged[key] = GaussianEvent(e.noise_multiplier, e.count + (prev.count if prev else 0))
        elif isinstance(e, DPSGDEvent) and e.sampling in _ADDITIVE_SAMPLING and not e.assume_poisson:
            key = ("dpsgd", e.noise_multiplier, e.sample_rate, e.sampling)
            prev = merged.get(key)
            merged[key] = DPSGDEvent(
                e.noise_multiplier, e.sample_rate, e.steps + (prev.steps if prev else 0), sampling=e.sampling
            )
        elif isinstance(e, NonPrivateEvent):
            merged.setdefault(("non_private",), e)
        else:
            merged[("other", i)] = e
    return list(merged.values())


def event_to_dict(event: Event) -> dict[str, Any]:
    """Serialise an event to a JSON-compatible dict with a ``kind`` key."""
    if not isinstance(event, tuple(EVENT_TYPES.values())):
        raise InvalidParameterError(f"Not a privtune event: {event!r}.")
    out: dict[str, Any] = {"kind": event.kind}
    for f in dataclasses.fields(event):
        v = getattr(event, f.name)
        if f.name == "events":
            v = [event_to_dict(e) for e in v]
        out[f.name] = v
    return out


def event_from_dict(data: dict[str, Any]) -> Event:
    """Inverse of :func:`event_to_dict`; unknown kinds or fields raise CertificateError."""
    if not isinstance(data, dict) or "kind" not in data:
        raise CertificateError(f"An event must be an object with a 'kind' key; got {data!r}.")
    kind = data["kind"]
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise CertificateError(
            f"Unknown event kind {kind!r}; known kinds are {sorted(EVENT_TYPES)}. "
            "It may come from a newer privtune: upgrade with `pip install -U privtune`."
        )
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(data) - names - {"kind"}
    if extra:
        raise CertificateError(
            f"Event of kind {kind!r} has unknown fields {sorted(extra)}; refusing to drop them "
            "because they may carry privacy cost. Upgrade privtune."
        )
    kwargs = {k: v for k, v in data.items() if k != "kind"}
    if cls is RepeatAndSelectEvent:
        kwargs["events"] = tuple(event_from_dict(e) for e in kwargs.get("events", ()))
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required field
        raise CertificateError(f"Malformed event {data!r}: {exc}") from None


def describe_event(event: Event) -> str:
    """A short human-readable summary, e.g. ``'DP-SGD σ=1.1 q=0.01 T=500 (poisson)'``."""
    prefix = f"[{event.label}] " if event.label else ""
    if isinstance(event, NonPrivateEvent):
        return f"{prefix}NOT PRIVATE (ε = ∞){': ' + event.reason if event.reason else ''}"
    if isinstance(event, GaussianEvent):
        return f"{prefix}Gaussian σ={event.noise_multiplier:.4g} ×{event.count}"
    if isinstance(event, DPSGDEvent):
        extra = ", assumed Poisson" if event.assume_poisson else ""
        return (
            f"{prefix}DP-SGD σ={event.noise_multiplier:.4g} q={event.sample_rate:.4g} "
            f"T={event.steps} ({event.sampling}{extra})"
        )
    inner = "; ".join(describe_event(e) for e in event.events)
    return f"{prefix}repeat-and-select (mean {event.mean:g}, shape {event.shape:g}) of [{inner}]"


__all__ = [
    "GaussianEvent",
    "DPSGDEvent",
    "RepeatAndSelectEvent",
    "NonPrivateEvent",
    "Event",
    "group_events",
    "SAMPLING_SCHEMES",
    "event_to_dict",
    "event_from_dict",
    "describe_event",
]

