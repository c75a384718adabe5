"""privtune: differentially private fine-tuning with privately chosen hyperparameters.

The public API is imported lazily, so ``import privtune`` (and the accounting-only CLI
commands) do not pay for importing torch and transformers.

Layout (each a small module composing the core):

* :mod:`privtune.accounting`: privacy events, accountants, calibration, certificates.
* :mod:`privtune.ledger`: the persistent per-dataset privacy budget ledger.
* :mod:`privtune.engine`: per-example norms, clipping and noise: the one DP step.
* :mod:`privtune.optim`: DP-SGD, DP-Adam(W), DP-LAMB over the DP step.
* :mod:`privtune.finetune`: what is trainable (full, BiTFiT, last layer, LoRA, two-phase).
* :mod:`privtune.hpo`: private hyperparameter tuning strategies.
* :mod:`privtune.specs`: validated run specifications (privacy, schedule, optimizer, clipping, LoRA).
* :mod:`privtune.data`, :mod:`privtune.models`, :mod:`privtune.report`, :mod:`privtune.cli`: edges.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "compute_epsilon": "privtune.accounting",
    "compute_delta": "privtune.accounting",
    "calibrate_noise_multiplier": "privtune.accounting",
    "Certificate": "privtune.accounting",
    "verify_certificate": "privtune.accounting",
    "Ledger": "privtune.ledger",
    "train": "privtune.training",
    "tune": "privtune.hpo",
    "recommend": "privtune.hpo",
    "audit": "privtune.audit",
    # validated run specifications (what train() and tune() build from their keyword arguments)
    "PrivacySpec": "privtune.specs",
    "ScheduleSpec": "privtune.specs",
    "OptimizerSpec": "privtune.specs",
    "ClippingSpec": "privtune.specs",
    "LoraSpec": "privtune.specs",
    "NoiseSpec": "privtune.specs",
    "LoopOptions": "privtune.specs",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'privtune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = ["__version__", *_EXPORTS]
