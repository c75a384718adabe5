"""Where trials run: a linear head on cached features, or a model; both trained by
:func:`privtune.training.fit`, the one DP loop (on the backend's ``device``).

Every backend implements :class:`Backend`: ``n`` (private training examples as published), ``run(...)``
(one DP run returning a :class:`TrialRun` with its events; loop hooks such as hyperfree's learning-rate
probe come in through ``hooks=``) and ``predict``/``logits`` (outputs on a selection split).  Strategies
only talk to this interface, so the same linear-scaling / random-search / hyperfree code tunes a head on
features (milliseconds per trial) or a BiTFiT/LoRA model.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from privtune.accounting.events import DPSGDEvent, GaussianEvent
from privtune.errors import InvalidParameterError
from privtune.finetune import apply_mode
from privtune.finetune.last_layer import FeatureSet
from privtune.hpo import _heads
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec
from privtune.training import LoopHook, declare_public_size, evaluate, fit, public_size


@dataclass
class TrialRun:
    """One DP run: the trained state (head or model), its privacy events, and its history."""

    state: Any
    events: list
    history: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HookContext:
    """What a run's loop hooks may use, known only when the run starts (after the journal seeded it).

    Attributes:
        seed: the run's seed (None: OS entropy); a hook derives its own noise stream from it.
        expected_batch_size: q·N with the public N (the divisor of a privatised mean).
        progress: per-step progress of the run (anything with ``advance``), or None.
        evaluate: accuracy of the run's current state on the backend's PUBLIC curve split (no argument;
            free: post-processing on public data), or None when the backend has none.
        eval_every: steps between two calls of ``evaluate`` (and at the end).
    """

    seed: int | None
    expected_batch_size: float
    progress: Any = None
    evaluate: Callable[[], float] | None = None
    eval_every: int = 0


@dataclass(frozen=True)
class RunHooks:
    """Loop hooks of one run (:class:`privtune.training.LoopHook`) and what they change about the run.

    Attributes:
        make: builds the hooks from the run's :class:`HookContext`; the hooks then report the run's per-step
            progress (the loop reports none).
        events_at: the privacy events of the run's first k steps with the hooks' own releases included
            (e.g. hyperfree's joint σ_eff update steps); ``events_at(steps)`` are the run's events.
        phase: how the progress display names the run.
        loss_label: what the loss the hooks report per step is (e.g. "privatised loss").
    """

    make: Callable[[HookContext], Sequence[LoopHook]]
    events_at: Callable[[int], list]
    phase: str
    loss_label: str


@runtime_checkable
class Backend(Protocol):
    """What strategies (and the run's journal, :mod:`privtune.hpo._resume`) need of a backend."""

    #: ``"features"`` (a head on cached features) or ``"model"`` (a fine-tuned model)
    kind: str
    #: the fine-tuning mode of a model's runs (``"last-layer"`` on features)
    mode: str
    #: where independent trials run (:mod:`privtune.hpo.executors`); None: in this process
    executor: Any
    #: runs started so far (display and tests)
    runs: int

    @property
    def n(self) -> int:
        """Private training rows as published."""

    def run(self, hp: dict, *, noise_multiplier: float, sample_rate: float, steps: int, learning_rate: float,
            **options: Any) -> TrialRun:
        """One DP run from the backend's fresh initial state.  ``options``: ``optimizer``, ``momentum``,
        ``clip``, ``clipping``, ``gamma``, ``weight_decay``, ``eps_adam``, ``bias`` (a head's), ``free_step``,
        ``backbone_lr_scale`` (a model's α), ``seed``, ``label``, ``record`` (public curve points),
        ``progress`` and ``hooks`` (a :class:`RunHooks`)."""

    def predict(self, state: Any, data: Any) -> torch.Tensor:
        """Predicted labels of a run's ``state`` on ``data``."""

    def logits(self, state: Any, data: Any) -> torch.Tensor:
        """Logits of a run's ``state`` on ``data``."""


class _PublicCurve(LoopHook):
    """Accuracy of the current state on a PUBLIC split every ``every`` steps and at the end (free)."""

    def __init__(self, accuracy, every: int, steps: int):
        self.accuracy, self.every, self.steps, self.points = accuracy, int(every), int(steps), []

    def after_step(self, loop, batch) -> None:
        t = loop.step + 1  # the loop counts this step after its hooks
        if t % self.every == 0 or t == self.steps:
            with torch.no_grad(), loop.paused():
                self.points.append({"step": t, "accuracy": float(self.accuracy())})


class _FreeMomentumStep(LoopHook):
    """One extra step along the SGD momentum buffer after training (post-processing; Panda et al. (linear
    scaling), their §A.3)."""

    def on_end(self, loop) -> None:
        with torch.no_grad():
            for p in loop.params:
                buf = loop.opt.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    p.add_(buf, alpha=-loop.learning_rate)


@dataclass(frozen=True)
class HeadRunOptions:
    """The options of one :meth:`FeatureBackend.run` (a zero linear head on cached features), with their
    defaults: the optimizer (``momentum`` applies to SGD; ``free_step``: one extra step along the momentum buffer
    after training), clipping norm C and style, AUTO-S γ, weight decay, Adam's ε, whether the head has a bias,
    ``backbone_lr_scale`` (1: a head is all head), the run's ``seed`` and ``label``, ``record`` (public curve
    points), ``progress`` and ``hooks`` (a :class:`RunHooks`)."""

    optimizer: str = "sgd"
    momentum: float = 0.9
    clip: float = 1.0
    free_step: bool = False
    seed: int | None = None
    label: str = ""
    eps_adam: float = 1e-8
    record: bool = False
    clipping: str = "flat"
    bias: bool = False
    gamma: float = 0.01
    weight_decay: float = 0.0
    backbone_lr_scale: float = 1.0
    progress: Any = None
    hooks: RunHooks | None = None


@dataclass(frozen=True)
class ModelRunOptions(HeadRunOptions):
    """The options of one :meth:`ModelBackend.run` (a fresh copy of the model): :class:`HeadRunOptions`' fields
    with a model's defaults (``optimizer``/``clipping`` None: the backend's; a head's ``momentum``,
    ``free_step``, ``eps_adam`` and ``bias`` do not apply to a model)."""

    optimizer: str | None = None
    momentum: float = 0.0
    clipping: str | None = None
    bias: bool = True


class FeatureBackend:
    """Trials on cached features: zero-initialised linear heads trained by :func:`privtune.training.fit`
    (closed-form clipped head gradient, :class:`privtune.finetune.LinearHeadGradient`).

    ``X`` (N, d) float32 and ``y`` (N,) int64 are the *private* training features.  A public
    split may be given as ``curve_data=(X, y)`` to draw accuracy curves of the final run at
    no privacy cost; never pass the reported split here.  ``device``: where the heads train
    (None = CUDA when available, else CPU); the returned heads live on the CPU.  ``public_n``: the
    public number of training rows when the realised one is private (a private-validation split);
    the expected batch size and :attr:`n` use it (:func:`privtune.training.public_size`).  ``units``: user level,
    ``(UnitIndex of the rows of X, k)``: every run samples units (:mod:`privtune.engine.units`); :attr:`n` is then
    the number of units N_u (``public_n``).  ``data_kind``: what the features were computed from (hyperfree's
    η0 for a head on image features, :func:`privtune.hpo.hyperfree.default_lr0`).
    """

    kind = "features"
    mode = "last-layer"
    executor: Any = None
    #: what the features were computed from ("text", "image"; None: given as features); public
    data_kind: str | None = None

    def __init__(self, X: torch.Tensor, y: torch.Tensor, num_classes: int, *, curve_data=None,
                 center: torch.Tensor | None = None, renormalize: bool = False, device: Any = None,
                 public_n: int | None = None, units: tuple | None = None, data_kind: str | None = None):
        self.data_kind = data_kind
        self.center = None if center is None else center.float()
        self.renormalize = bool(renormalize) and self.center is not None
        self.X = self._c(X.float())
        self.y = y.long()
        self.num_classes = int(num_classes)
        self.curve_data = None if curve_data is None else (self._c(curve_data[0].float()), curve_data[1])
        self.device = device
        self.features = FeatureSet(self.X, self.y, self.num_classes)
        if public_n is not None:
            declare_public_size(self.features, public_n)
        self.units = units
        self.runs = 0

    def _zero_head(self, bias: bool) -> nn.Linear:
        lin = nn.Linear(self.X.shape[1], self.num_classes, bias=bias, dtype=self.X.dtype)
        with torch.no_grad():
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()
        return lin

    @staticmethod
    def _as_head(lin: nn.Linear) -> _heads.LinearHead:
        return _heads.LinearHead(lin.weight.detach().cpu().clone(),
                                 None if lin.bias is None else lin.bias.detach().cpu().clone())

    def _curve(self, lin: nn.Linear, steps: int, every: int) -> _PublicCurve:
        Xc, yc = self.curve_data
        return _PublicCurve(lambda: _heads.accuracy(self._as_head(lin), Xc, yc), every, steps)

    def _c(self, X: torch.Tensor) -> torch.Tensor:
        """Centre features (x − m) when a centre is set, and with ``renormalize`` scale each row back to norm 1
        (:func:`centred_features`); predictions use the same transform."""
        return centred_features(X, self.center, self.renormalize)

    @property
    def n(self) -> int:
        """Training rows as published (:func:`privtune.training.public_size`)."""
        return public_size(self.features)

    def run(self, hp: dict, *, noise_multiplier: float, sample_rate: float, steps: int, learning_rate: float,
            **options: Any) -> TrialRun:
        """One DP run of a zero head (with a bias when ``bias``); ``options`` are :class:`HeadRunOptions`'
        fields.  ``momentum`` applies to SGD only.  With ``hooks`` (e.g. hyperfree's learning-rate probe), the
        hooks get ``progress`` and the public curve split's accuracy."""
        o = HeadRunOptions(**options)
        optimizer, momentum, clip, clipping, seed, label = (o.optimizer, o.momentum, o.clip, o.clipping, o.seed,
                                                            o.label)
        if o.backbone_lr_scale != 1.0:
            raise InvalidParameterError("`backbone_lr_scale` does not apply to a head on cached features (it is all "
                                        f"head). Got {o.backbone_lr_scale!r}.")
        hooks, progress, record, free_step, bias = o.hooks, o.progress, o.record, o.free_step, o.bias
        self.runs += 1
        lin = self._zero_head(bias)
        loop_hooks: list[LoopHook] = []
        curve = None
        if hooks is not None:
            evaluate_public = None
            if self.curve_data is not None:
                Xc, yc = self.curve_data
                evaluate_public = lambda: _heads.accuracy(self._as_head(lin), Xc, yc)  # noqa: E731
            loop_hooks += hooks.make(HookContext(seed, sample_rate * self.n, progress, evaluate_public,
                                                 _eval_every(steps) if evaluate_public is not None else 0))
        elif record and self.curve_data is not None:
            curve = self._curve(lin, steps, max(1, int(steps) // 20))
            loop_hooks.append(curve)
        if free_step and optimizer == "sgd" and momentum > 0:
            loop_hooks.append(_FreeMomentumStep())
        fit(lin, self.features,
            noise=NoiseSpec(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=int(steps),
                            **_unit_options(self.units)),
            optimizer=OptimizerSpec(name=optimizer, learning_rate=learning_rate, eps=o.eps_adam,
                                    momentum=momentum if optimizer == "sgd" else 0.0, weight_decay=o.weight_decay),
            clipping=ClippingSpec(clip=clip, clipping=clipping, gamma=o.gamma),
            options=LoopOptions(seed=seed, nonfinite_features="drop"),  # features cached after the reservation
            hooks=loop_hooks, device=self.device)
        # the events of a head trial as planned by the strategies: a full batch is exactly √T/σ-GDP
        if hooks is not None:
            events = hooks.events_at(int(steps))
        elif sample_rate >= 1.0:
            events = [GaussianEvent(noise_multiplier=noise_multiplier, count=int(steps), label=label)]
        else:
            events = [DPSGDEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=int(steps),
                                 sampling="poisson", label=label)]
        history = {"step": list(range(1, int(steps) + 1)), "lr": [float(learning_rate)] * int(steps),
                   "eval": curve.points if curve is not None else []}
        return TrialRun(state=self._as_head(lin), events=events, history=history)

    def predict(self, state: _heads.LinearHead, data: torch.Tensor) -> torch.Tensor:
        return state.predict(self._c(data.float()))

    def logits(self, state: _heads.LinearHead, data: torch.Tensor) -> torch.Tensor:
        return state.logits(self._c(data.float()))


#: the kinds of data whose centred head-input features are re-normalised (:func:`centred_features`).  On
#: L2-normalised image features the rows share a large common direction (the features of a ReLU network are
#: non-negative), so centring shrinks them, unevenly, and a clipped DP step then adds less signal per example
#: against the same noise; re-normalising gives every example norm 1 again.  Measured on the Fashion-MNIST bench's
#: cached EfficientNet-Lite0 features at 128 px (58,000 private, the 2,000 public images' mean as centre,
#: full-batch DP-GD, one noise seed, best of a 3 × 3 grid of (η, T) on the public split): test accuracy 87.5 %
#: re-normalised against 86.9 % centred only at ε = 1; in the bench, charged random search 85.4 / 85.9 / 86.0 %
#: against 84.8 / 85.3 / 85.4 % at ε = 1 / 3 / 8.  Text features keep centring alone: not measured there.
RENORMALIZE_KINDS = ("image",)


def renormalizes_centred_features(model: Any, data_kind: str | None) -> bool:
    """Whether a head on ``model``'s features of ``data_kind`` reads them centred and re-normalised: for the
    kinds in :data:`RENORMALIZE_KINDS`, when the features are L2-normalised and pooled by privtune (a model that
    keeps its own head, ``pooling="model"``, has no place for the transform, and takes the centring in its bias)."""
    return (data_kind in RENORMALIZE_KINDS and bool(getattr(model, "normalize", False))
            and getattr(model, "pooling", None) != "model")


def centred_features(X: torch.Tensor, center: torch.Tensor | None, renormalize: bool) -> torch.Tensor:
    """``X − center`` (rows), each row then scaled to norm 1 when ``renormalize`` (a zero row stays zero;
    :data:`RENORMALIZE_KINDS`)."""
    if center is None:
        return X
    X = X - center.to(X.dtype)
    return torch.nn.functional.normalize(X, p=2, dim=-1) if renormalize else X


def head_into_classifier(model: Any, head: _heads.LinearHead, center: torch.Tensor | None = None,
                         renormalize: bool = False) -> Any:
    """Copy a feature-space head into the classifier's final linear layer.

    A head trained on centred features ``W (x − m) + b`` becomes ``W x + (b − W m)``, exactly.  A head trained on
    centred, re-normalised features keeps its weights, and the classifier applies the same transform to its
    pooled features (:attr:`~privtune.models.classifier.Classifier.feature_center`).
    """
    lin = model.classification_head
    b = head.bias if head.bias is not None else torch.zeros(head.weight.shape[0], dtype=head.weight.dtype)
    if hasattr(model, "feature_center"):  # the head was trained on features without the model's own centring
        model.feature_center = None
    if center is not None and renormalize:
        model.feature_center = center.detach().float().to(lin.weight.device)
    elif center is not None:
        b = b - head.weight @ center.to(head.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(head.weight.to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_(b.to(lin.bias.dtype))
        elif center is not None or head.bias is not None:  # pragma: no cover - heads here have a bias
            raise ValueError("the classifier head has no bias; cannot represent a centred/biased head")
    return model


class ModelBackend:
    """Trials that fine-tune a copy of a model with :func:`privtune.training.fit` (BiTFiT, LoRA, full).

    Every run starts from the same initial model (deep copy), so trials are independent.
    Mini-batch runs use Poisson sampling; their events come from ``fit``.
    """

    kind = "model"
    executor: Any = None

    def __init__(self, model: Any, train_set: Any, mode: str, *, optimizer: str = "adam", clipping: str = "flat",
                 max_physical_batch_size: int = 64, curve_data=None, lora_rank: int = 8,
                 zero_init_head: bool = True, device: Any = None, units: tuple | None = None):
        """``zero_init_head``: start every run from a zero classification head (as Mehta et al., large-scale
        transfer, do).  With the random head of a fresh Hugging Face classifier, AUTO-S (hyperfree) DP-BiTFiT
        of MiniLM stayed at chance on SST-2 even without noise, while from a zero head it learned
        (docs/strategies/hyperfree.md)."""
        self.base = model
        self.train_set = train_set
        self.mode = mode
        self.optimizer = optimizer
        self.clipping = clipping
        self.max_physical_batch_size = max_physical_batch_size
        self.curve_data = curve_data
        self.zero_init_head = bool(zero_init_head)
        self.device = device  # where every run trains (None = CUDA when available, else CPU)
        self.mode_info = (apply_mode(self.base, mode, lora_rank=lora_rank, zero_init_head=self.zero_init_head)
                          if mode != "lora" else None)
        self._lora_rank = lora_rank
        self.units = units  # user level: (UnitIndex of train_set's rows, k); every run samples units
        self.runs = 0

    @property
    def n(self) -> int:
        """Training rows as published (:func:`privtune.training.public_size`)."""
        return public_size(self.train_set)

    def _fresh(self):
        m = copy.deepcopy(self.base)
        if self.mode == "lora":
            apply_mode(m, "lora", lora_rank=self._lora_rank, zero_init_head=self.zero_init_head)
        return m

    def run(self, hp: dict, *, noise_multiplier: float, sample_rate: float, steps: int, learning_rate: float,
            **options: Any) -> TrialRun:
        """One DP run with :func:`privtune.training.fit` (``backbone_lr_scale``: its α) on a fresh copy of the
        model; ``options`` are :class:`ModelRunOptions`' fields.  ``progress`` (a
        :class:`privtune.report.progress.Progress` or anything with its ``advance``) receives one update per step: examples, the batch loss (computed WITHOUT noise: NOT PRIVATE) and no ε
        (the caller adds the ε spent so far).  With ``record=True`` and ``curve_data`` (a PUBLIC split)
        accuracy is evaluated at a few points for the learning curves.  With ``hooks`` (e.g. hyperfree's
        learning-rate probe) the hooks get ``progress`` and the public curve accuracy instead of the loop.
        ``momentum``, ``free_step``, ``eps_adam`` and ``bias`` are a head's options: a model's optimizer keeps
        its defaults."""
        o = ModelRunOptions(**options)
        seed, label, record, progress, hooks = o.seed, o.label, o.record, o.progress, o.hooks
        self.runs += 1
        model = self._fresh()
        loop_hooks: Sequence[LoopHook] = ()
        if hooks is not None:
            curve_set = self.curve_data
            evaluate_public = None if curve_set is None else (lambda: evaluate(model, curve_set)["accuracy"])
            loop_hooks = hooks.make(HookContext(seed, sample_rate * self.n, progress, evaluate_public,
                                                _eval_every(steps) if evaluate_public is not None else 0))
            progress, record = None, False
        curve = self.curve_data if record else None
        res = fit(model, self.train_set,
                  noise=NoiseSpec(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=int(steps),
                                  **_unit_options(self.units)),
                  optimizer=OptimizerSpec(name=o.optimizer or self.optimizer, learning_rate=learning_rate,
                                          backbone_lr_scale=o.backbone_lr_scale, weight_decay=o.weight_decay),
                  clipping=ClippingSpec(clip=o.clip, clipping=o.clipping or self.clipping, gamma=o.gamma),
                  options=LoopOptions(seed=seed, eval_every=_eval_every(steps) if curve is not None else None,
                                      max_physical_batch_size=self.max_physical_batch_size),
                  eval_set=curve, progress=progress, device=self.device, hooks=loop_hooks)
        if hooks is not None:
            events = hooks.events_at(int(steps))
        else:
            events = list(res.events)
            if label:
                events = [_relabel(e, label) for e in events]
        return TrialRun(state=res.model, events=events, history=_as_history(res.history))

    def predict(self, state: Any, data: Any) -> torch.Tensor:
        return self.logits(state, data).argmax(dim=1)

    def logits(self, state: Any, data: Any) -> torch.Tensor:
        return state.predict_logits(data)


def _unit_options(units: tuple | None) -> dict:
    """:func:`privtune.training.fit`'s privacy-unit options of a backend's ``units`` (None: example level)."""
    return {} if units is None else {"privacy_unit": units[0], "max_rows_per_unit": units[1]}


def _eval_every(steps: int, points: int = 5) -> int:
    """Evaluate the (public) curve split at about ``points`` points of a run, and at its end."""
    return max(1, int(steps) // points)


def _relabel(event, label: str):
    try:
        return dataclasses.replace(event, label=label)
    except Exception:  # pragma: no cover
        return event


def _as_history(h: Any) -> dict:
    if isinstance(h, dict):
        return h
    if hasattr(h, "to_dict"):
        return h.to_dict()
    if hasattr(h, "__dataclass_fields__"):
        return dataclasses.asdict(h)
    return {}
