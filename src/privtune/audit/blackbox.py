"""``privtune.audit``: audit the user's own configuration, white-box and black-box, in one call each.

Black-box (input canaries): m synthetic texts of random letter-words with random labels are made (on
image data: images of uniformly random pixels with random labels); each is added to the user's training
data independently with probability 1/2; one real
:func:`privtune.train` run trains on the union; the score of a canary is minus the trained model's
loss on it (a canary the model has seen tends to have a lower loss).  This audits the whole
pipeline (data loading, mode, sampling, engine, optimizer) end to end.

On prompt → response data (a causal language model) the canaries are secret digit codes
(:mod:`privtune.audit.exposure`, configured by the spec's :class:`~privtune.audit.specs.ExposureSpec`): the
same one-run bound from their log-perplexities, and the exposure of each canary (Carlini et al. 2019) in the
DP model and in a non-private reference (NOT PRIVATE).

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

# module, not function: tests replace training.train with a spy
from privtune import training
from privtune._validation import check_batchnorm, check_image_features, check_image_size, check_int
from privtune.accounting import calibrate_noise_multiplier, compute_epsilon
from privtune.accounting.events import DPSGDEvent
from privtune.audit.exposure import DigitCanaries, ExposureReport, load_generation_user, nonprivate_reference
from privtune.audit.result import AuditResult, best_guesses
from privtune.audit.specs import AUDITED_MODES, AuditSpec, ProbeSpec
from privtune.audit.whitebox import audit_dp_step
from privtune.data import ImageDataset, TextDataset, load_dataset
from privtune.data.datasets import declared_label_set
from privtune.data.generation import is_generation_data
from privtune import _release
from privtune.engine.units import DEFAULT_MAX_ROWS_PER_UNIT, load_units
from privtune.errors import (BudgetExceededError, DataError, InvalidParameterError, ModelError, PrivtuneError,
                             UnknownDatasetError)
from privtune.ledger import Ledger, dataset_identity, open_ledger
from privtune.models.classifier import check_model
from privtune.models.generator import apply_generation_mode, generation_modes
from privtune.run import budget as run_budget
from privtune.run import release as run_release
from privtune.run.budget import BudgetRequest
from privtune.specs import NoiseSpec, PrivacySpec

__all__ = ["audit", "run_audit", "AuditInputs", "AuditReport", "make_text_canaries", "make_image_canaries",
           "AUDITED_MODES"]


@dataclass
class AuditReport:
    """The audits of one configuration: ``whitebox`` and/or ``blackbox`` :class:`AuditResult` (None if skipped);
    on prompt → response data also ``memorisation``, the canaries' exposures (:class:`ExposureReport`)."""

    whitebox: AuditResult | None = None
    blackbox: AuditResult | None = None
    memorisation: ExposureReport | None = None
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
        parts = [r.summary() for r in self.results]
        parts += [self.memorisation.summary()] if self.memorisation is not None else []
        return "\n\n".join(parts + (["\n".join(self.notes)] if self.notes else []))

    def save(self, directory: str | os.PathLike) -> Path:
        """Write each audit into ``directory/whitebox`` and ``directory/blackbox`` (audit.json/.png/.html), and
        the exposures into ``directory/memorisation/exposure.json``."""
        out = Path(directory).expanduser()
        for r in self.results:
            r.save(out / r.kind.replace("-", ""))
        if self.memorisation is not None:
            self.memorisation.save(out / "memorisation")
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


def make_image_canaries(num_canaries: int, num_labels: int, *, size: int, seed: int | None = None
                        ) -> tuple[list[Any], list[int]]:
    """m synthetic canary images, ``size`` × ``size`` pixels (RGB), each pixel uniformly random, with uniformly
    random labels.

    Like the text canaries they come from a random generator only (never from user data): noise is unlike any
    real photograph, so the model can only fit a canary's label by memorising it.  ``size`` is the model's
    input resolution (the audit's ``image_size``), so that resizing does not smooth the noise away."""
    import numpy as np
    from PIL import Image

    size = check_image_size(size)
    rng = np.random.default_rng(seed if seed is not None else secrets.randbits(62))
    images = [Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), mode="RGB")
              for _ in range(num_canaries)]
    return images, [int(y) for y in rng.integers(0, num_labels, size=num_canaries)]


