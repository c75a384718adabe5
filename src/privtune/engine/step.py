"""The DP-step interface of the one training loop (:class:`privtune.training._Loop`).

A DP step turns the micro-batches of one logical batch into one released gradient: it accumulates
clipped per-example terms per micro-batch (:meth:`DPStep.accumulate_batch`) and adds the Gaussian noise
once per logical batch (:meth:`DPStep.release`).  Two implementations exist:

* :class:`privtune.engine.PrivateGradient`: any module, per-example norms from hooks during one backward
  pass of the model's forward;
* :class:`privtune.finetune.LinearHeadGradient`: one ``nn.Linear`` head on cached features, per-example
  gradients in closed form (no forward of a backbone).

The loop hands each step a :class:`MicroBatch` that can produce both the per-example losses of its rows
(the task's loss, :class:`privtune.tasks.Task`) and their cached features; each step asks for the one it
needs, so the loop never checks which step it has.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["DPStep", "MicroBatch", "ReleaseInfo"]


@dataclass(frozen=True)
class ReleaseInfo:
    """What a DP step's :meth:`DPStep.release` did for one logical batch.

    Attributes:
        step: 1-based index of this release (logical batch) since construction / resume.
        batch_size: realised number of examples that went into the clipped sum. **NOT PRIVATE**
            (it is the size of a Poisson sample of the private data): log it for debugging only.
        clipped_fraction: fraction of those examples whose gradient norm exceeded the clipping
            norm C (for ``clipping="automatic"`` every example is rescaled; this still counts
            ‖g‖ > C). **NOT PRIVATE**.
        microbatches: number of :meth:`PrivateGradient.backward` calls in this logical batch.
        noise_std: standard deviation of the Gaussian noise per coordinate of the *released*
            (averaged) gradient, σ·C / expected_batch_size.
        sensitivity: L2 sensitivity of the clipped sum under adding/removing one example (= C).
        expected_batch_size: the public divisor (q·N) used instead of the realised batch size.
        nonfinite_examples: examples whose loss or gradient norm was NaN or infinite; their term was
            dropped (clip factor 0: they add exactly nothing to the sum, so the sensitivity stays C and the
            release stays finite). **NOT PRIVATE**.
    """

    step: int
    batch_size: int
    clipped_fraction: float
    microbatches: int
    noise_std: float
    sensitivity: float
    expected_batch_size: float
    nonfinite_examples: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["not_private"] = ["batch_size", "clipped_fraction", "nonfinite_examples"]
        return d


@dataclass(frozen=True)
class MicroBatch:
    """One physical micro-batch of private training examples, as the DP step sees it.

    Attributes:
        losses: computes the (B,) per-example losses of the rows (a forward pass of the model, then the
            task's per-example loss).  Called inside the DP step, so the engine's hooks record the
            activations of this forward pass.
        labels: (B,) class indices of the rows, on the training device (the closed-form head step and the
            clipping diagnostics read them); None for a task without classes.
        features: returns the rows' cached features (B, d) and their squared norms ‖x_i‖² (B,); None
            when the loop trains a model (no cached features).
    """

    losses: Callable[[], "torch.Tensor"]
    labels: "torch.Tensor | None" = None
    features: Callable[[], tuple["torch.Tensor", "torch.Tensor"]] | None = None
    #: (B,) weights multiplying the rows' clip factors (user level: 1/m_u, privtune.engine.units); None: 1
    row_weights: "torch.Tensor | None" = None


@runtime_checkable
class DPStep(Protocol):
    """What the training loop needs of a DP step.  Norms and losses it returns are computed from private
    data without noise (NOT PRIVATE: monitoring and clipping diagnostics only)."""

    #: AUTO-S stability constant γ (automatic clipping); recorded in the clipping diagnostics.
    gamma: float

    def accumulate_batch(self, batch: MicroBatch) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Add the clipped per-example gradients of ``batch``; return its (B,) per-example losses and
        (B,) per-example gradient norms."""

    @property
    def last_layer_norms(self) -> "torch.Tensor | None":
        """(B, K) per-layer norms of the last accumulated micro-batch, or None when not clipping per layer."""

    def release(self) -> "ReleaseInfo":
        """Write (clipped sum + N(0, σ²C²)) / expected batch size to each parameter's ``.grad``."""

    def example_gradients(self, batch: MicroBatch) -> "torch.Tensor":
        """(B, P) per-example gradients of the trainable parameters on ``batch``, without clipping, noise or
        accumulation (NOT PRIVATE: for the MSE-optimal clipping norm of the diagnostics)."""

    def paused(self) -> ContextManager[None]:
        """Context in which forward passes do not reach the DP step."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...
