"""Memorisation of a language model: the exposure of secret canaries (Carlini et al. 2019, "The Secret Sharer").

The black-box audit of a generation run (:func:`privtune.audit.audit` on prompt → response data) inserts
**digit canaries**: m pairs ``"my secret code is"`` → ``"3 9 1 4 7 2"`` with k uniformly random digits (the
secret), each added to the training data independently with probability 1/2.  The candidate space R is every
k-digit secret (|R| = 10^k).  The log-perplexity of a secret is the trained model's summed negative
log-likelihood of its response tokens given the canary prompt (the task's per-example loss, in bits here), and

    exposure(c) = log2 |R| − log2 rank(c),   rank(c) = |{r ∈ R : log-perplexity(r) ≤ log-perplexity(c)}|,

from 0 (the secret is no likelier than any other: ties count against it) to log2 |R| (the model ranks it first).

* |R| ≤ ``candidates``: every secret is scored and the rank is exact;
* otherwise ``candidates`` secrets are sampled uniformly from R (the canaries' own secrets left out) and
  rank ≈ 1 + (|R| − 1)·p̂, with p̂ the fraction of sampled secrets at most as perplexing as the canary; when
  fewer than :data:`MIN_SAMPLED_BELOW` of them are, p̂ cannot resolve the rank and p comes instead from a
  skew-normal distribution fitted to the sampled log-perplexities (the paper's extrapolation, Section 4.3).

An inserted canary with a high exposure has been memorised; a canary that was not inserted shows what chance
gives (its expected exposure is about log2 e ≈ 1.44 bits).  The audit measures the DP-trained model and, as a
reference, a model fine-tuned without privacy on the same data and canaries.  The reference's figures are
**NOT PRIVATE** (a non-private model of the private data: nothing of it is released but these numbers); the DP
model's are a post-processing of the charged run.  Neither model is released.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from privtune.audit.specs import DEFAULT_CANARY_DIGITS, DEFAULT_CANDIDATES
from privtune.errors import DataError, InvalidParameterError, ModelError

__all__ = ["CANARY_PROMPT", "DigitCanaries", "ExposureReport", "exposure_estimates", "make_digit_secrets",
           "secret_losses"]

#: the canary prompt (public: the canary's fixed format)
CANARY_PROMPT = "my secret code is"
#: below this many sampled secrets at most as perplexing as the canary, the skew-normal fit estimates the rank
MIN_SAMPLED_BELOW = 20

NOT_PRIVATE_REFERENCE = (
    "NOT PRIVATE: the non-private reference is a model of the private data trained without DP; its figures "
    "(exposures, scores, lower bound) are not covered by any privacy guarantee. The model is not released."
)


def make_digit_secrets(m: int, digits: int, rng: random.Random) -> list[str]:
    """``m`` distinct secrets of ``digits`` uniformly random digits, written ``"3 9 1 4 7 2"``."""
    if 10 ** digits < m:
        raise InvalidParameterError(f"{m} distinct canaries need more than {digits} digits (10^{digits} < {m}). "
                                    "Pass more digits or fewer canaries.")
    seen: dict[str, None] = {}
    while len(seen) < m:
        seen.setdefault(" ".join(str(rng.randrange(10)) for _ in range(digits)))
    return list(seen)


def _all_secrets(digits: int) -> list[str]:
    return [" ".join(f"{i:0{digits}d}") for i in range(10 ** digits)]


def secret_losses(model: Any, secrets_: Sequence[str], *, prompt: str = CANARY_PROMPT,
                  batch_size: int = 32) -> np.ndarray:
    """Log-perplexity in bits (summed negative log2-likelihood of the response tokens, end of text included) of
    each secret as the response to ``prompt`` under ``model`` (a :class:`privtune.models.generator.Generator`);
    no gradient, the model's mode kept."""
    from privtune.data.generation import GenerationDataset
    from privtune.tasks.generation import Generation

    task = Generation()
    data = GenerationDataset(prompts=[prompt] * len(secrets_), responses=list(secrets_))
    device = model._device()
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for s in range(0, len(data), batch_size):
                idx = torch.arange(s, min(len(data), s + batch_size))
                batch = {k: v.to(device) for k, v in task.batch(model, data, idx).items()}
                out.append(task.per_example_loss(model, batch).double().cpu())
    finally:
        model.train(was_training)
    return (torch.cat(out).numpy() / math.log(2)) if out else np.zeros(0)


