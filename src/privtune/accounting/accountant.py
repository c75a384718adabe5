"""Accountants: turn a list of privtune events into (ε, δ) with ``dp_accounting``.

All privacy mathematics is done by Google's ``dp_accounting``; this module only

1. *groups* identical events with :func:`~privtune.accounting.events.group_events` (the one event
   grouper, also used by the ledger) and *lowers* them to segments (Poisson-subsampled Gaussian
   (σ, q) × count, or Gaussian (σ) × count) and repeat-and-select events, recording every
   modelling choice (no amplification for shuffling, an explicit Poisson assumption, ...) as a note;
   a :class:`~privtune.accounting.events.NonPrivateEvent` makes the whole composition ε = ∞;
2. *merges* the lowered segments (:func:`merge_segments`): all non-subsampled Gaussian releases
   become one Gaussian with σ_eff = (Σ countᵢ/σᵢ²)^(-1/2), which is exact (a composition of
   Gaussian mechanisms is a Gaussian mechanism, i.e. μ-GDP with μ² = Σ μᵢ²), and equal subsampled
   segments that different event kinds lowered to (Poisson and assumed-Poisson shuffles) add counts;
3. evaluates the composition with either

   * ``"pld"`` (default): privacy loss distributions,
     ``dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism`` with
     ``pessimistic_estimate=True`` (every value is an *upper bound* on the true ε, whatever
     the discretisation), add/remove neighbouring relation, both directions tracked;
     the value discretisation interval is chosen automatically by target precision
     (see :func:`pld_epsilon`), or
   * ``"rdp"``: Rényi DP, ``dp_accounting.rdp.RdpAccountant`` with its default orders.

   ``RepeatAndSelectEvent`` (Papernot & Steinke tuning) is only supported by RDP in
   dp_accounting; when PLD is asked for a list containing one, the whole list is accounted
   with RDP and the result says so (``accountant == "rdp"`` and a note).

Extreme inputs are answered in seconds, never optimistically, and always with a note:

* a PLD grid is never built above ``_fast_pld.MAX_PLD_POINTS`` / ``MAX_COMPOSED_POINTS`` points
  (its size is predicted first).  When the finest affordable interval is coarser than the
  precision target, ε is the pessimistic PLD at that interval (still an upper bound) or the RDP
  bound if smaller; when not even the coarsest interval fits (σ ≲ 0.01, or T ~ 10⁹), the
  composition is accounted with RDP;
* a noise multiplier below :data:`MIN_ACCOUNTED_NOISE_MULTIPLIER` (1e-6), or an RDP bound that
  overflows, gives ε = inf (δ = 1): no finite guarantee is claimed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdplib

from privtune._validation import MIN_ACCOUNTED_NOISE_MULTIPLIER, check_choice, check_delta, check_real
from privtune.accounting._fast_pld import PLDTooLargeError
from privtune.accounting._fast_pld import compose as fast_compose
from privtune.accounting._fast_pld import gaussian_pld
from privtune.accounting._fast_pld import self_compose as fast_self_compose
from privtune.accounting.events import (
    DPSGDEvent,
    Event,
    GaussianEvent,
    NonPrivateEvent,
    RepeatAndSelectEvent,
    describe_event,
    group_events,
)
from privtune.choices import ACCOUNTANTS
from privtune.errors import InvalidParameterError


#: Relative precision (of ε) that the automatic PLD discretisation aims for.
DEFAULT_PLD_RTOL = 1e-3
#: Absolute precision floor (for tiny ε).
DEFAULT_PLD_ATOL = 1e-5
#: Value discretisation intervals tried, coarse to fine (pessimistic PLD at each is an upper bound).
PLD_LEVELS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)
#: dp_accounting's own default interval, used as "the tight PLD reference" in tests/benchmarks.
REFERENCE_PLD_INTERVAL = 1e-4
#: Largest self-composition count accounted without a rounding margin: up to 10⁵ steps the fast PLD path
#: and dp_accounting's public one agree to ≤ 2.2e-8 relative (bench/fast_pld_large_t.py).
LARGE_T_EXACT_UP_TO = 10**5
#: Relative safety margin added to a PLD ε whose composition contains a self-composition of more than
#: LARGE_T_EXACT_UP_TO steps.  Raising an FFT to the power T amplifies float64 rounding ~T·u: two FFT
#: evaluations of the same exact convolution (privtune's, dp_accounting's) differ by up to 1.3e-7 at
#: T = 10⁶, 3e-6 at 10⁷ and 7.5e-5 at 10⁸ relative, in both directions (bench/fast_pld_large_t.py;
#: docs/accounting.md).  The margin is 13× the largest, so a rounding error in the optimistic
#: direction cannot make the reported ε an under-estimate of the pessimistic PLD's.
LARGE_T_MARGIN = 1e-3
# MIN_ACCOUNTED_NOISE_MULTIPLIER (1e-6, imported from privtune._validation): the smallest σ that is
# accounted.  Below it ε is reported as infinite (no guarantee): the RDP bound is already > 5·10¹¹ at
# σ = 1e-6, and dp_accounting's RDP arithmetic breaks down for tiny σ (it raises ZeroDivisionError at
# σ = 1e-200 and returns ε = 0 at σ = 1e-160).


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------
@dataclass
class AccountingResult:
    """The outcome of accounting a list of events.

    ``epsilon`` and ``delta``: the (ε, δ)-DP guarantee (add/remove one example) of the
    whole composition.  ``accountant``: the accountant that produced ε (``"pld"`` or
    ``"rdp"``; may differ from the one requested, then ``notes`` says why).
    ``notes``: every modelling decision taken (no amplification for shuffled batches, an
    explicit Poisson assumption, an RDP fallback, the PLD discretisation used).
    ``sampling_assumptions``: the sampling model of each event, as stated in certificates.
    """

    epsilon: float
    delta: float
    accountant: str
    requested_accountant: str
    notes: list[str] = field(default_factory=list)
    sampling_assumptions: list[str] = field(default_factory=list)
    value_discretization_interval: float | None = None


# --------------------------------------------------------------------------------------------
# lowering events to segments
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Segment:
    """``count`` self-compositions of a Gaussian mechanism with multiplier σ, Poisson-subsampled
    with probability ``sample_rate`` (1.0 = no subsampling)."""

    noise_multiplier: float
    sample_rate: float
    count: int


@dataclass
class _Lowered:
    segments: list[Segment]
    repeat_and_select: list[RepeatAndSelectEvent]
    notes: list[str]
    assumptions: list[str]
    non_private: list[NonPrivateEvent] = field(default_factory=list)


_EVENT_CLASSES = (GaussianEvent, DPSGDEvent, RepeatAndSelectEvent, NonPrivateEvent)


def as_event_list(events) -> list[Event]:
    """Accept one event or an iterable of events; validate the types."""
    if isinstance(events, _EVENT_CLASSES):
        return [events]
    if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
        raise InvalidParameterError(
            f"`events` must be a privtune event or a list of events (GaussianEvent, DPSGDEvent, "
            f"RepeatAndSelectEvent, NonPrivateEvent). Got {events!r}."
        )
    out = list(events)
    for e in out:
        if not isinstance(e, _EVENT_CLASSES):
            raise InvalidParameterError(
                f"`events` must contain only privtune events (GaussianEvent, DPSGDEvent, "
                f"RepeatAndSelectEvent, NonPrivateEvent). Got {e!r}. Build events with "
                "privtune.accounting.DPSGDEvent(...)."
            )
    return out


#: sensitivity of one shuffled epoch in units of C under add/remove-one: √(2² + 1²)
_SHUFFLE_SENSITIVITY = math.sqrt(5.0)


def _lower_primitive(e, notes: list[str], assumptions: list[str]) -> Segment:
    if isinstance(e, GaussianEvent):
        assumptions.append(f"{describe_event(e)}: Gaussian releases on the full dataset (no subsampling)")
        return Segment(e.noise_multiplier, 1.0, e.count)
    assert isinstance(e, DPSGDEvent)
    if e.sampling == "poisson":
        if e.sample_rate >= 1.0:
            assumptions.append(f"{describe_event(e)}: q = 1, every example in every step (no amplification)")
            return Segment(e.noise_multiplier, 1.0, e.steps)
        assumptions.append(f"{describe_event(e)}: Poisson sampling with rate q = {e.sample_rate:g} (amplified)")
        return Segment(e.noise_multiplier, e.sample_rate, e.steps)
    if e.sampling == "full_batch":
        assumptions.append(f"{describe_event(e)}: full batch, every example in every step (no amplification)")
        return Segment(e.noise_multiplier, 1.0, e.steps)
    # shuffle
    if e.assume_poisson:
        assumptions.append(
            f"{describe_event(e)}: shuffled fixed-size batches ASSUMED to be Poisson sampled with rate "
            f"q = {e.sample_rate:g} (the caller asked for this assumption; it is not a proof)"
        )
        notes.append(
            f"{describe_event(e)}: shuffled batches were accounted AS IF Poisson sampled "
            "(assume_poisson=True); the guarantee rests on that assumption."
        )
        if e.sample_rate >= 1.0:
            return Segment(e.noise_multiplier, 1.0, e.steps)
        return Segment(e.noise_multiplier, e.sample_rate, e.steps)
    # Fixed-size batches cut from a permutation: adding (removing) one example puts it in one batch and,
    # under the best coupling, moves one other example into (out of) the epoch's last batch, so two batch
    # sums of the epoch change, by at most 2C and C.  Two Gaussian releases of sensitivities 2C and C
    # compose exactly to one of sensitivity √5·C, i.e. multiplier σ/√5 per epoch.  This also covers
    # replace-one (one sum changes by 2C).  It needs the neighbour to have the same number of batches
    # per epoch, ⌈(N±1)/B⌉ = ⌈N/B⌉, i.e. N mod B ∉ {0, 1}: otherwise every later batch shifts and the
    # bound fails (audit: ε ≥ 3.69 measured against 1.035).  fit/train refuse other N (engine.sampling.
    # check_shuffle_batching); an event alone does not know N, so the condition is stated here.
    assumptions.append(
        f"{describe_event(e)}: shuffled fixed-size batches (B = q·N, drop_last=False), no amplification "
        f"claimed: accounted as {e.epochs} epoch(s), each a Gaussian release with multiplier σ/√5 = "
        f"{e.noise_multiplier / _SHUFFLE_SENSITIVITY:.6g}. Covered: adding or removing one example to a "
        "data set of N examples with N mod B ∉ {0, 1} (then ⌈(N±1)/B⌉ = ⌈N/B⌉ and at most two batch sums "
        "of an epoch change, by ≤ 2C and ≤ C); privtune's fit/train refuse every other N (unless assume_poisson). N itself is "
        "public (it is released as q = B/N)"
    )
    notes.append(
        f"{describe_event(e)}: shuffling gets no privacy amplification and each epoch is charged as a "
        f"Gaussian with multiplier σ/√5 (two batch sums can change under add/remove-one); {e.epochs} "
        "epoch(s) composed. Poisson sampling (the default) is amplified and needs no assumption on the "
        "number of batches."
    )
    return Segment(e.noise_multiplier / _SHUFFLE_SENSITIVITY, 1.0, e.epochs)


def _non_private_note(e: NonPrivateEvent) -> str:
    return (f"{describe_event(e)}: a release without noise or without a sensitivity bound has no "
            "differential-privacy guarantee, so the whole composition has ε = ∞ (δ = 1). Nothing computed "
            "by it may be released as private.")


def lower_events(events) -> _Lowered:
    """Group the events (:func:`group_events`), lower them to merged :class:`Segment` s plus
    repeat-and-select events; notes and sampling assumptions describe the events as given."""
    evs = as_event_list(events)
    notes: list[str] = []
    assumptions: list[str] = []
    rs: list[RepeatAndSelectEvent] = []
    non_private: list[NonPrivateEvent] = []
    for e in evs:  # the text names each event as the caller gave it (labels included)
        if isinstance(e, RepeatAndSelectEvent):
            rs.append(e)
            sub_notes: list[str] = []
            sub_ass: list[str] = []
            for inner in e.events:
                _lower_primitive(inner, sub_notes, sub_ass)
            notes.extend(sub_notes)
            assumptions.extend(
                f"{a} (inside repeat-and-select, mean {e.mean:g}, shape {e.shape:g})" for a in sub_ass
            )
        elif isinstance(e, NonPrivateEvent):
            non_private.append(e)
            notes.append(_non_private_note(e))
            assumptions.append(f"{describe_event(e)}: no guarantee (ε = ∞)")
        else:
            _lower_primitive(e, notes, assumptions)
    raw = [_lower_primitive(g, [], []) for g in group_events(evs) if isinstance(g, (GaussianEvent, DPSGDEvent))]
    return _Lowered(merge_segments(raw), rs, notes, assumptions, non_private)


def merge_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Merge lowered segments exactly: all q = 1 Gaussians into one, equal (σ, q) segments add counts.

    Not a second event grouper (that is :func:`group_events`, applied before lowering): it merges
    what lowering made equal, e.g. shuffled epochs (Gaussians of σ/√5) with full-batch releases, and
    Poisson runs with assumed-Poisson shuffled runs of the same (σ, q).  Both steps are exact:
    self-composition is what the count means, and T₁ Gaussians with σ₁ composed with T₂ with σ₂ is
    one Gaussian with σ_eff = (T₁/σ₁² + T₂/σ₂²)^(-1/2).
    """
    counts: dict[tuple[float, float], int] = {}
    inv_var = 0.0
    for s in segments:
        if s.sample_rate >= 1.0:
            var = s.noise_multiplier**2
            inv_var += s.count / var if var > 0.0 else math.inf
        else:
            key = (s.noise_multiplier, s.sample_rate)
            counts[key] = counts.get(key, 0) + s.count
    out = [Segment(sig, q, c) for (sig, q), c in sorted(counts.items())]
    if inv_var > 0.0:
        out.append(Segment(1.0 / math.sqrt(inv_var), 1.0, 1))  # 0.0 when inv_var overflows to inf
    return out


