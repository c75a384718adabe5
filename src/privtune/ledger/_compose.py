"""Composition of a dataset's spends through the accounting core (never by adding ε's).

The ledger may hold thousands of entries; most are repeats of a few configurations.  Before
calling the accountant, events whose composition is *exactly* additive are merged:

* ``GaussianEvent(σ, a)`` and ``GaussianEvent(σ, b)`` -> ``GaussianEvent(σ, a + b)``;
* ``DPSGDEvent(σ, q, T1, "poisson")`` and ``DPSGDEvent(σ, q, T2, "poisson")`` ->
  ``DPSGDEvent(σ, q, T1 + T2, "poisson")`` (the same for ``"full_batch"``).

Shuffled DP-SGD is *not* merged: it is accounted per run as ``ceil(T·q)`` full releases, and
merging two half-epoch runs would count one release where there are two.  Repeat-and-select
events are kept as they are.  Labels never affect privacy and are dropped when merging.
Results are cached on ``(accountant, δ, events)`` because events are frozen (hashable).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from privtune.accounting.events import DPSGDEvent, GaussianEvent

_ADDITIVE_SAMPLING = ("poisson", "full_batch")


def group_events(events: Sequence) -> list:
    """Merge events whose composition is exactly additive; keep first-occurrence order."""
    merged: dict[tuple, object] = {}  # insertion-ordered: first occurrence decides the position
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
        else:
            key = ("other", i)
            merged[key] = e
    return list(merged.values())


@functools.lru_cache(maxsize=512)
def _cached_epsilon(events: tuple, delta: float, accountant: str) -> float:
    from privtune.accounting import compute_epsilon

    return float(compute_epsilon(list(events), delta, accountant=accountant))


def composed_epsilon(before: Sequence, delta: float, accountant: str, new: Sequence = ()) -> float:
    """ε of ``group(before) + group(new)`` at ``delta`` with ``accountant``; 0.0 for no events.

    ``before`` and ``new`` are grouped separately so that the number matches what
    ``calibrate_noise_multiplier(spent_events=group(before), ...)`` composes for a new run.
    """
    events = tuple(group_events(before)) + tuple(group_events(new))
    if not events:
        return 0.0
    return _cached_epsilon(events, float(delta), accountant)


__all__ = ["group_events", "composed_epsilon"]
