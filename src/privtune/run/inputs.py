"""The one loader of a run's splits (:mod:`privtune.run.pipeline`'s load stage): every split of ``train`` and
``tune`` is read here, with the declared label set, before anything is reserved."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from privtune.data import ImageDataset, TextDataset, load_dataset
from privtune.errors import DataError, InvalidParameterError


def load_split(data: Any, what: str, *, text_column: str | None = None, label_column: str | None = None,
               num_labels: int | None = None, label_names: Sequence[str] | None = None) -> Any:
    """Load one split (None: none); with a declared label set (``num_labels``/``label_names``) its labels must
    be in it.  ``what`` names the split in errors ("data", "eval_data", ...).

    A path must exist; a privtune dataset is checked against the label set; a Hugging Face ``datasets.Dataset``
    is converted; another loaded split (e.g. a :class:`privtune.finetune.FeatureSet`) is used as it is."""
    if data is None:
        return None
    if isinstance(data, (TextDataset, ImageDataset)):
        return load_dataset(data, num_labels=num_labels, label_names=label_names)
    if hasattr(data, "__len__") and hasattr(data, "kind"):
        return data
    if isinstance(data, (str, os.PathLike)):
        p = Path(data).expanduser()
        if not p.exists():
            raise DataError(f"`{what}` file {str(p)!r} does not exist. Check the path.")
        return load_dataset(str(p), text_column=text_column, label_column=label_column, num_labels=num_labels,
                            label_names=label_names)
    if hasattr(data, "column_names"):  # a Hugging Face datasets.Dataset
        return load_dataset(data, text_column, label_column, num_labels=num_labels, label_names=label_names)
    raise InvalidParameterError(f"`{what}` must be a path or a privtune dataset. Got {type(data).__name__}.")


def check_training_split(ds: Any) -> None:
    """The training split holds rows and labels.  No check of which classes the rows contain: the label set is
    declared (public), and a refusal that depends on the rows' classes would tell whoever sees it something about
    the private data."""
    if ds is None or len(ds) == 0:
        raise DataError("The training data is empty. Pass a file with at least two labelled examples per class.")
    if getattr(ds, "labels", None) is None:
        raise DataError("The training data has no labels. Add a label column (e.g. `label`).")


__all__ = ["check_training_split", "load_split"]
