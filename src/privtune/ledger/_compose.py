"""Composition of a dataset's spends through the accounting core (never by adding ε's).

The ledger may hold thousands of entries; most are repeats of a few configurations.  Before
calling the accountant, events whose composition is *exactly* additive are merged by
:func:`privtune.accounting.events.group_events`, the one event grouper (the accountant uses
the same function before lowering).  Results are cached on ``(accountant, δ, events)`` because
events are frozen (hashable).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import privtune.accounting as acct
from privtune.accounting.events import group_events


@functools.lru_cache(maxsize=512)
def _cached_epsilon(events: tuple, delta: float, accountant: str) -> float:
    # Looked up on the module at call time, so that a spy on privtune.accounting sees each call.
    return float(acct.compute_epsilon(list(events), delta, accountant=accountant))


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
