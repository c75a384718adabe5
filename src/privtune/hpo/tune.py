"""``privtune.tune``: private tuning plus training under one total (ε, δ).

``tune`` is a :class:`TuneJob` run by :func:`privtune.run.pipeline.execute`, the stage order every
budget-spending command shares.  The flow (each step happens before the next touches more data):

1. validate every argument and the data (the declared label set, labels outside it, empty data,
   overlapping splits, model path) — errors here cost no budget;
2. **plan**: the strategy fixes every trial event from data-independent choices and
   calibrates the final run inside the composition, so that the composed total meets the
   requested ε; an infeasible plan fails at once with the numbers and a fix;
3. **reserve** the whole plan in the ledger (embedded demo: a ledger inside the run dir;
   user data: the persistent ledger, where a new dataset is registered with the requested
   total) — before any training reads the data;
4. trials (scored on the public validation split, or by a charged noisy score), final run;
5. one certificate listing every event of every trial and of the final run, the model
   (``save_pretrained``), ``metrics.json`` (accuracy on the **reported** split, which no
   selector ever saw), ``history.json``, and the HTML report, written into a private staging
   directory and moved into RUN_DIR (certificate last);
6. **commit** the events in the ledger, only once the release is in place, then delete the
   private state file (a crash before the commit stays charged; ``--resume`` finishes the run
   without a new charge: :mod:`privtune._release`).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from privtune import _release, finetune  # finetune.cache_features: a test seam, read at call time
from privtune._validation import (check_batchnorm, check_choice, check_image_features, check_image_size, check_int,
                                  check_real)
from privtune.accounting.certificate import neighbouring_relation
from privtune.accounting.events import GaussianEvent, event_to_dict
from privtune.data import embedded_fashion_mnist, embedded_sst2
from privtune.data.datasets import (EMBEDDED_IMAGE_DEMO, EMBEDDED_IMAGE_FEATURES, EMBEDDED_IMAGE_LABELS,
                                    EMBEDDED_IMAGE_MODEL, EMBEDDED_LABELS,
                                    check_disjoint, declared_label_set)
from privtune.engine import distributed
from privtune.engine.mechanisms import noisy_feature_sum
from privtune.engine.sampling import make_generator, poisson_mask
from privtune.engine.units import (DEFAULT_MAX_ROWS_PER_UNIT, check_max_rows_per_unit, check_unit_delta,
                                   check_units_disjoint, checked_units, load_units, unit_description)
from privtune.errors import (InfeasibleBudgetError, InvalidParameterError, ModelError, OneClassModelWarning,
                             PrivtuneError, UnlikelyToLearnWarning)
from privtune.finetune import usefulness
from privtune.finetune.cost import backbone_cost, estimate_seconds, format_duration, format_estimates
from privtune.finetune.last_layer import check_finite_features
from privtune.finetune.modes import DEFAULT_LEARNING_RATES, default_backbone_lr_scale, default_lora_target_modules
from privtune.hpo import common, grid_oracle
from privtune.hpo.executors import for_tune
from privtune.hpo._resume import (  # noqa: F401  (STATE_FILE is part of this module's interface)
    STATE_FILE,
    _effective_config,
    _journaled,
    _label_curves,
    _open_journal,
    _resume_hint,
    _resume_state,
    _state_path,
    _write_state_header,
    derive_seed,
)
from privtune.hpo.backends import FeatureBackend, ModelBackend, head_into_classifier, renormalizes_centred_features
from privtune.hpo.common import TUNABLE_MODES, BudgetPlan, PlanRequest, Selector, as_plain, data_kind
from privtune.hpo.registry import STRATEGIES
from privtune.hpo.registry import get as get_strategy
from privtune.ledger import composed_epsilon, dataset_identity
from privtune.models import load_classifier, resolve_device
from privtune.models.classifier import check_model_label_set
from privtune.report.progress import Progress
from privtune.run import pipeline as run_pipeline
from privtune.run import release
from privtune.run.budget import BudgetRequest, open_ledger_for
from privtune.run.inputs import check_training_split, load_split
from privtune.run.pipeline import Described, ReleaseTarget
from privtune.training import declare_public_size, public_size
from privtune.specs import DEFAULT_CLIPPING, DEFAULT_OPTIMIZER, ClippingSpec, OptimizerSpec, PrivacySpec, ScheduleSpec

#: STRATEGIES (re-exported): the tuning strategies, read from the registry (privtune.hpo.registry)
#: tune(mode=...): a tunable mode, or "auto" (the one declaration of this choice set)
MODES = ("auto", *TUNABLE_MODES)
AUTO_MODES = ("last-layer", "bitfit", "lora")
#: the small-data set for a backbone LoRA has no default targets in (a convolutional network)
AUTO_MODES_WITHOUT_LORA = ("last-layer", "bitfit", "full")
#: --mode auto at fine-tuning scale (n·ε ≥ _FINETUNE_SCALE): the two fine-tuning modes, compared by pilots on
#: a charged Poisson subsample.  Measured: DP-BiTFiT beats the tuned linear probe from 20,000 phrases at ε = 1
#: (81.7 % against the probe's 80.4 % on 65,000), and every DP fine-tuning run on 2,000-4,000 phrases at
#: ε = 1 predicted one class; n and ε are public, so the rule costs nothing.  The order decides
#: pilots that the public split cannot tell apart (at these sizes the 10-step pilots sit at chance for both):
#: bitfit first, except from _FULL_FIRST_N private examples, where full comes first
AUTO_MODES_AT_SCALE = ("bitfit", "full")
AUTO_MODES_FROM_FULL_FIRST_N = ("full", "bitfit")
_FINETUNE_SCALE = 20_000
#: from this many private examples --mode auto puts full fine-tuning first (ties keep it).  Measured on SST-2:
#: on 60,957 phrases `tune --mode full` (pre-trained weights at α = 0.1 of the head's rate) reached 84.4 / 85.8
#: / 85.4 % at ε = 1 / 3 / 8 against 82.2 / 82.0 / 82.6 % for DP-BiTFiT; on 20,000 phrases at ε = 1 it reached
#: 78.4 % against 77.9 %, no measurable difference (66.3 % before its η trials dropped 10 × η0).  Between the
#: two sizes nothing was measured, so full comes first only where it was measured to win
_FULL_FIRST_N = 60_000
#: data kinds whose --mode auto also pilots the last layer at fine-tuning scale (first: a tie keeps the cheapest
#: mode).  Mehta et al. (large-scale transfer) find a DP head on a frozen ImageNet backbone's features competitive
#: with DP fine-tuning at scale; on 58,000 Fashion-MNIST images (EfficientNet-Lite0, 64 px) the head reached
#: 84.9 / 86.2 % test at ε = 1 / 3 and the bitfit that auto chose between bitfit and full 85.3 / 86.1 %, in 0.2
#: against 12 minutes per ε (docs/decisions/mode-pilots-at-fine-tuning-scale.md).  Text keeps the fine-tuning
#: modes alone: on SST-2 they beat the tuned probe from 20,000 phrases at ε = 1
AUTO_HEAD_AT_SCALE_KINDS = ("image",)
#: ``selection=`` accepts the user-facing name or the selection source itself (e.g. "train_noisy")
_SELECTION_SOURCE = {**common.SELECTION_SOURCE_OF, **{s: s for s in common.SELECTION_SOURCE_OF.values()}}
#: learning rate of the Adam pilot run used by --mode auto to compare modes (per-run ε = min(0.1, 0.1·ε_total)):
#: train()'s default for bitfit and lora; 1.0 for the last layer, whose pilot is only _PILOT_STEPS steps on cached
#: features (train()'s 5e-2 is meant for a full run); full: the head at bitfit's rate and the pre-trained weights
#: at α times it (DEFAULT_BACKBONE_LR_SCALES), so that the two pilots differ in what trains, not in how fast
#: their zero heads can grow
_PILOT_LEARNING_RATES = {"last-layer": 1.0, "bitfit": DEFAULT_LEARNING_RATES["bitfit"],
                         "lora": DEFAULT_LEARNING_RATES["lora"], "full": DEFAULT_LEARNING_RATES["bitfit"]}
_PILOT_STEPS = 10


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    model : the trained :class:`privtune.models.Classifier` (the released model; ``None``
        for the NOT PRIVATE grid oracle, which releases nothing).
    certificate : :class:`privtune.accounting.Certificate` over every event of every trial
        and of the final run.
    trials : list of trial dicts (hyperparameters, events, score, score source, ε after).
    metrics : the contents of ``metrics.json``.
    history : the contents of ``history.json``.
    run_dir : the run directory, or None when files were not written.
    plan : the :class:`~privtune.hpo.common.BudgetPlan` reserved before any data was read.
    """

    model: Any
    certificate: Any
    trials: list
    metrics: dict
    history: dict = field(default_factory=dict)
    run_dir: Path | None = None
    plan: BudgetPlan | None = None

    @property
    def accuracy(self) -> float | None:
        return self.metrics.get("accuracy")

    @property
    def epsilon(self) -> float:
        return float(self.certificate.epsilon)


# --------------------------------------------------------------------------------------
# data helpers
# --------------------------------------------------------------------------------------


def _labels_tensor(ds) -> torch.Tensor:
    lab = ds.labels
    return lab.long() if isinstance(lab, torch.Tensor) else torch.tensor(list(lab), dtype=torch.long)


# --------------------------------------------------------------------------------------
# main entry point
# --------------------------------------------------------------------------------------


