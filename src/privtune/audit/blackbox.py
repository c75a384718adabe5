"""``privtune.audit``: audit the user's own configuration, white-box and black-box, in one call each.

Black-box (input canaries): m synthetic texts of random letter-words with random labels are made;
each is added to the user's training data independently with probability 1/2; one real
:func:`privtune.train` run trains on the union; the score of a canary is minus the trained model's
loss on it (a canary the model has seen tends to have a lower loss).  This audits the whole
pipeline (data loading, mode, sampling, engine, optimizer) end to end.

Privacy of the audit itself.  The black-box run **trains on the user's private data**, so it is
charged to that dataset's budget in the ledger exactly like ``train`` (the planned events are
reserved before any data is read, the actual events committed), unless the caller declares the data
public (``public_data=True``).  It releases no model: the trained model is dropped after scoring.
What it writes (canary scores, memberships, the bound, histograms) is a post-processing of that
DP-trained model and of the synthetic canaries; it is NOT PRIVATE with respect to the canaries, which
are not user data.  The dataset must already be registered in the ledger (an audit never sets a
dataset's total budget).  The white-box part uses no user data and is never charged.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import string
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# module, not function: tests replace training.train with a spy
from privtune import training
from privtune._validation import (
    check_accounted_noise_multiplier,
    check_choice,
    check_delta,
    check_epsilon,
    check_int,
    check_real,
    check_steps,
    suggest_delta,
)
from privtune.accounting import calibrate_noise_multiplier, compute_epsilon
from privtune.accounting.events import DPSGDEvent
from privtune.audit.result import AuditResult, best_guesses
from privtune.audit.whitebox import audit_dp_step
from privtune.data import TextDataset, load_dataset
from privtune.data.datasets import declared_label_set
from privtune.errors import DataError, InvalidParameterError, UnknownDatasetError
from privtune.ledger import Ledger, dataset_identity, open_ledger

__all__ = ["audit", "AuditReport", "make_text_canaries", "AUDITED_MODES"]

# two-phase switches the trainable set mid-run (two events); audit each phase's mode on its own
AUDITED_MODES = ("full", "bitfit", "last-layer", "lora")


@dataclass
class AuditReport:
    """The audits of one configuration: ``whitebox`` and/or ``blackbox`` :class:`AuditResult` (None if skipped)."""

    whitebox: AuditResult | None = None
    blackbox: AuditResult | None = None
    output_dir: Path | None = None
    notes: list = field(default_factory=list)

    @property
    def results(self) -> list[AuditResult]:
        return [r for r in (self.whitebox, self.blackbox) if r is not None]

    @property
    def violation(self) -> bool:
        """True when any audit's lower bound exceeds the claimed ε."""
        return any(r.violation for r in self.results)

    def summary(self) -> str:
        return "\n\n".join([r.summary() for r in self.results] + (["\n".join(self.notes)] if self.notes else []))

    def save(self, directory: str | os.PathLike) -> Path:
        """Write each audit into ``directory/whitebox`` and ``directory/blackbox`` (audit.json/.png/.html)."""
        out = Path(directory).expanduser()
        for r in self.results:
            r.save(out / r.kind.replace("-", ""))
        self.output_dir = out
        return out


def make_text_canaries(num_canaries: int, num_labels: int, *, words: int = 8, seed: int | None = None
                       ) -> tuple[list[str], list[int]]:
    """m synthetic canary texts (random lower-case letter-words) with uniformly random labels.

    They are built from a random generator only (never from user data), so they are unlike any real
    example and the model can only fit them by memorising them.
    """
    rng = random.Random(seed if seed is not None else secrets.randbits(62))
    texts, labels = [], []
    for _ in range(num_canaries):
        texts.append(" ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
                              for _ in range(words)))
        labels.append(rng.randrange(num_labels))
    return texts, labels


