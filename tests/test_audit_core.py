"""One-run privacy audit (issue 17): the exact bound, and the white-box audit of the real DP step.

The broken builds are injected by monkeypatching PrivateGradient at its stable entry points
(release, backward, the clip-factor computation), so they keep working when the engine's internal
norm accumulation or sampler change.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from privtune.accounting import compute_epsilon
from privtune.accounting.events import DPSGDEvent
from privtune.audit import ProbeSpec, audit_dp_step, epsilon_lower_bound, p_value
from privtune.audit.result import best_guesses
from privtune.engine import PrivateGradient
from privtune.errors import InvalidParameterError
from privtune.specs import ClippingSpec, NoiseSpec


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


# ------------------------------------------------------------------ the bound


def test_all_correct_pure_dp_matches_closed_form():
    # δ = 0, v = r: P[Bin(r, p) ≥ r] = p^r ≤ β  ⇔  p ≤ β^(1/r), so ε_lb = logit(β^(1/r))
    assert epsilon_lower_bound(100, 1, 1) == 0.0  # one correct guess is chance at 95 %: ε ≥ 0 only
    for r in (5, 10, 40):
        assert epsilon_lower_bound(100, r, r, confidence=0.95) == pytest.approx(_logit(0.05 ** (1 / r)), abs=1e-7)


def test_one_wrong_guess_pure_dp_matches_closed_form():
    # v = r − 1: P[Bin(r, p) ≥ r − 1] = p^r + r p^(r−1)(1 − p); at the bound this equals β
    r, eps = 20, epsilon_lower_bound(50, 20, 19, confidence=0.9)
    p = 1 / (1 + math.exp(-eps))
    assert p ** r + r * p ** (r - 1) * (1 - p) == pytest.approx(0.1, rel=1e-6)


def test_p_value_pure_dp_is_the_binomial_tail():
    # r = 3, ε = log 3 (p = 3/4): P[Bin(3, 3/4) ≥ 2] = 3·(9/16)(1/4) + 27/64 = 54/64
    assert p_value(10, 3, 2, math.log(3.0)) == pytest.approx(54 / 64, abs=1e-12)
    assert p_value(10, 3, 0, 5.0) == 1.0


def test_delta_term_by_hand():
    # r = 1, v = 1: f(1) = p, f(0) = 1; α = max_i (f(1 − i) − f(1))/i = 1 − p (at i = 1);
    # p-value = p + 2mδ(1 − p)
    m, delta, eps = 4, 0.01, 1.0
    p = 1 / (1 + math.exp(-eps))
    assert p_value(m, 1, 1, eps, delta) == pytest.approx(p + 2 * m * delta * (1 - p), abs=1e-12)


def test_bound_is_monotone_in_correct_guesses_and_below_the_trivial_bound():
    m, r, delta = 1000, 200, 1e-5
    bounds = [epsilon_lower_bound(m, r, v, delta=delta) for v in range(0, r + 1, 10)] + [
        epsilon_lower_bound(m, r, r, delta=delta)]
    assert all(a <= b + 1e-9 for a, b in zip(bounds, bounds[1:]))
    trivial = _logit(0.05 ** (1 / r))  # all r correct, δ = 0
    assert max(bounds) <= trivial + 1e-9
    assert bounds[0] == 0.0 and epsilon_lower_bound(m, r, r // 2, delta=delta) == 0.0  # chance level
    assert epsilon_lower_bound(m, r, r, delta=1e-3) < epsilon_lower_bound(m, r, r, delta=0.0)  # δ weakens


def test_bound_rejects_inconsistent_counts():
    with pytest.raises(InvalidParameterError, match="correct ≤ num_guesses ≤ num_canaries"):
        epsilon_lower_bound(10, 5, 6)
    with pytest.raises(InvalidParameterError, match="confidence"):
        epsilon_lower_bound(10, 5, 5, confidence=1.0)


def test_best_guesses_perfect_separation_uses_all_guesses():
    scores = [1.0] * 50 + [0.0] * 50
    included = [True] * 50 + [False] * 50
    best = best_guesses(scores, included, delta=0.0)
    assert best["num_guesses"] == 100 and best["correct_guesses"] == 100
    # the union bound over the fixed guess counts costs confidence: below the single-test bound
    assert 0 < best["epsilon_lower_bound"] < epsilon_lower_bound(100, 100, 100)


# ------------------------------------------------------------------ white-box audit of the DP step

# claimed ε = 1 at δ = 1e-5; full batch (q = 1, T = 10) and Poisson (q = 0.5); 1000 Dirac canaries,
# micro-batches of 64 (≈ 8 per full batch) and 32 (≈ 8 per Poisson batch of ≈ 250 canaries).
FULL = dict(claim=NoiseSpec.for_epsilon(1.0, delta=1e-5, sample_rate=1.0, steps=10),
            probe=ProbeSpec(num_canaries=1000, max_physical_batch_size=64), seed=0)
POISSON = dict(claim=NoiseSpec.for_epsilon(1.0, delta=1e-5, sample_rate=0.5, steps=10),
               probe=ProbeSpec(num_canaries=1000, max_physical_batch_size=32), seed=1)


@pytest.mark.parametrize("cfg", [FULL, POISSON, dict(FULL, probe=replace(FULL["probe"], canary="random",
                                                                        background_examples=200), seed=2),
                                 dict(FULL, clipping=ClippingSpec(clipping="automatic"), seed=3)],
                         ids=["full-batch", "poisson", "random-canaries+background", "automatic-clipping"])
def test_real_engine_lower_bound_stays_below_claim(cfg):
    res = audit_dp_step(**cfg)
    assert res.claimed_epsilon == pytest.approx(1.0, abs=1e-3)
    assert res.num_canaries == 1000 and 0 < res.num_guesses <= 1000
    assert res.epsilon_lower_bound <= res.claimed_epsilon
    assert not res.violation and "consistent" in res.verdict


def _noise_off(monkeypatch):
    orig = PrivateGradient.release

    def release(self):
        saved, self.noise_multiplier = self.noise_multiplier, 0.0
        try:
            return orig(self)
        finally:
            self.noise_multiplier = saved

    monkeypatch.setattr(PrivateGradient, "release", release)


def _noise_per_microbatch(monkeypatch):
    """The bug: noise std σC divided by the number of micro-batches of the logical batch."""
    orig_release, orig_backward = PrivateGradient.release, PrivateGradient.backward

    def backward(self, losses):
        self._audit_microbatches = getattr(self, "_audit_microbatches", 0) + 1
        return orig_backward(self, losses)

    def release(self):
        k = max(1, getattr(self, "_audit_microbatches", 1))
        saved, self.noise_multiplier = self.noise_multiplier, self.noise_multiplier / k
        try:
            return orig_release(self)
        finally:
            self.noise_multiplier, self._audit_microbatches = saved, 0

    monkeypatch.setattr(PrivateGradient, "backward", backward)
    monkeypatch.setattr(PrivateGradient, "release", release)


def _clipping_off(monkeypatch):
    monkeypatch.setattr(PrivateGradient, "_clip_factors", lambda self, norms, C: torch.ones_like(norms))


def _norms_zero(monkeypatch):
    orig = PrivateGradient._clip_factors
    monkeypatch.setattr(PrivateGradient, "_clip_factors",
                        lambda self, norms, C: orig(self, torch.zeros_like(norms), C))


@pytest.mark.parametrize("breakage", [_noise_off, _noise_per_microbatch, _clipping_off, _norms_zero],
                         ids=["noise-off", "noise-std-over-microbatches", "clipping-off", "norm-forced-0"])
@pytest.mark.parametrize("cfg", [FULL, POISSON], ids=["full-batch", "poisson"])
def test_broken_engine_is_caught(monkeypatch, breakage, cfg):
    breakage(monkeypatch)
    res = audit_dp_step(**cfg)
    assert res.epsilon_lower_bound > res.claimed_epsilon, res.summary()
    assert res.violation and res.verdict.startswith("VIOLATION")


def test_audit_dp_step_rejects_bad_arguments():
    with pytest.raises(InvalidParameterError, match="needs its δ"):
        audit_dp_step(NoiseSpec(noise_multiplier=1.0, sample_rate=1.0, steps=1))
    with pytest.raises(InvalidParameterError, match="samples Poisson batches"):
        audit_dp_step(NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1, sampling="shuffle", delta=1e-5))
    with pytest.raises(InvalidParameterError, match="must be a privtune.specs.NoiseSpec"):
        audit_dp_step({"epsilon": 1.0, "sample_rate": 1.0, "steps": 1})
    with pytest.raises(InvalidParameterError, match="num_features"):
        ProbeSpec(num_canaries=100, num_features=10)
    with pytest.raises(InvalidParameterError, match="num_canaries"):
        ProbeSpec(num_canaries=5)
    with pytest.raises(InvalidParameterError, match="delta"):
        NoiseSpec(noise_multiplier=1.0, sample_rate=1.0, steps=1, delta=2.0)


def test_a_claim_calibrated_for_epsilon_composes_to_it():
    claim = NoiseSpec.for_epsilon(2.0, delta=1e-5, sample_rate=0.1, steps=50)
    events = [DPSGDEvent(claim.noise_multiplier, 0.1, 50, sampling="poisson")]
    assert claim.sampling == "poisson" and compute_epsilon(events, 1e-5, accountant="pld") == pytest.approx(2.0, 1e-3)
    assert NoiseSpec.for_epsilon(2.0, delta=1e-5, sample_rate=1.0, steps=5).sampling == "full_batch"


def test_result_files(tmp_path):
    res = audit_dp_step(NoiseSpec.for_epsilon(1.0, delta=1e-5, sample_rate=1.0, steps=2),
                        probe=ProbeSpec(num_canaries=100, max_physical_batch_size=64), seed=0)
    paths = res.save(tmp_path / "audit")
    assert paths["png"].stat().st_size > 1000
    page = paths["html"].read_text()
    assert "<h2>Audit</h2>" in page and "data:image/png;base64," in page and "evidence, not proof" in page
    import json

    d = json.loads(paths["json"].read_text())
    assert d["num_canaries"] == 100 and len(d["scores"]) == 100 and "NOT PRIVATE" in d["scores_label"]
