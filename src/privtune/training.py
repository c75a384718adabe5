"""Private training: the pure loop :func:`fit` and the full run :func:`train`.

* :func:`fit` trains a model (or, on a :class:`~privtune.finetune.FeatureSet`, its head) with DP-SGD /
  DP-Adam / DP-LAMB for a fixed (σ, q, T): Poisson sampling by default, one
  :class:`privtune.engine.PrivateGradient` step per logical batch (per-example clipping, noise
  N(0, σ²C²) once per logical batch, division by the expected batch size q·N), gradient accumulation
  over physical micro-batches.  No ledger, no files: it returns a :class:`FitResult` with the privacy
  events of what it did.  Hyperparameter tuning (:mod:`privtune.hpo`) calls it for every trial.
* :func:`train` is a complete run (a :class:`TrainJob` run by :func:`privtune.run.pipeline.execute`): validate every argument, load and check the data and the model,
  calibrate σ from (ε, δ) when asked, **reserve the planned events in the ledger before any
  computation on the data**, fit with progress and checkpoints (exact resume), evaluate, release
  ``RUN_DIR`` (model, certificate, metrics, history, config, log: staged, then moved into place)
  and only then commit the actual events (:mod:`privtune._release`).

**One loop.** Every DP training run of privtune goes through :class:`_Loop` (via :func:`fit`): ``train``,
every ``tune`` trial and final run (heads on cached features, BiTFiT, LoRA, full) and hyperfree's
learning-rate probe, which is a :class:`LoopHook` on this loop, not a loop of its own.

**Train/eval-mode policy (stated once, here).** During DP training the model runs in eval mode
(dropout off, as in the fine-tuning recipe of Mehta et al. (large-scale transfer)), in every mode and every
strategy; the extra forward passes of a hook (hyperfree's loss probes) run in the same mode with the engine paused.
This also makes resumed runs bit-for-bit identical to uninterrupted ones with a fixed seed (on the CPU; CUDA
sums some gradients in no fixed order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from privtune import _release
from privtune._validation import (
    check_batchnorm,
    check_choice,
    check_image_features,
    check_image_size,
    check_int,
    check_real,
)
from privtune.accounting.certificate import neighbouring_relation
from privtune.accounting.events import DPSGDEvent, NonPrivateEvent
from privtune.engine import distributed
from privtune.engine.sampling import check_shuffle_batching
from privtune.engine.step import DPStep, MicroBatch
from privtune.engine.units import DEFAULT_MAX_ROWS_PER_UNIT, checked_units, unit_description
from privtune.errors import (DataError, InvalidParameterError, ModelError, OneClassModelWarning, PrivtuneError,
                             UnlikelyToLearnWarning)
from privtune.finetune import usefulness
from privtune.finetune.modes import MODES
from privtune.ledger import check_ledger_argument, open_ledger
from privtune.models import resolve_device
from privtune.report.progress import BATCH_LOSS_LABEL
from privtune.run import pipeline as run_pipeline
from privtune.run import release
from privtune.run.budget import BudgetRequest
from privtune.run.inputs import check_training_split, load_split
from privtune.specs import (DEFAULT_OPTIMIZER, ClippingSpec, LoopOptions, LoraSpec, NoiseSpec, OptimizerSpec,
                            PrivacySpec, ScheduleSpec)
from privtune.tasks import TASKS, Task, TextClassification, task_for

NOT_PRIVATE_LOSS = (
    "NOT PRIVATE: mean loss of each sampled batch, computed without noise (monitoring only; "
    "do not publish)"
)
CHECKPOINT_FILE = "checkpoint.pt"
#: what train() releases into RUN_DIR (checked before the reservation: an entry of the wrong kind is an error)
#: the certificate's note of a run that registered its dataset in the ledger (the CLI says it with the command
#: that raises the total instead)
REGISTERED_NOTE = "dataset registered in the ledger by this run"


# ============================================================================================ results


@dataclass
class StepInfo:
    """What the callback of :func:`fit` receives after each optimizer step.

    ``loss`` and ``batch_size`` are computed from private data without noise (NOT PRIVATE).
    """

    step: int
    steps: int
    phase: int
    loss: float
    batch_size: int
    learning_rate: float
    seconds: float


@dataclass
class FitResult:
    """Outcome of :func:`fit`.

    Attributes
    ----------
    model : the trained model (the object passed in, trained in place).
    events : privacy events of the planned steps (``DPSGDEvent`` per phase): all ``steps``, also when the
        callback stopped training early (see :func:`fit`'s ``callback``).
    history : ``{"step": [...], "train_loss": [...], "train_loss_label": NOT PRIVATE..., "lr": [...],
        "eval": [{"step", "accuracy", "loss"}]}``.
    steps : optimizer steps taken (fewer than planned when the callback stopped early).  noise_multiplier,
        sample_rate, sampling: the DP parameters.
    seeds : ``{"sampler": int|None, "noise": int|None}`` (None: drawn from the OS, not recorded).
    eval : final evaluation on ``eval_set`` (``{"accuracy", "loss", "n", "predicted_class_counts"}``) or None.
    private : False when σ = 0 (then ``events`` is one ``NonPrivateEvent``, ε = ∞, and ``label`` says
        NOT PRIVATE).
    seconds, examples_per_second : wall time and sampled examples processed per second.
    nonfinite_examples : sampled examples whose loss or gradient norm was NaN or infinite; the DP step
        dropped their terms (clip factor 0).  **NOT PRIVATE** (a count over the private data).
    """

    model: nn.Module
    events: list
    history: dict
    steps: int
    noise_multiplier: float
    sample_rate: float
    sampling: str
    seeds: dict
    eval: dict | None = None
    seconds: float = 0.0
    examples_per_second: float = 0.0
    clipping_diagnostics: dict | None = None
    private: bool = True
    label: str = ""
    nonfinite_examples: int = 0


@dataclass
class TrainResult:
    """Outcome of :func:`train`: the model, its certificate, metrics, history and the run directory."""

    model: nn.Module
    certificate: Any
    metrics: dict
    history: dict
    output_dir: Path | None
    events: list
    #: NOT PRIVATE figures kept out of the release (``RUN_DIR/not_private/``): the noise-free batch loss,
    #: clipping diagnostics, the exact examples per second
    not_private: dict = field(default_factory=dict)

    @property
    def run_dir(self) -> Path | None:
        """The run directory, by the name :class:`privtune.TuneResult` gives it (``output_dir``)."""
        return self.output_dir


# ============================================================================================ helpers


def public_size(data: Any) -> int:
    """The number of rows of ``data`` that privtune may publish and divide by: the size declared with
    :func:`declare_public_size` (a private split of a declared file, whose realised size is itself private:
    its planned size from the public n), else ``len(data)`` (n is public by declaration)."""
    declared = getattr(data, "public_size", None)
    return int(declared) if declared is not None else len(data)


def declare_public_size(data: Any, size: int) -> Any:
    """Give ``data`` (a dataset or FeatureSet) the public size :func:`public_size` returns; returns ``data``.
    What is derived from it (the expected batch size q·size, published batch sizes) then never depends on
    how many rows ``data`` really holds."""
    data.__dict__["public_size"] = int(size)
    return data


def _is_features(data: Any) -> bool:
    return getattr(data, "kind", None) == "features"


def _is_generation(data: Any) -> bool:
    """Prompt → response pairs (:class:`privtune.data.generation.GenerationDataset`): the model is a
    :class:`privtune.models.generator.Generator` whose ``targets`` are each row's token labels."""
    return getattr(data, "kind", None) == "generation"


def _labels_tensor(data: Any) -> torch.Tensor:
    if _is_generation(data):  # a row's targets are its token labels (Generator.targets): here its row index
        if getattr(data, "responses", None) is None:
            raise DataError("The training data has no responses. Pass prompt → response pairs.")
        return torch.arange(len(data))
    if _is_features(data):
        if data.labels is None:
            raise DataError("The training features have no labels; cache features of a labelled dataset.")
        return data.labels.long()
    if getattr(data, "labels", None) is None:
        raise DataError("The training data has no labels. Pass a file with a label column.")
    return torch.tensor(data.labels, dtype=torch.long)


def micro_batch_bounds(n: int, size: int, fixed_shapes: bool = False) -> list[tuple[int, int]]:
    """``(start, stop)`` of the micro-batches of a logical batch of ``n`` rows, at most ``size`` rows each, in
    order.  Plain: full micro-batches, then the rest in one.  ``fixed_shapes``: the rest is split into pieces
    of power-of-two sizes, largest first, so every micro-batch has one of at most log2(size) + 2 sizes whatever n
    is (a Poisson batch's size changes at every step).  The rows and their order are the same either way, so the
    clipped sum is too (up to the order of float additions)."""
    bounds = [(s, s + size) for s in range(0, n - n % size, size)]
    start, rest = n - n % size, n % size
    if not rest:
        return bounds
    if not fixed_shapes:
        return bounds + [(start, n)]
    piece = 1 << (rest.bit_length() - 1)
    while rest:
        if piece <= rest:
            bounds.append((start, start + piece))
            start, rest = start + piece, rest - piece
        piece >>= 1
    return bounds


def _trained_module(model: nn.Module, data: Any) -> nn.Module:
    if _is_features(data):
        head = getattr(model, "classification_head", model)
        if not isinstance(head, nn.Linear):
            raise InvalidParameterError(
                "Training on cached features trains a linear head: pass a Classifier or an nn.Linear as `model`."
            )
        return head
    if not hasattr(model, "encode"):
        raise InvalidParameterError(
            f"`model` must be a privtune Classifier (privtune.models.load_classifier) to train on "
            f"{type(data).__name__}; got {type(model).__name__}."
        )
    return model


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _forward(model: nn.Module, module: nn.Module, data: Any, idx: torch.Tensor) -> torch.Tensor:
    if _is_features(data):
        return module(data.features[idx].to(_device_of(module)))
    return model(**model.encode(data, idx))  # a Classifier moves its inputs to its own device


@torch.no_grad()
def evaluate(model: nn.Module, data: Any, *, batch_size: int = 128, per_class: bool = False) -> dict:
    """Accuracy and mean cross-entropy of ``model`` on a labelled dataset (or FeatureSet); with ``per_class``
    also ``predicted_class_counts``, how many examples the model assigns to each class.

    On prompt → response pairs: perplexity and mean response-token loss (:class:`privtune.tasks.generation.Generation`),
    and with ``per_class`` (the final evaluation) also BLEU, chrF and ROUGE-L of greedy generations."""
    if _is_generation(data):
        from privtune.tasks.generation import Generation

        return Generation().evaluate(model, data, generate=per_class)
    labels = _labels_tensor(data)
    if _is_features(data):
        head = getattr(model, "classification_head", model)
        dev = _device_of(head)
        logits = torch.cat([head(data.features[s : s + 8192].to(dev)).cpu() for s in range(0, len(data), 8192)])
    else:
        logits = model.predict_logits(data, batch_size=batch_size)
    if logits.shape[1] <= int(labels.max()):
        raise DataError(
            f"The evaluation data has label {int(labels.max())} but the model has {logits.shape[1]} classes."
        )
    loss = F.cross_entropy(logits, labels).item()
    acc = (logits.argmax(1) == labels).float().mean().item()
    out = {"accuracy": acc, "loss": loss, "n": int(labels.numel())}
    if per_class:
        out["predicted_class_counts"] = torch.bincount(logits.argmax(1), minlength=logits.shape[1]).tolist()
    return out


def _make_optimizer(name: str, params: list, lr: float, momentum: float, weight_decay: float, eps: float = 1e-8):
    from privtune.optim import make_optimizer

    return make_optimizer(name, params, learning_rate=lr, momentum=momentum, weight_decay=weight_decay, eps=eps)


def _lr_groups(model: nn.Module, params: list, lr: float, backbone_lr_scale: float) -> list[dict]:
    """Parameter groups for the optimizer: the classification head at η, every other trainable parameter at
    α·η (the pre-trained-layer multiplier of Mehta et al. (large-scale transfer); α = 1 gives one group).
    Each group keeps its ``lr_scale`` so that a learning-rate change (a hook, a schedule) keeps the ratio."""
    head = getattr(model, "head", None)
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    if backbone_lr_scale == 1.0 or not head_ids:
        return [{"params": params, "lr": lr, "lr_scale": 1.0}]
    groups = [{"params": [p for p in params if id(p) in head_ids], "lr": lr, "lr_scale": 1.0},
              {"params": [p for p in params if id(p) not in head_ids], "lr": lr * backbone_lr_scale,
               "lr_scale": backbone_lr_scale}]
    return [g for g in groups if g["params"]]


def _make_sampler(sampling: str, n: int, q: float, seed: int | None):
    from privtune.engine import PoissonSampler, ShuffleSampler

    if sampling == "shuffle":
        return ShuffleSampler(n, max(1, round(q * n)), seed=seed)
    if sampling == "full_batch":
        return None
    return PoissonSampler(n, q, seed=seed)


class _BatchStream:
    """Endless stream of index tensors from a sampler (a new permutation per epoch for shuffling),
    with a state that restores the stream exactly (also mid-epoch).

    In a data-parallel run (``group``, :mod:`privtune.engine.distributed`) every rank's sampler has the
    same seed, so all ranks draw the same global batch of the whole data set; each rank then keeps the
    examples of it that it owns (``group.partition``), and the union of the shares is the global batch."""

    def __init__(self, sampling: str, n: int, q: float, seed: int | None, group: Any = None, units: Any = None,
                 max_rows_per_unit: int | None = None):
        self.sampling, self.n, self.group = sampling, n, group
        if units is not None:  # Poisson over privacy units, ≤ k rows each (engine/units.py; q = 1: every unit)
            from privtune.engine.units import UnitSampler

            self.sampling, self.sampler = "poisson", UnitSampler(units, q, max_rows_per_unit, seed=seed)
        else:
            self.sampler = _make_sampler(sampling, n, q, seed)
        self._it = None
        self._epoch_state = None  # sampler state before the current epoch's permutation (shuffle)
        self._consumed = 0  # batches taken from the current epoch (shuffle)

    def next(self) -> torch.Tensor:
        batch = self._next_global()
        return batch if self.group is None else self.group.partition(batch)

    def _next_global(self) -> torch.Tensor:
        if self.sampler is None:
            return torch.arange(self.n)
        if self.sampling == "poisson":
            return self.sampler.sample()
        while True:
            if self._it is None:
                self._epoch_state = self.sampler.state_dict()
                self._it = iter(self.sampler)
                self._consumed = 0
            try:
                batch = next(self._it)
                self._consumed += 1
                return batch
            except StopIteration:
                self._it = None

    def state_dict(self) -> dict | None:
        if self.sampler is None:
            return None
        if self.sampling == "shuffle":
            return {"epoch_state": self._epoch_state if self._it is not None else self.sampler.state_dict(),
                    "consumed": self._consumed if self._it is not None else 0}
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.sampler is None or state is None:
            return
        if self.sampling == "shuffle":
            self.sampler.load_state_dict(state["epoch_state"])
            self._it = None
            k = int(state["consumed"])
            if k:
                self._next_global()
                for _ in range(k - 1):
                    self._next_global()
            return
        self.sampler.load_state_dict(state)


# ============================================================================================ the loop


class LoopHook:
    """Extension point of the one DP training loop (:class:`_Loop`, run by :func:`fit`).

    A hook sees every logical batch of the run; what it computes from private data and publishes must
    be charged by its caller's plan (e.g. hyperfree's noised loss releases, accounted jointly with the
    gradient of the same Poisson batch).  All methods are optional; the default does nothing.

    * ``before_step(loop, batch)``: the privatised gradient of ``batch`` (int64 indices into the
      training set) is in ``param.grad``; the optimizer step has not happened yet.
    * ``after_step(loop, batch)``: after the optimizer step on the same ``batch``.  May change the
      trainable parameters in place and the step size (:meth:`_Loop.set_learning_rate`); may evaluate
      :meth:`_Loop.per_example_losses` on ``batch`` (engine paused, eval mode, no gradient).
    * ``on_end(loop)``: once after the last step (post-processing such as a free momentum step).
    """

    def before_step(self, loop: "_Loop", batch: torch.Tensor) -> None:
        """Called after the release of ``batch``'s noisy gradient, before the optimizer step."""

    def after_step(self, loop: "_Loop", batch: torch.Tensor) -> None:
        """Called after the optimizer step on ``batch``."""

    def on_end(self, loop: "_Loop") -> None:
        """Called once after the last step."""


@dataclass
class _Phase:
    steps: int
    learning_rate: float
    mode: str | None  # None: keep requires_grad as it is; "bitfit": switch (two-phase)
    label: str = ""


class _Loop:
    """The DP training loop with exact checkpoint/resume state (internal; see :func:`fit`)."""

    def __init__(self, model, data, plan: _LoopPlan, *, eval_set=None, callback=None, progress=None, hooks=(),
                 task: Task | None = None):
        self.model, self.data = model, data
        self.task = _task_of(data, task)
        units, max_rows_per_unit, device, seed = plan.units, plan.max_rows_per_unit, plan.device, plan.seed
        sampling, sample_rate, phases = plan.sampling, plan.q, plan.phases
        self.units, self.max_rows_per_unit = units, max_rows_per_unit  # privacy unit (None: one example)
        opt = plan.optimizer
        self.backbone_lr_scale = float(opt.backbone_lr_scale)
        self.hooks = list(hooks)
        self.gamma, self.eps = plan.clipping.gamma, opt.eps
        self.assume_poisson = bool(plan.assume_poisson)
        self.fast_head = plan.fast_head
        self.sigma, self.q, self.phases = plan.sigma, sample_rate, phases
        self.clip, self.clipping, self.optimizer_name = plan.clipping.clip, plan.clipping.clipping, opt.name
        self.per_layer = plan.clipping.per_layer
        self.momentum, self.weight_decay = opt.momentum, opt.weight_decay
        self.sampling, self.max_phys = sampling, plan.max_phys
        self.eval_set, self.eval_every, self.callback, self.progress = eval_set, plan.eval_every, callback, progress
        self.delta, self.accountant = plan.delta, plan.accountant
        self.n = len(data)
        self.labels = _labels_tensor(data)
        # texts of similar length share a micro-batch (less padding; the clipped sum is order-free)
        self.lengths = (torch.tensor([len(t) for t in data.texts]) if getattr(data, "kind", None) == "text"
                        else model.sequence_lengths(data) if _is_generation(data) else None)
        self.module = _trained_module(model, data)
        from privtune.models import resolve_device

        self.device = resolve_device(device)
        self.group = distributed.current(self.device)  # None: one process
        if self.group is not None:
            self.device = self.group.local_device(self.device)
        model.to(self.device)  # the whole model (also the frozen backbone of a head trained on features)
        self.module.to(self.device)
        # on an accelerator a model's micro-batches take their sizes from a fixed set (micro_batch_bounds): a
        # GPU selects (and may compile) kernels per input shape, and a Poisson batch's last micro-batch would
        # bring a new shape at every step; cached features train a linear head, which has no such cost
        self.fixed_shapes = self.device.type != "cpu" and not _is_features(data)
        if seed is not None:
            self.sampler_seed, self.noise_seed = int(seed), int(seed) + 1
        else:
            self.sampler_seed = self.noise_seed = None
        stream_seed = self.sampler_seed
        if self.group is not None:
            stream_seed = self._join_group(hooks, stream_seed)
        if units is not None and self.group is not None:
            raise InvalidParameterError(
                "A privacy unit needs the whole batch in one process (a unit's rows are weighted together). Run "
                "user-level training in one process (without torchrun / a torch.distributed process group).")
        self.stream = _BatchStream(sampling, self.n, sample_rate, stream_seed, group=self.group, units=units,
                                   max_rows_per_unit=max_rows_per_unit)
        # every step is torch.arange(n) (in one process: a data-parallel rank gets a share of it)
        self.sampler_is_full_batch = self.stream.sampler is None and self.group is None
        # ‖x_i‖² of cached features, once per run (the closed-form head step needs them every step)
        self.feature_sq_norms = None
        if _is_features(data):
            cached = getattr(data, "row_sq_norms", None)  # a FeatureSet caches them across trials
            self.feature_sq_norms = cached() if cached is not None else data.features.pow(2).sum(1)
        self.step = 0
        self.phase = 0
        self.steps_in_phase = [0] * len(phases)
        self.history: dict = {"step": [], "train_loss": [], "train_loss_label": NOT_PRIVATE_LOSS, "lr": [],
                              "phase": [], "eval": []}
        self.total_steps = sum(p.steps for p in phases)
        self.examples = 0
        self.nonfinite_examples = 0  # examples dropped for a NaN/inf loss or gradient norm (NOT PRIVATE)
        self.stopped_early = False  # a callback stopped the run before its planned steps
        self.seconds = 0.0
        self.diag = {"norms": [], "labels": [], "layer_norms": []} if plan.clipping_diagnostics else None
        self.pg: DPStep | None = None
        self.opt = None
        self._setup_phase(0, first=True)

    def _join_group(self, hooks, stream_seed: int | None) -> int:
        """Data-parallel start: check that every rank runs the same plan, start from rank 0's parameters and
        return rank 0's sampler seed (for a run without a seed, a secret one: never recorded, so
        ``sampler_seed`` stays None and no certificate shows it)."""
        if hooks:
            raise InvalidParameterError(
                "Loop hooks (e.g. hyperfree's learning-rate probe) see the whole batch; they do not run in a "
                f"data-parallel run. Got {len(self.hooks)} hook(s) with {self.group.world_size} processes. Run "
                "this training in one process (without torchrun / a torch.distributed process group)."
            )
        plan = {"N": self.n, "sampling": self.sampling, "sample_rate": self.q, "noise_multiplier": self.sigma,
                "clip": self.clip, "clipping": self.clipping, "steps": [p.steps for p in self.phases],
                "optimizer": self.optimizer_name}
        self.group.agree("the training plan", plan)
        self.group.broadcast_module_(self.module)
        return int(self.group.broadcast(stream_seed if stream_seed is not None else secrets.randbits(62)))

    # -- phases
    def _setup_phase(self, k: int, first: bool = False) -> None:
        from privtune.engine import PrivateGradient

        ph = self.phases[k]
        noise_state = None
        if self.pg is not None:
            noise_state = self.pg.state_dict()
            self.pg.close()
        if ph.mode is not None and not _is_features(self.data):
            from privtune.finetune import apply_mode

            apply_mode(self.model, ph.mode)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise ModelError("Nothing to train: no parameter has requires_grad=True. Call apply_mode first.")
        step_cls, extra = PrivateGradient, {"per_layer": self.per_layer}
        if self.fast_head and _is_features(self.data) and isinstance(self.module, nn.Linear) \
                and _closed_form_loss(self.task):
            from privtune.finetune.last_layer import LinearHeadGradient

            # one nn.Linear is one layer: per-layer clipping is flat clipping there
            step_cls, extra = LinearHeadGradient, {}
        self.pg = step_cls(
            self.module, max_grad_norm=self.clip, noise_multiplier=self.sigma,
            expected_batch_size=self.q * (public_size(self.data) if self.units is None else self.units.num_units),
            clipping=self.clipping, gamma=self.gamma, seed=self.noise_seed,
            process_group=self.group, **extra,
        )
        if noise_state is not None:
            self.pg.load_state_dict(noise_state)
        # a head trained on cached features is all head: one group, whatever α
        groups = _lr_groups(self.model, params, ph.learning_rate, self.backbone_lr_scale)
        self.opt = _make_optimizer(self.optimizer_name, groups, ph.learning_rate, self.momentum, self.weight_decay,
                                   self.eps)
        self.params = params
        self.phase = k

    # -- for hooks
    @property
    def learning_rate(self) -> float:
        """The optimizer's current step size η (the head's; the rest trains at α·η, ``backbone_lr_scale``)."""
        g = self.opt.param_groups[0]
        return float(g["lr"]) / float(g.get("lr_scale", 1.0))

    def set_learning_rate(self, lr: float) -> None:
        """Set the step size η (from the next optimizer step on); a group with ``lr_scale`` α gets α·η."""
        for group in self.opt.param_groups:
            group["lr"] = float(lr) * float(group.get("lr_scale", 1.0))

    def paused(self):
        """Context in which forward passes do not reach the DP step (no per-example gradients, no charge)."""
        return self.pg.paused()

    @torch.no_grad()
    def unit_weights(self, idx: torch.Tensor) -> torch.Tensor | None:
        """User level: the weights 1/m_u of the rows ``idx`` of one logical batch (what the DP step weights their
        clipped gradients by, :meth:`privtune.engine.units.UnitIndex.row_weights`), for a hook that releases a
        per-row statistic of the batch; None at example level."""
        return None if self.units is None else self.units.row_weights(idx)

    def per_example_losses(self, idx: torch.Tensor) -> torch.Tensor:
        """The task's per-example losses (float64 on the CPU, shape (len(idx),)) of the training examples
        ``idx`` at the current parameters; engine paused, model in eval mode like every training step, no
        gradient (a graph kept for every micro-batch of the batch held all their activations at once: 24 GB for
        4,096 images at 64 px).  Computed from private data WITHOUT noise: a hook must privatise anything it
        derives from them."""
        out = []
        with self.paused(), torch.no_grad():
            for s, e in micro_batch_bounds(idx.numel(), self.max_phys, self.fixed_shapes):
                out.append(self._task_losses(idx[s:e]).double().cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def _task_losses(self, chunk: torch.Tensor) -> torch.Tensor:
        """(B,) losses of the rows ``chunk``: the task's batch (on the training device) through the task's
        per-example loss (the seam of :class:`privtune.tasks.Task`)."""
        batch = self.task.batch(self.module, self.data, chunk)
        batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return self.task.per_example_loss(self.module, batch)

    # -- state
    def state_dict(self) -> dict:
        if _is_features(self.data):
            model_state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        else:
            model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {
            "format": 1,
            "step": self.step,
            "phase": self.phase,
            "steps_in_phase": list(self.steps_in_phase),
            "model": model_state,
            "optimizer": self.opt.state_dict(),
            "engine": self.pg.state_dict(),
            "sampler": self.stream.state_dict(),
            "history": self.history,
            "examples": self.examples,
            "seconds": self.seconds,
            "torch_rng": torch.get_rng_state(),
            "seeds": {"sampler": self.sampler_seed, "noise": self.noise_seed},
            "diag": self.diag,
        }

    def load_state_dict(self, st: dict) -> None:
        if int(st.get("phase", 0)) != self.phase:
            self._setup_phase(int(st["phase"]))
        target = self.module if _is_features(self.data) else self.model
        target.load_state_dict(st["model"])
        self.opt.load_state_dict(st["optimizer"])
        self.pg.load_state_dict(st["engine"])
        self.stream.load_state_dict(st["sampler"])
        self.step = int(st["step"])
        self.steps_in_phase = list(st["steps_in_phase"])
        self.history = st["history"]
        self.examples = int(st["examples"])
        self.seconds = float(st["seconds"])
        torch.set_rng_state(st["torch_rng"])
        self.diag = st.get("diag", self.diag)

    # -- events
    def events(self, planned: bool = False) -> list:
        """Privacy events of the steps taken (planned: of all steps); one NonPrivateEvent (ε = ∞) when σ = 0."""
        if self.sigma == 0:
            return [NonPrivateEvent(reason="noise_multiplier=0: gradients were clipped but no noise was added")]
        out = []
        for ph, done in zip(self.phases, self.steps_in_phase):
            t = ph.steps if planned else done
            if t > 0:
                out.append(DPSGDEvent(self.sigma, 1.0 if self.sampling == "full_batch" else self.q, t,
                                      sampling=self.sampling, assume_poisson=self.assume_poisson, label=ph.label))
        return out

    def epsilon_so_far(self) -> float | None:
        if self.delta is None or self.step == 0:
            return 0.0 if self.delta is not None else None
        from privtune.accounting import compute_epsilon

        return compute_epsilon(self.events(), self.delta, accountant=self.accountant)

    # -- one step
    def _micro_batch(self, chunk: torch.Tensor, y: torch.Tensor, start: int | None = None,
                     row_weights: torch.Tensor | None = None) -> MicroBatch:
        """The rows ``chunk`` as the DP step sees them; ``start``: the rows are ``start, start + 1, …`` (a full
        batch), so cached features are read as a view (no gather copy: head trials are many and short)."""
        def features() -> tuple[torch.Tensor, torch.Tensor]:
            rows = slice(start, start + chunk.numel()) if start is not None else chunk
            return self.data.features[rows].to(self.device), self.feature_sq_norms[rows].to(self.device)

        return MicroBatch(losses=lambda: self._task_losses(chunk), labels=y,
                          features=features if _is_features(self.data) else None, row_weights=row_weights)

    def _one_step(self) -> StepInfo:
        t0 = time.perf_counter()
        idx = self.stream.next()
        # a unit sample of every row (q = 1, every unit within the cap: sorted, so torch.arange(n)) of features or
        # images is read like an example-level full batch, as views of the data
        full = self.sampler_is_full_batch or (self.units is not None and self.group is None and self.lengths is None
                                              and idx.numel() == self.n)
        if self.lengths is not None and idx.numel() > self.max_phys:
            idx = idx[torch.argsort(self.lengths[idx], stable=True)]
            full = False  # reordered by length: row s of the batch is idx[s], no longer row s of the data
        # user level: weight 1/m_u per row, so each sampled unit adds the mean of its clipped gradients
        weights = self.units.row_weights(idx) if self.units is not None else None
        loss_sum, count, batch_losses = 0.0, 0, []
        for s, e in micro_batch_bounds(idx.numel(), self.max_phys, self.fixed_shapes):
            chunk = idx[s:e]
            y = (None if _is_generation(self.data)  # no classes: the task's batch holds the token labels
                 else (self.labels[s:e] if full else self.labels[chunk]).to(self.device))
            w = None if weights is None else weights[s:e]
            losses, norms = self.pg.accumulate_batch(self._micro_batch(chunk, y, s if full else None, w))
            # NOT PRIVATE monitoring: a NaN/inf loss (its term was dropped by the DP step) is not summed
            loss_sum += float(losses.detach().nan_to_num(0.0, 0.0, 0.0).sum())
            if self.hooks:  # a hook may need the losses at these parameters (hyperfree's L0): no second forward
                batch_losses.append(losses.detach().double().cpu())
            count += chunk.numel()
            if self.diag is not None:
                self.diag["norms"].append(norms.detach().double().cpu())
                self.diag["labels"].append(self.labels[chunk].clone())
                layer = self.pg.last_layer_norms if self.per_layer else None
                if layer is not None and chunk.numel():
                    self.diag.setdefault("layer_norms", []).append(layer.detach().double().cpu())
        released = self.pg.release()
        self.nonfinite_examples += int(getattr(released, "nonfinite_examples", 0))
        if self.group is not None:  # the whole batch's loss and size (NOT PRIVATE monitoring, as in one process)
            totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
            self.group.all_reduce_sum_([totals])
            loss_sum, count = float(totals[0]), int(totals[1])
        #: per-example losses of ``idx`` (in its order) at the parameters before this step, for hooks
        self.last_batch_losses = torch.cat(batch_losses) if batch_losses else None
        for hook in self.hooks:
            hook.before_step(self, idx)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for hook in self.hooks:
            hook.after_step(self, idx)
        self.step += 1
        self.steps_in_phase[self.phase] += 1
        self.examples += count
        dt = time.perf_counter() - t0
        self.seconds += dt
        loss = loss_sum / count if count else float("nan")
        self.history["step"].append(self.step)
        self.history["train_loss"].append(loss)
        lr = self.learning_rate  # a hook may have moved it (hyperfree)
        self.history["lr"].append(lr)
        self.history["phase"].append(self.phase)
        return StepInfo(self.step, self.total_steps, self.phase, loss, count, lr, dt)

    def run(self, checkpoint: Callable[["_Loop"], None] | None = None, checkpoint_every: int | None = None) -> None:
        self.model.eval()
        prog = self.progress
        eps_every = max(1, self.total_steps // 20)
        while self.step < self.total_steps:
            if self.steps_in_phase[self.phase] >= self.phases[self.phase].steps:
                self._setup_phase(self.phase + 1)
                continue
            info = self._one_step()
            if self.eval_set is not None and self.eval_every and self.step % self.eval_every == 0 \
                    and self.step < self.total_steps:
                self.history["eval"].append({"step": self.step, **evaluate(self.model, self.eval_set)})
            if prog is not None:
                eps = self.epsilon_so_far() if (self.step % eps_every == 0 or self.step == self.total_steps) else None
                prog.advance(1, examples=info.batch_size, loss=info.loss, epsilon=eps)
            stop = self.callback(info) if self.callback is not None else None
            if checkpoint is not None and checkpoint_every and self.step % checkpoint_every == 0 \
                    and self.step < self.total_steps:
                checkpoint(self)
            if stop is True:
                self.stopped_early = True  # charged for the plan all the same (fit's ``callback``)
                break
        for hook in self.hooks:
            hook.on_end(self)
        if self.pg is not None:
            self.pg.close()

    def clipping_diagnostics(self) -> dict | None:
        """Clipping diagnostics after Rehn et al. (optimal clipping and batch size) from the norms seen during
        training (+ MSE-optimal C on a sample). NOT PRIVATE."""
        if self.diag is None or not self.diag["norms"]:
            return None
        from privtune.engine import clipping_diagnostics, optimal_clip_mse

        norms = torch.cat(self.diag["norms"]).double()
        labels = torch.cat(self.diag["labels"])
        gamma = float(self.pg.gamma)
        layer_norms = None
        if self.per_layer and self.diag.get("layer_norms"):
            layer_norms = torch.cat(self.diag["layer_norms"])
        if _is_generation(self.data):  # rows of a generation task have no classes
            labels = None
        out = clipping_diagnostics(norms, self.clip, labels=labels,
                                   num_classes=None if labels is None else int(self.labels.max()) + 1,
                                   clipping=self.clipping, gamma=gamma, layer_norms=layer_norms)
        out["note"] = ("per-example gradient norms of private training examples seen during training, without "
                       "noise (the clipping diagnostics of Rehn et al.); never use them to choose what is released")
        out["scope"] = ("all sampled examples of all steps" if self.group is None else
                        f"the examples of rank {self.group.rank} of {self.group.world_size} data-parallel processes "
                        "(its share of every step's batch; per-example norms never leave their process)")
        flat_whole = self.clipping == "flat" and (
            not self.per_layer or (layer_norms is not None and layer_norms.shape[1] == 1))
        if not flat_whole:
            K = layer_norms.shape[1] if layer_norms is not None else "K"
            used = "automatic clipping (AUTO-S)" if self.clipping != "flat" else (
                f"per-layer clipping (threshold C/sqrt(K) for each of K = {K} layers)")
            out["mse_optimal_clip"] = {
                "C": None, "label": "NOT PRIVATE",
                "note": ("not computed: the MSE-optimal C of Rehn et al. (Thm 5.2) is defined for flat clipping of the "
                         f"whole per-example gradient, and this run used {used}"),
            }
            return out
        # MSE-optimal clipping norm for the final parameters on a small sample (exact solver, Thm 5.2)
        params = [p for p in self.module.parameters() if p.requires_grad]
        n_params = sum(p.numel() for p in params)
        pool = torch.arange(self.n) if self.group is None else self.group.owned(self.n)  # rows this process has
        sample = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(0))[: (512 if _is_features(
            self.data) else 32)]]
        if n_params * sample.numel() <= 5e7:
            with torch.enable_grad():
                G = self.pg.example_gradients(self._micro_batch(sample, self.labels[sample].to(self.device)))
            opt = optimal_clip_mse(G, self.sigma)
            out["mse_optimal_clip"] = {"C": opt["C"], "sample_size": int(sample.numel()),
                                       "noise_multiplier": self.sigma, "label": "NOT PRIVATE"}
        else:
            out["mse_optimal_clip"] = {"C": None, "label": "NOT PRIVATE",
                                       "note": f"not computed: {n_params} trainable parameters is too many "
                                               "for per-example gradient vectors"}
        return out


def _task_of(data: Any, task: Task | None) -> Task:
    """``task``, or the task of ``data``'s input kind (cached features: the classification head's)."""
    if task is not None:
        return task
    return TASKS["text"] if _is_features(data) else task_for(data)


def _closed_form_loss(task: Task) -> bool:
    """Whether ``task``'s per-example loss is the classification cross-entropy that the closed-form head step
    (:class:`privtune.finetune.LinearHeadGradient`) computes itself; any other loss goes through the hooks."""
    return getattr(type(task), "per_example_loss", None) is TextClassification.per_example_loss


def _phases_for(mode: str | None, steps: int, learning_rate: float, phase1_steps: int | None,
                phase1_learning_rate: float | None) -> list[_Phase]:
    if mode == "two-phase":
        if phase1_steps is None:
            raise InvalidParameterError(
                "`phase1_steps` must be given for mode='two-phase' (the number of DP full fine-tuning steps "
                "before DP-BiTFiT). Got None. Pass e.g. phase1_steps=steps // 3."
            )
        phase1_steps = check_int(phase1_steps, "phase1_steps", low=1, high=steps - 1,
                                 fix="Phase 1 (DP full) must leave at least one DP-BiTFiT step.")
        lr1 = phase1_learning_rate if phase1_learning_rate is not None else learning_rate / 10.0
        lr1 = check_real(lr1, "phase1_learning_rate", low=0.0)
        return [_Phase(phase1_steps, lr1, "full", "two-phase 1/2: full"),
                _Phase(steps - phase1_steps, learning_rate, "bitfit", "two-phase 2/2: bitfit")]
    return [_Phase(steps, learning_rate, None, mode or "")]


def fit(model: nn.Module, train_set: Any, *, noise: NoiseSpec, optimizer: OptimizerSpec,
        clipping: ClippingSpec = ClippingSpec(), options: LoopOptions = LoopOptions(), eval_set: Any = None,
        callback: Callable[[StepInfo], bool | None] | None = None, progress: Any = None,
        hooks: Sequence[LoopHook] = (), device: Any = None, task: Task | None = None) -> FitResult:
    """Train ``model`` privately for ``noise.steps`` DP steps and return a :class:`FitResult`; no ledger, no files.

    >>> fit(model, train_set, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.01, steps=500),
    ...     optimizer=OptimizerSpec("adam", learning_rate=1e-3), clipping=ClippingSpec(clip=1.0))

    Parameters
    ----------
    model : Classifier (or nn.Linear for features)
        Trainable parameters are those with ``requires_grad=True`` (set them with
        :func:`privtune.finetune.apply_mode`).  Trained in place.
    train_set : TextDataset, ImageDataset or FeatureSet
        Labelled training data.  With a :class:`~privtune.finetune.FeatureSet` only the
        classification head is trained (on the cached features), at the same DP semantics.
    noise : privtune.specs.NoiseSpec
        The mechanism: σ ≥ 0 (noise std / C; σ = 0 is NOT PRIVATE), q in (0, 1] (Poisson inclusion
        probability per step; expected batch size q·N), T steps, the sampling scheme
        (``"full_batch"`` needs q = 1; ``"shuffle"`` uses fixed batches of B = round(q·N) and refuses
        N mod B ∈ {0, 1}, see ``privtune.engine.sampling.check_shuffle_batching``; ``assume_poisson``
        accounts them AS IF Poisson sampled, an assumption every certificate states), the privacy unit
        (user-level DP with cap k; docs/privacy-unit.md), and δ / accountant of the ε-so-far display.
    optimizer : privtune.specs.OptimizerSpec
        Applied to the privatised gradient (:func:`privtune.optim.make_optimizer`): its name, the step size
        η (required; the DP-BiTFiT phase's for two-phase), momentum μ, decoupled weight decay, Adam's ε and
        ``backbone_lr_scale`` α in (0, 1] (None: 1): every trainable parameter outside the classification
        head (``model.head``) steps at α·η (Mehta et al.'s pre-trained-layer multiplier; post-processing, no
        effect on ε; ignored when training a head on cached features).
    clipping : privtune.specs.ClippingSpec, default C = 1.0, flat
        Per-example clipping norm C (L2 over all trainable parameters), the rule (Abadi min(1, C/‖g‖) or
        AUTO-S C/(‖g‖ + γ)) and ``per_layer`` (each layer's part to C/√K; the sensitivity stays C).
    options : privtune.specs.LoopOptions
        Seed (sampler: seed, noise: seed + 1), micro-batch size (results do not depend on it), two-phase
        mode, ``eval_every``, clipping diagnostics (NOT PRIVATE), the closed-form head step (``fast_head``;
        a task with another loss always uses the hooks) and non-finite cached features (``"refuse"``:
        DataError with the count before training; ``"drop"``: the DP step gives such an example clip factor
        0, counted in ``FitResult.nonfinite_examples``, NOT PRIVATE; for features computed after a budget
        was reserved, where a refusal would come too late).
    eval_set : labelled data, optional; evaluated every ``options.eval_every`` steps and at the end.
    callback : callable, optional
        Called with a :class:`StepInfo` after each step; returning True stops training, still charged
        for every planned step (``FitResult.events`` cover all steps: a stopping time chosen during the
        run is not a public number of steps).  Covered are stops on released or public values;
        ``StepInfo.loss`` and ``.batch_size`` are computed without noise, and a stop that reads them is
        covered by no ε, whatever is charged.
    progress : bool or privtune.report.progress.Progress, optional
        True shows a progress bar; or pass a Progress to advance (one unit per step).  The batch loss it
        shows is computed without noise (NOT PRIVATE).
    hooks : sequence of LoopHook, optional
        Called around every optimizer step (:class:`LoopHook`); what a hook releases must be charged by
        the caller (``fit``'s events cover only the gradient releases).
    device : str or torch.device, optional
        ``None``: ``"cuda"`` when available, else ``"cpu"``; or ``"cpu"``, ``"cuda:N"``, ``"mps"``.  The
        model is moved there in place; sampling and noise generators stay on the CPU (a seed gives the
        same batches and noise on every device).
    task : privtune.tasks.Task, optional
        Its ``batch`` and ``per_example_loss`` give the (B,) losses the DP step clips; default: the task of
        ``train_set``'s kind (classification cross-entropy).
    """
    if options.nonfinite_features == "refuse":
        from privtune.finetune.last_layer import check_finite_features

        check_finite_features(train_set, "train_set")
    plan = _checked_loop_options(train_set, noise, optimizer, clipping, options, device)
    own_progress = _make_progress(True, None, None) if progress is True else None
    if own_progress is not None and plan.units is not None:  # unit level: step times grow with the private rows
        own_progress.hide_timing()
    loop = _Loop(model, train_set, plan, eval_set=eval_set, callback=callback, hooks=hooks, task=task,
                 progress=own_progress if progress is True else None if progress is False else progress)
    _run_loop(loop, own_progress)
    return _result(loop)


@dataclass(frozen=True)
class _LoopPlan:
    """The checked options of one :class:`_Loop` (:func:`_checked_loop_options`; ``train`` builds its own from
    its plan).  ``q`` is the rate the sampler really uses; ``units`` the checked privacy units (None: rows)."""

    sigma: float
    q: float
    phases: list
    sampling: str
    clipping: ClippingSpec
    optimizer: OptimizerSpec  # name, momentum, weight decay, Adam's ε and α filled in (η: the phases')
    max_phys: int
    seed: int | None = None
    eval_every: int | None = None
    assume_poisson: bool = False
    device: Any = None
    units: Any = None
    max_rows_per_unit: int | None = None
    delta: float | None = None
    accountant: str = "pld"
    clipping_diagnostics: bool = False
    fast_head: bool = True


def _checked_loop_options(train_set: Any, noise: NoiseSpec, optimizer: OptimizerSpec, clipping: ClippingSpec,
                          options: LoopOptions, device: Any) -> _LoopPlan:
    """Check :func:`fit`'s specs against the training data (the specs have checked their own fields) and return
    the :class:`_LoopPlan` of its loop.

    The sample rate q is returned as the rate the sampler really uses: ``round(q·N)/N`` for ``sampling="shuffle"``
    and ``sampling="full_batch"`` for Poisson sampling with q = 1.
    """
    if optimizer.learning_rate is None:
        raise InvalidParameterError("`learning_rate` must be given to fit (OptimizerSpec(learning_rate=...)). Got "
                                    "None. Pass a positive step size such as 1e-3.")
    optimizer = replace(optimizer, name=optimizer.name or DEFAULT_OPTIMIZER,
                        backbone_lr_scale=1.0 if optimizer.backbone_lr_scale is None else optimizer.backbone_lr_scale)
    clipping = clipping.with_defaults()
    q, sampling = noise.sample_rate, noise.sampling
    unit_index = checked_units(noise.privacy_unit, len(train_set), noise.max_rows_per_unit, sampling)
    if sampling == "full_batch" and q != 1.0:
        raise InvalidParameterError(f"`sample_rate` must be 1.0 for sampling='full_batch'. Got {q!r}.")
    if q == 1.0 and sampling == "poisson":
        sampling = "full_batch"
    assume_poisson = _check_assume_poisson(noise.assume_poisson, sampling)
    device = resolve_device(device)
    if len(train_set) == 0:
        raise DataError("The training data is empty. Pass at least one labelled example.")
    if sampling == "shuffle":
        # The sampler cuts batches of round(q·N); account the rate it really uses, so that the number of
        # epochs ⌈T·B/N⌉ is never smaller than the passes the steps actually make.
        q = max(1, round(q * len(train_set))) / len(train_set)
        if not assume_poisson:  # σ/√5 per epoch needs N mod B ∈ {0, 1}
            check_shuffle_batching(len(train_set), round(q * len(train_set)))
    max_phys = options.max_physical_batch_size
    if max_phys is None:
        max_phys = 65536 if _is_features(train_set) else 32
    phases = _phases_for(options.mode, noise.steps, optimizer.learning_rate, options.phase1_steps,
                         options.phase1_learning_rate)
    return _LoopPlan(sigma=noise.noise_multiplier, q=q, phases=phases, sampling=sampling, clipping=clipping,
                     optimizer=optimizer, max_phys=max_phys, seed=options.seed, eval_every=options.eval_every,
                     assume_poisson=assume_poisson, device=device, units=unit_index,
                     max_rows_per_unit=noise.max_rows_per_unit, delta=noise.delta, accountant=noise.accountant,
                     clipping_diagnostics=options.clipping_diagnostics, fast_head=options.fast_head)


def _run_loop(loop: _Loop, own_progress: Any) -> None:
    """Run ``loop``; inside ``own_progress`` (a progress display :func:`fit` made itself: opened and closed here,
    one unit per step) unless that is None."""
    if own_progress is None:
        loop.run()
        return
    with own_progress:
        own_progress.start_phase("DP training", total=loop.total_steps, unit="steps", loss_label=BATCH_LOSS_LABEL)
        loop.run()


def _check_assume_poisson(assume_poisson: Any, sampling: str) -> bool:
    """``assume_poisson`` checked against ``sampling`` (the rule lives in :class:`privtune.specs.ScheduleSpec`)."""
    return ScheduleSpec(sampling=sampling, assume_poisson=assume_poisson).assume_poisson


def _result(loop: _Loop) -> FitResult:
    final = None
    if loop.eval_set is not None:
        final = evaluate(loop.model, loop.eval_set, per_class=True)
        loop.history["eval"].append({"step": loop.step, **{k: v for k, v in final.items()
                                                           if k != "predicted_class_counts"}})
    return FitResult(
        # an early stop is charged for the plan: the stopping time is not a public number of steps
        model=loop.model, events=loop.events(planned=loop.stopped_early), history=loop.history, steps=loop.step,
        noise_multiplier=loop.sigma, sample_rate=loop.q, sampling=loop.sampling,
        seeds={"sampler": loop.sampler_seed, "noise": loop.noise_seed}, eval=final, seconds=loop.seconds,
        examples_per_second=loop.examples / loop.seconds if loop.seconds > 0 else 0.0,
        clipping_diagnostics=loop.clipping_diagnostics(), nonfinite_examples=loop.nonfinite_examples,
        private=loop.sigma > 0, label="" if loop.sigma > 0 else "NOT PRIVATE (noise_multiplier=0)",
    )


def fit_nonprivate(model: nn.Module, train_set: Any, *, epochs: float = 1.0, batch_size: int = 32,
                   learning_rate: float, optimizer: str = "adam", seed: int | None = 0,
                   eval_set: Any = None, device: Any = None) -> FitResult:
    """Ordinary (NOT PRIVATE) mini-batch training, the reference DP runs are compared against.

    Shuffled batches of ``batch_size``, mean loss, no clipping, no noise.  Its one event is a
    ``NonPrivateEvent`` (ε = ∞) and it must never be released as private; benchmarks label it
    "non-private".  ``device`` as in :func:`fit` (default: CUDA when available, else CPU).
    """
    from privtune.models import resolve_device
    from privtune.optim import make_optimizer

    dev = resolve_device(device)
    labels = _labels_tensor(train_set)
    module = _trained_module(model, train_set)
    model.to(dev)
    module.to(dev)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, learning_rate=learning_rate)
    g = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
    n = len(train_set)
    steps = max(1, math.ceil(epochs * n / batch_size))
    history: dict = {"step": [], "train_loss": [], "train_loss_label": "NOT PRIVATE (non-private training)",
                     "lr": [], "eval": []}
    model.eval()
    t0, seen, perm, pos = time.perf_counter(), 0, torch.randperm(n, generator=g), 0
    for step in range(1, steps + 1):
        if pos >= n:
            perm, pos = torch.randperm(n, generator=g), 0
        idx = perm[pos : pos + batch_size]
        pos += batch_size
        if _is_generation(train_set):  # a causal LM: the mean over the batch of each example's summed response loss
            task = task_for(train_set)
            batch = {k: v.to(dev) for k, v in task.batch(module, train_set, idx).items()}
            loss = task.per_example_loss(module, batch).mean()
        else:
            loss = F.cross_entropy(_forward(model, module, train_set, idx), labels[idx].to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += idx.numel()
        history["step"].append(step)
        history["train_loss"].append(float(loss.detach()))
        history["lr"].append(learning_rate)
    secs = time.perf_counter() - t0
    final = evaluate(model, eval_set) if eval_set is not None else None
    if final:
        history["eval"].append({"step": steps, **final})
    events = [NonPrivateEvent(reason="fit_nonprivate: ordinary training, no clipping and no noise")]
    return FitResult(model=model, events=events, history=history, steps=steps, noise_multiplier=0.0,
                     sample_rate=batch_size / n, sampling="shuffle", seeds={"sampler": seed, "noise": None},
                     eval=final, seconds=secs, examples_per_second=seen / secs if secs else 0.0,
                     private=False, label="NOT PRIVATE (non-private training)")


# ============================================================================================ train


def _make_progress(progress: bool, log_path: Path | None, total_epsilon: float | None):
    if not distributed.is_main_process():  # data-parallel: rank 0 shows the progress of the whole run
        return None
    try:
        from privtune.report.progress import Progress
    except ImportError:  # pragma: no cover - REPORT module absent
        return None
    return Progress(quiet=not progress, log_path=log_path, total_epsilon=total_epsilon)


def train(
    data: Any,
    *,
    eval_data: Any = None,
    model: Any = None,
    mode: str | None = None,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    learning_rate: float | None = None,
    clip: float = 1.0,
    clipping: str = "flat",
    per_layer_clipping: bool = False,
    optimizer: str = "adam",
    ledger: Any = None,
    output_dir: str | os.PathLike | None = None,
    seed: int | None = None,
    resume: bool = False,
    progress: bool = True,
    sampling: str = "poisson",
    accountant: str = "pld",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    max_physical_batch_size: int = 32,
    phase1_epochs: float | None = None,
    phase1_learning_rate: float | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    pooling: str = "auto",
    max_length: int | None = None,
    lora_rank: int | None = None,
    lora_target_modules: Sequence[str] | str | None = None,
    checkpoint_every: int | None = None,
    eval_every: int | None = None,
    clipping_diagnostics: bool = False,
    config: dict | None = None,
    lora_alpha: float | None = None,
    assume_poisson: bool = False,
    device: Any = None,
    labels: Sequence[str | int] | str | None = None,
    backbone_lr_scale: float | None = None,
    privacy_unit: Any = None,
    max_rows_per_unit: int = DEFAULT_MAX_ROWS_PER_UNIT,
    image_size: int | None = None,
    batchnorm: str | None = None,
    image_features: str | None = None,
) -> TrainResult:
    """Fine-tune a classifier privately with fixed hyperparameters: one complete, accounted run.

    Parameters
    ----------
    data : path, datasets.Dataset, TextDataset or ImageDataset
        Private training data (labelled).  A file is read once to validate, count and fingerprint it.  Prompt →
        response pairs train a generator: a file with a prompt and a response column (detected by name), or, when
        ``model`` is a causal language model, any file without a label column, its columns named by
        ``text_column`` (the prompt) and ``label_column`` (the response) (docs/generation.md).
    eval_data : optional
        Evaluation split (reported accuracy); never used for training.
    model : path or Classifier, optional
        Backbone directory (default: bundled all-MiniLM-L6-v2) or a loaded Classifier.
    mode : {"full", "bitfit", "last-layer", "lora", "two-phase"}, default "bitfit" ("lora" on prompt → response pairs)
        ``"last-layer"`` caches the frozen backbone's features once (after the reservation) and trains
        the zero-initialised head on them.  A mode that trains the backbone at n·ε ≤ 4,000 (n training rows)
        issues :class:`privtune.errors.UnlikelyToLearnWarning` before the reservation; a released model that
        puts ≥ 95 % of its predictions on ``eval_data`` into one class, :class:`privtune.errors.OneClassModelWarning`
        (both in ``metrics["warnings"]``; docs/training.md).
    epsilon, delta : target (ε, δ); σ is calibrated so the run's events compose to ε at δ.
        δ defaults to min(1e-5, a power of ten below 1/(10·N)).
    noise_multiplier : σ instead of ε (then ε is computed and reported).
    epochs, steps : run length; T = steps or ceil(epochs / q) (default 3 epochs).
    batch_size : expected (Poisson) batch size B; q = B / N (default min(N, 256)).
    learning_rate : default by mode (full 1e-2 for the head with α = 0.1 for the rest, bitfit 5e-3, lora 2e-3,
        last-layer 5e-2).
    clip, clipping, per_layer_clipping, optimizer, sampling, accountant, momentum, weight_decay : see :func:`fit`.
    ledger : Ledger, URL or None ($PRIVTUNE_LEDGER or ~/.privtune/ledger.db).  A dataset seen for the
        first time is registered with the requested total ε.
    output_dir : RUN_DIR to write (model/, certificate.json, metrics.json, history.json, config.yaml,
        log.txt, checkpoint); None writes nothing.
    seed : seeds head init, sampler and noise (recorded in the certificate); None uses OS entropy.
    resume : continue an interrupted run in ``output_dir`` from its checkpoint, bit for bit on the CPU (same
        arguments required; the ledger reservation is continued, not charged twice).  A run interrupted
        while writing its files, even after its ledger commit, is finished from its final checkpoint
        without a new charge.
    phase1_epochs : two-phase only: epochs of DP full fine-tuning before DP-BiTFiT (default 1).
    lora_rank, lora_alpha, lora_target_modules : mode="lora" only: rank r ≥ 1 (default 8), scaling α > 0
        (default 16; the update is α/r · B A) and the names of the modules that get adapters (a list, or
        one comma-separated string; default per architecture, e.g. ``query,value`` for BERT).  A target
        that matches no module of the backbone is an error listing the module names there are.
    clipping_diagnostics : NOT PRIVATE norm statistics in history.json (off by default).
    backbone_lr_scale : α in (0, 1]: the head trains at ``learning_rate``, every other trainable parameter at
        α·``learning_rate`` (see :func:`fit`); default by mode
        (:data:`privtune.finetune.modes.DEFAULT_BACKBONE_LR_SCALES`; 1, one rate, where not listed).
    assume_poisson : sampling="shuffle" only: account the shuffled batches AS IF Poisson sampled (an
        assumption, recorded in the certificate's events, notes and sampling assumptions); default False
        accounts shuffling without amplification.
    device : "cpu", "cuda", "cuda:N", "mps" or None (default: CUDA when available, else CPU).  The model
        and every batch go there; the saved model, checkpoints and certificate do not depend on it.
    labels : list or comma-separated str, optional
        The label set, PUBLIC input, in class-index order: ``["neg", "pos"]`` (class 0 is ``neg``) or
        the integer classes ``[0, 1]``.  Default: the model's own label set (a privtune model, or a
        Hugging Face config that names its classes); otherwise an error: it is never inferred from the
        private data.  A row whose label is not in the set is an error (row number, not its content);
        ``eval_data`` must use the same labels.
    privacy_unit : str, sequence or callable, optional
        User-level DP (docs/privacy-unit.md): the column of ``data`` that names the person (document,
        conversation) owning each row, or one key per row, or ``f(row_index) -> key``.  Units are Poisson
        sampled (``batch_size`` is then the expected number of *units* per step, q = B/N_u), each contributes
        the mean of the clipped gradients of at most ``max_rows_per_unit`` of its rows, δ must be below 1/N_u,
        and the certificate states (ε, δ)-DP with respect to adding or removing all rows of one unit.  The
        number of units N_u is public by declaration, like N; how many rows a unit has is not released.
    max_rows_per_unit : int, default 8
        k, the public cap on the rows of one unit used in a step.
    image_size : int, optional
        A vision backbone's input resolution in pixels, a public choice (default 64, or the size the network
        requires); only with a vision backbone name (:mod:`privtune.models.vision`).
    batchnorm : {"eval", "group"}, optional
        A vision backbone's BatchNorm policy: ``"eval"`` (default) keeps the pretrained running statistics,
        ``"group"`` replaces each BatchNorm with a GroupNorm; ``"train"`` is refused (batch statistics mix the
        examples of a batch, so per-example gradients do not exist).
    image_features : {"final", "stages"}, optional
        What a vision backbone's head reads, a public choice: its final pooled features (default) or those with
        each stage's pooled output, each L2-normalised (``"stages"``, timm backbones; better for images unlike
        ImageNet's, see :mod:`privtune.models.vision`).

    Returns
    -------
    TrainResult
    """
    # ---------------------------------------------------------------- validate (no data yet); then the pipeline
    from privtune.data.generation import is_generation_data

    generation = is_generation_data(data, model)  # prompt → response pairs: a causal LM (LoRA by default)
    if generation:
        from privtune.models.generator import DEFAULT_GENERATION_MODE, GENERATION_LEARNING_RATES, GENERATION_MODES

        mode = check_choice(DEFAULT_GENERATION_MODE if mode is None else mode, "mode", GENERATION_MODES)
        if learning_rate is None:
            learning_rate = GENERATION_LEARNING_RATES[mode]
        if backbone_lr_scale is None:
            backbone_lr_scale = 1.0  # a causal LM has no new head: one rate
    mode = check_choice("bitfit" if mode is None else mode, "mode", MODES)
    request = _TrainRequest(
        data=data, eval_data=eval_data, model=model, mode=mode, labels=labels, text_column=text_column,
        label_column=label_column, pooling=pooling, max_length=max_length,
        image_size=None if image_size is None else check_image_size(image_size),
        batchnorm=None if batchnorm is None else check_batchnorm(batchnorm),
        image_features=None if image_features is None else check_image_features(image_features),
        privacy=PrivacySpec(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier, accountant=accountant),
        schedule=ScheduleSpec(epochs=epochs, steps=steps, batch_size=batch_size, sampling=sampling,
                              assume_poisson=assume_poisson, max_physical_batch_size=max_physical_batch_size),
        optim=OptimizerSpec(name=optimizer, learning_rate=learning_rate, momentum=momentum,
                            weight_decay=weight_decay, backbone_lr_scale=backbone_lr_scale).for_mode(mode),
        clipping=ClippingSpec(clip=clip, clipping=clipping, per_layer=per_layer_clipping).with_defaults(),
        lora=LoraSpec.for_mode(mode, lora_rank, lora_alpha, lora_target_modules),
        phase1_epochs=phase1_epochs, phase1_learning_rate=phase1_learning_rate,
        checkpoint_every=None if checkpoint_every is None else check_int(checkpoint_every, "checkpoint_every", low=1),
        eval_every=None if eval_every is None else check_int(eval_every, "eval_every", low=1),
        seed=None if seed is None else check_int(seed, "seed", low=0, high=2**62),
        ledger=ledger, output_dir=output_dir, resume=resume, progress=progress,
        clipping_diagnostics=clipping_diagnostics, config=config, device=device,
        privacy_unit=(privacy_unit, max_rows_per_unit))
    return run_pipeline.execute(TrainJob(request))


@dataclass(frozen=True)
class _TrainRequest:
    """:func:`train`'s arguments as typed specs, built once at the front door (validated by
    :meth:`TrainJob.load` before any data is read)."""

    data: Any
    eval_data: Any
    model: Any
    mode: str
    labels: Any
    text_column: str | None
    label_column: str | None
    pooling: str
    max_length: int | None
    image_size: int | None  # a vision backbone's input resolution (None: its default)
    batchnorm: str | None  # a vision backbone's BatchNorm policy (None: "eval")
    image_features: str | None  # what a vision backbone's head reads (None: "final")
    privacy: PrivacySpec
    schedule: ScheduleSpec
    optim: OptimizerSpec
    clipping: ClippingSpec
    lora: LoraSpec | None
    phase1_epochs: float | None
    phase1_learning_rate: float | None
    checkpoint_every: int | None
    eval_every: int | None
    seed: int | None
    ledger: Any
    output_dir: Any
    resume: bool
    progress: bool
    clipping_diagnostics: bool
    config: dict | None
    device: Any  # as given (None: the default); the resolved device is TrainJob's
    privacy_unit: tuple = (None, DEFAULT_MAX_ROWS_PER_UNIT)  # (unit column / keys / callable, k); None: one example


@dataclass(frozen=True)
class _TrainInputs:
    """The loaded splits, classifier and run context (:meth:`TrainJob.load`)."""

    train_set: Any
    eval_set: Any
    clf: Any
    privacy: PrivacySpec  # δ checked (or defaulted) against the training set's size
    mode_info: Any
    fingerprint: str  # the ledger's key: never published
    file_name: str | None  # the data file's local name (ledger only)
    device: Any
    group: Any  # the data-parallel group; None: one process
    out: Path | None
    ckpt_path: Path | None
    units: Any = None  # the privacy units (privtune.engine.units.UnitIndex); None: one example


@dataclass(frozen=True)
class _TrainPlan:
    schedule: _Schedule
    hyper: dict  # the published hyperparameters (metrics, certificate, checkpoint comparison)


@dataclass(frozen=True)
class _TrainFiles:
    """RUN_DIR of a train run (:meth:`TrainJob.prepare`); on ranks other than 0 of a data-parallel run,
    only the run id and checkpoint state."""

    run_id: str
    state: Any  # the resumed checkpoint, else None
    log: Callable[[str], None]
    created: list = field(default_factory=list)  # removed if the reservation is refused
    fresh_files: list = field(default_factory=list)


@dataclass(frozen=True)
class _Trained:
    loop: Any
    events: list  # the events actually run (the certificate's)
    hyper: dict  # the published hyperparameters


class TrainJob:
    """``privtune train`` as a :class:`privtune.run.pipeline.Job`: one DP fine-tuning run with fixed
    hyperparameters (σ calibrated from (ε, δ), or given)."""

    command = "train"

    def __init__(self, request: _TrainRequest):
        self.request = request
        self._group = None  # the data-parallel group, once loaded

    # ------------------------------------------------------------------ load
    def load(self) -> _TrainInputs:
        """Validate what needs no data, then load and check the data and model (no budget spent)."""
        from privtune.finetune import apply_mode
        from privtune.ledger import dataset_identity

        r = self.request
        if r.phase1_epochs is not None and r.mode != "two-phase":
            raise InvalidParameterError(f"`phase1_epochs` only applies to mode='two-phase'. Got mode={r.mode!r}.")
        if r.optim.backbone_lr_scale != 1.0 and r.mode == "last-layer":
            raise InvalidParameterError(
                f"`backbone_lr_scale` only applies to modes that train more than the head. Got mode='last-layer' "
                f"with backbone_lr_scale={r.optim.backbone_lr_scale:g}. Drop it, or train mode 'full', 'bitfit', "
                "'lora' or 'two-phase'.")
        device = resolve_device(r.device)
        check_ledger_argument(r.ledger)
        group = distributed.current(device)  # a data-parallel run (torchrun, or a process group); None: one process
        if group is not None:
            device = group.local_device(device)
        # only rank 0 of a data-parallel run has a RUN_DIR: it alone writes it, the ledger and the certificate
        out, ckpt_path = _on_rank0(group, lambda: _check_run_dir_args(r.output_dir, r.resume),
                                   unshare=lambda _: (None, None))
        # the label set is public input (released as the head's shape and names): never read from private rows,
        # and no check depends on which classes the rows happen to contain
        train_set, eval_set, clf, privacy, units = _load_train_inputs(
            r.data, r.eval_data, r.model, r.labels, r.privacy, text_column=r.text_column,
            label_column=r.label_column, pooling=r.pooling, max_length=r.max_length, seed=r.seed,
            privacy_unit=(*r.privacy_unit, r.schedule.sampling), vision={"image_size": r.image_size, "batchnorm": r.batchnorm, "image_features": r.image_features})
        if getattr(train_set, "kind", None) == "generation":
            from privtune.models.generator import apply_generation_mode

            mode_info = apply_generation_mode(clf, r.mode, **_lora_arguments(r.lora))
        else:
            mode_info = apply_mode(clf, r.mode, **_lora_arguments(r.lora))
        _dry_run_engine(clf, r.clipping)  # unsupported modules fail here, before the ledger reservation
        clf.to(device)
        fp, file_name = dataset_identity(train_set)
        return _TrainInputs(train_set=train_set, eval_set=eval_set, clf=clf, privacy=privacy, mode_info=mode_info,
                            fingerprint=fp, file_name=file_name, device=device, group=group, out=out,
                            ckpt_path=ckpt_path, units=units)

    # ------------------------------------------------------------------ plan, prepare, reserve
    def plan(self, inputs: _TrainInputs) -> _TrainPlan:
        """q, T, σ and the planned events (every rank of a data-parallel run agrees on them)."""
        r = self.request
        units = inputs.units  # user level: N_u units stand where the N rows stood (q = B/N_u)
        sched = _plan_schedule(len(inputs.train_set) if units is None else units.num_units, r.mode, inputs.privacy,
                               r.schedule, r.optim, phase1_epochs=r.phase1_epochs,
                               phase1_learning_rate=r.phase1_learning_rate, unit=units and units.name)
        if getattr(inputs.train_set, "kind", None) == "generation":  # the warning's measurements are classifiers'
            sched = dataclasses.replace(sched, unlikely_to_learn=None)
        hyper = _hyperparameters(r.mode, sched, inputs.privacy, r.schedule, r.optim, r.clipping, inputs.mode_info,
                                 r.lora, r.seed, units and unit_description(units, r.privacy_unit[1]))
        if inputs.group is not None:  # every rank trains rank 0's plan on the same data, or none does
            inputs.group.agree("the training data and plan",
                               (inputs.fingerprint, len(inputs.train_set), hyper, sched.planned),
                               describe=lambda v: f"N = {v[1]} and hyperparameters {v[2]}")
        return _TrainPlan(schedule=sched, hyper=hyper)

    def prepare(self, inputs: _TrainInputs, plan: _TrainPlan) -> _TrainFiles:
        r, sched, out = self.request, plan.schedule, inputs.out
        run_id, state, created, fresh_files = _prepare_run_dir(out, inputs.ckpt_path, r.resume, inputs.fingerprint,
                                                               plan.hyper)
        # at the unit level the number of rows is private: the log names N_u and k, and carries no time (feature
        # caching and every step take time in proportion to the private rows)
        units, k = inputs.units, r.privacy_unit[1]
        log = release.run_log(out / "log.txt" if out is not None else None, timestamps=units is None)
        group = inputs.group
        size = (f"N={len(inputs.train_set)}" if units is None else
                f"N_u={units.num_units} units of {units.name} (at most {k} rows each per step)")
        log(f"{'resume' if r.resume else 'start'} privtune train: mode={r.mode} {size} "
            f"q={sched.sample_rate:.5g} T={sched.steps} σ={sched.noise_multiplier:.5g} "
            f"planned ε={sched.planned_epsilon:.4g} δ={inputs.privacy.delta:g}"
            + (f" on {group.world_size} processes" if group else ""))
        usefulness.warn(sched.unlikely_to_learn, UnlikelyToLearnWarning, log)  # before the reservation: nothing spent
        return _TrainFiles(run_id=run_id, state=state, log=log, created=created, fresh_files=fresh_files)

    def _total_epsilon(self, inputs: _TrainInputs, plan: _TrainPlan) -> float:
        return inputs.privacy.epsilon or plan.schedule.planned_epsilon

    def budget_request(self, inputs: _TrainInputs, plan: _TrainPlan, files: _TrainFiles) -> BudgetRequest:
        out = inputs.out
        return BudgetRequest(
            fingerprint=inputs.fingerprint, total_epsilon=self._total_epsilon(inputs, plan),
            delta=inputs.privacy.delta, accountant="pld", command="train",
            config={"hyperparameters": plan.hyper, "output_dir": str(out) if out else None},
            resume_key=files.run_id, events=plan.schedule.planned, resuming=bool(self.request.resume),
            file_name=inputs.file_name, run_dir=out,
            privacy_unit=(plan.hyper.get("privacy_unit") or {}).get("unit"))

    def open_ledger(self, inputs: _TrainInputs, files: _TrainFiles) -> tuple[Any, str | None]:
        led = open_ledger(self.request.ledger)
        return led, _mask(getattr(led, "url", None))

    def before_reserving(self, inputs: _TrainInputs, files: _TrainFiles) -> None:
        return None

    def refused(self, files: _TrainFiles) -> None:
        _release.discard_unreserved(files.created, files.fresh_files)

    def reserved(self, budget: run_pipeline.Budget, inputs: _TrainInputs, plan: _TrainPlan,
                 files: _TrainFiles) -> None:
        """Log a registration; a resumed run whose commit is already in the ledger must be at its last step."""
        state, out, steps = files.state, inputs.out, plan.schedule.steps
        if budget.registered:
            st = budget.status
            files.log(f"dataset {st.dataset_id} registered in the ledger with total ε={st.total_epsilon:.4g}, "
                      f"δ={st.delta:g}")
        if budget.reservation is None:  # resume of a run whose release was interrupted after its ledger commit
            if int(state.get("step", 0)) != steps:
                raise InvalidParameterError(
                    f"`resume`: the run in {str(out)!r} is committed in the ledger but its "
                    f"checkpoint is at step {state.get('step', 0)} of {steps}; it cannot be finished. Its budget is "
                    "spent.")
            files.log("resume: the ledger already holds this run's commit; writing its files from the final "
                      "checkpoint, without a new charge")

    # ------------------------------------------------------------------ run
    def run(self, inputs: _TrainInputs, plan: _TrainPlan, files: _TrainFiles, budget: Any) -> _Trained:
        r, out = self.request, inputs.out
        prog = _make_progress(r.progress, out / "log.txt" if out is not None else None,
                              plan.schedule.planned_epsilon)
        if prog is not None and inputs.units is not None:  # unit level: durations grow with the private rows
            prog.hide_timing()
        loop, actual = _run_training(r, inputs, plan, files, prog)
        return _Trained(loop=loop, events=actual, hyper=plan.hyper)

    # ------------------------------------------------------------------ certify
    def describe(self, inputs: _TrainInputs, plan: _TrainPlan, files: _TrainFiles, outcome: _Trained,
                 budget: Any) -> run_pipeline.Described:
        import privtune

        r, hyper, loop, seed = self.request, plan.hyper, outcome.loop, self.request.seed
        registered = ([f"{REGISTERED_NOTE} with total ε={self._total_epsilon(inputs, plan):.4g}"]
                      if budget.registered else [])
        metadata = {
            # the ledger's random dataset id, never a hash of the data (which would let anyone holding the
            # data minus one row test candidate rows)
            "command": "train", "mode": r.mode, "hyperparameters": hyper, "dataset_id": budget.dataset_id,
            "seeds": {"sampler": loop.sampler_seed, "noise": loop.noise_seed, "explicit_seed": seed,
                      "noise_seed_source": (
                          "explicit seed (experiments): the noise generator is seeded with seed + 1, the sampler "
                          "with seed" if seed is not None else
                          "OS entropy (secrets.randbits): the seeds are never stored or exposed")},
            "sampling": hyper["sampling"], "assume_poisson": hyper["assume_poisson"], "device": str(loop.device),
            "run_id": files.run_id, "privtune_version": privtune.__version__,
            "selection": "none (fixed hyperparameters)", "notes": registered + inputs.mode_info.notes,
        }
        return run_pipeline.Described(events=outcome.events, delta=inputs.privacy.delta,
                                      accountant=hyper["accountant"], metadata=metadata, seed=seed,
                                      neighbouring=neighbouring_relation((hyper.get("privacy_unit") or {}).get("unit")))

    def figures(self, inputs: _TrainInputs, plan: _TrainPlan, files: _TrainFiles, outcome: _Trained, budget: Any,
                certificate: Any) -> tuple[dict, dict]:
        loop, hyper, mode_info = outcome.loop, plan.hyper, inputs.mode_info
        result = _result(loop)
        try:
            remaining = budget.ledger.status(inputs.fingerprint).remaining_epsilon
        except (PrivtuneError, AttributeError):
            remaining = None
        metrics = {
            "accuracy": result.eval.get("accuracy") if result.eval else None,
            "eval_loss": result.eval["loss"] if result.eval else None,
            "epsilon": certificate.epsilon, "delta": inputs.privacy.delta, "mode": self.request.mode,
            "strategy": None, "hyperparameters": hyper,
            "reported_split": release.split_name(self.request.eval_data) if inputs.eval_set is not None else None,
            "selection": "none (fixed hyperparameters)", "dataset_id": budget.dataset_id,
            "ledger_url": budget.ledger_url, "ledger_remaining_epsilon": remaining,
            "ledger_registered_new_dataset": budget.registered,
            "trainable_parameters": mode_info.num_trainable, "total_parameters": mode_info.num_total,
            # wall time and steps are data-independent; the exact example count is not (Σ_t |S_t|): NOT PRIVATE
            "train_seconds": result.seconds,
            "steps_per_second": loop.step / result.seconds if result.seconds else None,
            "examples_per_second": result.examples_per_second,
            "nonfinite_examples_dropped": result.nonfinite_examples,  # NOT PRIVATE: moved to not_private/
            "steps": loop.step, "device": str(loop.device),
        }
        if getattr(inputs.train_set, "kind", None) == "generation":  # a generator: its scores on the reported split
            metrics.update(task="text-generation", **{k: (result.eval or {}).get(k)
                                                      for k in ("perplexity", "bleu", "chrf", "rouge_l", "scored_rows")})
        _check_predictions(metrics, result.eval, getattr(loop.model, "label_names", None),
                           plan.schedule.unlikely_to_learn)
        history = {"final_run": result.history, "trials": [], "strategy": {"name": "fixed"}}
        if result.clipping_diagnostics is not None:
            history["clipping_diagnostics"] = result.clipping_diagnostics
        return metrics, history

    # ------------------------------------------------------------------ write, commit
    def release_target(self, inputs: _TrainInputs, files: _TrainFiles, outcome: _Trained) -> run_pipeline.ReleaseTarget:
        r, out = self.request, inputs.out
        config = None if out is None else r.config if r.config is not None else _effective_config(
            r, inputs, outcome.hyper, out)
        return run_pipeline.ReleaseTarget(run_dir=out, model=inputs.clf, config=config, log=files.log,
                                          private_files=[inputs.ckpt_path] if out is not None else [])

    # ------------------------------------------------------------------ around the stages
    def session(self, inputs: _TrainInputs):
        self._group = inputs.group  # the stages after load run on rank 0 only where on_main says so
        return contextlib.nullcontext()

    def on_main(self, stage: str, fn: Callable[[], Any]) -> Any:
        group = self._group
        if stage == "prepare":
            return _on_rank0(group, fn, share=lambda f: (f.run_id, f.state),
                             unshare=lambda s: _TrainFiles(run_id=s[0], state=s[1], log=release.run_log(None)))
        if stage == "reserve":
            return _on_rank0(group, fn, share=lambda b: b.registered,
                             unshare=lambda registered: run_pipeline.Budget(registered=registered))
        return _on_rank0(group, fn)

    def result(self, inputs: _TrainInputs, plan: _TrainPlan, files: _TrainFiles, outcome: _Trained,
               released: run_pipeline.Released) -> TrainResult:
        cert, metrics = released.certificate, released.metrics
        if inputs.group is None or inputs.group.is_main:  # the release and its log are rank 0's
            # released: now say when the model predicts nearly one class (after a failed write the error comes alone)
            usefulness.warn(usefulness.one_class_message(metrics.get("majority_prediction")), OneClassModelWarning,
                            files.log)
            if inputs.out is not None:
                files.log(f"done: ε={cert.epsilon:.4g} δ={cert.delta:g} accuracy={metrics['accuracy']}")
        return TrainResult(model=inputs.clf, certificate=cert, metrics=metrics, history=released.history,
                           output_dir=inputs.out, events=outcome.events, not_private=released.not_private)


def _on_rank0(group, fn: Callable[[], Any], share: Callable[[Any], Any] = lambda r: r,
              unshare: Callable[[Any], Any] = lambda s: s) -> Any:
    """``fn()`` in one process; in a data-parallel run, ``fn()`` on rank 0 and ``unshare(share(result))`` on the
    other ranks, with rank 0's error raised on every rank (:meth:`ProcessGroup.on_main`)."""
    if group is None:
        return fn()
    result = group.on_main(fn, share=share)
    return result if group.is_main else unshare(result)


def _check_run_dir_args(output_dir: Any, resume: bool) -> tuple[Path | None, Path | None]:
    """RUN_DIR and its checkpoint path; refuses a resume without a checkpoint and a new run over an
    interrupted or finished one (nothing is created)."""
    out = Path(output_dir).expanduser() if output_dir is not None else None
    ckpt_path = out / "checkpoints" / CHECKPOINT_FILE if out is not None else None
    if out is not None:
        _release.check_output_path(out, release.RELEASED_FILES, release.RELEASED_DIRS)
    if resume:
        if out is None:
            raise InvalidParameterError("`resume=True` needs `output_dir` (the RUN_DIR of the interrupted run).")
        if not ckpt_path.is_file():
            raise InvalidParameterError(
                f"`resume`: no checkpoint at {str(ckpt_path)!r}. Got output_dir={str(out)!r}. Run without --resume "
                "to start a new run, or pass the RUN_DIR of an interrupted one."
            )
    elif out is not None and ckpt_path.exists():
        # checked first: an interrupted release may already have put certificate.json in place
        raise InvalidParameterError(
            f"`output_dir` {str(out)!r} holds an interrupted run. Pass resume=True (--resume) to continue it, "
            "or a new directory."
        )
    elif out is not None and out.exists() and (out / "certificate.json").exists():
        raise InvalidParameterError(
            f"`output_dir` {str(out)!r} already holds a finished run. Pass a new directory."
        )
    return out, ckpt_path


def _load_train_inputs(data, eval_data, model, labels, privacy: PrivacySpec, *, text_column, label_column, pooling,
                       max_length, seed, privacy_unit=(None, None, "poisson"), vision=None):
    """Load and check the training and evaluation splits and the classifier (no budget spent).

    ``privacy_unit`` is ``(unit, k, sampling)`` (unit None: example level); ``vision`` maps
    ``image_size``, ``batchnorm``, ``image_features`` to a vision backbone's choices (None: its defaults).  Returns ``(train_set, eval_set,
    classifier, privacy, units)``; δ defaults from the training set size, or the number of units N_u."""
    from privtune.data.datasets import check_disjoint, declared_label_set
    from privtune.data.generation import is_generation_data
    from privtune.models.classifier import check_model_label_set

    if is_generation_data(data, model):
        return _load_generation_inputs(data, eval_data, model, labels, privacy, text_column=text_column,
                                       label_column=label_column, max_length=max_length, privacy_unit=privacy_unit)
    num_labels, label_names, label_source = declared_label_set(labels, model=model)
    if data is None:
        raise InvalidParameterError("`data` is required: the private training data (a file or a dataset).")
    train_set = load_split(data, "data", text_column=text_column, label_column=label_column, num_labels=num_labels,
                           label_names=label_names)
    check_training_split(train_set)
    task = task_for(train_set)  # the training data's input kind picks the task: its splits, model, metrics
    n = len(train_set)
    eval_set = None
    if eval_data is not None:
        eval_set = task.load_split(eval_data, "eval_data", text_column=text_column, label_column=label_column,
                                   num_labels=num_labels, label_names=label_names, labelled=False)
        if getattr(eval_set, "labels", None) is None:
            raise DataError("`eval_data` has no labels; evaluation needs a label column.")
        check_disjoint(train_set, eval_set, "eval_data")  # accuracy on training rows is not held-out (nor private)
    units = None
    if privacy_unit[0] is not None:  # user level: N_u replaces n in δ < 1/N_u and the sampling rate
        from privtune.engine.units import check_unit_delta, check_units_disjoint, load_units

        units = checked_units(load_units(data, privacy_unit[0], n, dataset=train_set), n, privacy_unit[1],
                              privacy_unit[2])
        check_units_disjoint(data, eval_data, privacy_unit[0], "eval_data")  # a reported split holds no private unit
        if privacy.delta is not None:
            check_unit_delta(privacy.delta, units.num_units, units.name)
        n = units.num_units
    privacy = privacy.for_dataset(n)
    clf = task.build_model(model, num_labels=num_labels, pooling=pooling, label_names=label_names,
                           max_length=max_length, seed=seed, **(vision or {}))
    check_model_label_set(clf, num_labels, label_names, label_source)
    if getattr(clf, "kind", "text") != train_set.kind:
        raise DataError(f"The model takes {clf.kind} inputs but the training data is {train_set.kind}.")
    return train_set, eval_set, clf, privacy, units


def _load_generation_inputs(data, eval_data, model, labels, privacy: PrivacySpec, *, text_column, label_column,
                            max_length, privacy_unit):
    """:func:`_load_train_inputs` for prompt → response pairs: the splits (``text_column`` names the prompt
    column, ``label_column`` the response column), a :class:`privtune.models.generator.Generator` and no label set.
    ``data="embedded:chitchat"`` is the generation demo (its test split is reported unless ``eval_data`` is given;
    the model defaults to SmolLM2-135M)."""
    from privtune.data.generation import EMBEDDED_CHITCHAT, embedded_chitchat
    from privtune.tasks.generation import Generation, check_generation_disjoint

    if labels is not None:
        raise InvalidParameterError("`labels` applies to classification; prompt → response data has no label set. "
                                    "Drop --labels.")
    task = Generation()
    demo = isinstance(data, str) and data == EMBEDDED_CHITCHAT
    if demo:
        train_set, _, test = embedded_chitchat()
        model = "smollm2-135m" if model is None else model
    else:
        train_set = task.load_split(data, "data", text_column=text_column, label_column=label_column)
    eval_set = (task.load_split(eval_data, "eval_data", text_column=text_column, label_column=label_column)
                if eval_data is not None else test if demo else None)
    check_generation_disjoint(train_set, eval_set, "eval_data")
    n, units = len(train_set), None
    if privacy_unit[0] is not None:  # user level: N_u replaces n in δ < 1/N_u and the sampling rate
        from privtune.engine.units import check_unit_delta, check_units_disjoint, load_units

        source = train_set.source if demo else data
        units = checked_units(load_units(source, privacy_unit[0], n), n, privacy_unit[1], privacy_unit[2])
        check_units_disjoint(source, eval_data, privacy_unit[0], "eval_data")  # a reported split holds no private unit
        if privacy.delta is not None:
            check_unit_delta(privacy.delta, units.num_units, units.name)
        n = units.num_units
    privacy = privacy.for_dataset(n)
    return train_set, eval_set, task.build_model(model, max_length=max_length), privacy, units


@dataclass(frozen=True)
class _Schedule:
    """What a run will do, fixed before its reservation: expected batch size B, sample rate q,
    T steps, noise multiplier σ, the phases and the events they charge (planned ε at the run's δ)."""

    batch_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    phases: list
    phase1_steps: int | None
    planned: list
    planned_epsilon: float
    unlikely_to_learn: str | None = None  # the pre-run warning (privtune.finetune.usefulness), from n, ε and mode


def _plan_schedule(n: int, mode: str, privacy: PrivacySpec, schedule: ScheduleSpec, optim: OptimizerSpec, *,
                   phase1_epochs: float | None, phase1_learning_rate: float | None,
                   unit: str | None = None) -> _Schedule:
    """q, T, σ and the planned events for ``n`` training rows, or ``n`` units of the privacy unit ``unit`` (σ
    calibrated to ``privacy.epsilon`` at ``privacy.delta``, or ``privacy.noise_multiplier`` as given)."""
    sampling, assume_poisson, batch_size = schedule.sampling, schedule.assume_poisson, schedule.batch_size
    B = batch_size if batch_size is not None else min(n, 256)
    if B > n:
        raise InvalidParameterError(
            f"`batch_size` must be at most the dataset size N = {n}. Got {B}. Pass batch_size <= {n}."
        )
    q = 1.0 if sampling == "full_batch" else B / n
    if sampling == "shuffle" and not assume_poisson:  # before the ledger reservation: σ/√5 needs N mod B ∉ {0, 1}
        from privtune.engine.sampling import check_shuffle_batching

        check_shuffle_batching(n, B)
    if sampling == "full_batch" and batch_size is not None and batch_size != n:
        raise InvalidParameterError(f"`batch_size` must be N = {n} (or omitted) for sampling='full_batch'.")
    if schedule.steps is None:
        T = max(1, math.ceil((schedule.epochs if schedule.epochs is not None else 3.0) / q - 1e-9))
    else:
        T = schedule.steps
    phase1_steps = None
    if mode == "two-phase":
        if T < 2:
            raise InvalidParameterError(f"mode='two-phase' needs at least 2 steps. Got T = {T}.")
        phase1_steps = min(T - 1, max(1, math.ceil((phase1_epochs if phase1_epochs is not None else 1.0) / q)))
    phases = _phases_for(mode, T, optim.learning_rate, phase1_steps, phase1_learning_rate)
    from privtune.accounting import calibrate_noise_multiplier, compute_epsilon

    if privacy.epsilon is not None:
        sigma = calibrate_noise_multiplier(privacy.epsilon, privacy.delta, sample_rate=q, steps=T,
                                           accountant=privacy.accountant, sampling=sampling,
                                           assume_poisson=assume_poisson)
    else:
        sigma = privacy.noise_multiplier
    planned = [DPSGDEvent(sigma, q, ph.steps, sampling=sampling, assume_poisson=assume_poisson, label=ph.label)
               for ph in phases]
    planned_epsilon = compute_epsilon(planned, privacy.delta, accountant=privacy.accountant)
    return _Schedule(batch_size=B, sample_rate=q, steps=T, noise_multiplier=sigma, phases=phases,
                     phase1_steps=phase1_steps, planned=planned, planned_epsilon=planned_epsilon,
                     unlikely_to_learn=usefulness.unlikely_to_learn_message(
                         mode, n, privacy.epsilon or planned_epsilon, command="train", unit=unit))


def _hyperparameters(mode: str, sched: _Schedule, privacy: PrivacySpec, schedule: ScheduleSpec, optim: OptimizerSpec,
                     clipping: ClippingSpec, mode_info: Any, lora: LoraSpec | None, seed: int | None,
                     privacy_unit: dict | None = None) -> dict:
    """The run's hyperparameters as published (metrics, certificate) and compared on resume; ``privacy_unit``
    (:func:`privtune.engine.units.unit_description`: the unit's name, k and N_u, all public) at user level."""
    hyper = {
        "mode": mode, "epochs": schedule.epochs, "steps": sched.steps, "batch_size": sched.batch_size,
        "sample_rate": sched.sample_rate, "sampling": schedule.sampling, "learning_rate": optim.learning_rate,
        "clip": clipping.clip, "clipping": clipping.clipping, "per_layer_clipping": clipping.per_layer,
        "optimizer": optim.name, "noise_multiplier": sched.noise_multiplier, "momentum": optim.momentum,
        "weight_decay": optim.weight_decay, "backbone_lr_scale": optim.backbone_lr_scale,
        "phase1_steps": sched.phase1_steps,
        "phase1_learning_rate": sched.phases[0].learning_rate if sched.phase1_steps else None,
        "max_physical_batch_size": schedule.max_physical_batch_size, "accountant": privacy.accountant, "seed": seed,
        "assume_poisson": schedule.assume_poisson,
    }
    if privacy_unit is not None:
        hyper["privacy_unit"] = privacy_unit
    if lora is not None:
        hyper.update({"lora_rank": lora.rank, "lora_alpha": lora.alpha,
                      "lora_target_modules": list(mode_info.lora_target_modules or [])})
    return hyper


def _lora_arguments(lora: LoraSpec | None) -> dict:
    """:func:`privtune.finetune.apply_mode`'s LoRA keyword arguments (none for a mode without adapters)."""
    if lora is None:
        return {}
    return {"lora_rank": lora.rank, "lora_alpha": lora.alpha,
            "lora_target_modules": list(lora.target_modules) if lora.target_modules is not None else None}


def _prepare_run_dir(out: Path | None, ckpt_path: Path | None, resume: bool, fp: str, hyper: dict):
    """Create RUN_DIR (proven writable) and its private checkpoint directory before any charge; load
    the checkpoint of a resumed run (same data and hyperparameters required) or save a step-0 state.

    Returns ``(run_id, state, created, fresh_files)``: what to remove if the reservation is refused."""
    run_id = uuid.uuid4().hex
    state = None
    created: list[Path] = []
    fresh_files: list[Path] = []  # what this call writes before the reservation (removed if it is refused)
    if out is not None:
        # every output path is checked and the directory proven writable before anything is charged
        log_existed = (out / "log.txt").exists()
        created = _release.prepare_output_dir(out, release.RELEASED_FILES, release.RELEASED_DIRS)
        if not log_existed:
            fresh_files.append(out / "log.txt")
        if not (out / "checkpoints").exists():
            created.append(out / "checkpoints")
        _release.private_dir(out / "checkpoints")  # holds the noise generator's state: 0700, files 0600
        if resume:
            state = torch.load(ckpt_path, weights_only=False, map_location="cpu")  # any device resumes
            if state.get("fingerprint") != fp or state.get("hyperparameters") != hyper:
                diff = [k for k in hyper if state.get("hyperparameters", {}).get(k) != hyper[k]]
                raise InvalidParameterError(
                    "`resume`: the arguments differ from the interrupted run "
                    f"({'data' if state.get('fingerprint') != fp else ', '.join(diff)}). Resume with the same "
                    "data and hyperparameters."
                )
            run_id = state["run_id"]
        else:
            # the run id and a step-0 state exist before the reservation: a run killed at any later point
            # resumes under the same reservation instead of being charged again
            try:
                _release.private_torch_save({"format": 1, "step": 0, "run_id": run_id, "fingerprint": fp,
                                             "hyperparameters": hyper}, ckpt_path)
            except OSError as exc:
                _release.discard_unreserved(created, [ckpt_path, ckpt_path.with_name(ckpt_path.name + ".tmp")])
                raise InvalidParameterError(
                    f"`output_dir` {str(out)!r}: writing the run's first checkpoint failed ({exc.strerror or exc}). "
                    "Nothing was charged. Free space or fix its permissions, or pass another directory (--output)."
                ) from None
            fresh_files.append(ckpt_path)
    return run_id, state, created, fresh_files


def _run_training(r: _TrainRequest, inputs: _TrainInputs, plan: _TrainPlan, files: _TrainFiles, prog: Any):
    """Train under the reservation (from the checkpoint ``state`` of a resumed run), saving checkpoints
    into ``ckpt_path``; returns the loop and the events it actually ran."""
    clf, train_set, eval_set, out, ckpt_path = inputs.clf, inputs.train_set, inputs.eval_set, inputs.out, inputs.ckpt_path
    hyper, phases, state, run_id, log = plan.hyper, plan.schedule.phases, files.state, files.run_id, files.log
    fp, delta, device, eval_every = inputs.fingerprint, inputs.privacy.delta, inputs.device, r.eval_every
    clipping_diagnostics, checkpoint_every = r.clipping_diagnostics, r.checkpoint_every
    mode, T, sigma, q = hyper["mode"], hyper["steps"], hyper["noise_multiplier"], hyper["sample_rate"]
    clip, clipping, per_layer_clipping = hyper["clip"], hyper["clipping"], hyper["per_layer_clipping"]
    optimizer, momentum, weight_decay = hyper["optimizer"], hyper["momentum"], hyper["weight_decay"]
    sampling, max_phys, seed = hyper["sampling"], hyper["max_physical_batch_size"], hyper["seed"]
    accountant, assume_poisson = hyper["accountant"], hyper["assume_poisson"]
    if checkpoint_every is None:
        checkpoint_every = max(1, min(50, T // 10)) if out is not None else None

    def save_checkpoint(lp: _Loop) -> None:
        st = lp.state_dict()
        st.update({"run_id": run_id, "fingerprint": fp, "hyperparameters": hyper})
        with _release.charged_write("the run's checkpoint", ckpt_path.parent,
                                    "it continues from the last checkpoint written"):
            _release.private_torch_save(st, ckpt_path)
        log(f"checkpoint at step {lp.step}/{T}")
        if 0 < lp.step < T:
            _release.fault_point("mid-training")

    fit_data, fit_eval, phys = train_set, eval_set, max_phys
    if prog is not None:
        prog.__enter__()
    try:
        if mode == "last-layer":  # frozen backbone: compute its features once (after the reservation)
            fit_data, fit_eval = _cached_for_last_layer(clf, train_set, eval_set, prog, log,
                                                        rows_private=inputs.units is not None)
            if fit_data is not train_set:
                phys = 65536
        if not distributed.is_main_process():
            fit_eval = None  # a data-parallel run evaluates on rank 0, which writes the metrics
        loop_plan = _LoopPlan(
            sigma=sigma, q=q, phases=phases, sampling=sampling, max_phys=phys, seed=seed, eval_every=eval_every,
            clipping=ClippingSpec(clip=clip, clipping=clipping, per_layer=per_layer_clipping),
            optimizer=OptimizerSpec(name=optimizer, momentum=momentum, weight_decay=weight_decay,
                                    backbone_lr_scale=hyper.get("backbone_lr_scale", 1.0)),
            delta=delta, accountant=accountant, clipping_diagnostics=clipping_diagnostics,
            assume_poisson=assume_poisson, device=device, units=inputs.units,
            max_rows_per_unit=(hyper.get("privacy_unit") or {}).get("max_rows_per_unit"))
        loop = _Loop(clf, fit_data, loop_plan, eval_set=fit_eval)
        if state is not None and "model" in state:
            loop.load_state_dict(state)
            log(f"resumed from step {loop.step}")
        elif out is not None:
            save_checkpoint(loop)  # the full step-0 state: the resumed run draws the same noise
        if prog is not None:
            prog.start_phase(f"DP {mode}", total=T, unit="steps", loss_label=BATCH_LOSS_LABEL)
            if loop.step:
                prog.advance(loop.step)
            loop.progress = prog
        loop.run(save_checkpoint if out is not None else None, checkpoint_every)
    finally:
        if prog is not None:
            import sys as _sys

            prog.__exit__(*_sys.exc_info())
    actual = loop.events()
    if out is not None and loop.step == T and int((state or {}).get("step", 0)) != T:
        save_checkpoint(loop)  # the final state: an interrupted release is written again from it
    _release.fault_point("after-last-step")
    return loop, actual


def _check_predictions(metrics: dict, final_eval: dict | None, label_names, pre_run_warning: str | None) -> None:
    """``metrics["majority_prediction"]``: the released model's most predicted class on the evaluation split
    (public by declaration; never the training data); ``metrics["warnings"]``: the pre-run warning and, when
    that class is nearly every prediction, the post-run one."""
    check = None
    if final_eval is not None and final_eval.get("predicted_class_counts") is not None:
        check = usefulness.majority_prediction(final_eval["predicted_class_counts"], label_names,
                                               metrics.get("reported_split"))
        metrics["majority_prediction"] = check
    after = usefulness.one_class_message(check)  # issued once the release is in place (_release_and_commit)
    found = [w for w in (pre_run_warning, after) if w]
    if found:
        metrics["warnings"] = found


def _cached_for_last_layer(clf, train_set, eval_set, prog, log, rows_private: bool = False):
    """Features of the frozen backbone for last-layer training (falls back to full forward passes when the
    model's own head pools after the head, e.g. GPT-2).  In a data-parallel run each process computes the
    features of the training examples it owns only (the other rows stay zero and are never read) and only
    rank 0, which evaluates, those of the evaluation split.  ``rows_private`` (the unit level, where the number
    of training rows is private): no line counts the training rows."""
    from privtune.finetune import FeatureSet, cache_features

    def cached(ds, name):
        counted = not (rows_private and name.startswith("train"))
        if prog is not None:
            prog.start_phase(f"caching features ({name})", total=len(ds) if counted else None, unit="examples",
                             counted=counted)
        return cache_features(clf, ds, progress=(lambda k: prog.advance(k, examples=k)) if prog else None)

    group = distributed.current()
    try:
        if group is None:
            fs = cached(train_set, "train")
        else:
            own = group.owned(len(train_set))
            part = cached(train_set.subset(own.tolist()), "train, this process's share")
            features = torch.zeros(len(train_set), part.num_features, dtype=part.features.dtype)
            features[own] = part.features
            fs = FeatureSet(features, _labels_tensor(train_set), part.num_labels, part.label_names,
                            getattr(train_set, "source", None))
    except ModelError as exc:
        log(f"last-layer without feature caching: {exc}")
        return train_set, eval_set
    fe = cached(eval_set, "eval") if eval_set is not None and (group is None or group.is_main) else None
    log(f"cached backbone features of {'the' if rows_private else len(fs)} training examples (dimension "
        f"{fs.num_features})"
        + (f", {group.world_size} processes computing their own examples' features" if group else ""))
    return fs, fe


def _dry_run_engine(model: nn.Module, clipping: ClippingSpec) -> None:
    """Build (and drop) the DP step on the model: BatchNorm, tied trainable weights and other unsupported
    configurations raise here, before any budget is reserved."""
    from privtune.engine import PrivateGradient

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PrivateGradient(model, max_grad_norm=clipping.clip, noise_multiplier=1.0, expected_batch_size=1.0,
                        clipping=clipping.clipping, per_layer=clipping.per_layer, seed=0).close()


def _split_name(eval_data: Any) -> str:
    if isinstance(eval_data, (str, os.PathLike)):
        return Path(eval_data).name
    return getattr(eval_data, "source", None) or "eval_data"


def _mask(url: Any) -> Any:
    if url is None:
        return None
    try:
        from privtune.ledger import mask_url  # lazy: the ledger's database driver only when a run is released

        return mask_url(str(url))
    except Exception:  # pragma: no cover
        return str(url)


def _effective_config(r: _TrainRequest, inputs: _TrainInputs, hyper: dict, out: Path) -> dict:
    """The options of this run under the `privtune train` configuration keys (reloadable with --config)."""
    clf, mode = inputs.clf, r.mode
    cfg = {
        "data": r.data, "eval_data": r.eval_data, "text_column": r.text_column, "label_column": r.label_column,
        "labels": (list(clf.label_names) if getattr(clf, "label_names", None) is not None
                   else [str(i) for i in range(clf.num_labels)]) if hasattr(clf, "num_labels") else None,
        "model": r.model if not isinstance(r.model, nn.Module) else getattr(clf, "source", None),
        "mode": mode, "delta": inputs.privacy.delta, "accountant": hyper["accountant"],
        "steps": hyper["steps"], "batch_size": hyper["batch_size"],
        "max_physical_batch_size": hyper["max_physical_batch_size"], "learning_rate": hyper["learning_rate"],
        "clip": hyper["clip"], "clipping": hyper["clipping"], "per_layer_clipping": hyper["per_layer_clipping"],
        "optimizer": hyper["optimizer"], "backbone_lr_scale": hyper["backbone_lr_scale"],
        "sampling": hyper["sampling"], "clipping_diagnostics": bool(r.clipping_diagnostics),
        "ledger": r.ledger if isinstance(r.ledger, str) else None, "output": out, "seed": hyper["seed"],
        "quiet": not r.progress,
    }
    if inputs.privacy.epsilon is not None:
        cfg["epsilon"] = inputs.privacy.epsilon
    else:
        cfg["noise_multiplier"] = inputs.privacy.noise_multiplier
    if mode == "two-phase":
        cfg["phase1_epochs"] = r.phase1_epochs if r.phase1_epochs is not None else 1.0
    if mode == "lora":
        for key in ("lora_rank", "lora_alpha", "lora_target_modules"):
            cfg[key] = hyper.get(key)
    if hyper.get("assume_poisson"):
        cfg["assume_poisson"] = True
    unit = hyper.get("privacy_unit")
    if unit and unit.get("column"):  # a unit read from a column reloads (keys or a callable passed in Python do not)
        cfg.update(privacy_unit=unit["column"], max_rows_per_unit=unit["max_rows_per_unit"])
    if isinstance(getattr(getattr(clf, "backbone", None), "batchnorm", None), str):  # a vision backbone by name
        cfg.update(image_size=clf.processor.image_size, batchnorm=clf.backbone.batchnorm,  # what it trained with
                   image_features=clf.backbone.features)
    if r.device is not None:  # only when asked for: a config written on a GPU machine must run elsewhere
        cfg["device"] = str(r.device)
    config, _ = release.effective_config(cfg, path_keys=("data", "eval_data", "model", "output"))
    return config


__all__ = ["fit", "fit_nonprivate", "train", "evaluate", "FitResult", "TrainResult", "StepInfo"]
