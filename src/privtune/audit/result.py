"""Turning canary scores into guesses, and the result of an audit (printing, JSON, histogram)."""

from __future__ import annotations

import base64
import html as _html
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from privtune.audit.bounds import epsilon_lower_bound
from privtune.errors import InvalidParameterError

__all__ = ["AuditResult", "best_guesses", "GUESS_FRACTIONS"]

# The auditor guesses "in" for the k highest scores and "out" for the k lowest, r = 2k guesses in all,
# for r = each of these fractions of m.  The fractions are fixed in advance and β is split evenly
# between them (union bound), so reporting the best of them keeps the stated confidence.
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

NOT_PRIVATE_SCORES = (
    "NOT PRIVATE with respect to the canaries: canary scores and memberships are the audit's own "
    "measurements (the canaries are synthetic, never user data)"
)


def best_guesses(scores: Sequence[float], included: Sequence[bool], *, delta: float,
                 confidence: float = 0.95) -> dict:
    """Guess membership from scores and return the guess count with the largest valid lower bound.

    For each r in ``GUESS_FRACTIONS`` · m: guess "included" for the ⌊r/2⌋ highest scores and "excluded"
    for the r − ⌊r/2⌋ lowest; count the correct guesses; compute the ε lower bound at confidence
    1 − β/len(GUESS_FRACTIONS).  By the union bound the largest of these bounds holds at confidence 1 − β.

    Returns a dict with ``epsilon_lower_bound``, ``num_guesses`` (r), ``correct_guesses`` (v) and
    ``candidates`` (every r tried with its v and bound).
    """
    s = np.asarray(scores, dtype=float)
    inc = np.asarray(included, dtype=bool)
    if s.ndim != 1 or s.shape != inc.shape or s.size == 0:
        raise InvalidParameterError(
            f"`scores` and `included` must be 1-D with one entry per canary. Got shapes {s.shape} and {inc.shape}."
        )
    if not np.isfinite(s).all():
        raise InvalidParameterError("`scores` must be finite. Got NaN or inf canary scores; check the training run.")
    m = s.size
    order = np.argsort(-s, kind="stable")  # highest score first
    per_test = 1.0 - (1.0 - confidence) / len(GUESS_FRACTIONS)
    tried: dict[int, dict] = {}
    for frac in GUESS_FRACTIONS:
        r = min(m, max(2, int(round(frac * m))))
        if r in tried:
            continue
        k_in = r // 2
        k_out = r - k_in
        v = int(inc[order[:k_in]].sum()) + int((~inc[order[m - k_out:]]).sum())
        bound = epsilon_lower_bound(m, r, v, delta=delta, confidence=per_test)
        tried[r] = {"num_guesses": r, "correct_guesses": v, "epsilon_lower_bound": bound}
    # ties (e.g. every bound 0) go to the most guesses: the most informative row to show
    best = max(tried.values(), key=lambda c: (c["epsilon_lower_bound"], c["num_guesses"]))
    return {**best, "candidates": list(tried.values()), "confidence_per_candidate": per_test}