def _exposure(space_size: int, log_p: float) -> float:
    """log2 |R| − log2(1 + (|R| − 1)·p) from log p (natural log; p may be far below float precision)."""
    log_rank = float(np.logaddexp(0.0, math.log(space_size - 1) + log_p)) if space_size > 1 else 0.0
    return max(0.0, (math.log(space_size) - log_rank) / math.log(2))


def exposure_estimates(canary: Sequence[float], candidates: Sequence[float], space_size: int, *,
                       exact: bool) -> list[dict]:
    """Exposure (bits) of each canary from log-perplexities.

    ``exact``: ``candidates`` is the whole space R (canaries included): rank = #{r : ℓ(r) ≤ ℓ(c)}.  Otherwise
    ``candidates`` is a uniform sample of R without the canaries: rank ≈ 1 + (|R| − 1)·p̂ (p̂: the sampled
    fraction with ℓ(r) ≤ ℓ(c)), or with fewer than :data:`MIN_SAMPLED_BELOW` such samples p from a skew-normal fit.
    Ties count against the canary (a relative tolerance of 1e-9 absorbs rounding).  Returns one
    ``{"exposure", "method", "rank", "sampled_below"}`` per canary."""
    from scipy.stats import skewnorm

    c = np.asarray(canary, dtype=float)
    r = np.sort(np.asarray(candidates, dtype=float))
    if r.size == 0 or not (np.isfinite(c).all() and np.isfinite(r).all()):
        raise InvalidParameterError("exposure needs finite log-perplexities and at least one candidate.")
    if exact and r.size != space_size:
        raise InvalidParameterError(f"an exact rank needs every one of the {space_size} candidates; got {r.size}.")
    below = np.searchsorted(r, c + 1e-9 * np.maximum(1.0, np.abs(c)), side="right")
    fit = None
    out = []
    for value, k in zip(c, below):
        k = int(k)
        if exact:
            rank = max(1, k)
            out.append({"exposure": math.log2(space_size) - math.log2(rank), "method": "exact", "rank": rank,
                        "sampled_below": None})
        elif k >= MIN_SAMPLED_BELOW:
            out.append({"exposure": _exposure(space_size, math.log(k / r.size)), "method": "sampled",
                        "rank": 1 + (space_size - 1) * k / r.size, "sampled_below": k})
        else:
            if fit is None:
                fit = skewnorm.fit(r) if np.ptp(r) > 0 else None
            log_p = float(skewnorm.logcdf(value, *fit)) if fit is not None else (0.0 if value >= r[0] else -math.inf)
            e = _exposure(space_size, log_p)
            out.append({"exposure": e, "method": "skew-normal fit", "rank": 2.0 ** (math.log2(space_size) - e),
                        "sampled_below": k})
    return out