def audit(
    data: Any = None,
    spec: AuditSpec | None = None,
    *,
    model: Any = None,
    labels: Any = None,
    text_column: str | None = None,
    label_column: str | None = None,
    max_length: int | None = None,
    device: Any = None,
    ledger: Any = None,
    output_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = False,
    image_size: int | None = None,
    batchnorm: str | None = None,
    image_features: str | None = None,
) -> AuditReport:
    """One-run privacy audit of a ``privtune train`` configuration (Steinke, Nasr & Jagielski 2023).

    Args:
        data: the training data, as for :func:`privtune.train`: labelled text, labelled images (an image folder
            with one sub-folder per class, IDX files; then a vision backbone, ``model``, and random-pixel canary
            images), or prompt → response pairs (then a causal language model: digit canaries and their
            exposures, see :mod:`privtune.audit.exposure`).
        spec: what is audited, a validated :class:`~privtune.audit.specs.AuditSpec`: the claim (ε or σ, δ,
            accountant), the mode ("full", "bitfit", "last-layer" or "lora"; default "bitfit", and "lora" on
            prompt → response data, which takes "lora", "full" or "bitfit"), the schedule, optimizer and clipping
            as for :func:`privtune.train`, the number of canaries, which audits run (white-box: the DP step at
            this configuration's (σ, q, T, C), no user data; black-box: one real training run on ``data`` plus
            the included canaries), ``public_data`` (the black-box run is then not charged to the ledger;
            otherwise the dataset must be registered in the ledger and the run is charged like ``train``), the
            confidence of the bounds, the seed, the user-level fields (labelled text only) and, for prompt →
            response data, the secret canaries (``exposure``: their digits, the secrets scored per rank, whether a
            non-private reference is also measured, NOT PRIVATE).  Build it with
            ``AuditSpec.create(epsilon=8.0, delta=1e-5, mode="bitfit", ...)`` (the keywords of ``privtune
            audit``) or from the nested specs.
        model, labels, text_column, label_column, max_length, device: as for :func:`privtune.train` (``labels``
            is the public label set, declared or the model's own, never read from ``data``).
        ledger: Ledger, URL or None (default ledger), as for :func:`privtune.train`.
        output_dir: write ``whitebox/`` and ``blackbox/`` (audit.json, audit.png, audit.html) there, and
            ``memorisation/exposure.json`` on prompt → response data.
        resume: finish an audit that was interrupted (killed, a full disk) in ``output_dir``: the same
            arguments repeat the same audit under its ledger reservation, without a second charge.  A charged
            audit with ``output_dir`` keeps its seeds there (``.privtune-audit-state.json``, 0600) until its
            files are written.
        progress: show the training run's progress.
        image_size, batchnorm, image_features: a vision backbone's public choices, as for :func:`privtune.train`
            (image data only); the canary images are ``image_size`` pixels square (default: the backbone's).

    The spec's seed seeds canaries, membership, the white-box probe and the training run (experiments); without
    one they are drawn from the OS, and the training run's seeds are then never recorded (as in ``train``).
    At user level (``privacy_unit``, docs/privacy-unit.md) the canaries are units of r = ``canary_rows`` rows, in
    or out whole, scored by their rows' mean; units are sampled at q = B/N_u; the charge records the unit.

    Everything knowable (the spec, the data, the model and ``max_length``, the output directory) is checked
    before the ledger reservation: a refused audit charges nothing and leaves no output directory.

    Returns:
        :class:`AuditReport`.
    """
    inputs = AuditInputs(data=data, model=model, labels=labels, text_column=text_column, label_column=label_column,
                         max_length=max_length, device=device, ledger=ledger, output_dir=output_dir, resume=resume,
                         progress=progress, image_size=image_size, batchnorm=batchnorm, image_features=image_features)
    return run_audit(spec, inputs)


