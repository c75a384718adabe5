"""White-box audit of the DP step: gradient canaries through the real :class:`PrivateGradient`.

The probe is a bias-free linear layer ``W`` (K × d) trained with the real engine: Poisson sampling
(:class:`privtune.engine.PoissonSampler`), physical micro-batches, per-example clipping and noise in
:meth:`PrivateGradient.backward` / :meth:`PrivateGradient.release`, plain SGD.  Canary ``c`` is an
example whose loss is linear in the logits, ``loss_c = −logit_{k_c}(s·u_c)``, so its per-example
gradient is exactly ``−s · e_{k_c} u_cᵀ``: a known direction of norm s = 100·C that the engine must
clip to C, i.e. the canary enters the clipped sum "as an example of norm C".

* ``canary="dirac"``: u_c is a basis vector and every canary owns one coordinate of W (d·K ≥ m).
* ``canary="random"``: u_c is a random unit vector (canaries overlap slightly).

Score of a canary = projection of the model update ``W_T − W_0`` on its direction, in units of one
clipped canary gradient (C · lr / expected batch size): about the number of steps that sampled it when
it was included, 0 when not, plus Gaussian noise.

The audit uses no user data (the probe data are the canaries and optional synthetic background
examples), so it spends no privacy budget; it measures the DP step at the user's (σ, q, T, C).
"""

from __future__ import annotations

import math
import secrets
import time

import torch
import torch.nn.functional as F
from torch import nn

from privtune._validation import check_int, check_real
from privtune.accounting import compute_epsilon
from privtune.accounting.events import DPSGDEvent
from privtune.audit.result import AuditResult, best_guesses
from privtune.audit.specs import ProbeSpec
from privtune.engine import PoissonSampler, PrivateGradient
from privtune.engine.sampling import poisson_mask
from privtune.engine.units import UnitIndex, UnitSampler
from privtune.errors import InvalidParameterError
from privtune.optim import make_optimizer
from privtune.specs import ClippingSpec, NoiseSpec

__all__ = ["audit_dp_step", "CANARY_GRADIENT_SCALE"]

# canary gradient norm in units of C: large, so that a step that does not clip is caught
CANARY_GRADIENT_SCALE = 100.0