@dataclass
class DigitCanaries:
    """The canaries of a generation audit (synthetic: never user data) and the training union.

    ``secrets[i]`` is canary i's response to :data:`CANARY_PROMPT`; ``included[i]`` whether it was added to the
    training data (probability 1/2); ``user`` is the user's pairs and ``union`` those followed by the included
    canaries; ``candidates`` is how many secrets estimate a rank; ``sample_seed`` seeds their sample.  The
    audit's public size is the union's rows, or at user level (``units``, the audit's privacy unit) its units:
    each canary is then a unit of r rows, its secret r times, included or left out whole."""

    secrets: list[str]
    included: list[bool]
    user: Any
    union: Any
    digits: int
    candidates: int
    sample_seed: int
    prompt: str = CANARY_PROMPT
    kind: str = "generation"
    units: Any = None  # the audit's privacy unit (privtune.audit.blackbox._AuditUnits), None: example level

    @property
    def union_size(self) -> int:
        """The union's public size: its rows, or at user level its units (the user's and the included canaries')."""
        return len(self.union) if self.units is None else self.units.num_units + sum(self.included)

    @classmethod
    def add_to(cls, user: Any, m: int, audit_seed: int, *, digits: int = DEFAULT_CANARY_DIGITS,
               candidates: int = DEFAULT_CANDIDATES, units: Any = None) -> "DigitCanaries":
        """``m`` digit canaries (seeded by ``audit_seed``), each included with probability 1/2, and the union.
        User level (``units``): canary i is a unit of ``units.r`` rows, its secret each time; ``units`` gets the
        union's unit keys."""
        from privtune.data.generation import GenerationDataset

        gen = random.Random(audit_seed)
        secrets_ = make_digit_secrets(m, digits, random.Random(gen.randrange(2**62)))
        included = [gen.random() < 0.5 for _ in range(m)]
        r = 1 if units is None else units.r
        ins = [i for i, inc in enumerate(included) if inc for _ in range(r)]  # canary i's r rows, in order
        union = GenerationDataset(prompts=list(user.prompts) + [CANARY_PROMPT] * len(ins),
                                  responses=list(user.responses) + [secrets_[i] for i in ins])
        if units is not None:
            units.union_keys = list(units.user_keys) + [f"canary unit {i}" for i in ins]
        return cls(secrets_, included, user, union, digits, candidates, gen.randrange(2**62), units=units)

    @property
    def description(self) -> str:
        rows = "" if self.units is None or self.units.r == 1 else f", units of {self.units.r} rows"
        return f"{self.prompt!r} → {self.digits} random digits{rows}"

    @property
    def space_size(self) -> int:
        return 10 ** self.digits

    def train_kwargs(self) -> dict:
        return {}

    def check_model(self, model: Any) -> None:
        """Refuse (before anything is charged) a model whose tokenizer cannot tell the digits apart or whose
        ``max_length`` cuts a canary: its exposures would mean nothing."""
        tok = model.tokenizer
        ids = [tuple(tok(d, add_special_tokens=False)["input_ids"]) for d in "0123456789"]
        unk = getattr(tok, "unk_token_id", None)
        if len(set(ids)) < 10 or any(not t or (unk is not None and unk in t) for t in ids):
            raise ModelError("The memorisation audit's canaries are digit codes, but the model's tokenizer does not "
                             "spell the ten digits as ten distinct known tokens. Use a model whose vocabulary has "
                             "the digits.")
        from privtune.data.generation import GenerationDataset, tokenize_generation

        probe = GenerationDataset(prompts=[self.prompt], responses=[self.secrets[0]])
        if tokenize_generation(probe, tok, max_length=model.max_length, template=model.template).truncated:
            raise InvalidParameterError(f"`max_length` {model.max_length} cuts the audit's canaries; pass a larger "
                                        "--max-length or fewer --canary-digits.")

    def measure(self, model: Any, *, batch_size: int = 32) -> dict:
        """Scores (minus the log-perplexity: higher = guessed inserted) and exposures of every canary."""
        t0 = time.perf_counter()
        exact = self.space_size <= self.candidates
        if exact:
            pool = _all_secrets(self.digits)
        else:
            rng, taken = random.Random(self.sample_seed), set(self.secrets)
            pool = []
            while len(pool) < self.candidates:
                s = " ".join(str(rng.randrange(10)) for _ in range(self.digits))
                if s not in taken:
                    pool.append(s)
        losses = secret_losses(model, pool + ([] if exact else self.secrets), prompt=self.prompt,
                               batch_size=batch_size)
        if exact:
            where = {s: i for i, s in enumerate(pool)}
            canary = losses[[where[s] for s in self.secrets]]
            cand = losses
        else:
            canary, cand = losses[len(pool):], losses[:len(pool)]
        est = exposure_estimates(canary, cand, self.space_size, exact=exact)
        return {"scores": (-canary).tolist(), "log_perplexity": canary.tolist(), "exposure": est,
                "candidates_scored": len(pool), "seconds": time.perf_counter() - t0}


