"""Where trials run: a linear head on cached features, or a model trained by
:func:`privtune.training.fit`.

A backend exposes ``n`` (private training examples), ``run(...)`` (one DP run returning a
:class:`TrialRun` with its events) and ``predict(state, data)`` (labels for a selection
split).  Strategies only talk to this interface, so the same linear-scaling / random-search
code tunes a head on features (milliseconds per trial) or a BiTFiT/LoRA model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from privtune.hpo import _heads


@dataclass
class TrialRun:
    """One DP run: the trained state (head or model), its privacy events, and its history."""

    state: Any
    events: list
    history: dict = field(default_factory=dict)


class FeatureBackend:
    """Trials on cached features: zero-initialised linear heads (see :mod:`privtune.hpo._heads`).

    ``X`` (N, d) float32 and ``y`` (N,) int64 are the *private* training features.  A public
    split may be given as ``curve_data=(X, y)`` to draw accuracy curves of the final run at
    no privacy cost; never pass the reported split here.
    """

    kind = "features"

    def __init__(self, X: torch.Tensor, y: torch.Tensor, num_classes: int, *, curve_data=None,
                 center: torch.Tensor | None = None):
        self.center = None if center is None else center.float()
        self.X = self._c(X.float())
        self.y = y.long()
        self.num_classes = int(num_classes)
        self.curve_data = None if curve_data is None else (self._c(curve_data[0].float()), curve_data[1])
        self.runs = 0

    def _c(self, X: torch.Tensor) -> torch.Tensor:
        """Centre features (x − m) when a centre is set; predictions use the same transform."""
        return X if self.center is None else X - self.center

    @property
    def n(self) -> int:
        return int(self.X.shape[0])

    def run(self, hp: dict, *, noise_multiplier: float, sample_rate: float, steps: int, learning_rate: float,
            optimizer: str = "sgd", momentum: float = 0.9, clip: float = 1.0, free_step: bool = False,
            seed: int | None = None, label: str = "", eps_adam: float = 1e-8, record: bool = False,
            clipping: str = "flat", bias: bool = False) -> TrialRun:
        self.runs += 1
        eval_fn, every = None, 0
        if record and self.curve_data is not None:
            Xc, yc = self.curve_data
            eval_fn = lambda h: _heads.accuracy(h, Xc, yc)  # noqa: E731
            every = max(1, int(steps) // 20)
        fit = _heads.train_head(self.X, self.y, self.num_classes, learning_rate=learning_rate, steps=steps,
                                noise_multiplier=noise_multiplier, sample_rate=sample_rate, clip=clip,
                                clipping=clipping, optimizer=optimizer, momentum=momentum, eps_adam=eps_adam,
                                free_step=free_step, bias=bias, seed=seed, label=label, eval_fn=eval_fn,
                                eval_every=every)
        return TrialRun(state=fit.head, events=fit.events, history=fit.history)

    def run_hyperfree(self, *, steps: int, sample_rate: float, sigma_g: float, sigma_l: float, config, lr0: float,
                      seed: int | None = None, progress=None):
        """HyFreeDP on the head; with ``curve_data`` (a PUBLIC split) its accuracy is recorded at a few
        points for the learning curves (free: post-processing of the released head on public data)."""
        from privtune.hpo.hyperfree import train_head_hyperfree

        self.runs += 1
        eval_fn, every = None, 0
        if self.curve_data is not None:
            Xc, yc = self.curve_data
            eval_fn = lambda h: _heads.accuracy(h, Xc, yc)  # noqa: E731
            every = _eval_every(steps)
        return train_head_hyperfree(self.X, self.y, self.num_classes, steps=steps, sample_rate=sample_rate,
                                    sigma_g=sigma_g, sigma_l=sigma_l, config=config, lr0=lr0, seed=seed,
                                    progress=progress, eval_fn=eval_fn, eval_every=every)

    def predict(self, state: _heads.LinearHead, data: torch.Tensor) -> torch.Tensor:
        return state.predict(self._c(data.float()))

    def logits(self, state: _heads.LinearHead, data: torch.Tensor) -> torch.Tensor:
        return state.logits(self._c(data.float()))


def head_into_classifier(model: Any, head: _heads.LinearHead, center: torch.Tensor | None = None) -> Any:
    """Copy a feature-space head into the classifier's final linear layer.

    A head trained on centred features ``W (x − m) + b`` becomes ``W x + (b − W m)``, exactly.
    """
    lin = model.classification_head
    b = head.bias if head.bias is not None else torch.zeros(head.weight.shape[0], dtype=head.weight.dtype)
    if center is not None:
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

    def __init__(self, model: Any, train_set: Any, mode: str, *, optimizer: str = "adam", clipping: str = "flat",
                 max_physical_batch_size: int = 64, curve_data=None, lora_rank: int = 8,
                 zero_init_head: bool = True):
        """``zero_init_head``: start every run from a zero classification head (seed 002).  With the
        random head of a fresh Hugging Face classifier, AUTO-S (hyperfree) DP-BiTFiT of MiniLM stayed
        at chance on SST-2 even without noise, while from a zero head it learned (docs/strategies/hyperfree.md)."""
        from privtune.finetune import apply_mode

        self.base = model
        self.train_set = train_set
        self.mode = mode
        self.optimizer = optimizer
        self.clipping = clipping
        self.max_physical_batch_size = max_physical_batch_size
        self.curve_data = curve_data
        self.zero_init_head = bool(zero_init_head)
        self.mode_info = (apply_mode(self.base, mode, lora_rank=lora_rank, zero_init_head=self.zero_init_head)
                          if mode != "lora" else None)
        self._lora_rank = lora_rank
        self.runs = 0

    @property
    def n(self) -> int:
        return len(self.train_set)

    def _fresh(self):
        m = copy.deepcopy(self.base)
        if self.mode == "lora":
            from privtune.finetune import apply_mode

            apply_mode(m, "lora", lora_rank=self._lora_rank, zero_init_head=self.zero_init_head)
        return m

    def run(self, hp: dict, *, noise_multiplier: float, sample_rate: float, steps: int, learning_rate: float,
            optimizer: str | None = None, momentum: float = 0.0, clip: float = 1.0, free_step: bool = False,
            seed: int | None = None, label: str = "", eps_adam: float = 1e-8, record: bool = False,
            clipping: str | None = None, bias: bool = True, progress=None) -> TrialRun:
        """One DP run with :func:`privtune.training.fit`.  ``progress`` (a
        :class:`privtune.report.progress.Progress` or anything with its ``advance``) receives one
        update per step: examples, the batch loss (computed WITHOUT noise: NOT PRIVATE) and no ε
        (the caller adds the ε spent so far).  With ``record=True`` and ``curve_data`` (a PUBLIC
        split) accuracy is evaluated at a few points for the learning curves."""
        from privtune.training import fit

        self.runs += 1
        model = self._fresh()
        curve = self.curve_data if record else None
        res = fit(model, self.train_set, noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=int(steps),
                  learning_rate=learning_rate, clip=clip, clipping=clipping or self.clipping,
                  optimizer=optimizer or self.optimizer, eval_set=curve, seed=seed,
                  eval_every=_eval_every(steps) if curve is not None else None,
                  max_physical_batch_size=self.max_physical_batch_size, progress=progress,
                  device="cpu")  # tune's other model paths (hyperfree) run on the CPU; keep one device per run
        events = list(res.events)
        if label:
            events = [_relabel(e, label) for e in events]
        return TrialRun(state=res.model, events=events, history=_as_history(res.history))

    def run_hyperfree(self, *, steps: int, sample_rate: float, sigma_g: float, sigma_l: float, config, lr0: float,
                      seed: int | None = None, progress=None):
        """HyFreeDP on a fresh copy of the model; with ``curve_data`` (a PUBLIC split) its accuracy is
        recorded at a few points for the learning curves (no privacy cost: public data)."""
        from privtune.hpo.hyperfree import train_model_hyperfree

        self.runs += 1
        eval_fn, every = None, 0
        if self.curve_data is not None:
            from privtune.training import evaluate

            curve = self.curve_data
            eval_fn = lambda m: evaluate(m, curve)["accuracy"]  # noqa: E731
            every = _eval_every(steps)
        return train_model_hyperfree(self._fresh(), self.train_set, steps=steps, sample_rate=sample_rate,
                                     sigma_g=sigma_g, sigma_l=sigma_l, config=config, lr0=lr0, seed=seed,
                                     max_physical_batch_size=self.max_physical_batch_size, progress=progress,
                                     eval_fn=eval_fn, eval_every=every)

    def predict(self, state: Any, data: Any) -> torch.Tensor:
        return self.logits(state, data).argmax(dim=1)

    def logits(self, state: Any, data: Any) -> torch.Tensor:
        return state.predict_logits(data)


def _eval_every(steps: int, points: int = 5) -> int:
    """Evaluate the (public) curve split at about ``points`` points of a run, and at its end."""
    return max(1, int(steps) // points)


def _relabel(event, label: str):
    import dataclasses

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
        import dataclasses

        return dataclasses.asdict(h)
    return {}
