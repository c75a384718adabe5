"""Image classification: the same classifier as text (:class:`TextClassification`) with image inputs:
image folders and IDX files (:mod:`privtune.data.idx`) load as :class:`privtune.data.ImageDataset`, and a
vision backbone name (:mod:`privtune.models.vision`) loads through the same
:func:`privtune.models.load_classifier`."""

from __future__ import annotations

from privtune.tasks.text_classification import TextClassification


class ImageClassification(TextClassification):
    """Classify images into a declared label set (a vision backbone with a linear head)."""

    name = "image-classification"
    kind = "image"