@dataclass(frozen=True)
class AuditInputs:
    """Where an audit reads and writes, beside its :class:`~privtune.audit.specs.AuditSpec`: the data, the model
    and the label set (as for :func:`privtune.train`), the device, the ledger, the output directory, whether to
    resume, whether to show progress and a vision backbone's choices (``image_size`` in pixels, ``batchnorm``,
    ``image_features``; image data only).  ``on_output_ready``, if given, is called with the output directory once
    everything is checked and the directory exists (a charged audit's state saved in it), before the ledger
    reservation: from then on an interrupted audit can be finished there with ``resume`` (``privtune audit``
    prints that command)."""

    data: Any
    model: Any = None
    labels: Any = None
    text_column: str | None = None
    label_column: str | None = None
    max_length: int | None = None
    device: Any = None
    ledger: Any = None
    output_dir: str | os.PathLike | None = None
    resume: bool = False
    progress: bool = False
    on_output_ready: Callable[[Path], None] | None = None
    image_size: int | None = None
    batchnorm: str | None = None
    image_features: str | None = None

    def __post_init__(self) -> None:
        if self.data is None:
            raise InvalidParameterError("`data` is required: the training data of the configuration to audit.")
        if not isinstance(self.resume, bool):
            raise InvalidParameterError(f"`resume` must be True or False. Got {self.resume!r}.")
        if self.image_size is not None:
            object.__setattr__(self, "image_size", check_image_size(self.image_size))
        if self.batchnorm is not None:
            object.__setattr__(self, "batchnorm", check_batchnorm(self.batchnorm))
        if self.image_features is not None:
            object.__setattr__(self, "image_features", check_image_features(self.image_features))

    @property
    def vision(self) -> dict:
        """The vision backbone's choices that were given (``image_size``, ``batchnorm``, ``image_features``)."""
        return {k: v for k, v in (("image_size", self.image_size), ("batchnorm", self.batchnorm),
                                  ("image_features", self.image_features)) if v is not None}


def run_audit(spec: AuditSpec, inputs: AuditInputs) -> AuditReport:
    """The audit of :func:`audit`, from its validated spec: everything knowable (the data, the model and
    ``max_length``, the output directory) is checked before the ledger reservation."""
    if not isinstance(spec, AuditSpec):
        raise InvalidParameterError(
            "`spec` must be an AuditSpec: the configuration to audit. Got "
            f"{type(spec).__name__}. E.g. AuditSpec.create(epsilon=8.0, delta=1e-5, mode='bitfit').")
    generation = is_generation_data(inputs.data, inputs.model)
    spec = spec.for_data(generation)  # the data kind's defaults (mode, canaries) and its refusals
    out = _check_audit_output(inputs.output_dir, inputs.resume)
    user, inputs, generator = _load_audited(spec, inputs, generation)
    canary_size = _checked_vision_backbone(spec, inputs, user) if user.kind == "image" else None
    units = _audit_units(inputs.data, user, spec)
    n_public = len(user) if units is None else units.num_units  # δ < 1/N_u at user level
    privacy = spec.privacy.for_dataset(n_public)
    label_names = getattr(user, "label_names", None)
    arguments = {**_compared_arguments(spec, inputs), "data": dataset_identity(user)[0],
                 "model": None if inputs.model is None else str(inputs.model),
                 "labels": None if generation else list(label_names) if label_names is not None else user.num_labels,
                 "privacy_unit": None if units is None else [units.name, units.k, units.r]}
    state = _audit_state(out, inputs.resume, arguments, spec.seed, charged=spec.blackbox and not spec.public_data)
    canaries = _make_canaries(user, spec, state.audit_seed, units, generator, canary_size)
    del generator
    plan = _plan_union_run(canaries.union_size, spec, privacy)
    created = _release.prepare_output_dir(out, (), _AUDIT_DIRS) if out is not None else []
    if state.path is not None and not inputs.resume:
        # written before the reservation: an audit killed at any later point resumes under that reservation
        state.save()
    if out is not None and inputs.on_output_ready is not None:
        inputs.on_output_ready(out)
    report = AuditReport()
    if spec.whitebox:
        probe = ProbeSpec(num_canaries=spec.num_canaries, max_physical_batch_size=spec.schedule.max_physical_batch_size,
                          rows_per_unit=1 if units is None else units.r)
        report.whitebox = audit_dp_step(plan.whitebox_claim, spec.clipping, probe, confidence=spec.confidence,
                                        seed=state.audit_seed)
        report.whitebox.config["mode"] = spec.mode
    if spec.blackbox:
        try:
            report.blackbox, measured = _blackbox(spec, inputs, plan, canaries, state)
        except _Unreserved as refused:  # nothing was charged: remove what this audit created
            _release.discard_unreserved(created, [state.path] if state.path is not None and not inputs.resume else [])
            raise refused.error from None
        if generation:  # the exposures, and those of the NOT PRIVATE non-private reference
            report.memorisation = _memorisation(spec, inputs, plan, canaries, measured, report.blackbox,
                                                seed=state.train_seed)
    if out is not None:
        _save_report(report, out, state)
    return report