def tune(
    data: Any = None,
    *,
    eval_data: Any = None,
    model: Any = None,
    mode: str = "auto",
    strategy: str = "hyperfree",
    epsilon: float = 1.0,
    delta: float = 1e-5,
    ledger: Any = None,
    output_dir: Any = None,
    seed: int | None = None,
    public_eval_data: Any = None,
    selection: str | None = None,
    selection_noise: float | None = None,
    validation_fraction: float = 0.1,
    trials: int | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    clip: float | None = None,
    clipping: str | None = None,
    optimizer: str | None = None,
    max_physical_batch_size: int = 32,
    strategy_options: dict | None = None,
    nonprivate_reference: bool = False,
    accountant: str = "pld",
    text_column: str | None = None,
    label_column: str | None = None,
    quiet: bool = False,
    write_files: bool = True,
    feature_cache_dir: Any = None,
    resume: bool = False,
    labels: Any = None,
    device: Any = None,
    executor: Any = "local",
    ray_address: str | None = None,
    image_size: int | None = None,
    batchnorm: str | None = None,
    image_features: str | None = None,
    time_budget: float | None = None,
    privacy_unit: Any = None,
    max_rows_per_unit: int | None = None,
    max_length: int | None = None,
    **unknown: Any,
) -> TuneResult:
    """Tune hyperparameters privately and train, under one total (ε, δ).

    Parameters
    ----------
    data : path or dataset, optional
        Private training data (.tsv/.csv/.jsonl).  ``None`` runs the embedded demo: the
        SST-2 subset shipped with privtune (train 3,000 / public validation 500 / dev 872)
        and the bundled MiniLM, with the ledger kept inside the run directory.  ``"embedded:fashion-mnist"``
        runs the image demo the same way: the Fashion-MNIST subset shipped with privtune (train 3,000 / public
        validation 500 / test 1,000, labels 0-9) and ImageNet EfficientNet-Lite0 (``model="efficientnet-lite0"``).
    eval_data : path or dataset, optional
        The **reported** split: accuracy in ``metrics.json`` is computed on it, after the
        final model is fixed.  It is never given to any selector.
    model : path, optional
        Backbone directory (Hugging Face format); ``None`` = bundled all-MiniLM-L6-v2.
    mode : {"auto", "last-layer", "bitfit", "lora", "full"}
        What is trained.  ``"auto"`` compares the modes the strategy can train among
        last-layer, bitfit and lora (bitfit and full when n·ε ≥ 20,000, after last-layer for images; full
        before bitfit from n ≥ 60,000) with one charged pilot run each (per-run ε = min(0.1, 0.1·ε)) and
        continues with the best (pilots the public split cannot tell apart are ties, won by the first candidate
        listed); single-step, random-search and
        grid-oracle train the last layer only, so for them ``"auto"`` is last-layer, no pilots; so it is at
        n·ε ≤ 4,000, where DP fine-tuning was measured at chance
        (:data:`privtune.finetune.usefulness.FINETUNE_AT_CHANCE_N_EPS`).  Pilots scored on a public split
        whose examples are all of one class are refused before the reservation.  A mode that trains the
        backbone at n·ε ≤ 4,000 is warned of before the reservation, and a released model that predicts
        nearly one class after the run (``metrics["warnings"]``, ``metrics["majority_prediction"]``).
    strategy : {"linear-scaling", "hyperfree", "single-step", "random-search", "grid-oracle"}
        See ``docs/strategies.md``.  Default ``"hyperfree"``: no search, and the best strategy
        at every ε in ``bench/hpo.py`` (README table).  ``"grid-oracle"`` is NOT PRIVATE
        (tuning uncharged), releases no model and does not touch the ledger.
    epsilon, delta : the **total** budget: trials, scoring and final run together.
    ledger : ledger URL; ``None`` = ``$PRIVTUNE_LEDGER`` / ``~/.privtune/ledger.db``.
    output_dir : run directory; ``None`` = ``runs/<timestamp>/``.
    public_eval_data : a validation split the user declares PUBLIC (scores trials for free; for a generator, a
        split of at least 20 pairs is cut in two: one half warm-starts every trial without noise, the other scores,
        see :mod:`privtune.hpo.generation_tune`).
    selection : ``"public-validation"``, ``"private-validation"`` (a held-out private split
        scored with a charged Gaussian count), ``"train-accuracy"`` or ``"train-loss"``
        (privatised statistics of the training data, charged).  Default: public validation
        when available, else ``"train-accuracy"``.
    validation_fraction : f in (0, 0.5], with ``"private-validation"``: each training row goes to the
        held-out split independently with probability f (so adding a row changes exactly one side).
        q, the steps, the score's divisor and ``n_train`` come from the planned sizes round(f·n) and
        n − round(f·n) of the file's n, never from the realised split; min(f, 1 − f)·n must be at
        least ln(100/δ) rows.
    selection_noise : σ of a charged score (noise std of the correct-count); default
        max(5, 0.5 % of the scored examples).
    trials, epochs, steps, batch_size, clip, clipping, optimizer : strategy overrides.
    strategy_options : extra keyword arguments of the strategy's config dataclass.
    nonprivate_reference : also compute the NOT PRIVATE grid-oracle reference (never released).
    labels : the label set, PUBLIC input, in class-index order (``["neg", "pos"]``, or ``[0, 1]`` for
        integer classes).  Default: the labels of ``public_eval_data``, else the model's own label set
        (a privtune model or a config that names its classes), else an error; never inferred from the
        private data.  The embedded demo declares 0/1.  Every split's labels must be in the set.
    resume : continue the interrupted run in ``output_dir`` (same options): its ledger reservation
        is continued (no new charge), completed trials are replayed from the private state file
        ``RUN_DIR/.tune_state.jsonl`` (not recomputed) and the interrupted one is recomputed with the
        same seeds.  Not available for ``grid-oracle`` (it reserves nothing).
    device : where every trial, pilot and the final run train: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or
        ``"mps"``; ``None`` (default) = ``"cuda"`` when available, else ``"cpu"`` (as :func:`privtune.train`).
    executor : where the strategy's independent trials run: ``"local"`` (default, this process) or ``"ray"``
        (one Ray task per trial; random-search, linear-scaling, grid-oracle), or a
        :class:`privtune.hpo.executors.RayExecutor` (per-trial CPUs/GPUs).  Plan, reservation, scores, ledger
        and files stay in this process; the release is the same as with ``"local"`` (docs/scaling-out.md).
    ray_address : with ``executor="ray"``: ``"auto"``, ``"local"``, ``HOST:PORT`` or ``ray://HOST:PORT``;
        ``None`` = Ray already initialised here, else ``$RAY_ADDRESS``, else a ``ray start`` instance on this
        machine, else a new local one.
    image_size, batchnorm : a vision backbone's input resolution in pixels (default 64, or the size the network
        requires) and BatchNorm policy (``"eval"``, the default: the pretrained running statistics; ``"group"``: a
        GroupNorm in place of each BatchNorm; ``"train"`` is refused), public choices; only with a vision
        backbone name (:mod:`privtune.models.vision`), e.g. the image demo's.
    image_features : what a vision backbone's head reads, a public choice: ``"final"`` (default) its final pooled
        features, ``"stages"`` (the image demo's default) those and each stage's pooled output, each L2-normalised
        (timm backbones; a DP head gains about 1.2 points on Fashion-MNIST, :mod:`privtune.models.vision`).
    time_budget : minutes, optional
        The plan prices every candidate mode before anything is reserved (the backbone's size and a timed forward
        pass on a dummy input, :mod:`privtune.finetune.cost`) and logs the estimates.  With a budget, ``mode="auto"``
        pilots only the modes estimated to fit in it (the cheapest when none does), and an explicit mode estimated
        above it is refused before the reservation.
    privacy_unit : str, sequence or callable, optional
        User-level DP (docs/privacy-unit.md): the column of ``data`` naming the unit (person, document) that owns
        each row, one key per row, or a callable ``f(row_index) -> key``.  Every pilot, trial, charged score, the
        private feature centre and the final run then protect all rows of one unit: runs sample units (Poisson,
        at most ``max_rows_per_unit`` rows each, weighted 1/m_u), scores and the centre weight each unit's rows
        to sum to one, and the accounting is over the N_u units (δ < 1/N_u; ``batch_size`` counts units).  A
        public or reported split with the unit column must share no unit with the training data.
        ``selection="private-validation"`` is refused with it.
    max_rows_per_unit : k, the public cap on one unit's rows per step (default 8); only with ``privacy_unit``.
    max_length : tokens per text (a classifier's input; a generator's prompt + response), a public choice;
        ``None`` = 128 (at most the model's positions), or what a released privtune model recorded.  Longer
        texts are cut (a generator's prompt loses its oldest tokens first).
    """
    from privtune.data.generation import is_generation_data

    if model is None and isinstance(data, str) and data == EMBEDDED_IMAGE_DEMO:
        model = EMBEDDED_IMAGE_MODEL  # the image demo's backbone
        image_features = EMBEDDED_IMAGE_FEATURES if image_features is None else image_features
    arguments = TuneArguments(
        data=data, eval_data=eval_data, model=model, mode=mode, strategy=strategy,
        epsilon=epsilon, delta=delta, ledger=ledger, output_dir=output_dir, seed=seed,
        public_eval_data=public_eval_data, selection=selection, selection_noise=selection_noise, validation_fraction=validation_fraction, trials=trials,
        epochs=epochs, steps=steps, batch_size=batch_size, clip=clip, clipping=clipping,
        optimizer=optimizer, max_physical_batch_size=max_physical_batch_size, strategy_options=strategy_options, nonprivate_reference=nonprivate_reference, accountant=accountant,
        text_column=text_column, label_column=label_column, quiet=quiet, write_files=write_files, feature_cache_dir=feature_cache_dir,
        resume=resume, labels=labels, device=device, executor=executor, ray_address=ray_address,
        image_size=image_size, batchnorm=batchnorm, image_features=image_features, time_budget=time_budget,
        privacy_unit=privacy_unit, max_rows_per_unit=max_rows_per_unit, max_length=max_length)
    if is_generation_data(data, model):  # prompt → response pairs: a causal LM (privtune.hpo.generation_tune)
        return _tune_generation(arguments, unknown)
    return run_pipeline.execute(TuneJob(arguments, unknown))


#: tune()'s arguments a generator's tuning takes (privtune.hpo.generation_tune.GenerationTuneRequest)
_GENERATION_ARGUMENTS = ("data", "eval_data", "public_eval_data", "model", "mode", "strategy", "epsilon", "delta",
                         "ledger", "output_dir", "seed", "trials", "epochs", "batch_size", "clip",
                         "max_physical_batch_size", "text_column", "label_column", "quiet", "write_files", "device",
                         "privacy_unit", "max_rows_per_unit", "max_length")
#: tune()'s other arguments at their defaults (a generator's tuning refuses any other value)
_GENERATION_UNUSED = {"selection": None, "selection_noise": None, "validation_fraction": 0.1, "steps": None,
                      "clipping": None, "optimizer": None, "strategy_options": None, "nonprivate_reference": False,
                      "accountant": "pld", "feature_cache_dir": None, "resume": False, "labels": None,
                      "executor": "local", "ray_address": None}


def _tune_generation(arguments: TuneArguments, unknown: dict) -> TuneResult:
    """:func:`tune` on prompt → response pairs (:mod:`privtune.hpo.generation_tune`); an option that does not
    apply to a generator is one clear error, before anything is read or charged."""
    from privtune.hpo.generation_tune import GenerationTuneRequest, tune_generation

    extra = [k for k, default in _GENERATION_UNUSED.items() if getattr(arguments, k) != default] + sorted(unknown)
    extra += [k for k in ("image_size", "batchnorm", "image_features", "time_budget")
              if getattr(arguments, k) is not None]
    if extra:
        raise InvalidParameterError(
            f"`{extra[0]}` does not apply to tuning a generator on prompt → response data. Drop it (options that "
            f"apply: {', '.join(a for a in _GENERATION_ARGUMENTS if a != 'data')}).")
    request = GenerationTuneRequest(**{k: getattr(arguments, k) for k in _GENERATION_ARGUMENTS})
    return TuneResult(**tune_generation(request))


# --------------------------------------------------------------------------------------
# the stages of a run (validate -> load -> plan -> reserve -> run -> certify -> write), and what each
# hands to the next
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuneArguments:
    """:func:`tune`'s keyword arguments as given, one typed record (checked by :func:`_check_arguments`
    into a :class:`_Request`; written to ``config.yaml`` and compared on resume through :meth:`options`)."""

    data: Any
    eval_data: Any
    model: Any
    mode: str
    strategy: str
    epsilon: float
    delta: float
    ledger: Any
    output_dir: Any
    seed: int | None
    public_eval_data: Any
    selection: str | None
    selection_noise: float | None
    validation_fraction: float
    trials: int | None
    epochs: float | None
    steps: int | None
    batch_size: int | None
    clip: float | None
    clipping: str | None
    optimizer: str | None
    max_physical_batch_size: int
    strategy_options: dict | None
    nonprivate_reference: bool
    accountant: str
    text_column: str | None
    label_column: str | None
    quiet: bool
    write_files: bool
    feature_cache_dir: Any
    resume: bool
    labels: Any
    device: Any
    executor: Any
    ray_address: str | None
    image_size: int | None = None
    batchnorm: str | None = None
    image_features: str | None = None
    time_budget: float | None = None
    privacy_unit: Any = None  # user level: the unit column (or keys, or a callable); None: one example
    max_rows_per_unit: int | None = None  # k (None: the default)
    max_length: int | None = None  # tokens per text (None: the model's default)

    def options(self) -> dict:
        """Every argument by name, in :func:`tune`'s order; the label set as one spelling ([0, 1], "0,1" and
        --labels 0,1 are one setting for config.yaml and the resume check)."""
        options = {f.name: getattr(self, f.name) for f in fields(self)}
        labels = self.labels
        if isinstance(labels, (str, list, tuple)):
            options["labels"] = [str(x).strip() for x in (labels.split(",") if isinstance(labels, str) else labels)]
        return options


@dataclass(frozen=True)
class _Request:
    """tune()'s arguments, checked before any data is read (:func:`_check_arguments`)."""

    strategy: Any  # the registered Strategy
    mode: str  # "auto" or a mode the strategy trains
    privacy: PrivacySpec  # ε: the total of trials, selection and final run; δ checked against n by _load_inputs
    schedule: ScheduleSpec  # the overrides epochs / steps / batch_size (None: the strategy's recipe)
    clipping: ClippingSpec  # the overrides clip / clipping (None: the strategy's)
    optimizer: OptimizerSpec  # the override of the optimizer's name (None: the strategy's)
    trials: int | None
    seed: int | None  # the user's seed (None: OS entropy, never published)
    selection: str | None  # the selection source asked for; None: public validation when there is one
    selection_noise: float | None  # σ of a charged score (None: the default for the number of rows scored)
    options: dict  # strategy_options
    device: Any
    executor: Any  # where independent trials run (hpo.executors; checked and connected before data is read)
    time_budget: float | None = None  # minutes; None: estimates are logged, nothing is refused or skipped
    units: tuple | None = None  # user level: (the unit column / keys / callable, k); None: one example


