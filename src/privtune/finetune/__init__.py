"""Fine-tuning modes: each is a statement of which parameters are trainable.

:func:`apply_mode` sets ``requires_grad`` on a :class:`privtune.models.Classifier` (and, for LoRA,
injects adapters through ``peft``) and returns a :class:`ModeInfo` describing what is trained:

* ``"full"``: every parameter;
* ``"bitfit"``: every bias found **by module type** (Linear, Conv1d/2d/3d, ConvTranspose, LayerNorm,
  GroupNorm, InstanceNorm, HF ``Conv1D``) plus the classification head (``train_head=True``, the
  default, as the head is new); a backbone without such biases is an error (DP-BiTFiT, Bu et al.);
* ``"last-layer"``: the classification head only, **zero-initialised** (Mehta et al.); train it fast on
  cached features with :mod:`privtune.finetune.last_layer`;
* ``"lora"``: LoRA adapters through ``peft`` (per-architecture default target modules) plus the head;
* ``"two-phase"``: DP full fine-tuning for the first phase, then DP-BiTFiT (Bu et al., "X+BiTFiT");
  :func:`apply_mode` sets up phase 1, :func:`privtune.training.fit` switches to phase 2.
"""

from privtune.finetune.modes import (
    BIAS_MODULE_TYPES,
    MODES,
    ModeInfo,
    apply_mode,
    default_lora_target_modules,
    head_input_normalization,
)
from privtune.finetune.last_layer import FeatureSet, LinearHeadGradient, cache_features

__all__ = [
    "MODES",
    "ModeInfo",
    "apply_mode",
    "head_input_normalization",
    "default_lora_target_modules",
    "BIAS_MODULE_TYPES",
    "FeatureSet",
    "LinearHeadGradient",
    "cache_features",
]