# --------------------------------------------------------------------------------------------
# dp_accounting events (RDP, and for users who want them)
# --------------------------------------------------------------------------------------------
def segment_to_dp_event(s: Segment) -> dpe.DpEvent:
    base: dpe.DpEvent = dpe.GaussianDpEvent(s.noise_multiplier)
    if s.sample_rate < 1.0:
        base = dpe.PoissonSampledDpEvent(s.sample_rate, base)
    return base if s.count == 1 else dpe.SelfComposedDpEvent(base, s.count)


def to_dp_event(events) -> dpe.DpEvent:
    """The ``dp_accounting`` event equivalent to a list of privtune events (after lowering)."""
    low = lower_events(events)
    parts: list[dpe.DpEvent] = [dpe.NonPrivateDpEvent() for _ in low.non_private[:1]]
    parts += [segment_to_dp_event(s) for s in low.segments]
    for r in low.repeat_and_select:
        inner = lower_events(list(r.events)).segments
        inner_ev = dpe.ComposedDpEvent([segment_to_dp_event(s) for s in inner])
        parts.append(dpe.RepeatAndSelectDpEvent(inner_ev, r.mean, r.shape))
    return dpe.ComposedDpEvent(parts)


# --------------------------------------------------------------------------------------------
# PLD
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=48)
def _base_pld(noise_multiplier: float, sample_rate: float, interval: float):
    # dp_accounting's pessimistic connect-the-dots PLD of the (subsampled) Gaussian,
    # add/remove; built with a vectorised privacy-loss inverse (see _fast_pld; same numbers).
    return gaussian_pld(noise_multiplier, sample_rate, interval)


