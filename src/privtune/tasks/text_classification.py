"""Sentence classification: the first :class:`~privtune.tasks.base.Task`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from privtune.errors import DataError, InvalidParameterError
from privtune.models import load_classifier
from privtune.run.inputs import load_split


class TextClassification:
    """Classify texts into a declared label set: a Hugging Face encoder (or a loaded
    :class:`privtune.models.Classifier`) with a linear head, trained with per-example cross-entropy."""

    name = "text-classification"
    kind = "text"

    def load_split(self, data: Any, what: str, *, text_column: str | None = None, label_column: str | None = None,
                   num_labels: int | None = None, label_names: Sequence[str] | None = None,
                   labelled: bool = True) -> Any:
        split = load_split(data, what, text_column=text_column, label_column=label_column, num_labels=num_labels,
                           label_names=label_names)
        if split is None:
            raise InvalidParameterError(f"`{what}` is required for a {self.name} split.")
        if getattr(split, "kind", self.kind) != self.kind:
            raise DataError(f"`{what}` holds {split.kind} inputs, but this is a {self.name} run on {self.kind} data.")
        if labelled and getattr(split, "labels", None) is None:
            raise DataError(f"`{what}` has no labels. Pass a file with a label column.")
        return split

    def build_model(self, model: Any, *, num_labels: int, label_names: Sequence[str] | None = None,
                    pooling: str = "auto", max_length: int | None = None, seed: int | None = None,
                    image_size: int | None = None, batchnorm: str | None = None,
                    image_features: str | None = None) -> nn.Module:
        if isinstance(model, nn.Module):
            if image_size is not None or batchnorm is not None or image_features is not None:
                raise InvalidParameterError(
                    "`image_size`, `batchnorm` and `image_features` are choices for loading a vision backbone by "
                    "name; the model given is already built. Drop them, or pass the backbone's name.")
            return model
        return load_classifier(model, num_labels=num_labels, pooling=pooling, label_names=label_names,
                               max_length=max_length, seed=seed, image_size=image_size, batchnorm=batchnorm,
                               image_features=image_features)

    def batch(self, model: nn.Module, data: Any, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"labels": (B,) classes}`` with the encoder's inputs (``model.encode``), or for cached features
        (a :class:`~privtune.finetune.FeatureSet`, ``model`` its linear head) ``{"features": (B, d)}``."""
        if getattr(data, "kind", None) == "features":
            return {"features": data.features[idx], "labels": data.labels[idx].long()}
        return {**model.encode(data, idx), "labels": torch.tensor([data.labels[i] for i in idx.tolist()],
                                                                   dtype=torch.long)}

    def per_example_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy (nats) of each row's logits against its class."""
        if "features" in batch:
            logits = model(batch["features"])
        else:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"})
        return F.cross_entropy(logits, batch["labels"], reduction="none")

    def evaluate(self, model: nn.Module, data: Any, *, batch_size: int = 128) -> dict:
        """``{"accuracy", "loss", "n"}``: accuracy and mean cross-entropy over the labelled rows."""
        logits = model.predict_logits(data, batch_size=batch_size)
        labels = torch.as_tensor(list(data.labels), dtype=torch.long)
        if logits.shape[1] <= int(labels.max()):
            raise DataError(
                f"The evaluation data has label {int(labels.max())} but the model has {logits.shape[1]} classes.")
        return {"accuracy": (logits.argmax(1) == labels).float().mean().item(),
                "loss": F.cross_entropy(logits, labels, reduction="none").mean().item(), "n": int(labels.numel())}

    def predict(self, model: nn.Module, data: Any, *, batch_size: int = 64) -> list:
        """The predicted label of every row: its name when the model names its classes, else its index."""
        classes = model.predict_logits(data, batch_size=batch_size).argmax(1).tolist()
        names = getattr(model, "label_names", None)
        return [names[c] for c in classes] if names is not None else classes