@dataclass
class ExposureReport:
    """Exposure of every canary in the DP-trained model and (NOT PRIVATE) in the non-private reference."""

    prompt: str
    digits: int
    space_size: int
    candidates_scored: int
    secrets: list
    included: list
    dp: list  # one exposure_estimates() entry per canary, with "log_perplexity"
    reference: list | None = None  # the same for the non-private reference (NOT PRIVATE), or None
    reference_lower_bound: float | None = None  # one-run ε lower bound of the reference's scores (NOT PRIVATE)
    reference_config: dict = field(default_factory=dict)
    claimed_epsilon: float | None = None
    privacy: str = ""
    seconds: float = 0.0
    #: user level: the audit's privacy unit (its column name), k and the rows r of a canary unit; None: example level
    privacy_unit: dict | None = None

    @classmethod
    def from_measurements(cls, canaries: DigitCanaries, dp: dict, reference: dict | None = None, **kw
                          ) -> "ExposureReport":
        join = (lambda m: None if m is None else [{**e, "log_perplexity": float(lp)}  # noqa: E731
                                                  for e, lp in zip(m["exposure"], m["log_perplexity"])])
        u = canaries.units
        unit = None if u is None else {"unit": u.name, "max_rows_per_unit": u.k, "canary_rows": u.r}
        return cls(prompt=canaries.prompt, digits=canaries.digits, space_size=canaries.space_size,
                   candidates_scored=dp["candidates_scored"], secrets=list(canaries.secrets),
                   included=list(canaries.included), dp=join(dp), reference=join(reference), privacy_unit=unit, **kw)

    def _stats(self, rows: list | None, inserted: bool) -> tuple[float, float] | None:
        if rows is None:
            return None
        xs = [r["exposure"] for r, i in zip(rows, self.included) if i == inserted]
        return (float(np.mean(xs)), float(np.max(xs))) if xs else None

    def summary(self, max_rows: int = 15) -> str:
        """The table ``privtune audit`` prints: inserted canaries (highest DP exposure first), then the mean and
        the maximum over inserted and over not inserted canaries (bits)."""
        ref = self.reference is not None
        how = ("exact ranks" if self.candidates_scored >= self.space_size else
               f"ranks estimated from {self.candidates_scored} sampled secrets")
        row = (lambda a, b, dp, rf, note="": f"{a:<24}{b:<10}{dp:>12}"  # noqa: E731
               + (f"{rf:>14}" if ref else "") + (f"   {note}" if note else ""))
        lines = [f"memorisation (exposure, Carlini et al. 2019): canaries {self.prompt!r} → {self.digits} random "
                 f"digits, |R| = 10^{self.digits} (exposure 0 … {math.log2(self.space_size):.1f} bits), {how}",
                 row("canary", "inserted", "exposure DP", "non-private*", "how (DP)")]
        if self.privacy_unit is not None:
            u = self.privacy_unit
            lines.insert(1, f"user level: (ε, δ) with respect to one {u['unit']!r}; each canary is a unit of "
                            f"{u['canary_rows']} rows, its secret each time (cap k = {u['max_rows_per_unit']})")
        order = sorted((i for i, inc in enumerate(self.included) if inc), key=lambda i: -self.dp[i]["exposure"])
        for i in order[:max_rows]:
            lines.append(row(self.secrets[i], "yes", f"{self.dp[i]['exposure']:.2f}",
                             f"{self.reference[i]['exposure']:.2f}" if ref else "", self.dp[i]["method"]))
        if len(order) > max_rows:
            lines.append(f"… {len(order) - max_rows} more inserted canaries in exposure.json")
        for label, inserted in (("inserted", True), ("not inserted", False)):
            d, r = self._stats(self.dp, inserted), self._stats(self.reference, inserted)
            if d is None:
                continue
            for k, what in enumerate(("mean", "max")):
                lines.append(row(f"{what} ({self.included.count(inserted)} {label})", "", f"{d[k]:.2f}",
                                 f"{r[k]:.2f}" if r is not None else ""))
        lines.append("not inserted: what chance gives (about 1.44 bits on average); ties count against a canary")
        if ref:
            bound = ("" if self.reference_lower_bound is None else
                     f" Its one-run ε lower bound from the same canaries: {self.reference_lower_bound:.3g}.")
            lines.append(f"* {NOT_PRIVATE_REFERENCE}{bound}")
        lines.append(f"privacy: {self.privacy}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reference_label"] = NOT_PRIVATE_REFERENCE if self.reference is not None else None
        d["canaries_label"] = ("NOT PRIVATE with respect to the canaries: synthetic secrets and their "
                               "memberships, never user data")
        return d

    def save(self, directory: str | Path) -> Path:
        """Write ``exposure.json`` into ``directory``."""
        out = Path(directory).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        path = out / "exposure.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, default=float), encoding="utf-8")
        return path