@functools.lru_cache(maxsize=48)
def _segment_pld(s: Segment, interval: float):
    base = _base_pld(s.noise_multiplier, s.sample_rate, interval)
    return base if s.count == 1 else fast_self_compose(base, s.count)


@functools.lru_cache(maxsize=8)
def _composed_pld(segments: tuple[Segment, ...], interval: float):
    pld = None
    for s in segments:
        p = _segment_pld(s, interval)
        pld = p if pld is None else fast_compose(pld, p)
    return pld


def _large_t(segments: Sequence[Segment]) -> bool:
    return any(s.count > LARGE_T_EXACT_UP_TO for s in segments)


def pld_epsilon_at(segments: Sequence[Segment], delta: float, interval: float) -> float:
    """Pessimistic-PLD ε of the composition at one value discretisation interval (an upper bound).

    With a self-composition of more than :data:`LARGE_T_EXACT_UP_TO` steps, ε is raised by the relative
    :data:`LARGE_T_MARGIN` (FFT-power rounding at huge T)."""
    if not segments:
        return 0.0
    eps = float(_composed_pld(tuple(segments), float(interval)).get_epsilon_for_delta(delta))
    return eps * (1.0 + LARGE_T_MARGIN) if _large_t(segments) else eps


def pld_delta_at(segments: Sequence[Segment], epsilon: float, interval: float) -> float:
    """δ(ε) of the pessimistic PLD; with the large-T margin, δ at ε/(1 + margin) (consistent with
    :func:`pld_epsilon_at`)."""
    if not segments:
        return 0.0
    if _large_t(segments):
        epsilon = epsilon / (1.0 + LARGE_T_MARGIN)
    return float(_composed_pld(tuple(segments), float(interval)).get_delta_for_epsilon(epsilon))


