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

from privtune._validation import check_choice, check_int, check_real, check_sample_rate, check_steps
from privtune.accounting import calibrate_noise_multiplier, compute_epsilon
from privtune.accounting.events import DPSGDEvent
from privtune.audit.result import AuditResult, best_guesses
from privtune.engine import PoissonSampler, PrivateGradient
from privtune.engine.sampling import poisson_mask
from privtune.engine.units import UnitIndex, UnitSampler
from privtune.errors import InvalidParameterError
from privtune.optim import make_optimizer

__all__ = ["audit_dp_step", "CANARY_GRADIENT_SCALE"]

# canary gradient norm in units of C: large, so that a step that does not clip is caught
CANARY_GRADIENT_SCALE = 100.0


def audit_dp_step(
    *,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    delta: float = 1e-5,
    sample_rate: float,
    steps: int,
    clip: float = 1.0,
    clipping: str = "flat",
    per_layer_clipping: bool = False,
    num_canaries: int = 1000,
    canary: str = "dirac",
    num_features: int | None = None,
    num_classes: int = 2,
    background_examples: int = 0,
    max_physical_batch_size: int = 64,
    learning_rate: float = 1.0,
    confidence: float = 0.95,
    accountant: str = "pld",
    seed: int | None = None,
    rows_per_unit: int = 1,
    max_rows_per_unit: int = 8,
) -> AuditResult:
    """One-run white-box audit of the DP-SGD step for (σ, q, T, C).

    Args:
        epsilon: the claimed ε (σ is calibrated from it for q, T, δ), or
        noise_multiplier: σ (the claimed ε is then computed).  Exactly one of the two.
        delta: δ of the claim.
        sample_rate: Poisson rate q in (0, 1] (1 = full batch).
        steps: T, the number of DP steps (logical batches).
        clip: clipping norm C.  clipping, per_layer_clipping: as in :func:`privtune.train`.
        num_canaries: m (≥ 10).  Each is included with probability 1/2.
        canary: ``"dirac"`` or ``"random"`` (see module doc).
        num_features: d of the probe (default: the smallest with d·K ≥ m for Dirac canaries, 64 for random).
        num_classes: K rows of the probe.
        background_examples: synthetic Gaussian examples (cross-entropy loss) trained alongside the canaries.
        max_physical_batch_size: micro-batch size (the logical batch is split into micro-batches).
        learning_rate: SGD step size of the probe (the score is normalised by it).
        confidence: 1 − β of the lower bound.
        accountant: ``"pld"`` or ``"rdp"`` for the claimed ε.
        seed: seeds canaries, membership, sampling and noise; None draws from the OS.
        rows_per_unit: r ≥ 1: audit the user-level step (docs/privacy-unit.md) with canary *units* of r rows
            each, all with the canary's direction (the worst case: their clipped gradients add up); units are
            Poisson sampled and each contributes at most ``max_rows_per_unit`` rows weighted 1/m_u, so a
            canary unit must enter the sum as one vector of norm C, like one canary row at r = 1.
        max_rows_per_unit: k, the user-level cap (used when r > 1).

    Returns:
        :class:`AuditResult` with kind ``"white-box"``.
    """
    t0 = time.perf_counter()
    if (epsilon is None) == (noise_multiplier is None):
        raise InvalidParameterError(
            "Pass exactly one of `epsilon` or `noise_multiplier`. Got "
            f"epsilon={epsilon!r}, noise_multiplier={noise_multiplier!r}. E.g. epsilon=1.0, delta=1e-5."
        )
    delta = check_real(delta, "delta", low=0.0, high=1.0, fix="Pass e.g. delta=1e-5.")
    q = check_sample_rate(sample_rate)
    T = check_steps(steps)
    clip = check_real(clip, "clip", low=0.0, fix="Pass the clipping norm C, e.g. clip=1.0.")
    canary = check_choice(canary, "canary", ("dirac", "random"))
    m = check_int(num_canaries, "num_canaries", low=10, fix="Use at least 10 canaries (1000 is a good default).")
    K = check_int(num_classes, "num_classes", low=2)
    n_bg = check_int(background_examples, "background_examples", low=0)
    phys = check_int(max_physical_batch_size, "max_physical_batch_size", low=1)
    lr = check_real(learning_rate, "learning_rate", low=0.0)
    d = _probe_width(num_features, m, K, canary)
    r = check_int(rows_per_unit, "rows_per_unit", low=1, fix="Pass the rows of each canary unit, e.g. 4.")
    sampling = "full_batch" if q == 1.0 else "poisson"
    sigma = (calibrate_noise_multiplier(epsilon, delta, sample_rate=q, steps=T, accountant=accountant,
                                        sampling=sampling) if epsilon is not None else noise_multiplier)
    sigma = check_real(sigma, "noise_multiplier", low=0.0, low_inclusive=True)
    events = [DPSGDEvent(sigma, q, T, sampling=sampling, label="audited DP step")]
    claimed = compute_epsilon(events, delta, accountant=accountant) if sigma > 0 else math.inf

    if seed is None:
        seed = secrets.randbits(62)
    gen = torch.Generator().manual_seed(int(seed))
    rows, U, included = _canary_directions(m, d, K, canary, gen)
    X_all, y_all, is_canary = _probe_training_set(U, rows, included, n_bg, K, CANARY_GRADIENT_SCALE * clip, gen)
    units = None
    if r > 1:  # each canary unit: r copies of its row; a background row is a unit of its own
        keep = _unit_rows(n_bg, X_all.shape[0], r)
        X_all, y_all, is_canary = (t.repeat_interleave(r, 0)[keep] for t in (X_all, y_all, is_canary))
        units = UnitIndex(list(range(n_bg)) + [n_bg + i // r for i in range(X_all.shape[0] - n_bg)])
    expected = q * max(1, X_all.shape[0] if units is None else units.num_units)
    probe = nn.Linear(d, K, bias=False).to(torch.float64)
    nn.init.zeros_(probe.weight)
    w0 = probe.weight.detach().clone()
    pg = PrivateGradient(probe, max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=expected,
                         clipping=clipping, per_layer=per_layer_clipping, seed=int(seed) + 1)
    _train_probe(probe, pg, X_all, y_all, is_canary, steps=T, sample_rate=q, learning_rate=lr,
                 max_physical_batch_size=phys, seed=int(seed) + 2,
                 units=None if units is None else (units, check_int(max_rows_per_unit, "max_rows_per_unit", low=1)))
    delta_w = (probe.weight.detach() - w0)  # (K, d)
    proj = (delta_w[rows] * U).sum(1)  # <ΔW, e_{k_c} u_cᵀ>
    scores = (proj * expected / (lr * clip)).tolist()
    best = best_guesses(scores, included.tolist(), delta=delta, confidence=confidence)
    return AuditResult(
        kind="white-box", claimed_epsilon=float(claimed), delta=delta,
        epsilon_lower_bound=best["epsilon_lower_bound"], confidence=confidence, num_canaries=m,
        num_guesses=best["num_guesses"], correct_guesses=best["correct_guesses"], scores=scores,
        included=included.tolist(), seconds=time.perf_counter() - t0,
        config={"noise_multiplier": sigma, "sample_rate": q, "steps": T, "clip": clip, "clipping": clipping,
                "per_layer_clipping": per_layer_clipping, "canary": canary, "num_features": d,
                "num_classes": K, "background_examples": n_bg, "max_physical_batch_size": phys,
                "accountant": accountant, "sampling": sampling, "seed": int(seed), "rows_per_unit": r,
                "max_rows_per_unit": int(max_rows_per_unit) if r > 1 else None},
        candidates=best["candidates"],
        privacy="no user data: gradient canaries and synthetic examples only (nothing charged to the ledger)",
    )


def _probe_width(num_features: int | None, m: int, K: int, canary: str) -> int:
    """d, the number of input features of the probe: by default the smallest with d·K ≥ m for Dirac canaries
    (one coordinate each), 64 for random ones."""
    d = num_features
    if d is None:
        d = math.ceil(m / K) if canary == "dirac" else 64
    d = check_int(d, "num_features", low=1)
    if canary == "dirac" and d * K < m:
        raise InvalidParameterError(
            f"Dirac canaries need one probe coordinate each: num_features · num_classes ≥ num_canaries. Got "
            f"{d} · {K} < {m}. Pass num_features ≥ {math.ceil(m / K)}, or canary='random'."
        )
    return d


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
