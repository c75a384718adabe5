"""The :class:`Task` interface (see :mod:`privtune.tasks`)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import nn


class Task(Protocol):
    """What one kind of fine-tuning supplies to a run; everything else (plan, ledger, DP loop, certificate,
    release) is shared."""

    #: the task's name, as a release states it (e.g. "text-classification")
    name: str
    #: the input kind of its datasets (``dataset.kind``)
    kind: str

    def load_split(self, data: Any, what: str, *, text_column: str | None = None, label_column: str | None = None,
                   num_labels: int | None = None, label_names: Sequence[str] | None = None,
                   labelled: bool = True) -> Any:
        """One split (``what`` names it in errors: "data", "eval_data", …), rows checked against the declared
        label set; with ``labelled``, a split without labels is an error."""

    def build_model(self, model: Any, *, num_labels: int, label_names: Sequence[str] | None = None,
                    pooling: str = "auto", max_length: int | None = None, seed: int | None = None,
                    image_size: int | None = None, batchnorm: str | None = None) -> nn.Module:
        """The model to fine-tune: a path or name loaded with a freshly initialised head for the declared label
        set (head initialised from ``seed``), or a loaded model returned as it is.  ``image_size`` and
        ``batchnorm`` are a vision backbone's (:func:`privtune.models.load_classifier`)."""

    def per_example_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B,) losses from the model's outputs and the targets: what DP-SGD clips per example."""

    def evaluate(self, model: nn.Module, data: Any, *, batch_size: int = 128) -> dict:
        """Metrics of ``model`` on a labelled split (floats and counts; the task's own keys)."""

    def predict(self, model: nn.Module, data: Any, *, batch_size: int = 64) -> list:
        """What ``privtune predict`` returns for every row of ``data``."""