def audit(
    data: Any = None,
    *,
    model: Any = None,
    mode: str = "bitfit",
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    delta: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    learning_rate: float | None = None,
    clip: float = 1.0,
    clipping: str = "flat",
    optimizer: str = "adam",
    sampling: str = "poisson",
    accountant: str = "pld",
    num_canaries: int = 1000,
    whitebox: bool = True,
    blackbox: bool = True,
    public_data: bool = False,
    ledger: Any = None,
    output_dir: str | os.PathLike | None = None,
    confidence: float = 0.95,
    seed: int | None = None,
    progress: bool = False,
    text_column: str | None = None,
    label_column: str | None = None,
    labels: Any = None,
    max_physical_batch_size: int = 32,
    max_length: int | None = None,
    device: Any = None,
) -> AuditReport:
    """One-run privacy audit of a ``privtune train`` configuration (Steinke, Nasr & Jagielski 2023).

    Args:
        data: the training data, as for :func:`privtune.train` (text data).
        model, mode, epsilon, noise_multiplier, delta, epochs, steps, batch_size, learning_rate, clip,
            clipping, optimizer, sampling ("poisson" or "full_batch"), accountant, text_column,
            label_column, labels, max_physical_batch_size, max_length, device: the configuration, as for
            :func:`privtune.train` (mode: "full", "bitfit", "last-layer" or "lora"; ``labels`` is the public
            label set, declared or the model's own, never read from ``data``).
        num_canaries: m canaries per audit (each included with probability 1/2).
        whitebox: run the white-box audit of the DP step at this configuration's (σ, q, T, C) (no user data).
        blackbox: run the black-box audit: one real training run on ``data`` plus the included canaries.
        public_data: declare ``data`` public: the black-box run is then not charged to the ledger.
            Otherwise the dataset must be registered in the ledger and the run is charged like ``train``.
        ledger: Ledger, URL or None (default ledger), as for :func:`privtune.train`.
        output_dir: write ``whitebox/`` and ``blackbox/`` (audit.json, audit.png, audit.html) there.
        confidence: 1 − β of the lower bounds (default 0.95).
        seed: seeds canaries, membership, the white-box probe and the training run (experiments); None draws
            from the OS, and the training run's seeds are then never recorded (as in ``train``).

    Returns:
        :class:`AuditReport`.
    """
    epsilon, noise_multiplier, epochs, steps = _check_budget_and_length(
        whitebox, blackbox, epsilon, noise_multiplier, epochs, steps)
    mode = check_choice(mode, "mode", AUDITED_MODES)
    sampling = check_choice(sampling, "sampling", ("poisson", "full_batch"))
    m = check_int(num_canaries, "num_canaries", low=10, fix="Use at least 10 canaries (1000 is a good default).")
    confidence = check_real(confidence, "confidence", low=0.0, high=1.0, fix="Pass e.g. confidence=0.95.")
    if not isinstance(public_data, bool):
        raise InvalidParameterError(f"`public_data` must be True or False. Got {public_data!r}.")
    if data is None:
        raise InvalidParameterError("`data` is required: the training data of the configuration to audit.")
    if seed is not None:
        seed = check_int(seed, "seed", low=0, high=2**62)
    # canaries, membership and the white-box probe touch no user data: their seed may be recorded.  The
    # training run on the user's data gets only an explicit seed (experiments), as in train(): a recorded
    # noise seed would make the canary scores a deterministic function of the private data.
    audit_seed = seed if seed is not None else secrets.randbits(62)
    user = _load_user_text(data, labels, model, text_column, label_column)
    delta = check_delta(min(1e-5, suggest_delta(len(user))) if delta is None else delta, dataset_size=len(user))
    can_texts, can_labels, included, union = _add_canaries(user, m, audit_seed)
    B, T, sigma, planned, claimed = _plan_union_run(
        len(union), batch_size=batch_size, steps=steps, epochs=epochs, sampling=sampling, epsilon=epsilon,
        noise_multiplier=noise_multiplier, delta=delta, accountant=accountant)
    report = AuditReport()
    if whitebox:
        report.whitebox = audit_dp_step(
            noise_multiplier=sigma, delta=delta, sample_rate=planned[0].sample_rate, steps=T, clip=clip,
            clipping=clipping, num_canaries=m, max_physical_batch_size=max_physical_batch_size,
            confidence=confidence, accountant=accountant, seed=audit_seed)
        report.whitebox.config["mode"] = mode
    if blackbox:
        report.blackbox = _blackbox(user, union, can_texts, can_labels, included, planned, claimed, delta, sigma, T, B,
                                    model=model, mode=mode, learning_rate=learning_rate, clip=clip,
                                    clipping=clipping, optimizer=optimizer, sampling=sampling,
                                    accountant=accountant, public_data=public_data, ledger=ledger,
                                    confidence=confidence, seed=seed, progress=progress,
                                    max_physical_batch_size=max_physical_batch_size, max_length=max_length,
                                    device=device)
    if output_dir is not None:
        report.save(output_dir)
    return report