def _large_t_note(segments: Sequence[Segment]) -> str:
    big = max(s.count for s in segments)
    return (f"A self-composition of {big} steps (> {LARGE_T_EXACT_UP_TO:.0e}): the PLD ε includes a "
            f"relative safety margin of {LARGE_T_MARGIN:g} for the float64 rounding of the FFT power "
            "at such T (measured at most 7.5e-5 relative at T = 1e8; docs/accounting.md).")


def choose_pld_interval(
    segments: Sequence[Segment],
    delta: float,
    *,
    rtol: float = DEFAULT_PLD_RTOL,
    atol: float = DEFAULT_PLD_ATOL,
) -> tuple[float, float]:
    """Pick the PLD discretisation by target precision; return ``(interval, epsilon)``.

    Evaluates the pessimistic PLD on the intervals of :data:`PLD_LEVELS`, coarse to fine:
    from the two coarsest levels it predicts, with the model ε(h) ≈ ε* + c·h² (connect-the-dots
    discretisation error is second order in h), the coarsest level whose error should be
    ≤ ``rtol``·ε + ``atol`` and jumps there, then refines level by level until the error
    estimated from the last two levels meets the tolerance.  Every value computed is an upper
    bound on the true ε (pessimistic estimate), so the choice affects tightness, never validity.

    A level whose PLD would exceed the size limits of :mod:`~privtune.accounting._fast_pld` is
    not computed: refinement stops at the finest level that fits (see :func:`account` for the
    note); :class:`~privtune.accounting._fast_pld.PLDTooLargeError` if not even the coarsest fits.
    """
    segments = tuple(segments)
    h, v, _ = _refine(lambda h: pld_epsilon_at(segments, delta, h), rtol, atol)
    return h, v