def _check_arguments(args: TuneArguments, unknown: dict) -> _Request:
    """Every argument of :func:`tune` checked (one clear error for the first bad one); no data is read."""
    world = distributed.data_parallel_world_size()
    if world > 1:  # every process would reserve, charge and write on its own: the budget spent `world` times
        raise InvalidParameterError(
            f"tune() runs in one process, but this is one of {world} processes of a data-parallel group (torchrun or "
            "torch.distributed). Run tune in one process; to run its trials in parallel use executor='ray' "
            "(CLI: --executor ray, docs/scaling-out.md).")
    if unknown:  # refuse, never drop: a misspelt option would otherwise run with the default silently
        valid = [k for k in inspect.signature(tune).parameters if k != "unknown"]
        name = sorted(unknown)[0]
        close = difflib.get_close_matches(name, valid, n=1)
        raise InvalidParameterError(
            f"tune() got an unknown option {name!r}." + (f" Did you mean {close[0]!r}?" if close else "")
            + f" Valid options: {', '.join(valid)}."
        )
    strategy = check_choice(args.strategy, "strategy", STRATEGIES)
    if args.image_size is not None:
        check_image_size(args.image_size)
    if args.batchnorm is not None:
        check_batchnorm(args.batchnorm)
    if args.image_features is not None:
        check_image_features(args.image_features)
    if args.max_length is not None:
        check_int(args.max_length, "max_length", low=2)
    strat = get_strategy(strategy)
    device = resolve_device(args.device)  # one clear error for a bad or absent device, before any data is read
    mode = check_choice(args.mode, "mode", MODES)
    # what the strategy can train; ``--mode auto`` pilots only these (none when only one is left), and any
    # other mode is refused before anything is reserved
    if mode != "auto" and mode not in strat.modes:
        raise InvalidParameterError(
            f"strategy={strategy!r} trains {' / '.join(strat.modes)} only; got mode={mode!r}. Use "
            f"mode={strat.modes[0]!r} (or 'auto'), or strategy='hyperfree' / 'linear-scaling' for {mode}."
        )
    privacy = PrivacySpec.with_target(args.epsilon, args.delta, args.accountant)
    clipping = ClippingSpec(clip=args.clip, clipping=args.clipping)
    if clipping.clip is not None and strat.fixed_clip is not None and clipping.clip != strat.fixed_clip:
        raise InvalidParameterError(
            f"`clip`={clipping.clip!r} does not apply to strategy={strategy!r}: it clips at C = {strat.fixed_clip:g} "
            "(sensitivity 1) and its learning-rate rule absorbs the scale. Remove `clip`, or choose another "
            "strategy.")
    if clipping.clipping is not None and (
            not strat.clipping_kinds or (mode != "auto" and data_kind(mode) not in strat.clipping_kinds)):
        raise InvalidParameterError(
            f"`clipping` does not apply to strategy={strategy!r} with mode={mode!r}: its full-batch recipe on cached "
            "features clips flat at `clip`. Remove `clipping`, or use strategy='hyperfree' (any mode) or "
            "'linear-scaling' with mode=bitfit/lora/full.")
    seed = None if args.seed is None else check_int(args.seed, "seed", low=0)
    selection = None
    if args.selection is not None:
        selection = _SELECTION_SOURCE.get(str(args.selection))
        if selection is None:
            check_choice(args.selection, "selection", common.SELECTIONS)
    schedule = ScheduleSpec(epochs=args.epochs, steps=args.steps, batch_size=args.batch_size,
                            max_physical_batch_size=args.max_physical_batch_size)
    units = _check_unit_arguments(args, selection)
    return _Request(strategy=strat, mode=mode, privacy=privacy, schedule=schedule, clipping=clipping,
                    optimizer=OptimizerSpec(name=args.optimizer), trials=args.trials, seed=seed,
                    selection=selection, selection_noise=args.selection_noise,
                    options=dict(args.strategy_options or {}), device=device,
                    executor=for_tune(args.executor, args.ray_address, strat), units=units,
                    time_budget=None if args.time_budget is None else check_real(
                        args.time_budget, "time_budget", low=0.0, fix="Pass the minutes the run may take, e.g. 30."))


def _check_unit_arguments(args: TuneArguments, selection: str | None) -> tuple | None:
    """``(privacy unit, k)`` of a user-level tune, or None; refused before any data is read: k without a unit,
    a unit without the user's own data (the embedded demos have no unit column), a private validation split
    (its random split is drawn per row)."""
    if args.privacy_unit is None:
        if args.max_rows_per_unit is not None:
            raise InvalidParameterError(
                "`max_rows_per_unit` applies only with `privacy_unit` (user-level DP). Pass privacy_unit=COLUMN "
                "(CLI --privacy-unit), or drop max_rows_per_unit.")
        return None
    k = check_max_rows_per_unit(DEFAULT_MAX_ROWS_PER_UNIT if args.max_rows_per_unit is None
                                else args.max_rows_per_unit)
    if args.data is None or (isinstance(args.data, str) and args.data.startswith("embedded:")):
        raise InvalidParameterError(
            "`privacy_unit` needs your own training data with a column naming each row's unit (--data FILE); the "
            "embedded demos have none.")
    if selection == "private_validation_noisy":
        raise InvalidParameterError(
            "selection='private-validation' is not available with `privacy_unit` (its held-out split is drawn row "
            "by row). Use selection='public-validation' with a split you declare public, or 'train-accuracy' / "
            "'train-loss' (charged per unit).")
    return args.privacy_unit, k


@dataclass(frozen=True)
class _Inputs:
    """The splits, loaded and checked before any budget is spent (:func:`_load_inputs`)."""

    train: Any  # the rows trained on (without the private validation split once it is drawn)
    eval_set: Any  # the reported split: never given to a selector
    public_set: Any  # the split the user declares public
    private_val: Any  # the held-out private validation split (selection="private-validation"), else None
    selection: str  # the selection source
    privacy: PrivacySpec  # the request's, with δ checked against the whole training set's size
    num_labels: int
    label_names: Any
    label_source: Any
    fingerprint: str  # of the WHOLE training file: the ledger's key, never published
    file_name: str | None  # the training file's local name: recorded with a registration, in the ledger only
    embedded: bool
    train_source: str  # how log.txt names the training data
    reported_split: str | None  # how the release names the reported split
    # selection="private-validation": every row of the file goes to the validation split independently with
    # probability validation_fraction (drawn by _split_private_validation), so a dataset and its neighbour
    # differ on exactly one side.  The realised sizes are private: the plan (q, steps), the divisors and
    # everything written use the sizes planned from the file's public n (_planned_split_sizes) instead.
    validation_fraction: float | None = None
    n_train_public: int | None = None  # planned training rows (None: no split, all n rows train)
    n_val_public: int | None = None  # planned validation rows
    whole: Any = None  # the whole training file, once split (its features are cached once, n rows: public)
    val_mask: Any = None  # (n,) bool, True for the validation rows (PRIVATE: never written)
    #: user level: the privacy units of the training rows (privtune.engine.units.UnitIndex) and the cap k; the
    #: public size n_train_public is then N_u, the number of units (how many rows each unit has is private)
    units: Any = None
    max_rows_per_unit: int | None = None

    @property
    def unit_option(self) -> tuple | None:
        """What a backend's runs take (:class:`privtune.hpo.backends.FeatureBackend`): ``(units, k)`` or None."""
        return None if self.units is None else (self.units, self.max_rows_per_unit)

    def score_weights(self, source: str) -> torch.Tensor | None:
        """User level: the weights 1/c_u of the training rows for a charged score on them (each unit adds the
        mean of its rows' terms, sensitivity 1 per unit); None for a public split or at example level."""
        if self.units is None or source == "public_validation":
            return None
        return self.units.mean_weights()

    @property
    def unit_description(self) -> dict | None:
        """What the run publishes about its unit (name, k, N_u: :func:`privtune.engine.units.unit_description`)."""
        return None if self.units is None else unit_description(self.units, self.max_rows_per_unit)

    @property
    def n_train(self) -> int:
        """Training rows as planned and published: public (never the realised size of a random split)."""
        return self.n_train_public if self.n_train_public is not None else len(self.train)

    @property
    def selector_data(self) -> Any:
        if self.selection == "public_validation":
            return self.public_set
        return self.private_val if self.private_val is not None else self.train


def _load_inputs(req: _Request, data, *, eval_data, public_eval_data, labels, model, text_column, label_column,
                 validation_fraction) -> _Inputs:
    """Load and check every split (declared label set, overlaps, δ < 1/n); ``data=None`` is the demo."""
    image_demo = isinstance(data, str) and data == EMBEDDED_IMAGE_DEMO
    embedded = data is None or image_demo
    if embedded:
        train, pub, test = embedded_fashion_mnist() if image_demo else embedded_sst2()
        # the image demo names its reported split (the SST-2 demo's is named by its dataset)
        reported_split = (f"embedded Fashion-MNIST test ({len(test):,} test-set images)"
                          if image_demo and eval_data is None else None)
        public_eval_data = pub if public_eval_data is None else public_eval_data
        eval_data = test if eval_data is None else eval_data
        train_source = f"embedded {'Fashion-MNIST' if image_demo else 'SST-2'} subset (train 3,000)"
        if labels is None:  # declared by the demo (public), not read from its rows
            labels = list(EMBEDDED_IMAGE_LABELS if image_demo else EMBEDDED_LABELS)
    else:
        train = data
        train_source = str(data) if isinstance(data, (str, os.PathLike)) else "in-memory dataset"
        reported_split = None
    # the label set is public input: declared, or a public split's, or the model's; never the private rows'
    public_probe = (load_split(public_eval_data, "public_eval_data", text_column=text_column,
                               label_column=label_column) if labels is None else None)
    num_labels, names, label_source = declared_label_set(labels, model=model, public_data=public_probe)
    train = load_split(train, "data", text_column=text_column, label_column=label_column,
                       num_labels=num_labels, label_names=names)
    check_training_split(train)
    eval_set = load_split(eval_data, "eval_data", text_column=text_column, label_column=label_column,
                          num_labels=num_labels, label_names=names)
    public_set = load_split(public_eval_data, "public_eval_data", text_column=text_column, label_column=label_column,
                            num_labels=num_labels, label_names=names)
    for split, what in ((train, "data"), (eval_set, "eval_data"), (public_set, "public_eval_data")):
        check_finite_features(split, what)  # cached features: NaN/inf refused before anything is reserved
    check_disjoint(train, public_set, "public_eval_data")
    if not embedded:
        check_disjoint(train, eval_set, "eval_data")
    if public_set is not None and eval_set is not None:
        check_disjoint(public_set, eval_set, "eval_data", against="public_eval_data")
    units = _load_units(req, data, train, public_eval_data, eval_data)
    privacy = req.privacy.for_dataset(len(train) if units is None else units.num_units)
    # the ledger's dataset is the WHOLE training file: fingerprint it before any private-validation split
    # (a split's rows would hash to a new fingerprint, i.e. a fresh budget for the same data)
    fingerprint, file_name = _dataset_identity(train)
    selection = req.selection or ("public_validation" if public_set is not None else "train_noisy")
    if selection == "public_validation" and public_set is None:
        raise InvalidParameterError(
            "`selection`='public-validation' needs a split you declare public: pass public_eval_data=PATH "
            "(--public-eval-data), or use selection='private-validation' or 'train-accuracy' (charged)."
        )
    frac = n_train_public = n_val_public = None
    if selection == "private_validation_noisy":  # drawn later, from the run's seed (_split_private_validation)
        frac = check_real(validation_fraction, "validation_fraction", low=0.0, high=0.5)
        n_train_public, n_val_public = _planned_split_sizes(len(train), frac, privacy.delta)
    if units is not None:  # N_u stands where n stood (q = B/N_u, the plan, the divisors, what is published)
        n_train_public = declare_public_size(train, units.num_units).public_size
    return _Inputs(train=train, eval_set=eval_set, public_set=public_set, private_val=None,
                   selection=selection, privacy=privacy, num_labels=num_labels, label_names=names,
                   label_source=label_source, fingerprint=fingerprint, file_name=file_name, embedded=embedded,
                   train_source=train_source,
                   reported_split=reported_split or (None if eval_data is None else release.split_name(
                       eval_data, "in-memory evaluation split")),
                   validation_fraction=frac, n_train_public=n_train_public, n_val_public=n_val_public,
                   units=units, max_rows_per_unit=None if units is None else req.units[1])


def _load_units(req: _Request, data: Any, train: Any, public_eval_data: Any, eval_data: Any) -> Any:
    """User level: the training rows' :class:`~privtune.engine.units.UnitIndex` (δ < 1/N_u checked), after
    refusing a public or reported split that shares a unit with the training data (checked when the split has
    the unit column; without it only its rows are checked, by :func:`check_disjoint`).  None at example level."""
    if req.units is None:
        return None
    column = req.units[0]
    units = checked_units(load_units(data, column, len(train), dataset=train), len(train), req.units[1], "poisson")
    check_unit_delta(req.privacy.delta, units.num_units, units.name)
    for split, what in ((public_eval_data, "public_eval_data"), (eval_data, "eval_data")):
        check_units_disjoint(data, split, column, what)
    return units


def _planned_split_sizes(n: int, frac: float, delta: float) -> tuple[int, int]:
    """(training rows, validation rows) of selection="private-validation" as planned: functions of the file's
    size n (public by declaration) and the fraction f only, never of the realised random split.

    Refused (before anything is read beyond n) when a side's expected size min(f, 1 − f)·n is below
    ln(100/δ): then a random split could leave a side empty with probability above δ/100."""
    n_val = max(1, round(frac * n))
    need = math.log(100.0 / delta)
    if min(frac, 1.0 - frac) * n < need:
        raise InvalidParameterError(
            f"selection='private-validation' with validation_fraction={frac:g} holds out about {frac * n:.3g} of the "
            f"{n} training rows; at least {need:.3g} expected rows (ln(100/δ)) are needed on each side of the random "
            "split. Use a larger validation_fraction, more data, or selection='train-accuracy'.")
    return n - n_val, n_val