def _compared_arguments(spec: AuditSpec, inputs: AuditInputs) -> dict:
    """The configuration a resumed audit must repeat (besides the data, the model, the label set and the unit),
    by its keywords' names (those of ``privtune audit``)."""
    p, sch, o, c = spec.privacy, spec.schedule, spec.optim, spec.clipping
    return {"mode": spec.mode, "epsilon": p.epsilon, "noise_multiplier": p.noise_multiplier, "delta": p.delta,
            "epochs": sch.epochs, "steps": sch.steps, "batch_size": sch.batch_size, "learning_rate": o.learning_rate,
            "clip": c.clip, "clipping": c.clipping, "optimizer": o.name, "sampling": sch.sampling,
            "accountant": p.accountant, "num_canaries": spec.num_canaries, "whitebox": spec.whitebox,
            "blackbox": spec.blackbox, "public_data": spec.public_data, "confidence": spec.confidence,
            "seed": spec.seed, "max_length": inputs.max_length, "max_physical_batch_size": sch.max_physical_batch_size,
            "canary_digits": spec.exposure.canary_digits, "candidates": spec.exposure.candidates,
            "reference": spec.exposure.reference, **inputs.vision}


def _load_audited(spec: AuditSpec, inputs: AuditInputs, generation: bool) -> tuple[Any, AuditInputs, Any]:
    """The user's training data and what the black-box run needs checked before the reservation: the model (a
    missing one, a too long ``max_length``; a causal language model: the mode applies).  Returns ``(user data,
    inputs with the model filled in, loaded generator or None)``."""
    if generation:
        _refuse_vision_choices(inputs, "prompt → response pairs")
    else:
        user = _load_user_labelled(inputs)
        if user.kind == "image":  # the vision backbone: _checked_vision_backbone
            return user, inputs, None
        _refuse_vision_choices(inputs, "text")
        if spec.blackbox and not isinstance(inputs.model, torch.nn.Module):
            check_model(inputs.model, max_length=inputs.max_length)  # a missing model, too long max_length
        return user, inputs, None
    user, model, generator = load_generation_user(inputs.data, inputs.model, inputs.text_column,
                                                  inputs.label_column, inputs.max_length, load_model=spec.blackbox)
    if generator is not None and spec.mode not in generation_modes(generator):
        apply_generation_mode(generator, spec.mode)  # the one clear refusal (e.g. bitfit without biases)
    return user, replace(inputs, model=model), generator


def _refuse_vision_choices(inputs: AuditInputs, kind: str) -> None:
    """A vision backbone's choices on data that is not images are one error (the training run would refuse them
    only after the reservation)."""
    if inputs.vision:
        given = list(inputs.vision)
        raise InvalidParameterError(
            f"{', '.join(f'`{k}`' for k in given)} {'applies' if len(given) == 1 else 'apply'} to image data (a "
            f"vision backbone); this data is {kind}. Drop {' '.join('--' + k.replace('_', '-') for k in given)}.")


