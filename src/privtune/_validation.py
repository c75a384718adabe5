"""Validation at the boundary: one message template for every bad argument.

The template follows scikit-learn: the argument's name, what is allowed, what was
given, and (when useful) how to fix it::

    `delta` must be a float in (0, 1). Got 1.5. Pass e.g. delta=1e-5 (well below 1/n).
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any

from privtune.choices import BATCHNORM_POLICIES, BATCHNORM_TRAIN_REFUSAL, IMAGE_FEATURES, IMAGE_SIZE_BOUNDS
from privtune.errors import InvalidParameterError


def _fail(name: str, allowed: str, value: Any, fix: str | None = None) -> InvalidParameterError:
    msg = f"`{name}` must be {allowed}. Got {value!r}."
    if fix:
        msg += f" {fix}"
    return InvalidParameterError(msg)


def check_real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = False,
    high_inclusive: bool = False,
    fix: str | None = None,
) -> float:
    """Return ``value`` as a finite float in the given interval, or raise InvalidParameterError."""
    lo_b = "[" if low_inclusive else "("
    hi_b = "]" if high_inclusive else ")"
    lo_s = "-inf" if low is None else f"{low:g}"
    hi_s = "inf" if high is None else f"{high:g}"
    interval = f"{lo_b}{lo_s}, {hi_s}{hi_b}"
    allowed = f"a finite number in {interval}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, allowed, value, fix)
    v = float(value)
    if not math.isfinite(v):
        raise _fail(name, allowed, value, fix)
    if low is not None and (v < low or (v == low and not low_inclusive)):
        raise _fail(name, allowed, value, fix)
    if high is not None and (v > high or (v == high and not high_inclusive)):
        raise _fail(name, allowed, value, fix)
    return v


def check_backbone_lr_scale(value: Any, name: str = "backbone_lr_scale") -> float:
    """α in (0, 1]: the learning-rate multiplier of every trainable parameter outside the head."""
    return check_real(value, name, low=0.0, high=1.0, high_inclusive=True,
                      fix="Pass α in (0, 1], e.g. 0.1 (the head trains at the learning rate, the rest at α times it; "
                          "1 trains everything at one rate).")


def check_int(value: Any, name: str, *, low: int | None = None, high: int | None = None, fix: str | None = None) -> int:
    """Return ``value`` as an int in [low, high]; floats with a fractional part are rejected."""
    rng = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
    allowed = f"an integer in {rng}"
    if isinstance(value, bool):
        raise _fail(name, allowed, value, fix)
    if isinstance(value, numbers.Integral):
        v = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value).is_integer():
        v = int(value)
    else:
        raise _fail(name, allowed, value, fix)
    if (low is not None and v < low) or (high is not None and v > high):
        raise _fail(name, allowed, value, fix)
    return v


def check_choice(value: Any, name: str, choices: tuple[str, ...] | list[str]) -> str:
    """Return ``value`` if it is one of ``choices``; otherwise raise, suggesting the closest choice."""
    if isinstance(value, str) and value in choices:
        return value
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    fix = f"Did you mean {close[0]!r}?" if close else None
    raise _fail(name, "one of " + ", ".join(repr(c) for c in choices), value, fix)


def check_batchnorm(value: Any, name: str = "batchnorm") -> str:
    """A BatchNorm policy of :data:`privtune.choices.BATCHNORM_POLICIES`; ``"train"`` is refused with its reason."""
    if isinstance(value, str) and value.strip().lower() == "train":
        raise InvalidParameterError(f"`{name}` cannot be 'train'. {BATCHNORM_TRAIN_REFUSAL}")
    return check_choice(value, name, BATCHNORM_POLICIES)


def check_image_features(value: Any, name: str = "image_features") -> str:
    """What a vision backbone gives its head: one of :data:`privtune.choices.IMAGE_FEATURES`."""
    return check_choice(value, name, IMAGE_FEATURES)


def check_image_size(value: Any, name: str = "image_size") -> int:
    """An input resolution in pixels within :data:`privtune.choices.IMAGE_SIZE_BOUNDS`."""
    return check_int(value, name, low=IMAGE_SIZE_BOUNDS[0], high=IMAGE_SIZE_BOUNDS[1],
                     fix="The input resolution is in pixels, e.g. 64 (CPU) or 224 (ImageNet).")


def check_epsilon(value: Any, name: str = "epsilon") -> float:
    """ε: a finite number > 0."""
    return check_real(value, name, low=0.0, fix="Pass a positive, finite privacy budget such as 1.0 or 8.0.")


def check_delta(value: Any, name: str = "delta", *, dataset_size: int | None = None) -> float:
    """δ: a number in (0, 1), and below 1/n when the dataset size n is known."""
    d = check_real(value, name, low=0.0, high=1.0, fix="Pass e.g. 1e-5; δ should be well below 1/n.")
    if dataset_size is not None and d >= 1.0 / dataset_size:
        raise InvalidParameterError(
            f"`{name}` must be < 1/n = {1.0 / dataset_size:.3g} for a dataset of n = {dataset_size} examples. "
            f"Got {value!r}. A δ this large allows releasing an example in the clear; pass "
            f"{name}={suggest_delta(dataset_size):.0e} or smaller."
        )
    return d


def suggest_delta(n: int) -> float:
    return 10 ** math.floor(math.log10(1.0 / (10 * n)))



def check_sample_rate(value: Any, name: str = "sample_rate") -> float:
    """q: a number in (0, 1]."""
    return check_real(
        value, name, low=0.0, high=1.0, high_inclusive=True,
        fix="The sampling rate is expected batch size / dataset size; 1.0 means full batch.",
    )


def check_steps(value: Any, name: str = "steps") -> int:
    """T: an integer ≥ 1."""
    return check_int(value, name, low=1, fix="Pass a whole number of optimizer steps, at least 1.")


def check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    """σ (multiplier of the clipping norm): a finite number > 0."""
    return check_real(
        value, name, low=0.0,
        fix="σ is the noise standard deviation divided by the clipping norm; it must be positive.",
    )


#: Smallest noise multiplier σ (noise std / clipping norm) that privtune's accountant evaluates.
#: Below it ε is reported as infinite: the RDP bound already exceeds 5·10¹¹ at σ = 1e-6, and
#: dp_accounting's arithmetic breaks down for tiny σ (ZeroDivisionError at σ = 1e-200, ε = 0 at
#: σ = 1e-160).  Used by the command line to reject such σ with a clear error.
MIN_ACCOUNTED_NOISE_MULTIPLIER = 1e-6


def check_accounted_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    """σ > 0 and ≥ :data:`MIN_ACCOUNTED_NOISE_MULTIPLIER` (a σ whose ε is finite and computable)."""
    v = check_noise_multiplier(value, name)
    if v < MIN_ACCOUNTED_NOISE_MULTIPLIER:
        raise InvalidParameterError(
            f"`{name}` must be ≥ {MIN_ACCOUNTED_NOISE_MULTIPLIER:g} for privtune to account it. Got {value!r}. "
            "With so little noise no finite ε can be certified (the run is effectively not private); "
            "σ (noise std / clipping norm) is usually 0.5–10."
        )
    return v
