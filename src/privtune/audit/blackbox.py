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

import json
import math
import os
import random
import secrets
import string
import tempfile
import time
import uuid
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
from privtune import _release
from privtune.errors import BudgetExceededError, DataError, InvalidParameterError, PrivtuneError, UnknownDatasetError
from privtune.ledger import Ledger, dataset_identity, open_ledger
from privtune.models.classifier import check_model
from privtune.run import budget as run_budget
from privtune.run import release as run_release
from privtune.run.budget import BudgetRequest

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
    resume: bool = False,
    privacy_unit: str | None = None,
    max_rows_per_unit: int | None = None,
    canary_rows: int | None = None,
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
        resume: finish an audit that was interrupted (killed, a full disk) in ``output_dir``: the same
            arguments repeat the same audit under its ledger reservation, without a second charge.  A charged
            audit with ``output_dir`` keeps its seeds there (``.privtune-audit-state.json``, 0600) until its
            files are written.
        privacy_unit, max_rows_per_unit, canary_rows: the user-level configuration (docs/privacy-unit.md): the
            unit column of ``data`` and k; the canaries are units of r = ``canary_rows`` (default k) rows, in or out
            whole, scored by their rows' mean; units are sampled at q = B/N_u; the charge records the unit.

    Everything knowable (arguments, data, the model and ``max_length``, the output directory) is checked
    before the ledger reservation: a refused audit charges nothing and leaves no output directory.

    Returns:
        :class:`AuditReport`.
    """
    given = dict(locals())  # the arguments as passed: a resumed audit must repeat them
    epsilon, noise_multiplier, epochs, steps = _check_budget_and_length(
        whitebox, blackbox, epsilon, noise_multiplier, epochs, steps)
    mode, sampling, m, confidence, seed = _check_options(data, mode, sampling, num_canaries, confidence, public_data,
                                                         seed, resume)
    out = _check_audit_output(output_dir, resume)
    user = _load_user_text(data, labels, model, text_column, label_column)
    units = _audit_units(data, user, privacy_unit, max_rows_per_unit, canary_rows)
    n_public = len(user) if units is None else units.num_units  # δ < 1/N_u at user level
    delta = check_delta(min(1e-5, suggest_delta(n_public)) if delta is None else delta, dataset_size=n_public)
    if blackbox and not isinstance(model, torch.nn.Module):
        check_model(model, max_length=max_length)  # a missing model or too long max_length: before the reservation
    arguments = {**{k: given[k] for k in _RESUME_COMPARED}, "data": dataset_identity(user)[0],
                 "model": None if model is None else str(model),
                 "labels": list(user.label_names) if user.label_names is not None else user.num_labels,
                 "privacy_unit": None if units is None else [units.name, units.k, units.r]}
    state = _audit_state(out, resume, arguments, seed, charged=blackbox and not public_data)
    can_texts, can_labels, included, union = _add_canaries(user, m, state.audit_seed, units)
    B, T, sigma, planned, claimed = _plan_union_run(
        len(union) if units is None else units.union_size(included), batch_size=batch_size, steps=steps, epochs=epochs, sampling=sampling, epsilon=epsilon,
        noise_multiplier=noise_multiplier, delta=delta, accountant=accountant)
    created = _release.prepare_output_dir(out, (), _AUDIT_DIRS) if out is not None else []
    if state.path is not None and not resume:
        # written before the reservation: an audit killed at any later point resumes under that reservation
        state.save()
    audit_seed = state.audit_seed
    report = AuditReport()
    if whitebox:
        report.whitebox = audit_dp_step(
            noise_multiplier=sigma, delta=delta, sample_rate=planned[0].sample_rate, steps=T, clip=clip,
            clipping=clipping, num_canaries=m, max_physical_batch_size=max_physical_batch_size,
            confidence=confidence, accountant=accountant, seed=audit_seed,
            **({} if units is None else {"rows_per_unit": units.r, "max_rows_per_unit": units.k}))
        report.whitebox.config["mode"] = mode
    if blackbox:
        try:
            report.blackbox = _blackbox(
                user, union, can_texts, can_labels, included, planned, claimed, delta, sigma, T, B,
                model=model, mode=mode, learning_rate=learning_rate, clip=clip, clipping=clipping,
                optimizer=optimizer, sampling=sampling, accountant=accountant, public_data=public_data,
                ledger=ledger, confidence=confidence, seed=seed, train_seed=state.train_seed, progress=progress,
                max_physical_batch_size=max_physical_batch_size, max_length=max_length, device=device,
                resume_key=state.run_id, resume=resume, units=units)
        except _Unreserved as refused:  # nothing was charged: remove what this audit created
            _release.discard_unreserved(created, [state.path] if state.path is not None and not resume else [])
            raise refused.error from None
    if out is not None:
        _save_report(report, out, state)
    return report


def _check_options(data: Any, mode: Any, sampling: Any, num_canaries: Any, confidence: Any, public_data: Any,
                   seed: Any, resume: Any) -> tuple[str, str, int, float, int | None]:
    """:func:`audit`'s options checked in order; returns ``(mode, sampling, m, confidence, seed)``."""
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
    if not isinstance(resume, bool):
        raise InvalidParameterError(f"`resume` must be True or False. Got {resume!r}.")
    return mode, sampling, m, confidence, seed