def _check_budget_and_length(whitebox: Any, blackbox: Any, epsilon: Any, noise_multiplier: Any, epochs: Any,
                             steps: Any) -> tuple[float | None, float | None, float | None, int | None]:
    """Refuse an audit of nothing, and validate the privacy target (exactly one of ε or σ) and the run length
    (at most one of epochs or steps); returns ``(epsilon, noise_multiplier, epochs, steps)``."""
    if not (whitebox or blackbox):
        raise InvalidParameterError("Nothing to audit: `whitebox` and `blackbox` are both False. Enable one.")
    if (epsilon is None) == (noise_multiplier is None):
        raise InvalidParameterError(
            "Pass exactly one of `epsilon` (with `delta`) or `noise_multiplier`. Got "
            f"epsilon={epsilon!r}, noise_multiplier={noise_multiplier!r}. E.g. epsilon=8, delta=1e-5."
        )
    if epsilon is not None:
        epsilon = check_epsilon(epsilon)
    else:
        noise_multiplier = check_accounted_noise_multiplier(noise_multiplier)
    if epochs is not None and steps is not None:
        raise InvalidParameterError(
            f"Pass either `epochs` or `steps`, not both. Got epochs={epochs!r}, steps={steps!r}.")
    if epochs is not None:
        epochs = check_real(epochs, "epochs", low=0.0, fix="Pass a positive number of passes over the data.")
    if steps is not None:
        steps = check_steps(steps)
    return epsilon, noise_multiplier, epochs, steps


def _load_user_text(data: Any, labels: Any, model: Any, text_column: str | None,
                    label_column: str | None) -> TextDataset:
    """The user's labelled text training data; the label set is public input, as in train(): declared, or the
    model's own (never read from the private rows)."""
    num_labels, label_names, _ = declared_label_set(labels, model=model)
    user = load_dataset(data, text_column, label_column, num_labels=num_labels, label_names=label_names)
    if getattr(user, "kind", None) != "text":
        raise DataError("The black-box audit inserts text canaries: pass text training data (.tsv/.csv/.jsonl).")
    if not user.has_labels:
        raise DataError("The training data has no labels. Pass a file with a label column.")
    return user


def _add_canaries(user: TextDataset, m: int, audit_seed: int
                  ) -> tuple[list[str], list[int], list[bool], TextDataset]:
    """``m`` synthetic canaries (no user data), each included with probability 1/2 (seeded by ``audit_seed``);
    returns their texts, labels, membership and the union of ``user`` and the included ones."""
    gen = random.Random(audit_seed)
    can_texts, can_labels = make_text_canaries(m, user.num_labels, seed=gen.randrange(2**62))
    included = [gen.random() < 0.5 for _ in range(m)]
    ins = [i for i in range(m) if included[i]]
    union = TextDataset(texts=list(user.texts) + [can_texts[i] for i in ins],
                        labels=list(user.labels) + [can_labels[i] for i in ins],
                        num_labels=user.num_labels, label_names=user.label_names)
    return can_texts, can_labels, included, union


def _plan_union_run(n: int, *, batch_size: int | None, steps: int | None, epochs: float | None, sampling: str,
                    epsilon: float | None, noise_multiplier: float | None, delta: float, accountant: str
                    ) -> tuple[int, int, float, list, float]:
    """The plan train() makes for the union of ``n`` examples: ``(B, T, σ, planned events, claimed ε)`` with the
    expected batch size B (examples), T steps (default 3 epochs), σ calibrated from ε at q = B/n and T when ε is
    given, and the ε those events compose to at ``delta``."""
    B = batch_size if batch_size is not None else min(n, 256)
    B = check_int(B, "batch_size", low=1, high=n, fix=f"Pass batch_size ≤ {n}.")
    q = 1.0 if sampling == "full_batch" else B / n
    T = steps if steps is not None else max(1, math.ceil((epochs if epochs is not None else 3.0) / q - 1e-9))
    sigma = (calibrate_noise_multiplier(epsilon, delta, sample_rate=q, steps=T, accountant=accountant,
                                        sampling=sampling) if epsilon is not None else noise_multiplier)
    planned = [DPSGDEvent(sigma, q, T, sampling=sampling, label="audit")]
    return B, T, sigma, planned, compute_epsilon(planned, delta, accountant=accountant)


