"""Classifiers built from Hugging Face backbones on local paths (text and images).

:func:`load_classifier` returns a :class:`Classifier`: a backbone, a pooling rule and a linear head.
The head pools the way the backbone was trained: masked **mean** pooling for sentence-embedding
checkpoints (detected from their sentence-transformers ``modules.json`` / ``1_Pooling/config.json``,
such as the bundled all-MiniLM-L6-v2), the model's **own** classification head otherwise.
"""

from privtune.models.classifier import (
    POOLING_CHOICES,
    Classifier,
    default_model_path,
    load_classifier,
    resolve_device,
)
from privtune.models import vision as _vision  # noqa: F401 - registers the vision model names with load_classifier

__all__ = ["Classifier", "load_classifier", "default_model_path", "resolve_device", "POOLING_CHOICES"]
