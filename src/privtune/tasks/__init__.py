"""Tasks: what differs between kinds of fine-tuning, behind one small interface (:class:`Task`).

A task says how its data splits load, how its model (backbone and head) is built, its per-example loss,
how a model is evaluated (a metrics dict) and what ``predict`` returns.  The run pipeline
(:mod:`privtune.run.pipeline`), the DP loop and the ledger are the same for every task.

* :class:`~privtune.tasks.text_classification.TextClassification`: sentence classification (tables of
  text and labels; Hugging Face encoders);
* :class:`~privtune.tasks.image_classification.ImageClassification`: image classification (image folders,
  IDX files; :mod:`privtune.models.vision` backbones), the same classifier with image inputs;
* :class:`~privtune.tasks.generation.Generation`: text generation (prompt → response pairs; a causal language
  model, :class:`privtune.models.generator.Generator`), loss on the response tokens only.

:func:`task_for` picks the task of a loaded training split by its input kind (``dataset.kind``).
"""

from __future__ import annotations

from typing import Any

from privtune.errors import DataError
from privtune.tasks.base import Task
from privtune.tasks.generation import Generation
from privtune.tasks.image_classification import ImageClassification
from privtune.tasks.text_classification import TextClassification

#: input kind of a dataset (``dataset.kind``) -> the task that trains on it
TASKS: dict[str, Task] = {"text": TextClassification(), "image": ImageClassification(), "generation": Generation()}


def task_for(dataset: Any) -> Task:
    """The task of a loaded split, by its input kind (``dataset.kind``; "text" when it names none)."""
    kind = getattr(dataset, "kind", "text")
    try:
        return TASKS[kind]
    except KeyError:
        raise DataError(f"No task trains on {kind} inputs. Supported input kinds: {', '.join(sorted(TASKS))}.") from None


__all__ = ["TASKS", "Generation", "ImageClassification", "Task", "TextClassification", "task_for"]