@dataclass
class AuditResult:
    """What an audit measured.

    Attributes:
        kind: ``"white-box"`` (gradient canaries in the DP step) or ``"black-box"`` (input canaries in a
            real training run, scored by their loss).
        claimed_epsilon, delta: the (ε, δ) the configuration claims (natural-log ε).
        epsilon_lower_bound: empirical ε lower bound at ``confidence`` (Steinke et al. 2023).
        confidence: 1 − β, e.g. 0.95.
        num_canaries: m.  num_guesses: r (non-abstaining guesses).  correct_guesses: v.
        scores: one score per canary (higher = more likely included).  NOT PRIVATE w.r.t. the canaries.
        included: the canaries' true membership (each drawn with probability 1/2).
        seconds: wall-clock time of the audit.
        config: the audited configuration (σ, q, T, C, mode, ...).
        privacy: how the audit is charged (ledger entry or declared public data).
    """

    kind: str
    claimed_epsilon: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    num_canaries: int
    num_guesses: int
    correct_guesses: int
    scores: list = field(repr=False)
    included: list = field(repr=False)
    seconds: float = 0.0
    config: dict = field(default_factory=dict)
    candidates: list = field(default_factory=list, repr=False)
    privacy: str = ""

    @property
    def violation(self) -> bool:
        """True when the lower bound exceeds the claimed ε (the claim is contradicted at ``confidence``)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        if self.violation:
            return (f"VIOLATION: the empirical lower bound {self.epsilon_lower_bound:.3g} exceeds the claimed "
                    f"ε = {self.claimed_epsilon:.3g} at {self.confidence:.0%} confidence: the implementation or its "
                    "accounting does not deliver the claimed privacy")
        return (f"consistent: lower bound {self.epsilon_lower_bound:.3g} ≤ claimed ε = {self.claimed_epsilon:.3g} "
                "(evidence, not proof, that the claim holds)")

    def summary(self) -> str:
        """The lines ``privtune audit`` prints."""
        return "\n".join([
            f"audit ({self.kind}): {self.num_canaries} canaries, each included with probability 1/2",
            f"claimed ε:               {self.claimed_epsilon:.4g} (δ = {self.delta:.3g})",
            f"empirical lower bound:   {self.epsilon_lower_bound:.4g} at {self.confidence:.0%} confidence",
            f"canaries m:              {self.num_canaries}",
            f"guesses r:               {self.num_guesses}",
            f"correct guesses v:       {self.correct_guesses}",
            f"verdict:                 {self.verdict}",
        ])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        d["violation"] = self.violation
        d["scores_label"] = NOT_PRIVATE_SCORES
        return d

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Write ``audit.json``, ``audit.png`` (score histograms) and a self-contained ``audit.html`` into
        ``directory``."""
        out = Path(directory).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "audit.json", "png": out / "audit.png", "html": out / "audit.html"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=2, default=float), encoding="utf-8")
        self.plot(paths["png"])

        png = base64.b64encode(paths["png"].read_bytes()).decode("ascii")
        paths["html"].write_text(self.html(image=f"data:image/png;base64,{png}"), encoding="utf-8")
        return paths

    def plot(self, path: str | Path) -> None:
        """Histograms of the scores of included and excluded canaries (matplotlib, PNG)."""
        # Lazy: matplotlib only when a plot is drawn: keeps privtune.audit light.
        import matplotlib.pyplot as plt

        fig = self.figure()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    @classmethod
    def from_dict(cls, d: dict) -> "AuditResult":
        """The inverse of :meth:`to_dict` (derived keys such as ``verdict`` are recomputed, not read)."""
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})

    def figure(self):
        """The score histograms as a matplotlib figure (the caller closes it)."""
        # Lazy: matplotlib only when a plot is drawn: keeps privtune.audit light.
        import matplotlib

        matplotlib.use("Agg")
        # Lazy: matplotlib only when a plot is drawn: keeps privtune.audit light.
        import matplotlib.pyplot as plt

        s = np.asarray(self.scores, dtype=float)
        inc = np.asarray(self.included, dtype=bool)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        bins = np.histogram_bin_edges(s, bins=min(40, max(5, int(math.sqrt(s.size)))))
        ax.hist(s[inc], bins=bins, alpha=0.6, label=f"included ({int(inc.sum())})")
        ax.hist(s[~inc], bins=bins, alpha=0.6, label=f"excluded ({int((~inc).sum())})")
        ax.set_xlabel("canary score (higher: guessed included)")
        ax.set_ylabel("canaries")
        ax.set_title(f"{self.kind} audit: ε lower bound {self.epsilon_lower_bound:.3g} "
                     f"vs claimed {self.claimed_epsilon:.3g}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig

    def html(self, image: str | None = "audit.png") -> str:
        """An "Audit" section in a minimal page; ``image`` is the histogram's URL (``save`` inlines it as a
        data URI, so the page is self-contained)."""
        rows = "".join(
            f"<tr><th>{_html.escape(k)}</th><td>{_html.escape(str(v))}</td></tr>"
            for k, v in [("kind", self.kind), ("claimed ε", f"{self.claimed_epsilon:.4g} (δ = {self.delta:.3g})"),
                         (f"lower bound ({self.confidence:.0%})", f"{self.epsilon_lower_bound:.4g}"),
                         ("canaries m", self.num_canaries), ("guesses r", self.num_guesses),
                         ("correct v", self.correct_guesses), ("verdict", self.verdict),
                         ("privacy", self.privacy), ("seconds", f"{self.seconds:.1f}")])
        img = f'<img src="{_html.escape(image)}" alt="canary score histograms">' if image else ""
        return ("<!doctype html><html><head><meta charset='utf-8'><title>privtune audit</title></head><body>"
                "<section id='audit'><h2>Audit</h2>"
                "<p>One-run privacy audit (Steinke, Nasr &amp; Jagielski 2023). A lower bound is evidence, not proof: "
                "a bound above the claimed ε shows a bug; a bound below it does not show the claim is right.</p>"
                f"<table>{rows}</table>{img}<p>{_html.escape(NOT_PRIVATE_SCORES)}.</p></section></body></html>")
