"""Datasets for privtune: text tables (TSV/CSV/JSONL), Hugging Face ``datasets`` objects, image folders.

Every loader validates at the boundary and raises :class:`privtune.errors.DataError` with the file,
the column or row at fault and a fix: missing columns, empty data, unreadable files, labels that are
not whole numbers in ``[0, num_labels)``.

* :func:`load_text_dataset` reads ``.tsv``/``.csv``/``.jsonl`` files (or a ``datasets.Dataset``) into a
  :class:`TextDataset`; text and label columns are auto-detected and can be overridden.
* :func:`load_image_folder` reads ``ROOT/<class name>/<image>`` into an :class:`ImageDataset`.
* :func:`load_idx_dataset` reads MNIST-style IDX image and label files (:mod:`privtune.data.idx`) into an
  :class:`ImageDataset`.
* :func:`load_dataset` dispatches on the path (directory → images, IDX file → images, other file → text).
* :func:`embedded_sst2` returns the small SST-2 subset shipped with the package (the default data of
  ``privtune tune``); :func:`embedded_fashion_mnist` the small Fashion-MNIST subset of the image demo
  (``privtune tune --data embedded:fashion-mnist``).
"""

from privtune.data.datasets import (
    ImageDataset,
    TextDataset,
    embedded_fashion_mnist,
    embedded_sst2,
    load_dataset,
    load_idx_dataset,
    load_image_folder,
    load_text_dataset,
)

__all__ = [
    "TextDataset",
    "ImageDataset",
    "load_text_dataset",
    "load_image_folder",
    "load_idx_dataset",
    "load_dataset",
    "embedded_sst2",
    "embedded_fashion_mnist",
]
