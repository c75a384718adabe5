"""The registry of tuning strategies: ``--strategy`` name → :class:`~privtune.hpo.common.Strategy`.

tune(), the config schema and the CLI read it; nothing else declares the names, the modes a strategy
trains or the options it takes.  Adding a strategy is one new ``hpo/<name>.py`` that defines a
:class:`~privtune.hpo.common.Strategy` subclass, and one line below.  The order here is the order of
``--strategy``'s choices and of the docs.
"""

from __future__ import annotations

from privtune.hpo.common import Strategy
from privtune.hpo.grid_oracle import GridOracle
from privtune.hpo.hyperfree import Hyperfree
from privtune.hpo.linear_scaling import LinearScaling
from privtune.hpo.random_search import RandomSearch
from privtune.hpo.single_step import SingleStep

REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` under its ``name`` (a second strategy with the same name is a programming error)."""
    if not strategy.name or strategy.name in REGISTRY:
        raise ValueError(f"strategy name {strategy.name!r} is empty or already registered")
    REGISTRY[strategy.name] = strategy
    return strategy


register(LinearScaling())
register(Hyperfree())
register(SingleStep())
register(RandomSearch())
register(GridOracle())

#: the ``--strategy`` choices, in registry order
STRATEGIES = tuple(REGISTRY)


def get(name: str) -> Strategy:
    """The registered strategy called ``name`` (validate the name with ``check_choice`` first)."""
    return REGISTRY[name]
