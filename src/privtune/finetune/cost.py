"""What a backbone costs before a run starts: its size, its floating-point operations per example and the seconds
one forward pass per example takes on this machine, so that the plan can say how long each mode will take.

The forward pass is timed on a public dummy input (a blank image at the model's resolution, or a text of
``max_length`` tokens: an upper bound, shorter texts run faster), never on the data.  Other kinds of work are
priced from it by :data:`privtune.report.progress.RELATIVE_COST` (a DP step of bitfit ≈ 3.3 forward passes per
example, of full fine-tuning ≈ 5.5, a step of a head on cached features ≈ nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from privtune.report.progress import format_duration, relative_cost

__all__ = ["BackboneCost", "backbone_cost", "estimate_seconds", "format_duration", "format_estimates"]

#: examples in the timed dummy batch on a CPU
_TIMED_BATCH = 4
#: examples in the timed dummy batch on an accelerator (timed after an untimed pass of the same shape): at 4 a GPU
#: waits on kernel launches, and the estimate was ten times a real step's cost per example
_ACCELERATOR_BATCH = 64


@dataclass(frozen=True)
class BackboneCost:
    """A backbone's size and measured forward cost (public: from the model and a dummy input only)."""

    parameters: int  # of the backbone (the head excluded)
    flops_per_example: float | None  # of one forward pass (None where the counter cannot run)
    forward_seconds: float  # seconds per example of a forward pass on this machine, no gradient
    input_words: str  # what one example was: "64 × 64 pixels" or "128 tokens"

    def describe(self) -> str:
        flops = f", {self.flops_per_example / 1e9:.3g} GFLOP per example" if self.flops_per_example else ""
        return (f"backbone {self.parameters / 1e6:.3g} M parameters{flops} ({self.input_words}); a forward pass "
                f"takes {1e3 * self.forward_seconds:.3g} ms per example here")


def _image_size(model: Any) -> int:
    """The side in pixels the model's images are given at (224 where nothing says)."""
    from privtune.models.vision import input_image_size

    return input_image_size(model, default=224)


def _dummy_batch(model: Any, batch: int) -> tuple[dict, str]:
    """A public input of ``batch`` examples the model takes: blank images, or texts of max_length tokens."""
    if getattr(model, "kind", "text") == "image":
        size = _image_size(model)
        return {"pixel_values": torch.zeros(batch, 3, size, size)}, f"{size} × {size} pixels"
    length = int(getattr(model, "max_length", None) or 128)
    ids = torch.ones(batch, length, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, f"{length} tokens, an upper bound"


def backbone_cost(model: Any, device: Any = None, batch_size: int | None = None) -> BackboneCost:
    """Count the backbone's parameters and FLOPs per example, and time its forward pass on a dummy batch.

    ``device``: where the run will train (the backbone is timed there, then returned to where it was); ``None``:
    where it is.  ``batch_size``: the run's micro-batch, the batch timed on an accelerator (at least
    :data:`_ACCELERATOR_BATCH`; a CPU times :data:`_TIMED_BATCH` examples, its cost per example barely depends
    on the batch)."""
    backbone = model.backbone
    home = next(backbone.parameters()).device
    device = home if device is None else torch.device(device)
    accelerator = device.type != "cpu"
    batch = max(_ACCELERATOR_BATCH, int(batch_size or 0)) if accelerator else _TIMED_BATCH
    inputs, words = _dummy_batch(model, batch)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    one = {k: v[:1] for k, v in inputs.items()}
    was_training = backbone.training
    if device != home:
        backbone.to(device)
    backbone.eval()
    flops = None
    try:
        with torch.no_grad():
            try:
                # Lazy: the FLOP counter only when a plan is priced.
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as counter:
                    backbone(**one)
                flops = float(counter.get_total_flops()) or None
            except Exception:  # noqa: BLE001 - an operator the counter cannot trace: the timing still prices it
                backbone(**one)
            if accelerator:  # the first pass of a shape pays for kernel selection and memory: not timed
                backbone(**inputs)
                _synchronize(device)
            start = time.perf_counter()
            backbone(**inputs)
            _synchronize(device)
            seconds = (time.perf_counter() - start) / batch
    finally:
        backbone.train(was_training)
        if device != home:
            backbone.to(home)
    return BackboneCost(parameters=sum(p.numel() for p in backbone.parameters()), flops_per_example=flops,
                        forward_seconds=max(seconds, 1e-9), input_words=words)


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU returns before its kernels finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def estimate_seconds(cost: BackboneCost, work: list) -> float:
    """Seconds of ``work``, (kind, examples) pairs as in :meth:`privtune.report.progress.Progress.plan_ahead`,
    priced at the backbone's forward cost times each kind's :data:`RELATIVE_COST` (``"release"``: one release is
    as long as :data:`RELATIVE_COST` ``["release"]`` forward passes)."""
    return sum(float(w) * cost.forward_seconds * relative_cost(str(kind)) for kind, w in work)


def format_estimates(estimates: dict) -> str:
    """``last-layer ≈ 45s, bitfit ≈ 2h10m`` from {mode: seconds}."""
    return ", ".join(f"{m} ≈ {format_duration(s)}" for m, s in estimates.items())