def _split_private_validation(inputs: _Inputs, run_seed: int) -> _Inputs:
    """Draw the private validation split: each row independently with probability f (the exact integer
    Poisson draw of privtune.engine.sampling), from the run's seed (OS entropy unless the user seeded the
    run; kept for --resume in the private state file).  Adding a row changes exactly one side; the realised
    sizes are never published (the training split carries the planned size, ``declare_public_size``)."""
    if inputs.validation_fraction is None:
        return inputs
    whole = inputs.train
    in_val = poisson_mask(len(whole), inputs.validation_fraction,
                          make_generator(derive_seed(run_seed, "private-validation split")))
    rows = torch.arange(len(whole))
    train, val = whole.subset(rows[~in_val].tolist()), whole.subset(rows[in_val].tolist())
    if len(train) == 0 or len(val) == 0:  # probability below δ/100 (_planned_split_sizes)
        raise PrivtuneError("the random private-validation split left one side empty; nothing was reserved. "
                            "Run again, or use a larger validation_fraction.")
    return replace(inputs, train=declare_public_size(train, inputs.n_train_public), private_val=val, whole=whole,
                   val_mask=in_val)


def _selection_of_strategy(req: _Request, inputs: _Inputs) -> str:
    """The selection source the strategy's trials are scored with ("none": a strategy that does not select)."""
    return inputs.selection if req.strategy.selects else "none"


@dataclass(frozen=True)
class _RunFiles:
    """RUN_DIR and the run's identity, fixed before anything is charged (:func:`_open_run_files`)."""

    run_dir: Path | None  # None: write_files=False
    created_dirs: list  # what this run created (removed again when the reservation is refused)
    log_existed: bool
    config: dict  # the effective options: config.yaml and the resume check
    unsaved: list  # options config.yaml cannot hold (in-memory objects)
    state_header: dict | None  # the interrupted run's (resume), else None
    state_entries: list
    run_seed: int  # every noise and sampling generator derives from it; PRIVATE (state file only)
    run_id: str


def _open_run_files(args: TuneArguments, req: _Request, inputs: _Inputs) -> _RunFiles:
    """Check and create RUN_DIR (every output path writable before anything is charged) and read the
    state of an interrupted run (``resume``)."""
    run_dir, created_dirs, log_existed = None, [], True
    if args.write_files:
        output_dir = args.output_dir
        run_dir = Path(output_dir) if output_dir is not None else _release.default_run_dir()
        _release.check_output_path(run_dir, release.RELEASED_FILES, release.RELEASED_DIRS)
        if (run_dir / "certificate.json").exists() and not _state_path(run_dir).exists():
            # with the state file, an interrupted release (certificate in place, ledger not yet committed)
            raise InvalidParameterError(
                f"`output` {str(run_dir)!r} already holds a finished run (certificate.json). Pass a new directory.")
        log_existed = (run_dir / "log.txt").exists()
        created_dirs = _release.prepare_output_dir(run_dir, release.RELEASED_FILES, release.RELEASED_DIRS)
    try:
        config, unsaved = _effective_config(args.options(), run_dir)
        header, entries = _resume_state(args.resume, run_dir, args.output_dir, req.strategy.name, config,
                                        inputs.fingerprint)
    except PrivtuneError:  # e.g. --resume with nothing to resume: leave no RUN_DIR behind
        _release.discard_unreserved(created_dirs)
        raise
    # every noise and sampling generator of the run derives from run_seed: the user's seed, or OS entropy
    # kept only in the private state file until the run finishes (never in config, metrics or certificate)
    run_seed = int(header["seed"]) if header else (req.seed if req.seed is not None else secrets.randbits(62))
    run_id = str(header["run_id"]) if header else uuid.uuid4().hex
    return _RunFiles(run_dir=run_dir, created_dirs=created_dirs, log_existed=log_existed, config=config,
                     unsaved=unsaved, state_header=header, state_entries=entries, run_seed=run_seed, run_id=run_id)


def _load_model(model: Any, inputs: _Inputs, run_seed: int, *, image_size: int | None = None,
                batchnorm: str | None = None, image_features: str | None = None, max_length: int | None = None):
    """The classifier with the declared label set (its head initialised from ``run_seed``); ``image_size``,
    ``batchnorm``, ``image_features``: a vision backbone's (None: its defaults); ``max_length``: a text
    backbone's tokens per text."""
    clf = load_classifier(model, num_labels=inputs.num_labels, label_names=inputs.label_names,
                          seed=derive_seed(run_seed, "model"), image_size=image_size, batchnorm=batchnorm,
                          image_features=image_features, max_length=max_length)
    check_model_label_set(clf, inputs.num_labels, inputs.label_names, inputs.label_source)
    return clf


@dataclass
class _TunePlan:
    """Every event of the run, fixed before the reservation from public sizes only (:func:`_plan_run`)."""

    plan: BudgetPlan  # the plan that runs; with --mode auto, set to the chosen mode's after the pilots
    mode_plans: dict  # every candidate mode's plan
    candidates: list  # the modes that may run
    pilot_modes: list  # --mode auto: the modes piloted (empty: nothing to choose)
    run_mode: str  # the mode, or "auto" while the pilots are to choose
    pilot_eps: float  # per-run ε of a pilot
    pilot_events: list  # the pilots' planned events, the charged feature centre first when there is one
    center_sigma: float | None  # σ of the charged feature centre (last-layer without a public split)
    selection_sigma: float | None  # σ of a charged score (None: public validation, free)
    hide_timing: bool  # repeat-and-select (the number of trials) or the unit level (the rows): no durations

    @property
    def center_events(self) -> list:
        return self.pilot_events[:1] if self.center_sigma else []


def _plan_run(req: _Request, inputs: _Inputs, log, warning_log=None, lora_capable: bool = True,
              cost: Any = None) -> _TunePlan:
    """Plan every candidate mode (and the --mode auto pilots) before anything is reserved: a combination
    that cannot work fails here, with the numbers and a fix; one that cannot learn is warned of (a Python
    warning, written to ``warning_log``: the log file alone, the console shows the warning itself).  With the
    backbone's ``cost`` (:func:`privtune.finetune.cost.backbone_cost`) every candidate is priced and the estimates
    logged; ``req.time_budget`` then drops the candidates above it (:func:`_within_time_budget`)."""
    strat, n_train, delta, accountant = req.strategy, inputs.n_train, inputs.privacy.delta, req.privacy.accountant
    # --mode auto: pilot only the modes this strategy can train; with one candidate there is nothing to
    # choose and nothing is spent on pilots
    kind = getattr(inputs.train, "kind", None)
    candidates = (_auto_candidates(strat.modes, n_train, req.privacy.epsilon, lora_capable=lora_capable, kind=kind)
                  if req.mode == "auto" else [req.mode])
    auto_candidates = list(candidates)
    timing_lines: list[str] = []  # the measured-speed estimates: logged below unless the run hides timing
    if cost is not None:
        candidates = _within_time_budget(req, inputs, candidates, cost, log, timing_lines)
    pilot_modes = candidates if len(candidates) > 1 else []
    run_mode = candidates[0] if not pilot_modes else "auto"
    # (a mode left alone by the time budget was explained when it was dropped)
    auto_note = (_auto_without_pilots_note(req, strat, n_train, run_mode, lora_capable, kind=kind)
                 if not pilot_modes and candidates == auto_candidates else None)
    pilot_events, pilot_eps = [], min(0.1, 0.1 * req.privacy.epsilon)
    sel_sigma = None
    if inputs.selection != "public_validation":
        n_scored = inputs.n_val_public if inputs.n_val_public is not None else n_train  # public sizes only
        sel_sigma = (float(req.selection_noise) if req.selection_noise is not None
                     else common.default_selection_noise(n_scored))
    if pilot_modes:
        try:
            pilot_events = _plan_pilots(pilot_modes, pilot_eps, delta, n_train, sel_sigma, accountant)
        except InfeasibleBudgetError:  # the pilot's ε is a share of the total: name both
            raise InfeasibleBudgetError(
                f"Budget plan infeasible: --mode auto runs each mode pilot at ε = {pilot_eps:g} (a tenth of the "
                f"total `epsilon` = {req.privacy.epsilon:g}, at most 0.1), and a pilot cannot meet that ε at "
                f"δ = {delta:g} without noise above the ceiling. Raise `epsilon`, or choose the mode (--mode "
                f"{' / '.join(pilot_modes)}) so that no pilots run.") from None
    options = dict(req.options)
    center_sigma = None
    if "last-layer" in candidates and inputs.public_set is None:
        # features are centred by a private mean (Sun et al. 2024, via Panda et al., linear scaling): a charged
        # release
        center_sigma = float(options.pop("center_noise", max(5.0, 0.005 * n_train)))
        pilot_events = [GaussianEvent(center_sigma, 1, label="private feature mean (centering)")] + pilot_events
    sched = req.schedule
    _check_overrides(strat, candidates, {"trials": req.trials, "epochs": sched.epochs, "steps": sched.steps,
                                         "batch_size": sched.batch_size, "optimizer": req.optimizer.name})
    # --mode auto: the pilots' outcome chooses one of the k plans.  Each is made at δ/k, so that by a union bound
    # over the plans the run is (ε, δ)-DP whichever is chosen, without assuming fully adaptive composition
    plan_delta = delta / len(pilot_modes) if pilot_modes else delta
    request = PlanRequest(total_epsilon=req.privacy.epsilon, delta=plan_delta, n_train=n_train, accountant=accountant,
                          prefix_events=pilot_events, score_sigma=sel_sigma if strat.selects else None,
                          epochs=sched.epochs, steps=sched.steps, batch_size=sched.batch_size, data_kind=kind)
    # the strategy's options do not depend on the mode: a bad one is the user's option, not a candidate's fault
    cfg = strat.make_config(options, trials=req.trials, optimizer=req.optimizer.name,
                            clip=req.clipping.clip, clipping=req.clipping.clipping)
    mode_plans = {}
    for m in candidates:
        try:
            mode_plans[m] = strat.plan(cfg, m, request)
        except PrivtuneError as exc:
            if not pilot_modes:
                raise
            raise type(exc)(f"mode='auto': candidate mode {m!r} cannot be planned with strategy {strat.name!r}: "
                            f"{exc} Pass an explicit mode (e.g. mode='last-layer') to skip it.") from None
    if inputs.selection == "public_validation":  # candidates compared on the public split: it needs two classes
        if pilot_modes:
            _check_public_split_can_compare(inputs.public_set, f"mode pilots ({', '.join(pilot_modes)}) of "
                                            "mode='auto'", "choose the mode yourself (e.g. --mode last-layer)")
        elif strat.selects and mode_plans[candidates[0]].trial_events:
            _check_public_split_can_compare(inputs.public_set, f"trials of strategy {strat.name!r}",
                                            "select on a charged private validation split "
                                            "(--selection private-validation)")
    plan = mode_plans[candidates[0]]
    if auto_note:  # printed with the plan, and kept in the certificate's plan notes
        plan.notes.append(auto_note)
    log(plan.describe())
    for m in candidates[1:]:
        log(f"  if the pilots choose {m}: planned ε = {mode_plans[m].planned_epsilon():.4g}")
    # a plan that works but cannot learn: warned of before the reservation (nothing spent yet)
    unit = None if inputs.units is None else inputs.units.name
    usefulness.warn(usefulness.unlikely_to_learn_message(run_mode, n_train, req.privacy.epsilon, command="tune",
                                                         kind=kind, unit=unit),
                    UnlikelyToLearnWarning, warning_log or log)
    # under repeat-and-select the number of trials is random and not published; durations grow with it; at the
    # unit level every phase over the training rows (feature caching, each step) takes time in proportion to the
    # private number of rows
    hide_timing = unit is not None or any(p.accounting == "repeat-and-select" for p in mode_plans.values())
    if not hide_timing:  # a measured speed varies from run to run: under hidden timing no line carries one
        for line in timing_lines:
            log(line)
    return _TunePlan(plan=plan, mode_plans=mode_plans, candidates=candidates, pilot_modes=pilot_modes,
                     run_mode=run_mode, pilot_eps=pilot_eps, pilot_events=pilot_events, center_sigma=center_sigma,
                     selection_sigma=sel_sigma, hide_timing=hide_timing)


@dataclass(frozen=True)
class _Ran:
    """What the strategy ran (:func:`_execute`)."""

    outcome: Any  # the strategy's StrategyOutcome
    model: Any  # the released model; None for the NOT PRIVATE grid oracle
    mode: str  # the mode that ran (--mode auto: the pilots' choice)
    pilot_records: list
    selector: Any
    features: dict  # cached features (last-layer), for the NOT PRIVATE reference
    trials: list  # pilot records and the strategy's trials, ε after each filled in
    events: list  # the certificate's events
    #: the NOT PRIVATE grid oracle's best head in the classifier: scored on the reported split, never released
    reference_model: Any = None

    @property
    def published_trial_count(self) -> int | None:
        """Trials published; None under repeat-and-select, whose number of trials is random and not published."""
        return None if self.outcome.certificate_events is not None else len(self.trials)