def _refine(value_at, rtol: float, atol: float) -> tuple[float, float, str | None]:
    """(interval, value, None), or (interval, value, why refinement stopped early)."""
    levels = list(PLD_LEVELS)

    def err(v_coarse, h_coarse, v_fine, h_fine):
        if not (math.isfinite(v_coarse) and math.isfinite(v_fine)):
            return math.inf
        return abs(v_coarse - v_fine) / ((h_coarse / h_fine) ** 2 - 1.0)

    def ok(v_coarse, h_coarse, v_fine, h_fine):
        return err(v_coarse, h_coarse, v_fine, h_fine) <= rtol * v_fine + atol

    def stopped(h_ok, exc, est=math.inf):
        est_s = f"; estimated discretisation error ≈ {est:.2g}" if math.isfinite(est) else ""
        return (f"PLD refinement stopped at interval {h_ok:g} (precision target not reached{est_s}): "
                f"the next interval would need too much memory ({exc}). The value is still an upper bound.")

    e0 = value_at(levels[0])  # PLDTooLargeError propagates: not even the coarsest level fits
    try:
        e1 = value_at(levels[1])
    except PLDTooLargeError as exc:
        return levels[0], e0, stopped(levels[0], exc)
    if ok(e0, levels[0], e1, levels[1]):
        return levels[1], e1, None
    start = 2
    if math.isfinite(e0) and math.isfinite(e1) and e0 != e1:
        c = abs(e0 - e1) / (levels[0] ** 2 - levels[1] ** 2)
        h_pred = math.sqrt((rtol * e1 + atol) / c)
        start = next((i for i, h in enumerate(levels) if i >= 2 and h <= h_pred), len(levels) - 1)
    prev_i, prev_h, prev_v = 1, levels[1], e1
    prev_err = err(e0, levels[0], e1, levels[1])
    i = start
    while i < len(levels):
        h = levels[i]
        try:
            v = value_at(h)
        except PLDTooLargeError as exc:
            if i - 1 > prev_i:  # the predicted jump does not fit: try the next coarser level
                i -= 1
                continue
            return prev_h, prev_v, stopped(prev_h, exc, prev_err)
        if ok(prev_v, prev_h, v, h):
            return h, v, None
        prev_err = err(prev_v, prev_h, v, h)
        prev_i, prev_h, prev_v = i, h, v
        i += 1
    return prev_h, prev_v, None


