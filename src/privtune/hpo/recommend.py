"""Batch-size, σ and clipping recommendations (Rehn et al., "On Optimal Hyperparameters for
Differentially Private Deep Transfer Learning", §6 and Table 1).

Under a fixed epoch budget (T = ⌈E·N/B⌉), the cumulative noise σ·√T is nearly flat over a
wide range of batch sizes at small ε (the "noise plateau"), and a minimum number of
optimizer steps is needed.  The rule: among candidate batch sizes with T ≥ ``min_steps``,
take the **smallest** B whose σ√T is within ``plateau_tol`` of the minimum (more steps at
no extra cumulative noise).  ``prefer="cap"`` instead takes the largest B meeting the step
floor (cheaper in wall-clock at high epochs).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from privtune._validation import check_choice, check_delta, check_epsilon, check_int, check_real
from privtune.accounting import calibrate_noise_multiplier
from privtune.choices import PREFERENCES

#: Table 1 (practical implications) of Rehn et al. (optimal clipping and batch size), printed with every recommendation.
CLIPPING_GUIDANCE = [
    ("Lower ε (tighter privacy)", "Increase C, decrease B."),
    ("Stronger backbone / easier dataset", "Use smaller C."),
    ("Weaker backbone / harder dataset", "Try larger C."),
    ("Fewer epochs (limited compute)", "Avoid large B (⇒ more steps)."),
    ("More epochs", "Larger B becomes viable."),
    ("General guidance", "Tune (C, B, η) jointly for each task."),
]


@dataclass
class Recommendation:
    """A recommended DP-SGD configuration for a budget.

    batch_size : expected batch size B (Poisson sampling, q = B/N).
    sample_rate : q = B/N (1.0 = full batch).
    steps : T = ⌈epochs·N/B⌉ optimizer steps (= epochs at full batch).
    noise_multiplier : σ calibrated for (ε, δ, q, T) (multiplier of the clipping norm).
    cumulative_noise : σ·√T, the quantity the rule flattens.
    rows : one dict per candidate B (B, q, T, σ, σ√T, feasible).
    """

    epsilon: float
    delta: float
    dataset_size: int
    epochs: float
    batch_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    cumulative_noise: float
    min_steps: int
    plateau_tol: float
    prefer: str
    rows: list = field(default_factory=list)
    clipping_guidance: list = field(default_factory=lambda: [f"{a}: {b}" for a, b in CLIPPING_GUIDANCE])
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"recommended for ε = {self.epsilon:g}, δ = {self.delta:g}, N = {self.dataset_size}, "
            f"epochs = {self.epochs:g} (the noise-plateau rule of Rehn et al., optimal clipping and batch size: "
            f"min_steps = {self.min_steps}, plateau_tol = {self.plateau_tol:g})",
            f"  batch size B = {self.batch_size}  (q = {self.sample_rate:.4g})",
            f"  steps T = {self.steps}",
            f"  noise multiplier σ = {self.noise_multiplier:.4g}  (σ√T = {self.cumulative_noise:.4g})",
            "  candidates (B, T, σ, σ√T):",
        ]
        for r in self.rows:
            mark = "*" if r["batch_size"] == self.batch_size else (" " if r["feasible"] else "x")
            lines.append(f"   {mark} B={r['batch_size']:>7} T={r['steps']:>6} σ={r['noise_multiplier']:.4g} "
                         f"σ√T={r['cumulative_noise']:.4g}")
        lines.append("  clipping and batch guidance (Rehn et al., Table 1):")
        lines += [f"   - {g}" for g in self.clipping_guidance]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def steps_for_epochs(dataset_size: int, batch_size: int, epochs: float) -> int:
    """T = ⌈E·N/B⌉ (full batch: T = ⌈E⌉)."""
    if batch_size >= dataset_size:
        return max(1, math.ceil(epochs - 1e-9))
    return max(1, math.ceil(epochs * dataset_size / batch_size - 1e-9))


def default_candidates(dataset_size: int, smallest: int = 16) -> list[int]:
    """Powers of two from ``smallest`` below N, plus N itself (full batch)."""
    out = sorted({2 ** k for k in range(int(math.log2(smallest)), 40) if 2 ** k < dataset_size} | {dataset_size})
    return out


def recommend(epsilon: float, delta: float, dataset_size: int, epochs: float, *, candidates=None,
              min_steps: int = 20, plateau_tol: float = 0.10, prefer: str = "smallest",
              accountant: str = "pld") -> Recommendation:
    """Recommend (B, σ, q, T) for a budget, with the clipping guidance of Table 1 of Rehn et al.

    Parameters
    ----------
    epsilon, delta : target (ε, δ) of the run.
    dataset_size : N, number of training examples.
    epochs : E, passes over the data (T = ⌈E·N/B⌉).
    candidates : batch sizes to consider (default: powers of two ≥ 16 below N, and N).
    min_steps : minimum number of optimizer steps (20 in the paper; dataset-dependent).
    plateau_tol : relative tolerance on σ√T defining the plateau (0.10).
    prefer : ``"smallest"`` (the paper's rule) or ``"cap"`` (largest B with T ≥ min_steps).
    """
    eps = check_epsilon(epsilon)
    n = check_int(dataset_size, "dataset_size", low=2, fix="Pass the number of training examples.")
    dl = check_delta(delta, dataset_size=n)
    ep = check_real(epochs, "epochs", low=0.0, fix="Pass the number of passes over the data, e.g. 3.")
    ms = check_int(min_steps, "min_steps", low=1)
    tol = check_real(plateau_tol, "plateau_tol", low=0.0, low_inclusive=True)
    check_choice(prefer, "prefer", PREFERENCES)
    cands = sorted({check_int(b, "candidates", low=1) for b in (candidates or default_candidates(n))})
    cands = sorted({min(b, n) for b in cands})
    rows = []
    for b in cands:
        q = min(1.0, b / n)
        T = steps_for_epochs(n, b, ep)
        sigma = float(calibrate_noise_multiplier(eps, dl, q, T, accountant=accountant,
                                                 sampling="full_batch" if q >= 1.0 else "poisson"))
        rows.append({"batch_size": b, "sample_rate": q, "steps": T, "noise_multiplier": sigma,
                     "cumulative_noise": sigma * math.sqrt(T), "feasible": T >= ms})
    feasible = [r for r in rows if r["feasible"]]
    notes = []
    if not feasible:
        choice = min(rows, key=lambda r: r["batch_size"])
        notes.append(f"no candidate reaches min_steps = {ms} in {ep:g} epochs; took the smallest batch "
                     f"(most steps). Consider more epochs.")
    elif prefer == "cap":
        choice = max(feasible, key=lambda r: r["batch_size"])
    else:
        c_ref = min(r["cumulative_noise"] for r in feasible)
        plateau = [r for r in feasible if r["cumulative_noise"] <= (1 + tol) * c_ref]
        choice = min(plateau, key=lambda r: r["batch_size"])
    return Recommendation(epsilon=eps, delta=dl, dataset_size=n, epochs=ep, batch_size=choice["batch_size"],
                          sample_rate=choice["sample_rate"], steps=choice["steps"],
                          noise_multiplier=choice["noise_multiplier"], cumulative_noise=choice["cumulative_noise"],
                          min_steps=ms, plateau_tol=tol, prefer=prefer, rows=rows, notes=notes)