def _ran(outcome, model, mode: str, pilot_records: list, selector, feats: dict, tplan: _TunePlan, delta: float,
         accountant: str) -> _Ran:
    """Collect the run's trials and the certificate's events (the charged feature centre first)."""
    trial_list = pilot_records + list(outcome.trials)
    pre = tplan.center_events
    common.fill_epsilon_after(trial_list, delta, accountant, prefix_events=pre)
    if outcome.certificate_events is not None:
        events = pre + [e for t in pilot_records for e in t.events] + list(outcome.certificate_events)
    else:
        events = pre + [e for t in trial_list for e in t.events] + list(outcome.final_events)
    return _Ran(outcome=outcome, model=model, mode=mode, pilot_records=pilot_records, selector=selector,
                features=feats, trials=trial_list, events=events)


class TuneJob:
    """``privtune tune`` as a :class:`privtune.run.pipeline.Job`: plan every candidate (and the ``--mode auto``
    pilots), reserve the most expensive, run the strategy, certify every trial and the final run."""

    command = "tune"

    def __init__(self, arguments: TuneArguments, unknown: dict):
        self.arguments, self.unknown = arguments, unknown
        self._started = time.time()
        self._journal = None  # the trial journal, once the reservation is in place (private strategies)
        self._reserved = False  # the reservation stage is passed: a later failure is not a refusal
        self._fresh_state = False  # this run wrote a new state file before reserving

    # ------------------------------------------------------------------ load
    def load(self) -> _Loaded:
        """Every argument checked, every split loaded and checked, RUN_DIR opened (no budget spent)."""
        args = self.arguments
        req = _check_arguments(args, self.unknown)
        inputs = _load_inputs(req, args.data, eval_data=args.eval_data, public_eval_data=args.public_eval_data,
                              labels=args.labels, model=args.model, text_column=args.text_column,
                              label_column=args.label_column, validation_fraction=args.validation_fraction)
        # RUN_DIR is opened here, not in `prepare`: the private validation split is drawn from its run seed
        files = _open_run_files(args, req, inputs)
        inputs = _split_private_validation(inputs, files.run_seed)
        prog = _progress(args.quiet, files.run_dir, req.privacy.epsilon)
        prog.hold_lines()  # until the plan says whether this run's timing may be shown
        return _Loaded(req=req, inputs=inputs, files=files, prog=prog)

    @contextlib.contextmanager
    def session(self, loaded: _Loaded):
        """The progress display; on an interruption after the reservation, how to resume; on a refusal
        before it, no RUN_DIR left behind."""
        files, prog = loaded.files, loaded.prog
        refused = False
        try:
            yield
        except KeyboardInterrupt:
            journal = self._journal
            if journal is not None:  # reserved: the reservation stays charged; say how to continue without a new one
                hint = _resume_hint(files.run_dir if journal.path is not None else None, journal.config_written)
                prog.runlog.write(hint)
                print(hint, file=sys.stderr)
            raise
        except Exception as exc:
            # failed before the reservation (a refusal, or a model that fails to load): nothing was charged, and a
            # half-made RUN_DIR would only block the rerun
            refused = not self._reserved
            journal = self._journal
            if journal is not None and journal.path is not None:
                prog.runlog.write(f"failed after the ledger reservation ({type(exc).__name__}): the reservation stays "
                                  f"charged; once the cause is fixed, `--resume` continues this run. "
                                  + _resume_hint(files.run_dir, journal.config_written).split("\n", 1)[-1])
            raise
        finally:
            prog.close()
            if refused and files.run_dir is not None:  # refused before the reservation: leave no RUN_DIR behind
                _release.discard_unreserved(files.created_dirs,
                                            [] if files.log_existed else [files.run_dir / "log.txt"])

    # ------------------------------------------------------------------ plan, prepare, reserve
    def plan(self, loaded: _Loaded) -> _Planned:
        """The classifier, then every candidate's plan (no data read yet)."""
        req, inputs, log = loaded.req, loaded.inputs, loaded.prog.log
        clf = _load_model(self.arguments.model, inputs, loaded.files.run_seed, image_size=self.arguments.image_size,
                          batchnorm=self.arguments.batchnorm, image_features=self.arguments.image_features,
                          max_length=self.arguments.max_length)
        log(f"privtune tune: strategy={req.strategy.name}, mode={req.mode}, total ε={req.privacy.epsilon:g}, "
            f"δ={inputs.privacy.delta:g}, data={inputs.train_source} ("
            + (f"n={inputs.n_train}" if inputs.units is None else
               f"N_u={inputs.n_train} units of {inputs.units.name}, at most {inputs.max_rows_per_unit} rows each per "
               "step") + "), "
            f"selection={common.describe_selection(_selection_of_strategy(req, inputs))}")
        tplan = _plan_run(req, inputs, log, warning_log=loaded.prog.log_to_file, lora_capable=_lora_capable(clf),
                          cost=backbone_cost(clf, req.device, req.schedule.max_physical_batch_size))
        if tplan.hide_timing:  # no time on any line: the time the search's lines span would tell its K
            loaded.prog.hide_timing()
        loaded.prog.release_lines()
        return _Planned(clf=clf, tplan=tplan)

    def prepare(self, loaded: _Loaded, planned: _Planned) -> _RunFiles:
        return loaded.files

    def budget_request(self, loaded: _Loaded, planned: _Planned, files: _RunFiles) -> BudgetRequest | None:
        """The most expensive candidate plan, by the ledger's own measure (:func:`_cover_candidates`); None for
        a NOT PRIVATE strategy, which spends and releases nothing and does not touch the ledger."""
        req, inputs = loaded.req, loaded.inputs
        if req.strategy.not_private:
            loaded.prog.log(f"{req.strategy.name} is NOT PRIVATE: tuning is not charged, no model is released and "
                            "the ledger is not touched")
            return None
        eps_total, delta, fp, accountant = req.privacy.epsilon, inputs.privacy.delta, inputs.fingerprint, \
            req.privacy.accountant
        in_run_dir = inputs.embedded and self.arguments.ledger is None  # holds no data file name of the ledger's
        return BudgetRequest(
            fingerprint=fp, total_epsilon=eps_total, delta=delta, accountant=accountant, command="tune",
            config={"strategy": req.strategy.name, "mode": req.mode, "epsilon": eps_total, "delta": delta,
                    "output": str(files.run_dir) if files.run_dir is not None else None},
            resume_key=files.run_id,
            events=lambda led: _cover_candidates(led, fp, planned.tplan.mode_plans, eps_total, delta, accountant),
            resuming=files.state_header is not None, file_name=None if in_run_dir else inputs.file_name,
            reserve_delta=delta, strict_resume=True, replayed=bool(files.state_entries), run_dir=files.run_dir,
            privacy_unit=None if inputs.units is None else inputs.units.name)

    def open_ledger(self, loaded: _Loaded, files: _RunFiles) -> tuple[Any, str]:
        return open_ledger_for(self.arguments.ledger, run_dir=files.run_dir, in_run_dir=loaded.inputs.embedded)

    def before_reserving(self, loaded: _Loaded, files: _RunFiles):
        """A new run's private state file, written before the reservation: a run killed at any later point
        resumes under it."""
        if files.state_header is not None or files.run_dir is None:
            return None

        def write_state() -> None:
            _write_state_header(files.run_dir, files.run_id, files.run_seed, loaded.inputs.fingerprint,
                                files.config)
            self._fresh_state = True

        return write_state

    def refused(self, files: _RunFiles) -> None:
        if files.run_dir is not None:
            _release.discard_unreserved(files.created_dirs, ([] if files.log_existed else [files.run_dir / "log.txt"])
                                        + ([_state_path(files.run_dir)] if self._fresh_state else []))

    def reserved(self, budget: Any, loaded: _Loaded, planned: _Planned, files: _RunFiles) -> None:
        log, req, inputs = loaded.prog.log, loaded.req, loaded.inputs
        if budget.registered:
            log(f"ledger: new dataset {budget.dataset_id} registered with total ε = {req.privacy.epsilon:g}, "
                f"δ = {inputs.privacy.delta:g} ({budget.ledger_url})")
        if budget.committed is not None:  # interrupted after its commit: write the release, charge nothing
            log(f"resume: ledger entry {budget.committed.entry_id} is already committed; the run is finished from "
                "its state without a new charge")
        self._reserved = True

    # ------------------------------------------------------------------ run
    def run(self, loaded: _Loaded, planned: _Planned, files: _RunFiles, budget: Any) -> _Ran:
        req, inputs, tplan, prog = loaded.req, loaded.inputs, planned.tplan, loaded.prog
        reservation = (budget.reservation if budget.reservation is not None
                       else _CommittedEntry(budget.committed.entry_id) if budget.committed is not None
                       else _null_reservation())
        if not req.strategy.not_private:  # seeds, completed trials and replay (see _Journal)
            self._journal = _open_journal(files.run_dir, files.state_header, files.state_entries, files.run_seed,
                                          files.run_id, files.config, files.unsaved, inputs.fingerprint, prog,
                                          inputs.privacy.delta, req.privacy.accountant, tplan.center_events,
                                          reservation)
        ran = _execute(req, inputs, tplan, planned.clf, prog, files.run_seed, self._journal,
                       self.arguments.feature_cache_dir)
        _release.fault_point("after-last-step")
        return ran

    # ------------------------------------------------------------------ certify
    def describe(self, loaded: _Loaded, planned: _Planned, files: _RunFiles, ran: _Ran, budget: Any) -> Described:
        req, inputs = loaded.req, loaded.inputs
        # published: the ledger's random dataset id, never a hash of the data (grid-oracle: no ledger, none)
        metadata = _certificate_metadata(req, inputs, planned.tplan, ran, _selection_of_run(req, inputs, ran),
                                         None if req.strategy.not_private else budget.dataset_id)
        return Described(events=ran.events, delta=inputs.privacy.delta, accountant=req.privacy.accountant,
                         metadata=as_plain(metadata), seed=req.seed,
                         epsilon_limit=None if req.strategy.not_private else req.privacy.epsilon,
                         neighbouring=neighbouring_relation(None if inputs.units is None else inputs.units.name))

    def figures(self, loaded: _Loaded, planned: _Planned, files: _RunFiles, ran: _Ran, budget: Any,
                cert: Any) -> tuple[dict, dict]:
        """The accuracy on the reported split (evaluated only now, after the final model is fixed), metrics
        and history."""
        req, inputs, prog, strat = loaded.req, loaded.inputs, loaded.prog, loaded.req.strategy
        delta, accountant, selection = inputs.privacy.delta, req.privacy.accountant, _selection_of_run(req, inputs, ran)
        # the NOT PRIVATE grid oracle: its best head scored on the reported split (metrics say NOT PRIVATE)
        acc, majority = _reported_accuracy(ran, inputs, prog, model=ran.reference_model if strat.not_private
                                           else ran.model)
        remaining = None
        try:
            remaining = (float(budget.ledger.status(inputs.fingerprint).remaining_epsilon)
                         if budget.ledger is not None else None)
        except Exception:  # pragma: no cover - status is informative only
            pass
        metrics = {
            "accuracy": acc, "epsilon": float(cert.epsilon), "delta": float(delta), "strategy": strat.name,
            "mode": ran.mode, "hyperparameters": as_plain(ran.outcome.final_hyperparameters),
            "reported_split": inputs.reported_split, "selection": selection,
            "selection_description": common.describe_selection(selection),
            "dataset_id": None if strat.not_private else budget.dataset_id, "ledger_url": budget.ledger_url,
            "ledger_remaining_epsilon": remaining, "total_epsilon": req.privacy.epsilon, "n_train": inputs.n_train,
            "trials": ran.published_trial_count, "ledger_registered_new_dataset": budget.registered,
            "majority_prediction": majority,
            # under repeat-and-select the wall time grows with the hidden number of trials: not published
            "wall_time_s": (None if ran.outcome.certificate_events is not None or planned.tplan.hide_timing
                            else round(time.time() - self._started, 1)),
        }
        if inputs.units is not None:  # the unit's name, k and N_u (public); n_train is N_u
            metrics["privacy_unit"] = inputs.unit_description
        if len(planned.tplan.pilot_modes) > 1:  # the pilots chose one of k plans: (total ε, δ) by a union bound
            metrics["mode_plans"] = len(planned.tplan.pilot_modes)
        _list_warnings(metrics, req, inputs, planned.tplan)
        if strat.not_private:
            metrics["not_private"] = True
            metrics["label"] = "NOT PRIVATE"
        if self.arguments.nonprivate_reference and not strat.not_private and ran.features is not None:
            metrics["nonprivate_reference"] = _oracle_reference(ran.features, ran.selector, req.privacy.epsilon,
                                                                delta, accountant, req.seed, inputs.unit_option, prog)
        history = {
            "final_run": _final_curves(ran.outcome.final_history),
            "trials": [as_plain(t.to_dict()) for t in ran.trials],
            "strategy": as_plain(ran.outcome.strategy_data),
            "plan": as_plain(planned.tplan.plan.to_dict()),
        }
        _label_curves(history["final_run"], inputs.public_set is not None)
        journal = self._journal
        if journal is not None and journal.replayed and not journal.hide_trials:
            metrics["resumed"] = {"replayed_trials": journal.replayed}
        return metrics, history

    # ------------------------------------------------------------------ write, commit
    def release_target(self, loaded: _Loaded, files: _RunFiles, ran: _Ran) -> ReleaseTarget:
        run_dir, log = files.run_dir, loaded.prog.log
        if run_dir is not None and files.unsaved:
            log(f"note: config.yaml cannot hold {', '.join(files.unsaved)} (in-memory objects, not paths); "
                "rerunning from it needs them passed again")
        # the state file holds the noise seeds: with them anyone could subtract the noise from the released
        # model, so it goes right after the commit
        return ReleaseTarget(run_dir=run_dir, model=ran.model, config=files.config, log=log,
                             private_files=[_state_path(run_dir)] if run_dir is not None else [], published=as_plain)

    def on_main(self, stage: str, fn):
        return fn()  # tune runs in one process (_check_arguments)

    def result(self, loaded: _Loaded, planned: _Planned, files: _RunFiles, ran: _Ran, released: Any) -> TuneResult:
        req, tplan, cert, metrics = loaded.req, planned.tplan, released.certificate, released.metrics
        # released: now say when the model predicts nearly one class (after a failed write the error comes alone)
        usefulness.warn(usefulness.one_class_message(metrics.get("majority_prediction")), OneClassModelWarning,
                        loaded.prog.log_to_file)
        loaded.prog.log(
            ("done: " if tplan.hide_timing else f"done in {time.time() - self._started:.0f} s: ")
            + (f"ε = {cert.epsilon:.4f} (≤ {req.privacy.epsilon:g}), δ = {cert.delta:g}"
               if not req.strategy.not_private else
               f"NOT PRIVATE reference (composition of the grid runs: ε = {cert.epsilon:.4g}, δ = {cert.delta:g})")
            + (f", accuracy {metrics['accuracy']:.4f}" if metrics.get("accuracy") is not None else "")
            + (f" → {files.run_dir.name}" if files.run_dir else ""))  # log.txt is released: no machine path
        return TuneResult(model=ran.model, certificate=cert, trials=released.history["trials"], metrics=metrics,
                          history=released.history, run_dir=files.run_dir, plan=tplan.plan)