def pld_epsilon(segments: Sequence[Segment], delta: float, *, rtol: float = DEFAULT_PLD_RTOL) -> float:
    """Pessimistic-PLD ε with the discretisation chosen by :func:`choose_pld_interval`."""
    if not segments:
        return 0.0
    return choose_pld_interval(segments, delta, rtol=rtol)[1]


# --------------------------------------------------------------------------------------------
# RDP
# --------------------------------------------------------------------------------------------
def _rdp_accountant(events) -> rdplib.RdpAccountant:
    acc = rdplib.RdpAccountant()
    acc.compose(to_dp_event(events))
    return acc


_RDP_FAILURES = (ArithmeticError, ValueError, FloatingPointError)


def _rdp_epsilon(events, delta: float, notes: list[str]) -> float:
    """RDP ε; +inf (with a note) when dp_accounting's arithmetic overflows (never an exception)."""
    try:
        eps = float(_rdp_accountant(events).get_epsilon(delta))
    except _RDP_FAILURES as exc:
        eps, why = math.inf, f"{type(exc).__name__}: {exc}"
    else:
        why = f"it returned {eps!r}"
    if not (math.isfinite(eps) and eps >= 0.0):
        notes.append(f"The RDP bound is not finite ({why}); ε is reported as infinite: no finite "
                     "guarantee can be certified for these events.")
        return math.inf
    return eps


def _rdp_delta(events, epsilon: float) -> float:
    try:
        d = float(_rdp_accountant(events).get_delta(epsilon))
    except _RDP_FAILURES:
        return 1.0
    return d if math.isfinite(d) and 0.0 <= d <= 1.0 else 1.0


def _smallest_sigma(low: _Lowered) -> float:
    """Smallest noise multiplier fed to dp_accounting (after grouping), repeat-and-select included."""
    sigmas = [s.noise_multiplier for s in low.segments]
    for r in low.repeat_and_select:
        sigmas += [s.noise_multiplier for s in lower_events(list(r.events)).segments]
    return min(sigmas, default=math.inf)


