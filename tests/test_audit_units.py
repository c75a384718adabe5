"""The one-run white-box audit at user level: canary units of several rows through the real DP step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from privtune.audit import ProbeSpec, audit_dp_step
from privtune.specs import NoiseSpec
from privtune.engine.units import UnitIndex

# claimed ε = 1 at δ = 1e-5; 1000 canary units of 4 rows each, all rows of a unit pointing the same way; k = 4
UNITS = ProbeSpec(num_canaries=1000, max_physical_batch_size=256, rows_per_unit=4)
FULL = dict(claim=NoiseSpec.for_epsilon(1.0, delta=1e-5, sample_rate=1.0, steps=10, max_rows_per_unit=4),
            probe=UNITS, seed=0)
POISSON = dict(claim=NoiseSpec.for_epsilon(1.0, delta=1e-5, sample_rate=0.5, steps=10, max_rows_per_unit=4),
               probe=UNITS, seed=1)
CAP_BELOW_ROWS = dict(claim=replace(FULL["claim"], max_rows_per_unit=2),
                      probe=replace(UNITS, background_examples=200), seed=2)


@pytest.mark.parametrize("cfg", [FULL, POISSON, CAP_BELOW_ROWS], ids=["full-batch", "poisson", "cap-below-rows+background"])
def test_canary_units_stay_below_the_claim(cfg):
    res = audit_dp_step(**cfg)
    assert res.claimed_epsilon == pytest.approx(1.0, abs=1e-3)
    assert res.epsilon_lower_bound <= res.claimed_epsilon, res.summary()
    assert not res.violation
    assert res.config["rows_per_unit"] == 4 and res.config["max_rows_per_unit"] == cfg["claim"].max_rows_per_unit


@pytest.mark.parametrize("cfg", [FULL, POISSON], ids=["full-batch", "poisson"])
def test_clipping_per_row_instead_of_per_unit_is_caught(monkeypatch, cfg):
    """The broken build: every row clipped to C and summed (weight 1), so a unit of 4 rows adds 4·C."""
    monkeypatch.setattr(UnitIndex, "row_weights", lambda self, idx: torch.ones(idx.numel(), dtype=torch.float64))
    res = audit_dp_step(**cfg)
    assert res.epsilon_lower_bound > res.claimed_epsilon, res.summary()
    assert res.violation