def _checked_vision_backbone(spec: AuditSpec, inputs: AuditInputs, user: ImageDataset) -> int:
    """Check, before the reservation, that the black-box run on images can load its vision backbone (a missing or
    text backbone is refused without a charge); returns the canary images' size in pixels: ``image_size`` if
    given, else the backbone's input resolution.  The backbone is loaded again by the training run, whose seed
    initialises its head."""
    from privtune.models.vision import DEFAULT_IMAGE_SIZE, input_image_size
    from privtune.tasks import task_for

    if not spec.blackbox:
        return inputs.image_size or DEFAULT_IMAGE_SIZE
    if inputs.model is None:
        raise InvalidParameterError(
            "The black-box audit of image data trains a vision backbone: name it with `model` (--model), e.g. "
            "efficientnet-lite0, timm:ARCH@WEIGHTS or an image model directory, the one your runs use.")
    clf = task_for(user).build_model(inputs.model, num_labels=user.num_labels, label_names=user.label_names,
                                     seed=0, **inputs.vision)
    if getattr(clf, "kind", "text") != "image":
        raise ModelError(f"`model` takes {getattr(clf, 'kind', 'other')} inputs but the training data is images. "
                         "Pass a vision backbone (--model), e.g. efficientnet-lite0.")
    return inputs.image_size or input_image_size(clf)


def _make_canaries(user: Any, spec: AuditSpec, audit_seed: int, units: "_AuditUnits | None",
                   generator: Any, image_size: int | None = None) -> "_Canaries | DigitCanaries":
    """The audit's canaries and the training union: digit canaries on prompt → response data (checked against
    the loaded generator, before the reservation), random-pixel images of ``image_size`` pixels with random labels
    on image data, letter-word texts with random labels otherwise."""
    if getattr(user, "kind", None) != "generation":
        return _add_canaries(user, spec.num_canaries, audit_seed, units, image_size=image_size)
    canaries = DigitCanaries.add_to(user, spec.num_canaries, audit_seed, digits=spec.exposure.canary_digits,
                                    candidates=spec.exposure.candidates, units=units)
    if generator is not None:
        canaries.check_model(generator)  # digits the tokenizer spells, a max_length that keeps a canary whole
    return canaries


def _memorisation(spec: AuditSpec, inputs: AuditInputs, plan: "_UnionPlan", canaries: DigitCanaries,
                  measured: dict, dp: AuditResult, *, seed: int | None) -> ExposureReport:
    """The exposures of the DP-trained model's canaries and, with ``spec.exposure.reference``, of a non-private
    reference (NOT PRIVATE: trained and measured here on the same union, epochs and learning rate, never
    released)."""
    ref, bound, config = None, None, {}
    if spec.exposure.reference:
        noise = plan.noise
        ref = nonprivate_reference(
            canaries, model=inputs.model, mode=spec.mode, epochs=noise.steps * noise.sample_rate,
            batch_size=min(plan.batch_size, spec.schedule.max_physical_batch_size),
            learning_rate=spec.optim.learning_rate, optimizer=spec.optim.name, seed=seed,
            max_length=inputs.max_length, device=inputs.device)
        bound = best_guesses(ref["scores"], canaries.included, delta=dp.delta,
                             confidence=dp.confidence)["epsilon_lower_bound"]
        config = ref.pop("config")
    return ExposureReport.from_measurements(
        canaries, measured, ref, reference_lower_bound=bound, reference_config=config,
        claimed_epsilon=dp.claimed_epsilon, privacy=dp.privacy, seconds=measured["seconds"])


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
_AUDIT_DIRS = ("whitebox", "blackbox", "memorisation")
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


def _load_user_labelled(inputs: AuditInputs) -> TextDataset | ImageDataset:
    """The user's labelled text or image training data; the label set is public input, as in train(): declared,
    or the model's own (never read from the private rows)."""
    num_labels, label_names, _ = declared_label_set(inputs.labels, model=inputs.model)
    user = load_dataset(inputs.data, inputs.text_column, inputs.label_column, num_labels=num_labels,
                        label_names=label_names)
    if getattr(user, "kind", None) not in ("text", "image"):
        raise DataError(
            f"`privtune audit` takes labelled text or images, or prompt → response data; `data` holds "
            f"{getattr(user, 'kind', 'other')} data. Its white-box audit (--no-blackbox) reads only the number of "
            "rows, so it runs on any text file of as many rows.")
    if not user.has_labels:
        raise DataError("The training data has no labels. Pass a file with a label column.")
    return user


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