def _blackbox(user, union, can_texts, can_labels, included, planned, claimed, delta, sigma, T, B, *, model, mode,
              learning_rate, clip, clipping, optimizer, sampling, accountant, public_data, ledger, confidence,
              seed, progress, max_physical_batch_size, max_length, device) -> AuditResult:
    t0 = time.perf_counter()
    m = len(can_texts)
    config = {"mode": mode, "noise_multiplier": sigma, "sample_rate": planned[0].sample_rate, "steps": T,
              "batch_size": B, "clip": clip, "clipping": clipping, "optimizer": optimizer, "sampling": sampling,
              "learning_rate": learning_rate, "accountant": accountant, "canary": "random letter-words, random label",
              "seed": seed if seed is not None else "OS entropy (not recorded)"}
    # the union's label set is the declared one (the canaries' labels are drawn from it)
    declared = list(union.label_names) if union.label_names is not None else list(range(union.num_labels))
    kwargs = dict(model=model, mode=mode, labels=declared, noise_multiplier=sigma, delta=delta, steps=T, batch_size=B,
                  learning_rate=learning_rate, clip=clip, clipping=clipping, optimizer=optimizer, sampling=sampling,
                  accountant=accountant, output_dir=None, seed=seed, progress=progress,
                  max_physical_batch_size=max_physical_batch_size, max_length=max_length, device=device)
    with tempfile.TemporaryDirectory(prefix="privtune-audit-") as tmp:
        # the union is a new dataset: its own throw-away ledger; the user's budget is charged below
        scratch = Ledger(Path(tmp) / "audit-ledger.db")
        if public_data:
            result = training.train(union, ledger=scratch, **kwargs)
            privacy = "data declared public by the user: not charged to the ledger"
        else:
            led = open_ledger(ledger)
            fp, _name = dataset_identity(user)
            try:
                led.status(fp)
            except UnknownDatasetError:
                raise UnknownDatasetError(
                    f"The black-box audit trains on this dataset and spends ε = {claimed:.4g} of its budget, but the "
                    "dataset has no budget in the ledger yet. Register it first with a total that covers the audit "
                    "and your real runs (`privtune budget init`), pass --public-data if the data is public, or run "
                    "the white-box audit only (--no-blackbox), which uses no data."
                ) from None
            with led.spend(fp, planned, command="audit", config={"audit": config}, delta=delta) as reservation:
                result = training.train(union, ledger=scratch, **kwargs)
                reservation.commit(result.events)
            privacy = (f"trained on the user's data: charged to the ledger like train (ε = {claimed:.4g}, "
                       f"δ = {delta:g}); no model released")
    clf = result.model
    clf.eval()
    canaries = TextDataset(texts=list(can_texts), labels=list(can_labels), num_labels=union.num_labels)
    y = torch.tensor(can_labels)
    losses = []
    with torch.no_grad():
        for s in range(0, m, 64):
            idx = torch.arange(s, min(m, s + 64))
            logits = clf(**clf.encode(canaries, idx)).float().cpu()
            losses.append(F.cross_entropy(logits, y[idx], reduction="none"))
    scores = (-torch.cat(losses)).tolist()
    del result, clf
    best = best_guesses(scores, included, delta=delta, confidence=confidence)
    return AuditResult(
        kind="black-box", claimed_epsilon=float(claimed), delta=delta, epsilon_lower_bound=best["epsilon_lower_bound"],
        confidence=confidence, num_canaries=m, num_guesses=best["num_guesses"],
        correct_guesses=best["correct_guesses"], scores=scores, included=list(included),
        seconds=time.perf_counter() - t0, config=config, candidates=best["candidates"], privacy=privacy)
