"""Private hyperparameter tuning: one honest (ε, δ) for tuning *and* training.

:func:`tune` takes a total budget, spends part of it on tuning with one of the published
strategies and trains the final model with the rest, proving the total in one
certificate.  :func:`recommend` gives a batch size, σ and clipping guidance for a budget.

Strategies (one module each): :mod:`~privtune.hpo.linear_scaling` (Panda et al., linear scaling),
:mod:`~privtune.hpo.hyperfree` (Liu et al., HyFreeDP), :mod:`~privtune.hpo.single_step` (Mehta et al.,
large-scale transfer),
:mod:`~privtune.hpo.random_search` (honest baseline) and :mod:`~privtune.hpo.grid_oracle`
(NOT PRIVATE reference only), each one :class:`~privtune.hpo.common.Strategy`
class registered in :mod:`privtune.hpo.registry`.
"""

from __future__ import annotations

# The function names equal their module names (hpo/tune.py defines tune, hpo/recommend.py
# defines recommend), so they are bound eagerly: a lazy attribute would be shadowed by the
# submodule once it is imported.
from privtune.hpo.recommend import Recommendation, recommend
from privtune.hpo.tune import STRATEGIES, TuneResult, tune

__all__ = ["tune", "TuneResult", "STRATEGIES", "recommend", "Recommendation"]