@dataclass(frozen=True)
class _Loaded:
    """What :meth:`TuneJob.load` hands on: the checked request, the splits, RUN_DIR and the progress display."""

    req: _Request
    inputs: _Inputs
    files: _RunFiles
    prog: Any


@dataclass(frozen=True)
class _Planned:
    clf: Any  # the classifier with the declared label set
    tplan: _TunePlan


def _selection_of_run(req: _Request, inputs: _Inputs, ran: _Ran) -> str:
    """How the released model was selected: the strategy's selection, or the --mode auto pilots' source."""
    selection = _selection_of_strategy(req, inputs)
    if ran.pilot_records and selection == "none":
        selection = inputs.selection  # the mode-auto pilots were scored with it
    return selection


def _auto_choice_note(candidates: int, epsilon: float, delta: float) -> str:
    """What the certificate of a ``--mode auto`` run that piloted ``candidates`` modes proves about the choice
    (``epsilon``, ``delta``: the run's total)."""
    return (f"mode auto: the pilots chose one of {candidates} mode plans fixed before the reservation, each made so "
            f"that the pilots and its run compose to ε = {epsilon:g} at δ/{candidates} = {delta / candidates:.3g}; "
            f"by a union bound over the plans the run is (ε = {epsilon:g}, δ = {delta:g})-DP whichever was chosen. "
            "The certificate's ε is that of the events that ran, composed at δ")


def _certificate_metadata(req: _Request, inputs: _Inputs, tplan: _TunePlan, ran: _Ran, selection: str,
                          dataset_id: str | None) -> dict:
    """The certificate's metadata: what ran, how trials were selected and accounted (never data)."""
    source = inputs.selection
    metadata = {
        "strategy": req.strategy.name, "mode": ran.mode, "selection": selection,
        "selection_description": common.describe_selection(selection),
        "selection_split": ("public validation (declared public by the user)" if source == "public_validation"
                            else "private validation split (charged)" if source == "private_validation_noisy"
                            else "private training data (charged)" if selection != "none" else "none"),
        "reported_split": inputs.reported_split,
        "reported_split_used_for_selection": False,
        "total_epsilon_requested": req.privacy.epsilon, "seed": req.seed, "trials": ran.published_trial_count,
        "dataset_id": dataset_id, "plan": as_plain(tplan.plan.notes),
        "notes": [*(ran.outcome.strategy_data.get("notes", []) or [])],
    }
    if inputs.units is not None:  # user level: every pilot, trial, score and the final run sample and weigh units
        metadata["privacy_unit"] = inputs.unit_description
    if len(tplan.pilot_modes) > 1:
        metadata["mode_plans"] = len(tplan.pilot_modes)  # what RunData.guarantee_epsilon reads
        metadata["notes"].append(_auto_choice_note(len(tplan.pilot_modes), req.privacy.epsilon,
                                                   inputs.privacy.delta))
    metadata.update(_trial_section(ran.trials, ran.outcome, req.strategy.not_private))
    if req.strategy.not_private:
        metadata["label"] = "NOT PRIVATE"
        metadata["notes"].append("NOT PRIVATE: every grid run is (ε, δ)-DP alone; the selection is uncharged")
    return metadata


def _reported_accuracy(ran: _Ran, inputs: _Inputs, prog, *, model: Any) -> tuple:
    """``(accuracy, majority prediction)`` of ``model`` (the released one, or the NOT PRIVATE grid oracle's
    best head) on the reported split (public by declaration):
    :func:`privtune.finetune.usefulness.majority_prediction`; without a labelled reported split no accuracy
    and the majority prediction on the public split (never on private data).  ``(None, None)`` without either."""
    eval_set, names = inputs.eval_set, inputs.label_names
    if model is None:
        return None, None
    if eval_set is None or getattr(eval_set, "labels", None) is None:
        public_set = inputs.public_set
        if public_set is None:
            return None, None
        prog.start_phase("predicting the public split", len(public_set), unit="examples", work=len(public_set),
                         kind="predict")
        counts = torch.bincount(model.predict_logits(public_set).argmax(1), minlength=inputs.num_labels)
        prog.advance(len(public_set))
        prog.end_phase()
        return None, usefulness.majority_prediction(counts.tolist(), names, "the public validation split")
    prog.start_phase("evaluating on the reported split", len(eval_set), unit="examples", work=len(eval_set),
                     kind="predict")
    logits = model.predict_logits(eval_set)
    prog.advance(len(eval_set))
    acc = float((logits.argmax(1) == _labels_tensor(eval_set)).float().mean().item())
    prog.end_phase()
    what = "" if model is ran.model else " of the grid oracle's best head (NOT PRIVATE)"
    prog.log(f"accuracy{what} on the reported split ({inputs.reported_split}): {acc:.4f}")
    counts = torch.bincount(logits.argmax(1), minlength=logits.shape[1]).tolist()
    return acc, usefulness.majority_prediction(counts, names, inputs.reported_split)


def _list_warnings(metrics: dict, req: _Request, inputs: _Inputs, tplan: _TunePlan) -> None:
    """After the run: list in ``metrics["warnings"]`` the pre-run warning and, when the released model predicts
    nearly one class (``metrics["majority_prediction"]``), the post-run one, issued once the release is in place
    (:func:`tune`).  Public quantities only."""
    after = usefulness.one_class_message(metrics.get("majority_prediction"))
    before = usefulness.unlikely_to_learn_message(tplan.run_mode, inputs.n_train, req.privacy.epsilon, command="tune",
                                                  kind=getattr(inputs.train, "kind", None),
                                                  unit=None if inputs.units is None else inputs.units.name)
    found = [w for w in (before, after) if w]
    if found:
        metrics["warnings"] = found


def _trial_section(trial_list, outcome, not_private: bool) -> dict:
    """The certificate's per-trial section: one record per trial (hyperparameters, score, events) and
    one for the final run, each saying how it is accounted in the certificate's ``events``."""
    ps = outcome.certificate_events is not None
    records = []
    for t in trial_list:
        d = as_plain(t.to_dict())
        if ps and t.phase != "mode-auto pilot":
            d["accounted"] = ("by the repeat-and-select event in `events` (Papernot & Steinke), which covers every "
                              "trial and the selection; this trial's own events are listed for information and are "
                              "NOT composed again")
        else:
            d["accounted"] = "its events are listed in `events`"
        records.append(d)
    final = {"phase": "final run", "hyperparameters": as_plain(outcome.final_hyperparameters),
             "events": [as_plain(event_to_dict(e)) for e in outcome.final_events]}
    if not_private:
        final["accounted"] = "NOT PRIVATE reference: no model is released"
    elif outcome.final_events:
        final["accounted"] = "its events are listed in `events`"
    elif ps:
        final["accounted"] = ("the released model is the selected trial's: no separate run, no further event "
                              "(covered by the repeat-and-select event)")
    else:
        sel = outcome.final_hyperparameters.get("selected_trial")
        final["accounted"] = f"the released model is trial {sel}'s: no separate run, no further event"
    out = {"trial_records": records + [final]}
    if ps:
        out["trials_accounting"] = ("repeat-and-select (Papernot & Steinke 2022): `events` holds ONE "
                                    "RepeatAndSelectEvent for all trials and the selection of the best; only the "
                                    "selected trial is listed in `trial_records` (the bound covers releasing it "
                                    "alone), its events for information, not composed again (that would double "
                                    "count). The number of trials run and the other trials are not published.")
    else:
        out["trials_accounting"] = "composition: every trial's events (and charged scores) are listed in `events`"
    return out


# --------------------------------------------------------------------------------------
# planning
# --------------------------------------------------------------------------------------


def _mode_estimates(req: _Request, inputs: _Inputs, modes: list, cost: Any) -> dict:
    """{mode: estimated seconds of a run in that mode} (no pilots), from a plan of each mode made from public sizes
    only and the backbone's measured forward cost."""
    strat, n = req.strategy, inputs.n_train
    sched = req.schedule
    request = PlanRequest(total_epsilon=req.privacy.epsilon, delta=inputs.privacy.delta, n_train=n,
                          accountant=req.privacy.accountant, epochs=sched.epochs, steps=sched.steps,
                          batch_size=sched.batch_size, data_kind=getattr(inputs.train, "kind", None))
    cfg = strat.make_config(dict(req.options), trials=req.trials, optimizer=req.optimizer.name,
                            clip=req.clipping.clip, clipping=req.clipping.clipping)
    out = {}
    for m in modes:
        plan = strat.plan(cfg, m, request)
        priced = _TunePlan(plan=plan, mode_plans={m: plan}, candidates=[m], pilot_modes=[], run_mode=m, pilot_eps=0.0,
                           pilot_events=[], center_sigma=None, selection_sigma=None, hide_timing=False)
        out[m] = estimate_seconds(cost, _work_ahead(priced, inputs, [], m, cached=False))
    return out


def _within_time_budget(req: _Request, inputs: _Inputs, candidates: list, cost: Any, log,
                        timing_lines: list) -> list:
    """The candidate modes, priced (the estimate's line appended to ``timing_lines``, for the caller to log when
    the run shows timing); with ``req.time_budget`` (minutes) those estimated above it are dropped (--mode auto
    keeps the cheapest when none fits) and an explicit mode above it is refused."""
    try:
        estimates = _mode_estimates(req, inputs, candidates, cost)
    except PrivtuneError:  # a mode that cannot be planned is reported by the plan itself, with its fix
        return candidates
    timing_lines.append(f"time estimate before the run ({cost.describe()}): {format_estimates(estimates)}")
    if req.time_budget is None:
        return candidates
    budget = 60.0 * req.time_budget
    fits = [m for m in candidates if estimates[m] <= budget]
    if req.mode != "auto" and not fits:
        m = candidates[0]
        cheaper = {k: v for k, v in _mode_estimates(req, inputs, [x for x in req.strategy.modes if x != m],
                                                    cost).items() if v <= budget}
        raise InvalidParameterError(
            f"mode {m} is estimated at {format_duration(estimates[m])} on this machine "
            f"({cost.describe()}), above `time_budget` = {req.time_budget:g} min. "
            + (f"Choose a cheaper mode ({format_estimates(cheaper)}) or raise `time_budget`." if cheaper
               else "Raise `time_budget`, or run on a faster device (--device cuda)."))
    if not fits:
        fits = [min(candidates, key=estimates.get)]
    dropped = [m for m in candidates if m not in fits]
    if dropped:
        log(f"mode auto: {', '.join(dropped)} not piloted: estimated above the time budget of "
            f"{req.time_budget:g} min")
    return fits