def _floor_note(sigma: float) -> str:
    return (f"A noise multiplier of {sigma:.3g} (after grouping identical releases) is below "
            f"{MIN_ACCOUNTED_NOISE_MULTIPLIER:g}, the smallest σ privtune accounts: ε is reported as "
            "infinite (no privacy guarantee). Such runs are effectively not private; use σ ≥ 0.3 for "
            "a meaningful ε.")


def _too_large_note(exc: Exception, interval: float) -> str:
    if isinstance(exc, MemoryError):
        exc = f"building the PLD ran out of memory ({exc})"
    return (f"PLD was requested, but {exc} even at interval {interval:g} (a tiny σ or a huge number "
            "of steps); the WHOLE composition was accounted with RDP instead (an upper bound, looser "
            "than the PLD).")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _resolve(accountant: str, low: _Lowered, notes: list[str]) -> str:
    accountant = check_choice(accountant, "accountant", ACCOUNTANTS)
    if accountant == "pld" and low.repeat_and_select:
        notes.append(
            "PLD was requested, but RepeatAndSelectEvent (Papernot & Steinke random-stopping tuning) "
            "is only supported by dp_accounting's RDP accountant; the WHOLE composition was accounted "
            "with RDP (composing an RDP bound with PLD segments would need a lossy (ε, δ) split)."
        )
        return "rdp"
    return accountant


def account(
    events,
    delta: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float | None = None,
    dataset_size: int | None = None,
) -> AccountingResult:
    """Account a composition of events at a given δ.

    Args:
        events: one event or a list of events (:class:`GaussianEvent`, :class:`DPSGDEvent`,
            :class:`RepeatAndSelectEvent`, :class:`NonPrivateEvent`); they are composed
            (adaptively allowed).
        delta: target δ in (0, 1); below 1/n when ``dataset_size`` n is given.
        accountant: ``"pld"`` (default, tight) or ``"rdp"``.
        value_discretization_interval: PLD only; ``None`` (default) chooses it by target
            precision (relative ε error ≈ 1e-3), a number fixes it (e.g. 1e-4, dp_accounting's
            default).  Any value gives an upper bound on ε.
        dataset_size: optional n, to check δ < 1/n.

    Returns:
        :class:`AccountingResult` with ε (add/remove one example), δ, the accountant used and notes.
        Never an exception for a tiny σ or a huge T: if the PLD would be too large to build, RDP
        is used (``accountant == "rdp"``, a note says why); if the events hold a :class:`NonPrivateEvent`,
        if σ < :data:`MIN_ACCOUNTED_NOISE_MULTIPLIER` or if the RDP bound overflows, ``epsilon`` is
        ``inf`` (no guarantee) and a note says why.
    """
    delta = check_delta(delta, dataset_size=dataset_size)
    low = lower_events(events)
    notes = list(low.notes)
    used = _resolve(accountant, low, notes)
    interval = None
    fixed = None
    if value_discretization_interval is not None:
        fixed = check_real(value_discretization_interval, "value_discretization_interval", low=0.0, high=1.0)
    smallest = _smallest_sigma(low)
    if low.non_private:
        eps = math.inf  # the notes say which release was not private
    elif smallest < MIN_ACCOUNTED_NOISE_MULTIPLIER:
        notes.append(_floor_note(smallest))
        eps = math.inf
    elif used == "rdp":
        eps = _rdp_epsilon(events, delta, notes)
    elif not low.segments:
        eps = 0.0
    else:
        try:
            if fixed is None:
                interval, eps, stopped = _refine(
                    lambda h: pld_epsilon_at(low.segments, delta, h), DEFAULT_PLD_RTOL, DEFAULT_PLD_ATOL)
                if stopped is None:
                    notes.append(f"PLD value discretisation interval {interval:g} (chosen for ~0.1% ε precision).")
                else:
                    rdp_notes: list[str] = []
                    rdp_eps = _rdp_epsilon(events, delta, rdp_notes)
                    if rdp_eps < eps:
                        notes.append(f"{stopped} The RDP bound, ε = {rdp_eps:.6g}, is smaller than the PLD's "
                                     f"{eps:.6g} at that interval; RDP is reported.")
                        notes.extend(rdp_notes)
                        used, interval, eps = "rdp", None, rdp_eps
                    else:
                        notes.append(stopped)
            else:
                interval = fixed
                eps = pld_epsilon_at(low.segments, delta, interval)
            if used == "pld" and _large_t(low.segments):
                notes.append(_large_t_note(low.segments))
        except (PLDTooLargeError, MemoryError) as exc:  # MemoryError: only if a size prediction was wrong
            notes.append(_too_large_note(exc, fixed if fixed is not None else PLD_LEVELS[0]))
            used, interval = "rdp", None
            eps = _rdp_epsilon(events, delta, notes)
    return AccountingResult(
        epsilon=eps,
        delta=delta,
        accountant=used,
        requested_accountant=accountant,
        notes=notes,
        sampling_assumptions=list(low.assumptions),
        value_discretization_interval=interval,
    )


