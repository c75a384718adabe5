"""The one-run ε lower bound of Steinke, Nasr & Jagielski (2023), computed exactly.

Setting (their Theorem 3.1): m canaries, each included in the training data independently with
probability 1/2; after one training run the auditor guesses "in" or "out" for r of them (abstaining
on the other m − r) and v guesses are correct.  If training is (ε, δ)-DP with respect to each
canary, then

    P[correct ≥ v] ≤ f(v) + 2·m·δ · max_{1 ≤ i ≤ m} (f(v − i) − f(v)) / i,
    f(u) = P[Binomial(r, p_ε) ≥ u],   p_ε = e^ε / (1 + e^ε)

for every v when δ = 0.  With δ > 0 it can fail where the right-hand side is near 1 (:func:`p_value` gives a
counter-example and what was searched); the lower bound uses only p-values ≤ β, where no failure is known.

(p_ε is the accuracy of ε-randomised response: the best any ε-DP guesser can do per canary).
The right-hand side is the p-value of observing v correct guesses under the hypothesis "the run is
(ε, δ)-DP".  The lower bound at confidence 1 − β is the largest ε whose p-value is still ≤ β: every
smaller ε is rejected by the observation at level β.

Everything here is exact up to floating point: the binomial probabilities come from
``scipy.stats.binom`` (no normal approximation), and ε is located by bisection on the
monotone p-value.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom

from privtune._validation import check_int, check_real
from privtune.errors import InvalidParameterError

__all__ = ["p_value", "epsilon_lower_bound", "max_epsilon_lower_bound"]

# ε above this is reported as this value (e^60 overflows nothing, and no claim is anywhere near it)
_EPSILON_CEILING = 60.0


def _check_counts(num_canaries: int, num_guesses: int, correct: int) -> tuple[int, int, int]:
    m = check_int(num_canaries, "num_canaries", low=1, fix="Pass the number m of canaries (at least 1).")
    r = check_int(num_guesses, "num_guesses", low=0, fix="Pass the number r of non-abstaining guesses.")
    v = check_int(correct, "correct", low=0, fix="Pass the number v of correct guesses.")
    if not v <= r <= m:
        raise InvalidParameterError(
            f"The counts must satisfy correct ≤ num_guesses ≤ num_canaries. Got correct={v}, num_guesses={r}, "
            f"num_canaries={m}. Count only the guesses made (abstentions excluded) and their correct ones."
        )
    return m, r, v


def p_value(num_canaries: int, num_guesses: int, correct: int, epsilon: float, delta: float = 0.0) -> float:
    """Probability of at least ``correct`` correct guesses out of ``num_guesses`` if training were (ε, δ)-DP.

    Args:
        num_canaries: m, canaries each included independently with probability 1/2.
        num_guesses: r ≤ m, guesses made (the auditor abstains on the others).
        correct: v ≤ r, correct guesses.
        epsilon: ε ≥ 0 of the null hypothesis (natural log units).
        delta: δ in [0, 1] of the null hypothesis.

    Returns:
        The expression of Steinke et al. (2023, Theorem 3.1 as computed by their Appendix D) for
        P[correct ≥ v], capped at 1.  With δ = 0 it is an upper bound.  With δ > 0 it is NOT an upper
        bound for every v: when v is at or below about r·p_ε (p_ε = e^ε / (1 + e^ε)), some (ε, δ)-DP
        mechanisms exceed it (a linear program over all such mechanisms on m = 2 canaries, r = 2, v = 1,
        ε = 1, δ = 0.05 reaches 0.9447 against 0.9421).  Those are p-values near 1, which reject
        nothing; :func:`epsilon_lower_bound` only uses p-values ≤ β, where no such case is known (a search
        over every case with m ≤ 5 and a p-value ≤ 0.3 found the worst mechanism below the expression).
    """
    m, r, v = _check_counts(num_canaries, num_guesses, correct)
    eps = check_real(epsilon, "epsilon", low=0.0, low_inclusive=True, fix="Pass ε ≥ 0.")
    delta = check_real(delta, "delta", low=0.0, high=1.0, low_inclusive=True, fix="Pass δ in [0, 1].")
    if v == 0:
        return 1.0
    p = 1.0 / (1.0 + math.exp(-eps))
    pmf = binom.pmf(np.arange(r + 1), r, p)
    # tail[u] = P[Bin(r, p) ≥ u] for u = 0..r (summed from the top: exact small tails, no 1 − cdf)
    tail = np.concatenate([np.cumsum(pmf[::-1])[::-1], [0.0]])
    f_v = float(tail[v])
    if delta == 0.0:
        return min(1.0, f_v)
    # (f(v − i) − f(v)) / i for i = 1..v; for i > v, f(v − i) = 1 and the ratio only decreases in i
    i = np.arange(1, v + 1)
    window = tail[v - i] - f_v
    alpha = float(np.max(window / i))
    return min(1.0, f_v + 2.0 * m * delta * alpha)


def epsilon_lower_bound(num_canaries: int, num_guesses: int, correct: int, *, delta: float = 0.0,
                        confidence: float = 0.95) -> float:
    """Largest ε that ``correct`` correct guesses out of ``num_guesses`` rule out at the given confidence.

    With probability ≥ ``confidence`` over the canaries' random inclusion, an (ε, δ)-DP run yields a
    lower bound ≤ ε.  A bound above the claimed ε is therefore evidence (at that confidence) that the
    claim is false; a bound below it proves nothing about the claim.

    Args:
        num_canaries, num_guesses, correct: m, r and v as in :func:`p_value`.
        delta: δ of the claim being audited.
        confidence: 1 − β in (0, 1), e.g. 0.95.

    Returns:
        ε lower bound in natural-log units, ≥ 0 (0 when the guesses are no better than chance at this
        confidence).
    """
    m, r, v = _check_counts(num_canaries, num_guesses, correct)
    conf = check_real(confidence, "confidence", low=0.0, high=1.0, fix="Pass e.g. confidence=0.95.")
    if conf >= 1.0:
        raise InvalidParameterError(f"`confidence` must be below 1. Got {confidence!r}. Pass e.g. 0.95.")
    beta = 1.0 - conf
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    if p_value(m, r, v, _EPSILON_CEILING, delta) <= beta:
        return _EPSILON_CEILING
    lo, hi = 0.0, _EPSILON_CEILING  # p(lo) ≤ β < p(hi); the p-value grows with ε
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-9:
            break
    return lo


def max_epsilon_lower_bound(num_canaries: int, num_guesses: int, *, delta: float = 0.0,
                            confidence: float = 0.95) -> float:
    """The largest lower bound ``num_guesses`` guesses can give (all of them correct): what m and r can show."""
    return epsilon_lower_bound(num_canaries, num_guesses, num_guesses, delta=delta, confidence=confidence)