def _auto_candidates(supported_modes, n: int, eps_total: float, lora_capable: bool = True,
                     kind: str | None = None) -> list:
    """The modes ``--mode auto`` compares, in the order that breaks their ties, from public sizes and the data's
    ``kind`` only: at fine-tuning scale (n·ε ≥ :data:`_FINETUNE_SCALE`) the fine-tuning modes the strategy
    trains (full first from n ≥ :data:`_FULL_FIRST_N`), after the last layer for the kinds in
    :data:`AUTO_HEAD_AT_SCALE_KINDS` (images); where DP fine-tuning was measured at chance (n·ε ≤
    :data:`privtune.finetune.usefulness.FINETUNE_AT_CHANCE_N_EPS`) last-layer alone, with no pilot: a
    fine-tuning pilot there cannot win and only costs time and ε; else the small-data set.  A backbone with
    no attention projections for LoRA (``lora_capable=False``: a convolutional network) pilots full in its
    place, so that no pilot is charged for a mode that cannot be built."""
    if not lora_capable:
        supported_modes = [m for m in supported_modes if m != "lora"]
    order = AUTO_MODES_FROM_FULL_FIRST_N if n >= _FULL_FIRST_N else AUTO_MODES_AT_SCALE
    at_scale = [m for m in order if m in supported_modes]
    if n * eps_total >= _FINETUNE_SCALE and at_scale:
        head = ["last-layer"] if kind in AUTO_HEAD_AT_SCALE_KINDS and "last-layer" in supported_modes else []
        return head + at_scale
    small = [m for m in (AUTO_MODES if lora_capable else AUTO_MODES_WITHOUT_LORA) if m in supported_modes]
    if "last-layer" in small and all(usefulness.backbone_cannot_learn(m, n, eps_total) for m in small
                                     if m != "last-layer"):
        return ["last-layer"]
    return small


def _lora_capable(clf) -> bool:
    """Whether LoRA finds its default target modules in the classifier's backbone (mode="lora" can run)."""
    try:
        default_lora_target_modules(clf)
    except ModelError:
        return False
    return True


def _auto_without_pilots_note(req: _Request, strat, n: int, run_mode: str, lora_capable: bool = True,
                              kind: str | None = None) -> str | None:
    """Why ``--mode auto`` runs no pilot (None when the mode was given): public quantities only; ``kind``, the
    data's ("text", "image"), words where the threshold was measured (usefulness.threshold_evidence)."""
    if req.mode != "auto":
        return None
    small = AUTO_MODES if lora_capable else AUTO_MODES_WITHOUT_LORA
    skipped = [m for m in small if m in strat.modes and m != run_mode]
    if not skipped:
        return f"mode auto: strategy {strat.name} trains {run_mode} only; no mode pilots are run"
    eps, unit = req.privacy.epsilon, req.units and req.units[0]
    size = f"n = {n:,}" if not unit else (f"n = N_u = {n:,} units" + (f" ({unit})" if isinstance(unit, str) else ""))
    return (f"mode auto: {run_mode} without mode pilots: at n·ε = {n * eps:,.0f} ({size}, ε = {eps:g}), at or "
            f"below {usefulness.FINETUNE_AT_CHANCE_N_EPS:,}, DP fine-tuning of the backbone ({', '.join(skipped)}) "
            f"was measured at chance ({usefulness.threshold_evidence(kind)}), so its pilots could not win and are "
            "not run")


def _check_public_split_can_compare(public_set, compared: str, alternative: str) -> None:
    """Refuse, before the reservation, candidates (``compared``: mode pilots, or a strategy's trials) scored on a
    public split whose examples are all of one class: its accuracy rewards the candidate that predicts that class
    most often, not the better one; ``alternative`` is the other way out the error offers.  The split is public,
    so looking at its labels costs nothing."""
    labels = getattr(public_set, "labels", None)
    if labels is None or len(set(int(y) for y in labels)) > 1:
        return
    names = getattr(public_set, "label_names", None)
    only = labels[0] if not names else names[int(labels[0])]
    raise InvalidParameterError(
        f"`public_eval_data`: all {len(labels)} of its examples are of class {str(only)!r}, so accuracy on it "
        f"cannot compare the {compared}: it rewards whichever predicts that class most often. Pass a public "
        f"split with examples of at least two classes, or {alternative}. Nothing was charged.")


def _work_kind(mode: str) -> str:
    """The kind of work of a run in ``mode`` for the time-left estimate (Progress.plan_ahead)."""
    return "features" if mode == "last-layer" else f"model:{mode}"


def _work_ahead(tplan: _TunePlan, inputs: _Inputs, pilots_left, mode: str, *, cached: bool) -> list:
    """The work still ahead of a tune, as (kind, expected examples) pairs from public sizes and the plan only:
    feature caching (when a last-layer run is still ahead and nothing is cached), the ``pilots_left`` with their
    scores, the planned runs of ``mode`` with the scores of its η trials, the evaluation on the reported split
    and the release.  For the time-left estimate of :class:`privtune.report.progress.Progress`."""
    n = inputs.n_train
    # sizes privtune may publish (the estimate is printed and logged): a split's declared public size where it
    # has one, the planned size of a private validation split where that is planned, else its length
    sel = inputs.selector_data
    n_select = 0 if sel is None else public_size(sel)
    if inputs.selection == "private_validation_noisy" and getattr(inputs, "n_val_public", None) is not None:
        n_select = int(inputs.n_val_public)
    out = []
    if not cached and ("last-layer" in pilots_left or mode == "last-layer"):
        public = inputs.public_set if inputs.public_set is not inputs.selector_data else None
        out.append(("forward", n + (n_select if inputs.selection == "public_validation" else 0)
                    + (public_size(public) if public is not None else 0)))
    for m in pilots_left:
        if m == "last-layer":
            out.append(("features", n))
        else:
            out += [(_work_kind(m), _PILOT_STEPS * _pilot_batch(n)), ("predict", n_select)]
    plan = tplan.mode_plans.get(mode, tplan.plan)
    events = [e for e in plan.events if not str(getattr(e, "label", "")).startswith("planned pilot")]
    out.append((_work_kind(mode), common.planned_examples(events, n)))
    if mode != "last-layer":
        scored = sum(str(getattr(e, "label", "")).startswith("planned η trial") for e in events)
        out.append(("predict", scored * n_select))
    if inputs.eval_set is not None and getattr(inputs.eval_set, "labels", None) is not None:
        out.append(("predict", public_size(inputs.eval_set)))
    out.append(("release", 1))  # the model, the report and its plots
    return out