def compute_epsilon(events, delta: float, accountant: str = "pld", **kwargs) -> float:
    """ε (add/remove one example) of a composition of events at δ; see :func:`account`.

    Example: ``compute_epsilon(DPSGDEvent(noise_multiplier=1.0, sample_rate=0.01, steps=5000), 1e-5)``
    is ≈ 4.20 (PLD); with ``accountant="rdp"`` ≈ 4.59.
    """
    return account(events, delta, accountant, **kwargs).epsilon


def compute_delta(
    events,
    epsilon: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float | None = None,
) -> float:
    """δ of a composition of events at a given ε ≥ 0 (add/remove one example).

    PLD: the pessimistic PLD's δ(ε) (an upper bound); the discretisation is chosen by target
    precision (relative δ error ≈ 1e-3) unless given.  RDP: dp_accounting's
    ``RdpAccountant.get_delta``.  As in :func:`account`, a PLD too large to build falls back to
    RDP (or the smaller of the two upper bounds when refinement had to stop early), and a
    :class:`NonPrivateEvent`, a noise multiplier below :data:`MIN_ACCOUNTED_NOISE_MULTIPLIER` or an
    overflowing RDP bound gives δ = 1.
    """
    epsilon = check_real(epsilon, "epsilon", low=0.0, low_inclusive=True,
                         fix="Pass a finite ε ≥ 0 at which to evaluate δ.")
    low = lower_events(events)
    used = _resolve(accountant, low, [])
    fixed = None
    if value_discretization_interval is not None:
        fixed = check_real(value_discretization_interval, "value_discretization_interval", low=0.0, high=1.0)
    if low.non_private or _smallest_sigma(low) < MIN_ACCOUNTED_NOISE_MULTIPLIER:
        return 1.0  # no guarantee claimed (see MIN_ACCOUNTED_NOISE_MULTIPLIER)
    if used == "rdp":
        return _rdp_delta(events, epsilon)
    if not low.segments:
        return 0.0
    segs = tuple(low.segments)
    try:
        if fixed is None:
            _, d, stopped = _refine(lambda h: pld_delta_at(segs, epsilon, h), DEFAULT_PLD_RTOL, 1e-12)
            # refinement stopped early: both values are upper bounds, report the smaller
            return min(d, _rdp_delta(events, epsilon)) if stopped else d
        return pld_delta_at(segs, epsilon, fixed)
    except (PLDTooLargeError, MemoryError):  # the PLD does not fit even at the coarsest interval: RDP
        return _rdp_delta(events, epsilon)


__all__ = [
    "ACCOUNTANTS",
    "AccountingResult",
    "MIN_ACCOUNTED_NOISE_MULTIPLIER",
    "LARGE_T_EXACT_UP_TO",
    "LARGE_T_MARGIN",
    "PLDTooLargeError",
    "Segment",
    "account",
    "compute_epsilon",
    "compute_delta",
    "lower_events",
    "merge_segments",
    "to_dp_event",
    "segment_to_dp_event",
    "choose_pld_interval",
    "pld_epsilon",
    "pld_epsilon_at",
]