def load_generation_user(data: Any, model: Any, text_column: str | None, label_column: str | None,
                         max_length: int | None, *, load_model: bool = True) -> tuple[Any, Any, Any]:
    """The user's prompt → response pairs (``embedded:chitchat``: the demo's private split, with SmolLM2-135M
    as the default model), the model name and, with ``load_model``, the loaded generator (for the checks before
    any charge; else None)."""
    from privtune.data.generation import EMBEDDED_CHITCHAT, embedded_chitchat
    from privtune.models.generator import load_generator
    from privtune.tasks.generation import Generation

    if isinstance(data, str) and data == EMBEDDED_CHITCHAT:
        user = embedded_chitchat()[0]
        model = "smollm2-135m" if model is None else model
    else:
        user = Generation().load_split(data, "data", text_column=text_column, label_column=label_column)
    if user.responses is None:
        raise DataError("The memorisation audit trains on prompt → response pairs: every row needs a response.")
    return user, model, load_generator(model, max_length=max_length) if load_model else None


def nonprivate_reference(canaries: DigitCanaries, *, model: Any, mode: str, epochs: float, batch_size: int,
                         learning_rate: float | None, optimizer: str, seed: int | None, max_length: int | None,
                         device: Any) -> dict:
    """Fine-tune a fresh copy of ``model`` on the union without privacy (NOT PRIVATE; ``fit_nonprivate``, the
    same mode, epochs and learning rate as the DP run, batches of ``batch_size``) and measure the canaries."""
    from privtune.models.generator import GENERATION_LEARNING_RATES, apply_generation_mode, load_generator
    from privtune.training import fit_nonprivate

    gen = load_generator(model, max_length=max_length)
    apply_generation_mode(gen, mode)
    lr = learning_rate if learning_rate is not None else GENERATION_LEARNING_RATES[mode]
    fit_nonprivate(gen, canaries.union, epochs=epochs, batch_size=batch_size, learning_rate=lr, optimizer=optimizer,
                   seed=seed, device=device)
    measured = canaries.measure(gen, batch_size=batch_size)
    measured["config"] = {"mode": mode, "epochs": epochs, "batch_size": batch_size, "learning_rate": lr,
                          "optimizer": optimizer, "label": "NOT PRIVATE (non-private training)"}
    return measured