@dataclass(frozen=True)
class _Canaries:
    """The black-box canaries and the union they make with the user's data: the canary rows' inputs (texts, or
    images) and labels (canary i: rows i·r … i·r + r − 1), each canary's membership, the union, and its public
    size N (examples, or units N_u at user level)."""

    inputs: list
    labels: list
    included: list
    user: TextDataset | ImageDataset
    union: TextDataset | ImageDataset
    union_size: int
    units: _AuditUnits | None = None

    @property
    def description(self) -> str:
        if self.union.kind == "image":
            size = self.inputs[0].width if self.inputs else 0
            what = f"random-pixel {size}×{size} images"
            return (f"{what}, random label" if self.units is None
                    else f"units of {what}, one random label per unit")
        return ("random letter-words, random label" if self.units is None
                else "units of random letter-words rows, one random label per unit")

    def rows(self, indices: list[int]) -> TextDataset | ImageDataset:
        """Canary rows ``indices`` as a dataset of the union's kind, with their labels."""
        u = self.union
        labels = [self.labels[i] for i in indices]
        if u.kind == "image":
            return ImageDataset(images=[self.inputs[i] for i in indices], labels=labels, num_labels=u.num_labels,
                                label_names=u.label_names)
        return TextDataset(texts=[self.inputs[i] for i in indices], labels=labels, num_labels=u.num_labels,
                           label_names=u.label_names)

    def train_kwargs(self) -> dict:
        """The union's label set is the declared one (the canaries' labels are drawn from it)."""
        u = self.union
        return {"labels": list(u.label_names) if u.label_names is not None else list(range(u.num_labels))}

    def measure(self, clf: Any, *, batch_size: int = 64) -> dict:
        """``{"scores"}``: minus the trained classifier's mean loss on each canary's rows."""
        return {"scores": _canary_scores(clf, self, batch_size=batch_size)}


