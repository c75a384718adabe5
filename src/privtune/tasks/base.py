"""The :class:`Task` interface (see :mod:`privtune.tasks`)."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn


class Task(Protocol):
    """What one kind of fine-tuning supplies to a run; everything else (plan, ledger, DP loop, certificate,
    release) is shared.

    **The loss seam.**  The DP loop (:func:`privtune.training.fit`) never computes a loss itself.  For every
    physical micro-batch of row indices ``idx`` it asks the task for the rows as a batch dict
    (:meth:`batch`) and for their per-example losses (:meth:`per_example_loss`), inside the DP step, so
    that the forward pass is the one whose per-example gradients are clipped:

    * ``batch(model, data, idx)`` returns a dict of tensors (model inputs and targets; classification:
      the encoder's ``input_ids``/``attention_mask``/… or ``pixel_values``, or ``features`` for cached
      features, and ``labels`` (B,); a sequence task: ``input_ids``, ``attention_mask`` and token
      ``labels`` (B, T) with ``-100`` where no loss is taken).  The loop moves its tensors to the training
      device before the loss sees them.
    * ``per_example_loss(model, batch)`` returns the (B,) loss vector that DP-SGD clips per example:
      ``losses[i]`` may depend on row ``i`` of the batch only (classification: cross-entropy of the
      logits; a sequence task: the summed masked token loss of each sequence).  It must come from a
      forward pass of ``model`` with grad enabled (the loop calls it in eval mode; hyperfree's loss
      probes call it again with the DP step paused and no gradient).
    """

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
                    image_size: int | None = None, batchnorm: str | None = None,
                    image_features: str | None = None) -> nn.Module:
        """The model to fine-tune: a path or name loaded with a freshly initialised head for the declared label
        set (head initialised from ``seed``), or a loaded model returned as it is.  ``image_size``,
        ``batchnorm`` and ``image_features`` are a vision backbone's (:func:`privtune.models.load_classifier`)."""

    def batch(self, model: nn.Module, data: Any, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows ``idx`` (int64 indices into ``data``) of a training split as one batch dict: the model's
        inputs and the targets the loss reads."""

    def per_example_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(B,) losses of ``model`` on ``batch`` (from :meth:`batch`): what DP-SGD clips per example."""

    def evaluate(self, model: nn.Module, data: Any, *, batch_size: int = 128) -> dict:
        """Metrics of ``model`` on a labelled split (floats and counts; the task's own keys)."""

    def predict(self, model: nn.Module, data: Any, *, batch_size: int = 64) -> list:
        """What ``privtune predict`` returns for every row of ``data``."""
