"""Batch-size recommendation (seed 003) and `privtune recommend`."""

from __future__ import annotations

import json

import pytest

from privtune.cli import main
from privtune.errors import InvalidParameterError
from privtune.hpo import recommend

CANDS = [64, 256, 1000, 4000]


def test_recommend_is_monotone_in_epsilon():
    recs = [recommend(e, 1e-5, 4000, 4, candidates=CANDS, min_steps=10) for e in (0.25, 1.0, 16.0)]
    bs = [r.batch_size for r in recs]
    assert bs == sorted(bs) and bs[0] < bs[-1]  # lower ε ⇒ smaller (or equal) batch
    for r in recs:
        assert r.steps >= 10 and r.sample_rate == pytest.approx(r.batch_size / 4000)
        assert r.cumulative_noise == pytest.approx(r.noise_multiplier * r.steps ** 0.5)
    # for a fixed batch size, more ε means less noise
    sig = [next(row for row in r.rows if row["batch_size"] == 256)["noise_multiplier"] for r in recs]
    assert sig == sorted(sig, reverse=True)


def test_rule_picks_smallest_batch_on_the_plateau_or_the_cap():
    r = recommend(1.0, 1e-5, 4000, 4, candidates=CANDS, min_steps=10, plateau_tol=0.10)
    feas = [row for row in r.rows if row["feasible"]]
    best = min(row["cumulative_noise"] for row in feas)
    assert r.cumulative_noise <= 1.10 * best
    assert all(row["cumulative_noise"] > 1.10 * best for row in feas if row["batch_size"] < r.batch_size)
    cap = recommend(1.0, 1e-5, 4000, 4, candidates=CANDS, min_steps=10, prefer="cap")
    assert cap.batch_size == max(row["batch_size"] for row in cap.rows if row["feasible"])
    assert any("Increase C, decrease B" in g for g in r.clipping_guidance)


def test_bad_inputs():
    with pytest.raises(InvalidParameterError, match="dataset_size"):
        recommend(1.0, 1e-5, 1, 3)
    with pytest.raises(InvalidParameterError, match="delta"):
        recommend(1.0, 0.01, 1000, 3)
    with pytest.raises(InvalidParameterError, match="prefer"):
        recommend(1.0, 1e-5, 1000, 3, prefer="largest")


def test_cli_recommend_json(capsys):
    rc = main(["recommend", "--epsilon", "1", "--delta", "1e-5", "--dataset-size", "4000", "--epochs", "4",
               "--candidates", "64,256,1000", "--min-steps", "10", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_size"] in (64, 256, 1000) and out["steps"] >= 10
    assert main(["recommend", "--epsilon", "-1", "--delta", "1e-5", "--dataset-size", "4000", "--epochs", "4"]) == 2