#: the arguments a resumed audit must repeat (besides the data, the model and the label set)
_RESUME_COMPARED = ("mode", "epsilon", "noise_multiplier", "delta", "epochs", "steps", "batch_size", "learning_rate",
                    "clip", "clipping", "optimizer", "sampling", "accountant", "num_canaries", "whitebox", "blackbox",
                    "public_data", "confidence", "seed", "max_length", "max_physical_batch_size")


def _save_report(report: AuditReport, out: Path, state: "_AuditState") -> None:
    """Write the audit's files; a failed write is one error (a charged audit: --resume writes them again
    without a new charge).  The private state goes once the files are in place."""
    try:
        report.save(out)
    except OSError as exc:
        again = (" The ledger charge stands; fix the cause, then run the same command with --resume: it "
                 "repeats the audit without a new charge." if state.path is not None else "")
        raise PrivtuneError(
            f"Writing the audit's files into {str(out)!r} failed ({exc.strerror or exc}).{again}") from None
    state.remove()


#: what an audit writes into its output directory
_AUDIT_DIRS = ("whitebox", "blackbox")
#: OUTPUT/AUDIT_STATE: the private state of an unfinished charged audit (seeds and ledger resume key)
AUDIT_STATE = ".privtune-audit-state.json"


class _Unreserved(Exception):
    """The ledger refused the audit before anything was charged (carries the error to raise)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _check_audit_output(output_dir: Any, resume: bool) -> Path | None:
    """The output directory, checked without creating anything: it must be able to hold ``whitebox/`` and
    ``blackbox/``; ``resume`` needs an interrupted audit there, a new audit must not find one."""
    out = Path(output_dir).expanduser() if output_dir is not None else None
    if out is not None:
        _release.check_output_path(out, (), _AUDIT_DIRS)
        for name in _AUDIT_DIRS:
            for file in ("audit.json", "audit.png", "audit.html"):
                if (out / name / file).is_dir():
                    raise InvalidParameterError(
                        f"`output_dir`: {str(out / name / file)!r} is a directory, but the audit writes its file "
                        f"{file!r} there. Nothing was charged. Move it away or pass another output directory (--output).")
    if resume:
        if out is None:
            raise InvalidParameterError("`resume=True` needs `output_dir` (--output: the directory of the interrupted "
                                        "audit).")
        if not (out / AUDIT_STATE).is_file():
            raise InvalidParameterError(
                f"`resume`: no interrupted audit in {str(out)!r} (no {AUDIT_STATE}). Run without --resume to start "
                "a new audit, or pass the --output of an interrupted one.")
    elif out is not None and (out / AUDIT_STATE).exists():
        raise InvalidParameterError(
            f"`output_dir` {str(out)!r} holds an interrupted audit (its ledger reservation stays charged). Pass "
            "--resume (resume=True) to finish it without a new charge, or pass a new directory.")
    return out


@dataclass
class _AuditState:
    """Seeds and ledger resume key of one audit.  Kept in ``OUTPUT/AUDIT_STATE`` (0600) while a charged audit
    is unfinished, so that ``resume`` repeats exactly the same audit (same canaries, same training noise) under
    the same reservation; deleted once its files are written (the training seed is private state)."""

    audit_seed: int
    train_seed: int | None
    run_id: str | None
    arguments: dict
    path: Path | None = None

    def save(self) -> None:
        fd = _release.private_open(self.path.with_name(self.path.name + ".tmp"),
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"audit_seed": self.audit_seed, "train_seed": self.train_seed, "run_id": self.run_id,
                       "arguments": self.arguments}, f)
        os.replace(self.path.with_name(self.path.name + ".tmp"), self.path)

    def remove(self) -> None:
        if self.path is not None and self.path.exists():
            self.path.unlink()


def _audit_state(out: Path | None, resume: bool, arguments: dict, seed: int | None, *, charged: bool) -> _AuditState:
    """A new audit's seeds (canaries and membership: ``seed`` or random; a charged training run that can be
    resumed: a secret training seed unless ``seed`` is given), or the interrupted audit's, whose arguments must
    be the same."""
    # canaries, membership and the white-box probe touch no user data: their seed may be recorded.  The
    # training run on the user's data gets only an explicit seed (experiments), as in train(): a recorded
    # noise seed would make the canary scores a deterministic function of the private data.  A resumable
    # audit keeps its secret training seed in the private state file only (like train's checkpoint).
    path = out / AUDIT_STATE if out is not None and charged else None
    if not resume:
        return _AuditState(audit_seed=seed if seed is not None else secrets.randbits(62),
                           train_seed=seed if seed is not None or path is None else secrets.randbits(62),
                           run_id=uuid.uuid4().hex if path is not None else None, arguments=arguments, path=path)
    if path is None:
        raise InvalidParameterError("`resume`: only a black-box audit charged to the ledger can be resumed; this one "
                                    "charges nothing. Run it again without --resume.")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        state = _AuditState(int(saved["audit_seed"]), saved["train_seed"], str(saved["run_id"]),
                            saved["arguments"], path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidParameterError(f"`resume`: {str(path)!r} is not a readable audit state ({exc}). ") from None
    if state.arguments != json.loads(json.dumps(arguments)):
        diff = ", ".join(f"{k}: was {state.arguments.get(k)!r}, now {v!r}"
                         for k, v in json.loads(json.dumps(arguments)).items() if state.arguments.get(k) != v)
        raise InvalidParameterError(
            f"`resume`: the arguments differ from the interrupted audit ({diff}). Resume with the same arguments.")
    return state


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


def _add_canaries(user: TextDataset, m: int, audit_seed: int, units: "_AuditUnits | None" = None
                  ) -> tuple[list[str], list[int], list[bool], TextDataset]:
    """``m`` synthetic canaries (no user data), each included with probability 1/2 (seeded by ``audit_seed``);
    returns their texts, labels, membership and the union of ``user`` and the included ones.

    User level (``units``): canary i is a unit of r rows (r texts of one random label, at rows i·r … i·r + r − 1
    of the returned lists), included or left out whole; ``units`` gets the union's unit keys."""
    gen = random.Random(audit_seed)
    r = 1 if units is None else units.r
    can_texts, can_labels = make_text_canaries(m * r, user.num_labels, seed=gen.randrange(2**62))
    if r > 1:  # one label per canary unit: its rows pull the same way (the worst case for per-row clipping)
        can_labels = [can_labels[(i // r) * r] for i in range(m * r)]
    included = [gen.random() < 0.5 for _ in range(m)]
    ins = [i for i in range(m * r) if included[i // r]]
    union = TextDataset(texts=list(user.texts) + [can_texts[i] for i in ins],
                        labels=list(user.labels) + [can_labels[i] for i in ins],
                        num_labels=user.num_labels, label_names=user.label_names)
    if units is not None:
        units.union_keys = list(units.user_keys) + [f"canary unit {i // r}" for i in ins]
    return can_texts, can_labels, included, union


@dataclass
class _AuditUnits:
    """A user-level audit's privacy unit: its name, k, the rows r of a canary unit, the user rows' unit keys
    (private: used only inside the run) and, once the canaries are added, the union's."""

    name: str
    k: int
    r: int
    user_keys: list
    num_units: int
    union_keys: list = field(default_factory=list)

    def union_size(self, included: list) -> int:
        """N_u of the union: the user's units and the included canary units."""
        return self.num_units + sum(bool(x) for x in included)


def _audit_units(data: Any, user: TextDataset, privacy_unit: Any, k: Any, canary_rows: Any) -> _AuditUnits | None:
    """The audit's privacy unit, read and checked before anything is reserved (None: example level)."""
    if privacy_unit is None:
        if k is not None or canary_rows is not None:
            raise InvalidParameterError("`max_rows_per_unit` and `canary_rows` apply only with `privacy_unit` "
                                        "(--privacy-unit COLUMN). Add it, or drop them.")
        return None
    from privtune.engine.units import DEFAULT_MAX_ROWS_PER_UNIT, check_max_rows_per_unit, load_units

    if not isinstance(privacy_unit, str):
        raise InvalidParameterError(f"`privacy_unit` must name a column of the data. Got {type(privacy_unit).__name__}.")
    k = check_max_rows_per_unit(DEFAULT_MAX_ROWS_PER_UNIT if k is None else k)
    r = check_int(k if canary_rows is None else canary_rows, "canary_rows", low=1,
                  fix="Pass the rows of each canary unit, e.g. the cap k.")
    index = load_units(data, privacy_unit, len(user))
    return _AuditUnits(name=index.name, k=k, r=r, user_keys=[f"user unit {u}" for u in index.unit_of_row.tolist()],
                       num_units=index.num_units)


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
              seed, train_seed, progress, max_physical_batch_size, max_length, device, resume_key,
              resume, units=None) -> AuditResult:
    t0 = time.perf_counter()
    m = len(included)
    config = {"mode": mode, "noise_multiplier": sigma, "sample_rate": planned[0].sample_rate, "steps": T,
              "batch_size": B, "clip": clip, "clipping": clipping, "optimizer": optimizer, "sampling": sampling,
              "learning_rate": learning_rate, "accountant": accountant, "canary": "random letter-words, random label",
              "seed": seed if seed is not None else "OS entropy (not recorded)"}
    if units is not None:  # canary units of r rows; batch_size counts units
        config.update(privacy_unit=units.name, max_rows_per_unit=units.k, canary_rows=units.r,
                      canary="units of random letter-word rows, one random label per unit")
    # the union's label set is the declared one (the canaries' labels are drawn from it)
    declared = list(union.label_names) if union.label_names is not None else list(range(union.num_labels))
    kwargs = dict(model=model, mode=mode, labels=declared, noise_multiplier=sigma, delta=delta, steps=T, batch_size=B,
                  learning_rate=learning_rate, clip=clip, clipping=clipping, optimizer=optimizer, sampling=sampling,
                  accountant=accountant, output_dir=None, seed=train_seed, progress=progress,
                  max_physical_batch_size=max_physical_batch_size, max_length=max_length, device=device,
                  **({} if units is None else {"privacy_unit": units.union_keys, "max_rows_per_unit": units.k}))
    with tempfile.TemporaryDirectory(prefix="privtune-audit-") as tmp:
        # the union is a new dataset: its own throw-away ledger; the user's budget is charged below
        scratch = Ledger(Path(tmp) / "audit-ledger.db")
        if public_data:
            result = training.train(union, ledger=scratch, **kwargs)
            privacy = "data declared public by the user: not charged to the ledger"
        else:
            led = open_ledger(ledger)
            fp, _name = dataset_identity(user)
            # the one reservation path (privtune.run.budget), on a budget the user registered: a run killed after
            # its commit repeats the charged run with the same seeds, without a new charge
            request = BudgetRequest(fingerprint=fp, total_epsilon=claimed, delta=delta, accountant=accountant,
                                    command="audit", config={"audit": config}, resume_key=resume_key,
                                    events=planned, resuming=bool(resume), reserve_delta=delta, register=False,
                                    privacy_unit=None if units is None else units.name)
            try:
                reservation = run_budget.reserve(led, request).reservation
            except UnknownDatasetError:
                raise _Unreserved(UnknownDatasetError(
                    f"The black-box audit trains on this dataset and spends ε = {claimed:.4g} of its budget, but the "
                    "dataset has no budget in the ledger yet. Register it first with a total that covers the audit "
                    "and your real runs (`privtune budget init`), pass --public-data if the data is public, or run "
                    "the white-box audit only (--no-blackbox), which uses no data.")) from None
            except BudgetExceededError as exc:
                raise _Unreserved(exc) from None
            result = training.train(union, ledger=scratch, **kwargs)
            run_release.commit(reservation, result.events)
            privacy = (f"trained on the user's data: charged to the ledger like train (ε = {claimed:.4g}, "
                       f"δ = {delta:g}); no model released")
    clf = result.model
    clf.eval()
    canaries = TextDataset(texts=list(can_texts), labels=list(can_labels), num_labels=union.num_labels)
    y = torch.tensor(can_labels)
    losses = []
    with torch.no_grad():
        for s in range(0, len(can_texts), 64):
            idx = torch.arange(s, min(len(can_texts), s + 64))
            logits = clf(**clf.encode(canaries, idx)).float().cpu()
            losses.append(F.cross_entropy(logits, y[idx], reduction="none"))
    # a canary unit's score: minus the mean loss of its rows (one row per canary at example level)
    scores = (-torch.cat(losses).view(m, -1).mean(dim=1)).tolist()
    del result, clf
    best = best_guesses(scores, included, delta=delta, confidence=confidence)
    return AuditResult(
        kind="black-box", claimed_epsilon=float(claimed), delta=delta, epsilon_lower_bound=best["epsilon_lower_bound"],
        confidence=confidence, num_canaries=m, num_guesses=best["num_guesses"],
        correct_guesses=best["correct_guesses"], scores=scores, included=list(included),
        seconds=time.perf_counter() - t0, config=config, candidates=best["candidates"], privacy=privacy)
