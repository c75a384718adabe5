"""The one DP step used by every fine-tuning mode and optimizer.

* :class:`PrivateGradient`: per-example clipping (flat or automatic) in one backward pass,
  Gaussian noise once per logical batch, division by the expected batch size.
* :class:`PoissonSampler`, :class:`ShuffleSampler`: batch samplers matching the accounting.
* Clipping diagnostics (:func:`clipping_diagnostics`, :func:`retained_weight`,
  :func:`optimal_clip_mse`, ...): **NOT PRIVATE**, off the training path.
"""

from privtune.engine.diagnostics import (
    NOT_PRIVATE,
    clip_mse,
    clipping_diagnostics,
    optimal_clip_mse,
    per_example_gradients,
    retained_weight,
)
from privtune.engine.private_gradient import CLIPPINGS, PrivateGradient, ReleaseInfo
from privtune.engine.sampling import PoissonSampler, ShuffleSampler

__all__ = [
    "CLIPPINGS",
    "PrivateGradient",
    "ReleaseInfo",
    "PoissonSampler",
    "ShuffleSampler",
    "NOT_PRIVATE",
    "clipping_diagnostics",
    "retained_weight",
    "clip_mse",
    "optimal_clip_mse",
    "per_example_gradients",
]
