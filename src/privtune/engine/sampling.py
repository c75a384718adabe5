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

Every Poisson mask in privtune comes from :func:`poisson_mask` (also the head trainers of
``privtune.hpo``): example i is included iff U_i < ⌊q·2⁶²⌋ for U_i uniform on the integers
[0, 2⁶²), so P(included) = ⌊q·2⁶²⌋/2⁶² ≤ q exactly (never above the q the accountant is given;
below it by less than 2⁻⁶²).  A float comparison ``torch.rand(n) < q`` would not do: float32
``rand`` lies on a 2⁻²⁴ grid, so its rate is ⌈q·2²⁴⌉/2²⁴ > q (6·q at q = 1e-8).
"""

from __future__ import annotations

import math
import secrets
from fractions import Fraction
from typing import Iterator

import torch

from privtune._validation import check_int, check_sample_rate
from privtune.errors import InvalidParameterError

__all__ = [
    "PoissonSampler",
    "ShuffleSampler",
    "check_shuffle_batching",
    "shuffle_batching_is_neighbour_stable",
    "inclusion_probability",
    "make_generator",
    "poisson_indices",
    "poisson_mask",
]

#: Bits of the integer uniform draw behind every Poisson mask (see :func:`poisson_mask`).
POISSON_BITS = 62


def poisson_threshold(sample_rate: float) -> int:
    """The integer threshold ⌊q·2⁶²⌋: an example is included iff its uniform U ∈ [0, 2⁶²) is below it.

    q is a float64, so q·2⁶² is exact (a power-of-two scaling) and ``math.floor`` of it is the exact
    threshold; the inclusion probability threshold/2⁶² is therefore ≤ q, with equality at q = 1."""
    q = float(sample_rate)
    if not (0.0 <= q <= 1.0):
        raise InvalidParameterError(f"`sample_rate` must be in [0, 1]. Got {sample_rate!r}.")
    return math.floor(math.ldexp(q, POISSON_BITS))


def inclusion_probability(sample_rate: float):
    """The exact per-example inclusion probability of :func:`poisson_mask`, as a ``fractions.Fraction`` (≤ q)."""
    return Fraction(poisson_threshold(sample_rate), 2**POISSON_BITS)


def poisson_mask(num_examples: int, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Boolean mask of a Poisson sample: each of ``num_examples`` entries True independently with
    probability :func:`inclusion_probability` (q) ≤ q.

    Consumes one 64-bit draw per example from ``generator`` whatever the data (so a generator that
    also draws noise stays in a data-independent state).  ``torch.randint`` with a power-of-two range
    takes ``random64() mod 2⁶²``, which is exactly uniform."""
    u = torch.randint(0, 2**POISSON_BITS, (int(num_examples),), generator=generator, dtype=torch.int64)
    return u < poisson_threshold(sample_rate)


def poisson_indices(num_examples: int, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Sorted ``torch.long`` indices of a Poisson sample (:func:`poisson_mask`); all of them when q = 1
    (then nothing is drawn)."""
    if sample_rate >= 1.0:
        return torch.arange(int(num_examples))
    return poisson_mask(num_examples, sample_rate, generator).nonzero().squeeze(1)


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
        return poisson_indices(self.num_examples, self.sample_rate, self._g)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.steps):
            yield self.sample()

    def __len__(self) -> int:
        return self.steps



def shuffle_batches_per_epoch(num_examples: int, batch_size: int) -> int:
    """⌈N/B⌉: the batches of one epoch of :class:`ShuffleSampler` (``drop_last=False``)."""
    return -(-int(num_examples) // int(batch_size))


def shuffle_batching_is_neighbour_stable(num_examples: int, batch_size: int) -> bool:
    """True iff adding or removing one example leaves ⌈N/B⌉ unchanged, i.e. N mod B ∉ {0, 1}.

    This is the precondition of the σ/√5-per-epoch shuffle accounting (docs/accounting.md,
    "Shuffling"): when it fails, a neighbouring data set has one batch more or fewer per epoch,
    every later batch of a fixed number of steps shifts, and no bound of the form "two batch sums
    change" holds (the audit measured ε ≥ 3.69 against a certified 1.035 at N = 2560, B = 256)."""
    n, b = int(num_examples), int(batch_size)
    per_epoch = shuffle_batches_per_epoch(n, b)
    return (n > 1 and shuffle_batches_per_epoch(n + 1, b) == per_epoch
            and shuffle_batches_per_epoch(n - 1, b) == per_epoch)


def _stable_batch_sizes_near(num_examples: int, batch_size: int, count: int = 2) -> list[int]:
    out: list[int] = []
    for delta in range(1, num_examples):
        for b in (batch_size - delta, batch_size + delta):
            if 2 <= b < num_examples and shuffle_batching_is_neighbour_stable(num_examples, b) and b not in out:
                out.append(b)
        if len(out) >= count:
            break
    return sorted(out[:count])


def check_shuffle_batching(num_examples: int, batch_size: int) -> None:
    """Refuse shuffled fixed-size batches whose privacy accounting would not hold.

    Shuffled runs are accounted as σ/√5 per epoch, which is valid only when the number of batches
    per epoch ⌈N/B⌉ is the same for N − 1, N and N + 1 examples, i.e. N mod B ∉ {0, 1} (see
    :func:`shuffle_batching_is_neighbour_stable`).  Raises :class:`InvalidParameterError` otherwise,
    naming batch sizes close to B that satisfy it.  The test depends only on N and B, which are public
    (N through the sampling rate q = B/N in every certificate), so the refusal reveals nothing else.
    """
    n, b = int(num_examples), int(batch_size)
    if shuffle_batching_is_neighbour_stable(n, b):
        return
    near = _stable_batch_sizes_near(n, b)
    suggestion = (f"Use batch size {' or '.join(f'{x} (sample_rate {x}/{n})' for x in near)} instead, or "
                  if near else "Use ")
    raise InvalidParameterError(
        f"Shuffled batches of {b} from {n} examples are not covered by the privacy accounting: "
        f"{n} mod {b} = {n % b}, so adding or removing one example changes the number of batches per epoch "
        f"(⌈N/B⌉) and shifts every later batch; the σ/√5-per-epoch bound needs N mod B ∉ {{0, 1}}. "
        f"{suggestion}sampling='poisson' (the default, CLI --sampling poisson), which has no such condition."
    )


class ShuffleSampler(_SamplerState):
    """Fixed-size batches from a fresh random permutation each epoch (no Poisson amplification).

    Args:
        num_examples: dataset size N ≥ 1.
        batch_size: examples per batch, 1 ≤ B ≤ N.
        seed: integer seed, or None to seed from the OS.
        drop_last: drop the final short batch of each epoch.

    ``accounting_note`` says how such runs should be accounted.  The sampler itself accepts any
    1 ≤ B ≤ N; the σ/√5-per-epoch accounting additionally needs N mod B ∉ {0, 1} (with
    ``drop_last=False``), which ``privtune.fit``/``train`` enforce with :func:`check_shuffle_batching`.
    Call it yourself when you account a loop of your own with ``sampling="shuffle"`` events.
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

