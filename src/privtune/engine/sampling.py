"""Batch samplers whose randomness matches the privacy accounting.

* :class:`PoissonSampler` (default for DP training): every example joins each logical batch
  independently with probability q, so batch sizes vary (and may be 0). This is what the
  Poisson-subsampled Gaussian accountant (``DPSGDEvent(..., sampling="poisson")``) assumes.
  q = 1 gives full-batch DP-GD (every batch is the whole dataset).
* :class:`ShuffleSampler`: fixed-size batches from a random permutation per epoch. Privacy
  amplification by shuffling is *not* what the Poisson accountant assumes; account such runs
  without amplification (``sampling="shuffle"``) unless you explicitly assume otherwise.

Both yield ``torch.long`` index tensors and carry their RNG state in ``state_dict()`` so a
resumed run draws exactly the batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import math
import secrets
from typing import Iterator

import torch

from privtune._validation import check_int, check_sample_rate
from privtune.errors import InvalidParameterError

__all__ = ["PoissonSampler", "ShuffleSampler", "make_generator"]


def make_generator(seed: int | None, offset: int = 0) -> torch.Generator:
    """A CPU ``torch.Generator`` for DP noise or sampling.

    ``seed=None`` seeds it from the OS (``secrets``), which is what a release needs: noise from a
    known seed can be subtracted by anyone who knows it.  An explicit ``seed`` (experiments,
    exact resume) gives ``seed + offset``, so one run seed can feed several independent streams.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) + int(offset) if seed is not None else secrets.randbits(63))
    return g


_generator = make_generator


def _check_seed(seed):
    if seed is None:
        return None
    return check_int(seed, "seed", low=0, high=2**63 - 1, fix="Pass a non-negative integer or None (OS entropy).")


class _SamplerState:
    """Checkpointing shared by the samplers: the generator state, so a resumed run draws the same batches."""

    sampling: str
    seed: int | None
    _g: torch.Generator

    def state_dict(self) -> dict:
        return {"sampling": self.sampling, "seed": self.seed, "generator_state": self._g.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("sampling") != self.sampling:
            raise InvalidParameterError(
                f"`state` must come from {type(self).__name__}.state_dict(). Got {state!r:.80}. Pass the saved sampler state."
            )
        self.seed = state.get("seed")
        self._g.set_state(state["generator_state"])


class PoissonSampler(_SamplerState):
    """Poisson subsampling: each of ``num_examples`` indices is included independently w.p. ``sample_rate``.

    Args:
        num_examples: dataset size N ≥ 1.
        sample_rate: q ∈ (0, 1], the inclusion probability (expected batch size q·N).
        seed: integer seed, or None to seed from the OS.
        steps: batches yielded per ``iter()``; default ``round(1/q)`` (one epoch in expectation).

    Iterating yields 1-D ``torch.long`` tensors of sorted indices; some may be empty.
    """

    sampling = "poisson"

    def __init__(self, num_examples: int, sample_rate: float, seed: int | None = None, steps: int | None = None):
        self.num_examples = check_int(num_examples, "num_examples", low=1, fix="The dataset must not be empty.")
        self.sample_rate = check_sample_rate(sample_rate)
        self.seed = _check_seed(seed)
        if steps is None:
            steps = max(1, round(1.0 / self.sample_rate))
        self.steps = check_int(steps, "steps", low=1, fix="Pass the number of batches per iteration, at least 1.")
        self._g = _generator(self.seed)

    @property
    def expected_batch_size(self) -> float:
        """q·N, the public normaliser for PrivateGradient."""
        return self.sample_rate * self.num_examples

    def sample(self) -> torch.Tensor:
        """Draw one Poisson batch of indices."""
        if self.sample_rate >= 1.0:
            return torch.arange(self.num_examples)
        mask = torch.rand(self.num_examples, generator=self._g) < self.sample_rate
        return mask.nonzero().squeeze(1)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.steps):
            yield self.sample()

    def __len__(self) -> int:
        return self.steps



class ShuffleSampler(_SamplerState):
    """Fixed-size batches from a fresh random permutation each epoch (no Poisson amplification).

    Args:
        num_examples: dataset size N ≥ 1.
        batch_size: examples per batch, 1 ≤ B ≤ N.
        seed: integer seed, or None to seed from the OS.
        drop_last: drop the final short batch of each epoch.

    ``accounting_note`` says how such runs should be accounted.
    """

    sampling = "shuffle"
    accounting_note = (
        "shuffled fixed-size batches: accounted without amplification by subsampling unless the user "
        "explicitly assumes Poisson-equivalent amplification (recorded in the certificate)"
    )

    def __init__(self, num_examples: int, batch_size: int, seed: int | None = None, drop_last: bool = False):
        self.num_examples = check_int(num_examples, "num_examples", low=1, fix="The dataset must not be empty.")
        self.batch_size = check_int(batch_size, "batch_size", low=1, high=self.num_examples,
                                    fix="The batch size must be between 1 and the dataset size.")
        self.seed = _check_seed(seed)
        self.drop_last = bool(drop_last)
        self._g = _generator(self.seed)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        perm = torch.randperm(self.num_examples, generator=self._g)
        for start in range(0, self.num_examples, self.batch_size):
            idx = perm[start:start + self.batch_size]
            if self.drop_last and len(idx) < self.batch_size:
                break
            yield idx

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_examples // self.batch_size
        return math.ceil(self.num_examples / self.batch_size)