def _pilot_batch(n: int) -> int:
    """Expected batch of a model-mode pilot: 64, or 256 at fine-tuning scale (n ≥ _FINETUNE_SCALE; still
    ≤ 2,560 examples per pilot), never above n/4."""
    return min(256 if n >= _FINETUNE_SCALE else 64, max(1, n // 4))


def _plan_pilots(modes, pilot_eps, delta, n, sel_sigma, accountant) -> list:
    """Events of the --mode auto pilots, exactly as they will run: per-run ε_pilot each (+ a score)."""
    from privtune.accounting.events import DPSGDEvent, GaussianEvent

    out = []
    for m in modes:
        if m == "last-layer":
            sigma = common.calibrate_final(pilot_eps, delta, [], sample_rate=1.0, steps=1, sampling="full_batch",
                                           accountant=accountant, what="a mode pilot")
            out.append(GaussianEvent(sigma, 1, label=f"planned pilot {m}"))
        else:
            q = _pilot_batch(n) / n
            sigma = common.calibrate_final(pilot_eps, delta, [], sample_rate=q, steps=_PILOT_STEPS,
                                           accountant=accountant, what="a mode pilot")
            out.append(DPSGDEvent(sigma, q, _PILOT_STEPS, label=f"planned pilot {m}"))
        if sel_sigma:
            out.append(GaussianEvent(sel_sigma, 1, label=f"score pilot {m}"))
    return out


def _check_overrides(strat, modes, given: dict) -> None:
    """Refuse an override that no candidate mode of the strategy uses (never drop it silently)."""
    used = set().union(*(strat.overrides.get(data_kind(m), frozenset()) for m in modes))
    for name in common.OVERRIDE_NAMES:
        if given.get(name) is not None and name not in used:
            where = "mode " + "/".join(modes)
            raise InvalidParameterError(
                f"`{name}` does not apply to strategy={strat.name!r} in {where}"
                + (" (the full-batch recipe on cached features fixes it)" if name != "trials" else
                   " (it runs no trials)")
                + f"; remove it{' or use mode=bitfit/lora/full' if name in strat.overrides.get('model', ()) else ''}."
            )


# --------------------------------------------------------------------------------------
# execution
# --------------------------------------------------------------------------------------


def _execute(req: _Request, inputs: _Inputs, tplan: _TunePlan, clf, prog, seed: int, journal,
             feature_cache_dir: Any) -> _Ran:
    """Run the pilots (mode auto), then the strategy, with every backend and selector in the run's
    ``journal``.  The reported split is never passed in here: :func:`_certify` evaluates it after the
    final model is fixed."""
    strat, delta, accountant = req.strategy, inputs.privacy.delta, req.privacy.accountant
    train, selector_data, sel_name, public_set = inputs.train, inputs.selector_data, inputs.selection, inputs.public_set
    sel_eff = _selection_of_strategy(req, inputs)
    # what the pilots' backends and selectors read (device, memory, the journal that records their draws)
    kw = {"journal": journal, "device": req.device, "accountant": accountant,
          "max_physical_batch_size": req.schedule.max_physical_batch_size, "executor": req.executor,
          "units": inputs.unit_option}
    feats: dict = {}

    def features():
        if not feats:
            # the frozen-backbone features (a model pilot may have switched the shared model's pooling before; a
            # loaded privtune model's own centre belongs to the head that this run replaces)
            clf.normalize = finetune.head_input_normalization(clf, "last-layer")
            clf.feature_center = None
            # a private-validation split: the whole file's n rows (public) are cached once, then split by rows, so
            # neither the progress lines nor log.txt show the realised sizes
            split = inputs.whole is not None
            for name, ds in (("train", inputs.whole if split else train),
                             ("select", selector_data if sel_name == "public_validation" else None),
                             ("public", public_set)):
                if ds is None or name in feats:
                    continue
                if name == "public" and ds is selector_data and "select" in feats:
                    feats["public"] = feats["select"]
                    continue
                counted = inputs.units is None or name != "train"  # unit level: the rows' number is private
                prog.start_phase(f"caching features ({name})", len(ds) if counted else None, unit="examples",
                                 work=public_size(ds), kind="forward", counted=counted)
                fs = finetune.cache_features(clf, ds, cache_dir=feature_cache_dir, progress=lambda k: prog.advance(k, examples=k))
                prog.end_phase()
                feats[name] = (fs.features.float(), fs.labels)
            if split:
                (X_all, y_all), m = feats.pop("train"), inputs.val_mask
                feats["train"], feats["_private_val"] = (X_all[~m], y_all[~m]), (X_all[m], y_all[m])
            _choose_centre(feats, clf, getattr(train, "kind", None), tplan, inputs, seed)
        return feats

    # a score on the private validation split is normalised by its planned size, never its realised one; at user
    # level by N_u
    scored_size = inputs.n_val_public if sel_name == "private_validation_noisy" else inputs.units and inputs.n_train

    def make_selector(source, data_kind: str):
        if source == "none":
            return None
        weights = inputs.score_weights(source)  # user level, charged: each unit's rows weighted to sum to one
        size = None if source == "public_validation" else scored_size
        if data_kind == "features":
            f = features()
            if source == "public_validation":
                X, y = f["select"]
            elif sel_name == "private_validation_noisy":
                X, y = f["_private_val"]
            else:
                X, y = f["train"]
            return _journaled(Selector(source, X, y, noise_std=tplan.selection_sigma or 0.0,
                                       name=f"selection:{source}", seed=seed, public_size=size,
                                       row_weights=weights), kw)
        return _journaled(Selector(source, selector_data, _labels_tensor(selector_data),
                                   noise_std=tplan.selection_sigma or 0.0, name=f"selection:{source}", seed=seed,
                                   public_size=size, row_weights=weights), kw)

    def plan_time(pilots_left, mode):  # the work ahead, for the time left of the whole tune
        prog.plan_ahead(_work_ahead(tplan, inputs, pilots_left, mode, cached=bool(feats)))

    # ---------------------------------------------------------------- --mode auto pilots
    pilot_records = []
    used_mode = tplan.run_mode
    if tplan.pilot_modes:
        used_mode, pilot_records = _run_pilots(tplan.pilot_modes, clf, train, features, make_selector, sel_eff
                                               if sel_eff != "none" else sel_name, tplan.pilot_eps, delta, seed, prog,
                                               dict(kw, plan_time=plan_time))
        tplan.plan = _adopt_pilots_choice(tplan, used_mode, pilot_records, delta, accountant, prog.log)
    else:
        tplan.plan = tplan.mode_plans[used_mode]  # the plan as reserved (armed by _cover_candidates)
    plan_time([], used_mode)
    plan = tplan.plan
    seed_s = None if seed is None else seed + 17
    if journal is not None:
        journal.set_plan(plan)
    if used_mode == "last-layer":
        f = features()
        X, y = f["train"]
        backend = _journaled(FeatureBackend(X, y, clf.num_labels, curve_data=f.get("public"), center=f.get("_center"),
                                            renormalize=f.get("_renormalize", False),
                                            device=req.device, public_n=inputs.n_train, units=inputs.unit_option,
                                            data_kind=clf.kind), kw)
        selector = make_selector(sel_eff, "features")
        prog.start_phase(f"{strat.name} on cached features", None, unit="runs")
        if journal is not None and plan.accounting == "repeat-and-select":
            journal.hide_trials = True  # not even the count of trials goes to log.txt
        out = strat.run(backend, selector, plan, mode=used_mode, seed=seed_s, progress=prog.log)
        prog.end_phase()
        final_model, reference_model = _heads_in_classifier(clf, out, strat, f)
    else:
        # curves of the final run: accuracy on the PUBLIC validation split only (free); never the reported split
        backend = _journaled(ModelBackend(clf, train, used_mode, optimizer=req.optimizer.name or DEFAULT_OPTIMIZER,
                                          clipping=req.clipping.clipping or DEFAULT_CLIPPING,
                                          max_physical_batch_size=req.schedule.max_physical_batch_size,
                                          curve_data=public_set, device=req.device, units=inputs.unit_option), kw)
        selector = make_selector(sel_eff, "model")
        prog.start_phase(f"{strat.name} ({used_mode})", None, unit="runs")
        if used_mode not in strat.modes:  # refused in tune() before anything is reserved; kept as a guard
            raise InvalidParameterError(f"strategy={strat.name!r} is not available for mode={used_mode!r}.")
        out = strat.run(backend, selector, plan, mode=used_mode, seed=seed_s, progress=prog.log)
        prog.end_phase()
        final_model, reference_model = out.state, None
    ran = _ran(out, final_model, used_mode, pilot_records, selector, feats, tplan, delta, accountant)
    return replace(ran, reference_model=reference_model)


def _heads_in_classifier(clf, out, strat, feats: dict) -> tuple[Any, Any]:
    """``(released model, None)`` of a last-layer run, or for the NOT PRIVATE grid oracle ``(None, its best head in
    the classifier)``: scored on the reported split, never released."""
    finetune.apply_mode(clf, "last-layer")
    if strat.not_private:
        return None, (None if out.state is None else head_into_classifier(clf, out.state, feats.get("_center"),
                                                                           feats.get("_renormalize", False)))
    if feats.get("_center_note"):
        out.strategy_data.setdefault("notes", []).append(feats["_center_note"])
    return head_into_classifier(clf, out.state, feats.get("_center"), feats.get("_renormalize", False)), None


def _choose_centre(feats: dict, clf, data_kind: str | None, tplan: _TunePlan, inputs: _Inputs, seed: int) -> None:
    """Set the cached features' centre (``_center``: the public split's mean, free, or the charged private mean),
    whether the head reads them re-normalised after centring (``_renormalize``), and the note that says so."""
    if "public" in feats:
        feats["_center"] = feats["public"][0].mean(dim=0)
        feats["_center_note"] = "features centred by the mean of the PUBLIC validation split (free)"
    elif tplan.center_sigma:
        feats["_center"], feats["_center_note"] = _private_centre(feats["train"][0], tplan.center_sigma, inputs, seed)
    feats["_renormalize"] = "_center" in feats and renormalizes_centred_features(clf, data_kind)
    if feats["_renormalize"]:
        feats["_center_note"] += ", then re-normalised to norm 1"


def _private_centre(X: torch.Tensor, sigma: float, inputs: _Inputs, seed: int) -> tuple[torch.Tensor, str]:
    """The charged private feature mean (tplan's planned ``GaussianEvent(σ, 1)``) and its note: the noisy sum of
    the rows scaled to norm ≤ 1, over the public n (or N_u: a random split's realised size is private).  User
    level: each unit adds the mean of its rows (sensitivity 1 per unit)."""
    g = make_generator(seed, offset=4242)  # noise of the private centring
    noisy = noisy_feature_sum(X, sigma, g, weights=inputs.score_weights("centre")).value
    return noisy / inputs.n_train, f"features centred by a PRIVATE mean (Gaussian, σ = {sigma:.3g}, charged)"


def _adopt_pilots_choice(tplan: _TunePlan, mode: str, pilot_records: list, delta: float, accountant: str,
                         log) -> BudgetPlan:
    """The plan to continue with: the one of the mode the pilots chose, made before the reservation with the
    pilots' planned events (which are exactly the events the pilots ran: checked here) and covered by it; its
    notes follow the reserved plan's."""
    log(f"mode auto: chose {mode} (pilot scores: "
        + ", ".join(f"{r.hyperparameters['mode']}={r.score:.4f}" for r in pilot_records) + ")")
    actual = tplan.center_events + [e for r in pilot_records for e in r.events]
    if common.epsilon_of(actual, delta, accountant) > common.epsilon_of(tplan.pilot_events, delta,
                                                                        accountant) * (1 + 1e-9):
        raise PrivtuneError("internal error: the mode pilots cost more than planned; the reservation stays "
                            "charged and nothing is released.")
    chosen = tplan.mode_plans[mode]
    notes = (list(tplan.plan.notes) + [f"after the pilots: mode {mode}, planned before the reservation:"]
             + list(chosen.notes))
    return replace(chosen, notes=notes)


def _run_pilots(modes, clf, train, features, make_selector, source, pilot_eps, delta, seed, prog, kw):
    """One charged pilot per mode at per-run ε_pilot; best by the selection score."""
    from privtune.hpo.backends import FeatureBackend, ModelBackend
    from privtune.hpo.common import TrialRecord
    records = []
    n = public_size(train)  # the planned size under a private-validation split (its realised one is private)
    # time left for the whole tune while the pilots run: the pilots still to run, then the plan of the mode that
    # leads so far by the rule that chooses (before any score: the first candidate, which wins ties)
    plan_time = kw.pop("plan_time", None) or (lambda pilots_left, mode: None)
    plan_time(modes, modes[0])
    for i, m in enumerate(modes):
        label = f"mode-auto pilot {m}"
        prog.log(f"pilot {i + 1}/{len(modes)}: {m} at per-run ε = {pilot_eps:g}")
        if m == "last-layer":
            f = features()
            X, y = f["train"]
            be = _journaled(FeatureBackend(X, y, clf.num_labels, center=f.get("_center"),
                                           renormalize=f.get("_renormalize", False), device=kw.get("device"),
                                           public_n=n, units=kw.get("units")), kw)
            sel = make_selector(source, "features")
            sigma = common.calibrate_final(pilot_eps, delta, [], sample_rate=1.0, steps=1, sampling="full_batch",
                                           accountant=kw.get("accountant", "pld"), what="a mode pilot")
            run = be.run({}, noise_multiplier=sigma, sample_rate=1.0, steps=1, learning_rate=1.0, optimizer="sgd",
                         momentum=0.0, seed=seed, label=label)
            hp = {"mode": m, "optimizer": "sgd", "steps": 1, "batch": "full", "noise_multiplier": sigma}
        else:
            be = _journaled(ModelBackend(clf, train, m, max_physical_batch_size=kw.get("max_physical_batch_size") or 32,
                                         device=kw.get("device"), units=kw.get("units")),
                            kw)
            sel = make_selector(source, "model")
            q, T = _pilot_batch(n) / n, _PILOT_STEPS  # a short, cheap pilot on a Poisson subsample
            sigma = common.calibrate_final(pilot_eps, delta, [], sample_rate=q, steps=T, what="a mode pilot",
                                           accountant=kw.get("accountant", "pld"))
            alpha = default_backbone_lr_scale(m)
            run = be.run({}, noise_multiplier=sigma, sample_rate=q, steps=T,
                         learning_rate=_PILOT_LEARNING_RATES[m], optimizer="adam", seed=seed, label=label,
                         backbone_lr_scale=alpha)
            hp = {"mode": m, "optimizer": "adam", "learning_rate": _PILOT_LEARNING_RATES[m], "backbone_lr_scale": alpha,
                  "steps": T, "sample_rate": q, "noise_multiplier": sigma}
        score, evs = sel.score(be.logits(run.state, sel.data), label=label + " score")
        records.append(TrialRecord(index=i, phase="mode-auto pilot", hyperparameters=hp,
                                   events=list(run.events) + evs, score=score, score_source=sel.source))
        leader = common.choose_best(common.statistical_ties(records, sel), key=lambda r: 0.0, tie=lambda r: r.index)
        plan_time(modes[i + 1:], leader.hyperparameters["mode"])
    # pilots the selection split cannot tell apart (Selector.tie_margin) are ties, won by the earlier candidate
    # (_auto_candidates: the cheaper mode first, except full first from _FULL_FIRST_N examples; for images the
    # last layer before both);
    # measured at ε = 1 on 60,957 SST-2 phrases, bitfit 56.20 % and full 56.30 % on 2,000 public phrases: both at
    # chance, so the order, not the noise, decides
    best = common.choose_best(common.statistical_ties(records, sel), key=lambda r: 0.0, tie=lambda r: r.index)
    return best.hyperparameters["mode"], records


def _oracle_reference(feats, selector, eps, delta, accountant, seed, units, prog) -> dict:
    """NOT PRIVATE grid-oracle reference on the same features (never released)."""
    X, y = feats["train"]
    sel = selector
    if sel is None:
        if "select" not in feats:
            return {"label": "NOT PRIVATE", "note": "no public selection split; reference skipped"}
        Xs, ys = feats["select"]
        sel = Selector("public_validation", Xs, ys, name="oracle")
    be = FeatureBackend(X, y, int(y.max().item()) + 1, units=units,
                        public_n=None if units is None else units[0].num_units)
    res = grid_oracle.run(be, sel, grid_oracle.GridOracleConfig(), eps, delta, seed=seed, accountant=accountant,
                          progress=prog.log)
    return {"kind": "grid-oracle (tuning uncharged)", "label": "NOT PRIVATE", "selection_score": res.score,
            "hyperparameters": res.hyperparameters}


# --------------------------------------------------------------------------------------
# ledger, progress, files
# --------------------------------------------------------------------------------------


class _null_reservation:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def commit(self, *a, **k):  # pragma: no cover
        return None


def _dataset_identity(train) -> tuple[str, str | None]:
    """(content SHA-256, local file name) of the whole training set, exactly as ``privtune train`` identifies it.

    The file's content is fingerprinted (in-memory data: its canonical rows); the digest stays in
    this process and the private state file, the ledger keys it.  The file name is recorded with a
    registration, in the ledger only; the run directory publishes the dataset's random id."""
    return dataset_identity(train)


def _cover_candidates(led, fp, plans: dict, eps_total, delta, accountant) -> list:
    """The events to reserve; each candidate plan in ``plans`` is replaced by a copy armed so that what runs
    stays inside the reservation (:meth:`BudgetPlan.covered_by`; the plans themselves are immutable).

    The ledger refuses a commit that costs more than its reservation (measured at the dataset's δ
    with the dataset's accountant).  With ``--mode auto`` the mode, hence the plan, is chosen after
    the reservation, so the plan reserved is the most expensive candidate *by the ledger's own
    measure*; every plan's in-run calibrations then target at most that (``epsilon_cap``) and are
    checked against it (``covered``).
    """
    st = led.status(fp)

    def ledger_eps(events) -> float:
        return float(composed_epsilon((), st.delta, st.accountant, new=list(events)))

    scored = [(ledger_eps(p.events), p.planned_epsilon(), m) for m, p in plans.items()]
    reserved_ledger, _, worst = max(scored)
    reserved = list(plans[worst].events)
    del eps_total, delta, accountant  # the ledger's own δ and accountant measure the cover
    for m, p in plans.items():
        plans[m] = p.covered_by(common.epsilon_of(reserved, p.delta, p.accountant),
                                lambda evs, _cap=reserved_ledger: ledger_eps(evs) <= _cap)
    return reserved


def _progress(quiet, run_dir, eps):
    return Progress(quiet=quiet, log_path=(run_dir / "log.txt") if run_dir else None, total_epsilon=eps)


def _final_curves(h: dict) -> dict:
    h = dict(h or {})
    out = {"step": h.get("step", []), "lr": h.get("lr", []), "eval": h.get("eval", [])}
    if h.get("train_loss"):
        out["train_loss"] = h["train_loss"]
        out["train_loss_step"] = h.get("train_loss_step")
        out["train_loss_label"] = h.get("train_loss_label", "NOT PRIVATE (unlabelled loss)")  # never assumed private
    for k in ("R_l", "accepted", "acceptance_rate"):
        if k in h:
            out[k] = h[k]
    return as_plain(out)


class _CommittedEntry:
    """Stands for the ledger entry of a resumed run that was committed before its files were written."""

    state = "committed"
    resumed = True

    def __init__(self, entry_id: str):
        self.entry_id = entry_id
