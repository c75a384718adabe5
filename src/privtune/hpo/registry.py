"""The registry of tuning strategies: ``--strategy`` name → :class:`~privtune.hpo.common.Strategy`.

tune() reads it; nothing else declares the modes a strategy trains or the options it takes.  The names
themselves are declared in :data:`privtune.choices.STRATEGIES`, which the config schema and the CLI read
without importing the strategies (and torch); :func:`register` refuses a name that is not declared there.
Adding a strategy is one new ``hpo/<name>.py`` that defines a :class:`~privtune.hpo.common.Strategy`
subclass, its name in ``privtune.choices.STRATEGIES`` and one line below.
"""

from __future__ import annotations

from privtune.choices import STRATEGIES
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
    if strategy.name not in STRATEGIES:
        raise ValueError(f"strategy name {strategy.name!r} is not declared in privtune.choices.STRATEGIES")
    REGISTRY[strategy.name] = strategy
    return strategy


register(LinearScaling())
register(Hyperfree())
register(SingleStep())
register(RandomSearch())
register(GridOracle())

# STRATEGIES (imported above) are the ``--strategy`` choices; tests/test_choices.py checks that the registry
# holds exactly these, in this order


def get(name: str) -> Strategy:
    """The registered strategy called ``name`` (validate the name with ``check_choice`` first)."""
    return REGISTRY[name]