def _add_canaries(user: TextDataset | ImageDataset, m: int, audit_seed: int, units: _AuditUnits | None = None, *,
                  image_size: int | None = None) -> _Canaries:
    """``m`` synthetic canaries (no user data), each included with probability 1/2 (seeded by ``audit_seed``),
    added to ``user``: letter-word texts, or on image data random-pixel images of ``image_size`` pixels (default
    privtune's vision default).

    User level (``units``): canary i is a unit of r rows (r rows of one random label), included or left out
    whole; ``units`` gets the union's unit keys."""
    gen = random.Random(audit_seed)
    r = 1 if units is None else units.r
    if user.kind == "image":
        from privtune.models.vision import DEFAULT_IMAGE_SIZE

        can_inputs, can_labels = make_image_canaries(m * r, user.num_labels, size=image_size or DEFAULT_IMAGE_SIZE,
                                                     seed=gen.randrange(2**62))
    else:
        can_inputs, can_labels = make_text_canaries(m * r, user.num_labels, seed=gen.randrange(2**62))
    if r > 1:  # one label per canary unit: its rows pull the same way (the worst case for per-row clipping)
        can_labels = [can_labels[(i // r) * r] for i in range(m * r)]
    included = [gen.random() < 0.5 for _ in range(m)]
    ins = [i for i in range(m * r) if included[i // r]]
    labels = list(user.labels) + [can_labels[i] for i in ins]
    if user.kind == "image":
        union = ImageDataset(images=list(user.images) + [can_inputs[i] for i in ins], labels=labels,
                             num_labels=user.num_labels, label_names=user.label_names)
    else:
        union = TextDataset(texts=list(user.texts) + [can_inputs[i] for i in ins], labels=labels,
                            num_labels=user.num_labels, label_names=user.label_names)
    if units is not None:
        units.union_keys = list(units.user_keys) + [f"canary unit {i // r}" for i in ins]
    size = len(union) if units is None else units.num_units + sum(included)
    return _Canaries(can_inputs, can_labels, included, user, union, size, units)


def _audit_units(data: Any, user: Any, spec: AuditSpec) -> _AuditUnits | None:
    """The audit's privacy unit (its column read and checked before anything is reserved; an image dataset's in
    its sidecar table); None: example level."""
    if spec.privacy_unit is None:
        return None
    index = load_units(data, spec.privacy_unit, len(user), dataset=user)
    return _AuditUnits(name=index.name, k=spec.max_rows_per_unit, r=spec.canary_rows,
                       user_keys=[f"user unit {u}" for u in index.unit_of_row.tolist()], num_units=index.num_units)


@dataclass(frozen=True)
class _UnionPlan:
    """The plan of the training run on the union: the expected batch size B (examples, or units), the planned
    DP-SGD mechanism (σ, q = B/N, T, δ, accountant), its events and the claimed ε they compose to at δ."""

    batch_size: int
    noise: NoiseSpec
    planned: list
    claimed: float

    @property
    def whitebox_claim(self) -> NoiseSpec:
        """The same step for the white-box probe (which samples full batches at q = 1)."""
        q = self.noise.sample_rate
        return replace(self.noise, sampling="full_batch" if q == 1.0 else "poisson")


def _plan_union_run(n: int, spec: AuditSpec, privacy: PrivacySpec) -> _UnionPlan:
    """The plan train() makes for the union of ``n`` examples (or units): B (default min(n, 256); n for full
    batches), T steps
    (default 3 epochs), σ calibrated from ε at q = B/n and T when ε is given, and the claimed ε."""
    schedule = spec.schedule
    if spec.blackbox and schedule.sampling == "full_batch" and schedule.batch_size not in (None, n):
        raise InvalidParameterError(  # the training run would refuse it after the reservation
            "`batch_size` does not apply to sampling='full_batch': every step of the black-box run takes the whole "
            "union of the data and the included canaries. Drop --batch-size (batch_size).")
    B = schedule.batch_size if schedule.batch_size is not None else (n if schedule.sampling == "full_batch"
                                                                    else min(n, 256))
    B = check_int(B, "batch_size", low=1, high=n, fix=f"Pass batch_size ≤ {n}.")
    sampling, delta, accountant = schedule.sampling, privacy.delta, privacy.accountant
    q = 1.0 if sampling == "full_batch" else B / n
    epochs = schedule.epochs if schedule.epochs is not None else 3.0
    T = schedule.steps if schedule.steps is not None else max(1, math.ceil(epochs / q - 1e-9))
    sigma = (calibrate_noise_multiplier(privacy.epsilon, delta, sample_rate=q, steps=T, accountant=accountant,
                                        sampling=sampling) if privacy.epsilon is not None
             else privacy.noise_multiplier)
    noise = NoiseSpec(noise_multiplier=sigma, sample_rate=q, steps=T, sampling=sampling, delta=delta,
                      accountant=accountant, max_rows_per_unit=spec.max_rows_per_unit or DEFAULT_MAX_ROWS_PER_UNIT)
    planned = [DPSGDEvent(sigma, q, T, sampling=sampling, label="audit")]
    return _UnionPlan(B, noise, planned, compute_epsilon(planned, delta, accountant=accountant))


def _blackbox(spec: AuditSpec, inputs: AuditInputs, plan: _UnionPlan, canaries: _Canaries | DigitCanaries,
              state: _AuditState) -> tuple[AuditResult, dict]:
    """The black-box audit: one real train() run on the union (charged to the user's budget unless the data is
    declared public), then each canary scored by minus the trained model's mean loss on its rows (a digit
    canary: minus its log-perplexity).  Returns the result and the canaries' measurements (the trained model is
    dropped)."""
    t0 = time.perf_counter()
    m, units, union, noise, delta = len(canaries.included), canaries.units, canaries.union, plan.noise, plan.noise.delta
    config = {"mode": spec.mode, "noise_multiplier": noise.noise_multiplier, "sample_rate": noise.sample_rate,
              "steps": noise.steps, "batch_size": plan.batch_size, "clip": spec.clipping.clip,
              "clipping": spec.clipping.clipping, "optimizer": spec.optim.name, "sampling": noise.sampling,
              "learning_rate": spec.optim.learning_rate, "accountant": noise.accountant,
              "canary": canaries.description,
              "seed": spec.seed if spec.seed is not None else "OS entropy (not recorded)"}
    if units is not None:  # canary units of r rows; batch_size counts units
        config.update(privacy_unit=units.name, max_rows_per_unit=units.k, canary_rows=units.r)
    kwargs = dict(model=inputs.model, mode=spec.mode, **canaries.train_kwargs(), noise_multiplier=noise.noise_multiplier,
                  delta=delta, steps=noise.steps, batch_size=plan.batch_size, learning_rate=spec.optim.learning_rate,
                  clip=spec.clipping.clip, clipping=spec.clipping.clipping, optimizer=spec.optim.name,
                  sampling=noise.sampling, accountant=noise.accountant, output_dir=None, seed=state.train_seed,
                  progress=inputs.progress, max_physical_batch_size=spec.schedule.max_physical_batch_size,
                  max_length=inputs.max_length, device=inputs.device, **inputs.vision,
                  **({} if units is None else {"privacy_unit": units.union_keys, "max_rows_per_unit": units.k}))
    with tempfile.TemporaryDirectory(prefix="privtune-audit-") as tmp:
        # the union is a new dataset: its own throw-away ledger; the user's budget is charged below
        scratch = Ledger(Path(tmp) / "audit-ledger.db")
        if spec.public_data:
            result = training.train(union, ledger=scratch, **kwargs)
            privacy = "data declared public by the user: not charged to the ledger"
        else:
            reservation = _reserve(inputs, plan, canaries, state, config)
            result = training.train(union, ledger=scratch, **kwargs)
            run_release.commit(reservation, result.events)
            privacy = (f"trained on the user's data: charged to the ledger like train (ε = {plan.claimed:.4g}, "
                       f"δ = {delta:g}); no model released")
    measured = canaries.measure(result.model, batch_size=spec.schedule.max_physical_batch_size)
    del result  # no model is released
    scores = measured["scores"]
    best = best_guesses(scores, canaries.included, delta=delta, confidence=spec.confidence)
    return AuditResult(
        kind="black-box", claimed_epsilon=float(plan.claimed), delta=delta,
        epsilon_lower_bound=best["epsilon_lower_bound"], confidence=spec.confidence, num_canaries=m,
        num_guesses=best["num_guesses"], correct_guesses=best["correct_guesses"], scores=scores,
        included=list(canaries.included), seconds=time.perf_counter() - t0, config=config,
        candidates=best["candidates"], privacy=privacy), measured


def _reserve(inputs: AuditInputs, plan: _UnionPlan, canaries: _Canaries | DigitCanaries, state: _AuditState, config: dict) -> Any:
    """Reserve the planned events on the user's registered budget through the one reservation path
    (privtune.run.budget): a run killed after its commit repeats the charged run with the same seeds, without a
    new charge.  A refusal raises :class:`_Unreserved` (nothing was charged)."""
    led = open_ledger(inputs.ledger)
    fp, _name = dataset_identity(canaries.user)
    units, delta = canaries.units, plan.noise.delta
    request = BudgetRequest(fingerprint=fp, total_epsilon=plan.claimed, delta=delta, accountant=plan.noise.accountant,
                            command="audit", config={"audit": config}, resume_key=state.run_id,
                            events=plan.planned, resuming=bool(inputs.resume), reserve_delta=delta, register=False,
                            privacy_unit=None if units is None else units.name)
    try:
        return run_budget.reserve(led, request).reservation
    except UnknownDatasetError:
        raise _Unreserved(UnknownDatasetError(
            f"The black-box audit trains on this dataset and spends ε = {plan.claimed:.4g} of its budget, but the "
            "dataset has no budget in the ledger yet. Register it first with a total that covers the audit "
            "and your real runs (`privtune budget init`), pass --public-data if the data is public, or run "
            "the white-box audit only (--no-blackbox), which uses no data.")) from None
    except BudgetExceededError as exc:
        raise _Unreserved(exc) from None


def _canary_scores(clf: Any, canaries: _Canaries, *, batch_size: int = 64) -> list[float]:
    """Each canary's score: minus the trained model's mean cross-entropy loss on its rows (one row per canary at
    example level)."""
    clf.eval()
    rows = canaries.rows(list(range(len(canaries.inputs))))
    y = torch.tensor(canaries.labels)
    losses = []
    with torch.no_grad():
        for s in range(0, len(canaries.inputs), batch_size):
            idx = torch.arange(s, min(len(canaries.inputs), s + batch_size))
            logits = clf(**clf.encode(rows, idx)).float().cpu()
            losses.append(F.cross_entropy(logits, y[idx], reduction="none"))
    return (-torch.cat(losses).view(len(canaries.included), -1).mean(dim=1)).tolist()
