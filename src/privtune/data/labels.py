"""The declared label set of a run: validation and description.

The label set (class count and names) is public input: it is written into the released model (head
shape and names), so privtune never infers it from private rows.  It lives in its own module so that
both the data loaders (:mod:`privtune.data.datasets`) and the model loader
(:mod:`privtune.models.classifier`) can use it without importing each other.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from privtune.errors import InvalidParameterError

__all__ = ["check_label_set", "describe_label_set", "label_kind", "LABELS_HOWTO", "MISSING_LABEL_SPELLINGS"]

# spellings of "no label" in text tables (compared case-insensitively); JSON null and float NaN are missing too
MISSING_LABEL_SPELLINGS = frozenset({"", "nan", "null", "none"})

LABELS_HOWTO = (
    "Declare the label set: `--labels neg,pos` (CLI), labels=['neg', 'pos'] (Python) or `labels: [neg, pos]` "
    "(config file), in class-index order (the i-th label is class i); for integer labels give the class "
    "indices, e.g. `--labels 0,1`."
)


def label_kind(value: Any) -> tuple[str, Any]:
    """Classify one raw label: ``("missing", None)``, ``("int", k)``, ``("fraction", None)`` (a number that is
    not a whole number, or ±inf) or ``("name", stripped string)``.  TSV/CSV cells (strings) and JSON values
    (numbers, strings, null) are classified the same way, so every format accepts and refuses the same labels."""
    if value is None:
        return "missing", None
    if isinstance(value, bool):
        return "int", int(value)
    if isinstance(value, numbers.Integral):
        return "int", int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        if math.isnan(f):
            return "missing", None
        return ("int", int(f)) if math.isfinite(f) and f.is_integer() else ("fraction", None)
    s = str(value).strip()
    if s.lower() in MISSING_LABEL_SPELLINGS:
        return "missing", None
    try:
        return "int", int(s)
    except ValueError:
        pass
    try:
        f = float(s)
    except ValueError:
        return "name", s
    if math.isnan(f):
        return "missing", None
    return ("int", int(f)) if math.isfinite(f) and f.is_integer() else ("fraction", None)


def check_label_set(labels: Any, what: str = "labels") -> tuple[int, list[str] | None]:
    """Validate a declared label set; return ``(num_labels, label_names)``.

    ``labels`` is a list (or one comma-separated string) of class labels in class-index order: the
    i-th label is class i.  Either every label is a class name (``["neg", "pos"]``: ``label_names`` is
    that list) or every label is an integer and the list is exactly ``0, 1, ..., K-1`` in that order
    (``label_names`` is ``None``: the class index is the label itself).  At least two distinct labels;
    no empty, NaN-like (``nan``, ``null``, ``None``) or fractional (``0.5``) labels.

    The label set is public input: it is written into the released model (head shape and names), so
    privtune never infers it from private rows.

    Raises
    ------
    InvalidParameterError
        Fewer than two labels, duplicates, a mix of integers and names, a fractional or NaN-like label,
        integers that are not 0..K-1 in order.
    """
    if isinstance(labels, str):
        items: list[Any] = labels.split(",")
    elif isinstance(labels, (list, tuple)):
        items = list(labels)
    else:
        raise InvalidParameterError(
            f"`{what}` must be a list of class labels or one comma-separated string. Got {type(labels).__name__} "
            f"{labels!r}. {LABELS_HOWTO}"
        )
    kinds = [label_kind(v) for v in items]
    shown = [v.strip() if isinstance(v, str) else v for v in items]
    if len(items) < 2:
        raise InvalidParameterError(f"`{what}` must name at least two classes. Got {shown!r}. {LABELS_HOWTO}")
    bad = [shown[i] for i, (k, _) in enumerate(kinds) if k in ("missing", "fraction")]
    if bad:
        raise InvalidParameterError(
            f"`{what}` holds {bad[0]!r}, which is empty, NaN-like or a number that is not a whole number; class "
            f"labels are names or the integer class indices 0..K-1. Got {shown!r}. {LABELS_HOWTO}"
        )
    values = [v for _, v in kinds]
    if len(set(map(str, values))) != len(values):
        raise InvalidParameterError(f"`{what}` lists a class twice. Got {shown!r}. Give each class once.")
    n_int = sum(k == "int" for k, _ in kinds)
    if 0 < n_int < len(kinds):
        raise InvalidParameterError(
            f"`{what}` mixes integers and names ({shown!r}). Use names throughout (e.g. neg,pos) or the integer "
            "class indices 0..K-1 throughout."
        )
    if n_int:
        if values != list(range(len(values))):
            raise InvalidParameterError(
                f"`{what}`: integer labels must be the class indices 0..K-1 in that order (class i is label i). "
                f"Got {shown!r}. Pass e.g. `--labels {','.join(map(str, range(len(values))))}`, renumbering the "
                "labels in your files to match, or use class names."
            )
        return len(values), None
    return len(values), [str(v) for v in values]


def describe_label_set(num_labels: int, label_names: Sequence[str] | None) -> str:
    """``[neg, pos]`` or ``the integers 0..K-1`` (for messages)."""
    if label_names is not None:
        return "[" + ", ".join(map(str, label_names)) + "]"
    return f"the integer class indices 0..{num_labels - 1}"