def audit_dp_step(claim: NoiseSpec, clipping: ClippingSpec | None = None, probe: ProbeSpec | None = None, *,
                  confidence: float = 0.95, seed: int | None = None) -> AuditResult:
    """One-run white-box audit of the DP-SGD step for (σ, q, T, C).

    Args:
        claim: the step and its claim: σ, q (``sample_rate``; 1 = full batch, else Poisson), T (``steps``),
            δ (``delta``, required) and the accountant of the claimed ε, which they compose to (σ = 0: ε = ∞,
            NOT PRIVATE).  :meth:`NoiseSpec.for_epsilon <privtune.specs.NoiseSpec.for_epsilon>` calibrates σ
            for a claimed ε.  At user level (``probe.rows_per_unit`` > 1) ``claim.max_rows_per_unit`` is k.
        clipping: the clipping norm C, the rule and per-layer clipping, as in :func:`privtune.train`
            (default: C = 1, flat).
        probe: the canaries and the linear probe (:class:`~privtune.audit.specs.ProbeSpec`; default: 1000
            Dirac canaries on a 2-row probe).
        confidence: 1 − β of the lower bound, in (0, 1).
        seed: seeds canaries, membership, sampling and noise; None draws from the OS.

    Returns:
        :class:`AuditResult` with kind ``"white-box"``.
    """
    t0 = time.perf_counter()
    q, T, delta, sampling = _check_claim(claim)
    clipping = (clipping or ClippingSpec()).with_defaults()
    probe = probe or ProbeSpec()
    confidence = check_real(confidence, "confidence", low=0.0, high=1.0, fix="Pass e.g. confidence=0.95.")
    clip, m, K, d, r = clipping.clip, probe.num_canaries, probe.num_classes, probe.width, probe.rows_per_unit
    sigma = claim.noise_multiplier
    events = [DPSGDEvent(sigma, q, T, sampling=sampling, label="audited DP step")]
    claimed = compute_epsilon(events, delta, accountant=claim.accountant) if sigma > 0 else math.inf

    seed = check_int(seed, "seed", low=0, high=2**62) if seed is not None else secrets.randbits(62)
    gen = torch.Generator().manual_seed(int(seed))
    rows, U, included = _canary_directions(m, d, K, probe.canary, gen)
    X_all, y_all, is_canary = _probe_training_set(U, rows, included, probe.background_examples, K,
                                                  CANARY_GRADIENT_SCALE * clip, gen)
    n_bg, units = probe.background_examples, None
    if r > 1:  # each canary unit: r copies of its row; a background row is a unit of its own
        keep = _unit_rows(n_bg, X_all.shape[0], r)
        X_all, y_all, is_canary = (t.repeat_interleave(r, 0)[keep] for t in (X_all, y_all, is_canary))
        units = UnitIndex(list(range(n_bg)) + [n_bg + i // r for i in range(X_all.shape[0] - n_bg)])
    expected = q * max(1, X_all.shape[0] if units is None else units.num_units)
    layer = nn.Linear(d, K, bias=False).to(torch.float64)
    nn.init.zeros_(layer.weight)
    w0 = layer.weight.detach().clone()
    pg = PrivateGradient(layer, max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=expected,
                         clipping=clipping.clipping, gamma=clipping.gamma, per_layer=clipping.per_layer,
                         seed=int(seed) + 1)
    _train_probe(layer, pg, X_all, y_all, is_canary, steps=T, sample_rate=q, learning_rate=probe.learning_rate,
                 max_physical_batch_size=probe.max_physical_batch_size, seed=int(seed) + 2,
                 units=None if units is None else (units, claim.max_rows_per_unit))
    delta_w = (layer.weight.detach() - w0)  # (K, d)
    proj = (delta_w[rows] * U).sum(1)  # <ΔW, e_{k_c} u_cᵀ>
    scores = (proj * expected / (probe.learning_rate * clip)).tolist()
    best = best_guesses(scores, included.tolist(), delta=delta, confidence=confidence)
    return AuditResult(
        kind="white-box", claimed_epsilon=float(claimed), delta=delta,
        epsilon_lower_bound=best["epsilon_lower_bound"], confidence=confidence, num_canaries=m,
        num_guesses=best["num_guesses"], correct_guesses=best["correct_guesses"], scores=scores,
        included=included.tolist(), seconds=time.perf_counter() - t0,
        config={"noise_multiplier": sigma, "sample_rate": q, "steps": T, "clip": clip, "clipping": clipping.clipping,
                "per_layer_clipping": clipping.per_layer, "canary": probe.canary, "num_features": d,
                "num_classes": K, "background_examples": n_bg,
                "max_physical_batch_size": probe.max_physical_batch_size, "accountant": claim.accountant,
                "sampling": sampling, "seed": int(seed), "rows_per_unit": r,
                "max_rows_per_unit": claim.max_rows_per_unit if r > 1 else None},
        candidates=best["candidates"],
        privacy="no user data: gradient canaries and synthetic examples only (nothing charged to the ledger)",
    )


def _check_claim(claim: NoiseSpec) -> tuple[float, int, float, str]:
    """``(q, T, δ, sampling)`` of the audited step: the probe samples Poisson batches at q < 1 and full batches at
    q = 1, so the claim must be one of those two; its δ is required (the bound is at δ)."""
    if not isinstance(claim, NoiseSpec):
        raise InvalidParameterError(
            "`claim` must be a privtune.specs.NoiseSpec (σ, q, T, δ), e.g. NoiseSpec.for_epsilon(1.0, delta=1e-5, "
            f"sample_rate=1.0, steps=10). Got {type(claim).__name__}.")
    if claim.delta is None:
        raise InvalidParameterError("The audited claim needs its δ: pass NoiseSpec(..., delta=1e-5).")
    if claim.privacy_unit is not None:
        raise InvalidParameterError(
            "The white-box probe makes its own canary units: leave the claim's `privacy_unit` unset and pass "
            "ProbeSpec(rows_per_unit=R) (with the claim's max_rows_per_unit=K).")
    q = claim.sample_rate
    if claim.sampling not in ("poisson", "full_batch") or (claim.sampling == "full_batch" and q != 1.0):
        raise InvalidParameterError(
            f"The white-box audit samples Poisson batches (q < 1) or full batches (q = 1). Got "
            f"sampling={claim.sampling!r} at q={q:g}. Pass sampling='poisson', or 'full_batch' with sample_rate=1.")
    return q, claim.steps, claim.delta, "full_batch" if q == 1.0 else "poisson"


def _canary_directions(m: int, d: int, K: int, canary: str, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The canaries' gradient directions e_{k_c} ⊗ u_c and their membership: ``(rows, U, included)`` with the
    class row k_c of each canary (m,), the unit vectors u_c (m, d) in float64, and the (m,) bool mask of the
    canaries included in training (each with probability 1/2)."""
    rows = torch.arange(m) % K if canary == "dirac" else torch.randint(0, K, (m,), generator=gen)
    if canary == "dirac":
        U = torch.zeros(m, d, dtype=torch.float64)
        U[torch.arange(m), torch.arange(m) // K] = 1.0
    else:
        U = torch.randn(m, d, generator=gen, dtype=torch.float64)
        U = U / U.norm(dim=1, keepdim=True)
    included = poisson_mask(m, 0.5, gen)  # each canary in with probability 1/2 exactly
    return rows, U, included


def _unit_rows(n_bg: int, n_rows: int, r: int) -> torch.Tensor:
    """Indices into rows repeated r times that keep one copy of each background row and r of each canary."""
    keep = torch.arange(n_rows * r)
    return keep[(keep // r >= n_bg) | (keep % r == 0)]


def _probe_training_set(U: torch.Tensor, rows: torch.Tensor, included: torch.Tensor, n_bg: int, K: int,
                        scale: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probe's training set ``(X, y, is_canary)``: ``n_bg`` synthetic Gaussian background rows first, then
    the included canaries as inputs ``scale · u_c`` (``scale`` = the canary gradient norm, units of the
    clipping norm times ``CANARY_GRADIENT_SCALE``) with label k_c."""
    d = U.shape[1]
    canary_ids = torch.nonzero(included).flatten()
    X_bg = torch.randn(n_bg, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    y_bg = torch.randint(0, K, (n_bg,), generator=gen)
    X_all = torch.cat([X_bg, scale * U[canary_ids]])
    y_all = torch.cat([y_bg, rows[canary_ids]])
    is_canary = torch.cat([torch.zeros(n_bg, dtype=torch.bool), torch.ones(canary_ids.numel(), dtype=torch.bool)])
    return X_all, y_all, is_canary


def _train_probe(probe: nn.Linear, pg: PrivateGradient, X_all: torch.Tensor, y_all: torch.Tensor,
                 is_canary: torch.Tensor, *, steps: int, sample_rate: float, learning_rate: float,
                 max_physical_batch_size: int, seed: int, units: tuple | None = None) -> None:
    """``steps`` DP-SGD steps of ``probe`` through ``pg`` (closed at the end): Poisson batches of rate
    ``sample_rate`` (full batches at 1) cut into micro-batches; a canary's loss is minus its label's logit
    (gradient exactly −scale·e_{k_c}u_cᵀ), a background row's is the cross-entropy."""
    n_total = X_all.shape[0]
    opt = make_optimizer("sgd", probe.parameters(), learning_rate=learning_rate)
    sampler = PoissonSampler(max(1, n_total), sample_rate, seed=seed) if sample_rate < 1.0 else None
    if units is not None:  # user level: Poisson over units, ≤ k rows each, weight 1/m_u (engine/units.py)
        sampler = UnitSampler(units[0], sample_rate, units[1], seed=seed)
    try:
        for _ in range(steps):
            idx = sampler.sample() if sampler is not None else torch.arange(n_total)
            idx = idx[idx < n_total]
            weights = None if units is None else units[0].row_weights(idx)
            for start in range(0, idx.numel(), max_physical_batch_size):
                chunk = idx[start:start + max_physical_batch_size]
                w = None if weights is None else weights[start:start + max_physical_batch_size]
                logits = probe(X_all[chunk])
                ce = F.cross_entropy(logits, y_all[chunk], reduction="none")
                lin = -logits.gather(1, y_all[chunk][:, None]).squeeze(1)
                losses = torch.where(is_canary[chunk], lin, ce)
                pg.backward(losses) if w is None else pg.backward(losses, row_weights=w)
            pg.release()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        pg.close()
