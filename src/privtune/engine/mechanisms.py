"""Every Gaussian release of privtune: the one module that draws noise to privatise something.

Each function adds N(0, σ²Δ²) to a statistic of L2 sensitivity Δ (add/remove one example) and returns a
:class:`Release`: the noisy value together with the privacy event (:mod:`privtune.accounting.events`) of that
one release.  The callers decide how releases compose (a DP-SGD step is one subsampled release, accounted by
the loop as a :class:`~privtune.accounting.events.DPSGDEvent`; hyperfree's loss releases share the gradient's
batch and are accounted jointly with it); the event returned here is what the release is on its own, so a test
can check each mechanism's noise against its claim.

The module lives in ``engine/`` because that is the layer that holds the noise generators and adds the noise to
gradients; it imports only the event types of ``accounting/`` (which draws nothing).

* :func:`privatise_sum`: the clipped gradient sum of one logical batch (:class:`~privtune.engine.PrivateGradient`
  and :class:`~privtune.finetune.LinearHeadGradient`).
* :func:`noisy_scalar`: a clipped scalar sum (hyperfree's privatised losses, a charged selection score).
* :func:`noisy_feature_sum`: the sum of rows scaled to norm ≤ 1 (the private feature centre of a head on
  cached features when no split is public).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from privtune.accounting.events import Event, GaussianEvent, NonPrivateEvent

__all__ = ["Release", "noisy_feature_sum", "noisy_scalar", "privatise_sum"]

T = TypeVar("T")


@dataclass(frozen=True)
class Release(Generic[T]):
    """A privatised value and the privacy event of releasing it once.

    Attributes:
        value: the noisy value (a float, a tensor or a list of tensors).
        event: a :class:`GaussianEvent` with ``count=1`` and the release's noise multiplier σ (noise standard
            deviation / sensitivity); a :class:`NonPrivateEvent` when σ = 0 (nothing was added).
    """

    value: T
    event: Event


def _event(noise_multiplier: float, label: str) -> Event:
    if noise_multiplier > 0:
        return GaussianEvent(noise_multiplier=noise_multiplier, count=1, label=label)
    return NonPrivateEvent(reason=f"{label}: noise_multiplier=0, released without noise")


def privatise_sum(clipped_sums: torch.Tensor | list[torch.Tensor], noise_multiplier: float, sensitivity: float,
                  expected_batch_size: float, generator: torch.Generator,
                  group: Any = None) -> Release[torch.Tensor | list[torch.Tensor]]:
    """``(clipped_sum + N(0, (σΔ)² I)) / expected_batch_size`` for each part of one logical batch's gradient (one
    tensor, or a list of them): the one place privtune adds Gaussian noise to a gradient.

    Args:
        clipped_sums: sums of per-example terms of norm ≤ ``sensitivity`` (all parts together); updated in place.
        noise_multiplier: σ ≥ 0 (noise standard deviation / sensitivity).
        sensitivity: Δ, the clipping norm C.
        expected_batch_size: the public divisor q·N (never the realised batch size).
        generator: CPU generator; the noise is drawn in each sum's dtype, part after part.  Parts on the CPU draw
            from it directly; parts on an accelerator draw on their device, from a generator of that device seeded
            by one 63-bit draw of ``generator`` per release (drawing millions of normals on the host and copying
            them over would cost about as much as the whole step on a GPU).
        group: a :class:`privtune.engine.distributed.ProcessGroup` (data-parallel runs): every rank passes its
            own clipped sums; only ``group.adds_noise`` (rank 0) adds the noise, then the sums are all-reduced,
            so the released gradient has the noise of one process exactly once, whatever the number of processes.

    Returns a :class:`Release` of the released gradient (a tensor for a tensor, a list for a list) and the
    event of this one unsampled release, ``GaussianEvent(σ, 1)`` (the loop accounts the step with its sampling).
    """
    if isinstance(clipped_sums, torch.Tensor):
        out = privatise_sum([clipped_sums], noise_multiplier, sensitivity, expected_batch_size, generator, group)
        return Release(out.value[0], out.event)
    std = noise_multiplier * sensitivity
    if std > 0 and (group is None or group.adds_noise):
        device_generators: dict[torch.device, torch.Generator] = {}
        for s in clipped_sums:
            if s.device.type == "cpu":
                z = torch.empty(s.shape, dtype=s.dtype).normal_(generator=generator)
            else:
                if s.device not in device_generators:
                    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, dtype=torch.int64))
                    device_generators[s.device] = torch.Generator(device=s.device).manual_seed(seed)
                z = torch.empty_like(s).normal_(generator=device_generators[s.device])
            s.add_(z, alpha=std)
    if group is not None:
        group.all_reduce_sum_(clipped_sums)
    released = [s.mul_(1.0 / expected_batch_size) for s in clipped_sums]
    return Release(released, _event(noise_multiplier if std > 0 else 0.0, "clipped gradient sum"))


def noisy_scalar(clipped_sum: float, noise_multiplier: float, sensitivity: float,
                 generator: torch.Generator | None, label: str = "clipped scalar sum") -> Release[float]:
    """``clipped_sum + σΔ·N(0, 1)`` for a sum of per-example terms each bounded by ``sensitivity`` Δ in absolute
    value (a count of correct predictions: Δ = 1; a sum of losses clamped to [−R, R]: Δ = R).

    One float64 standard normal is drawn from ``generator`` (only when σ > 0).  Returns the noisy sum (in the
    units of ``clipped_sum``) and ``GaussianEvent(σ, 1, label)``."""
    if noise_multiplier <= 0:
        return Release(float(clipped_sum), _event(0.0, label))
    z = float(torch.randn((), generator=generator, dtype=torch.float64).item())
    return Release(float(clipped_sum) + noise_multiplier * sensitivity * z, _event(noise_multiplier, label))


def noisy_feature_sum(features: torch.Tensor, noise_multiplier: float,
                      generator: torch.Generator, weights: torch.Tensor | None = None) -> Release[torch.Tensor]:
    """``Σ_i x_i / max(1, ‖x_i‖) + σ·N(0, I_d)``: the sum of the (n, d) ``features`` rows, each scaled to norm ≤ 1
    (sensitivity 1), plus noise drawn in the default dtype from ``generator``.  Divide by a public n for a mean
    (never by the realised number of rows when that is private).  Returns the noisy (d,) sum and
    ``GaussianEvent(σ, 1)``.

    ``weights`` (n,), user level: row i's scaled vector is multiplied by w_i, with the weights of one privacy
    unit's rows summing to at most 1 (:meth:`privtune.engine.units.UnitIndex.mean_weights`), so a unit adds
    the mean of its rows' vectors and the sensitivity stays 1 per unit."""
    scaled = features * (1.0 / features.norm(dim=1, keepdim=True).clamp_min(1.0))
    if weights is not None:
        scaled = scaled * weights.to(scaled.dtype).unsqueeze(1)
    total = scaled.sum(0)
    if noise_multiplier > 0:
        total = total + noise_multiplier * torch.randn(features.shape[1], generator=generator)
    return Release(total, _event(noise_multiplier, "private feature mean (centering)"))
