"""Dataset containers and loaders (text tables, HF ``datasets`` objects, image folders)."""

from __future__ import annotations

import csv
import dataclasses
import difflib
import io
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from privtune.data.labels import LABELS_HOWTO, check_label_set, describe_label_set, label_kind
from privtune.errors import DataError, InvalidParameterError

TEXT_COLUMN_CANDIDATES = ("sentence", "text", "review", "content", "document", "sentence1", "question", "input")
LABEL_COLUMN_CANDIDATES = ("label", "labels", "target", "class", "y", "category", "sentiment")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
TEXT_SUFFIXES = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}


@dataclass
class TextDataset:
    """Labelled (or unlabelled) texts.

    ``labels[i]`` is an integer class index in ``[0, num_labels)``, or ``labels`` is ``None`` for
    unlabelled data (prediction only).  ``label_names`` maps class indices back to the strings of
    the file when labels were given as names (e.g. ``"neg"``/``"pos"``).  ``source`` is the file the
    data came from (``None`` for in-memory data); the ledger fingerprints that file's content.
    """

    texts: list[str]
    labels: list[int] | None = None
    num_labels: int | None = None
    label_names: list[str] | None = None
    source: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    kind: str = field(default="text", init=False)

    def __post_init__(self) -> None:
        if self.labels is not None and len(self.labels) != len(self.texts):
            raise DataError(
                f"`labels` has {len(self.labels)} entries but `texts` has {len(self.texts)}; pass one label per text."
            )
        _check_texts_not_blank(self.texts, "`texts`")
        if self.labels is not None and self.num_labels is None and self.labels:
            _check_contiguous(self.labels, "TextDataset")
            self.num_labels = max(self.labels) + 1

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def has_labels(self) -> bool:
        return self.labels is not None

    def subset(self, indices: Iterable[int]) -> "TextDataset":
        """A new dataset with the rows at ``indices`` (same label space; ``source`` dropped)."""
        idx = [int(i) for i in indices]
        return TextDataset(
            texts=[self.texts[i] for i in idx],
            labels=None if self.labels is None else [self.labels[i] for i in idx],
            num_labels=self.num_labels,
            label_names=self.label_names,
            source=None,
            text_column=self.text_column,
            label_column=self.label_column,
        )

    def canonical_rows(self) -> Iterable[bytes]:
        """Canonical content (``label\\ttext\\n`` per row, UTF-8) for fingerprinting in-memory data."""
        for i, t in enumerate(self.texts):
            lab = "" if self.labels is None else str(self.labels[i])
            yield f"{lab}\t{t}\n".encode("utf-8")


@dataclass
class ImageDataset:
    """Labelled (or unlabelled) images: ``images[i]`` is a file path or a ``PIL.Image.Image``."""

    images: list[Any]
    labels: list[int] | None = None
    num_labels: int | None = None
    label_names: list[str] | None = None
    source: str | None = None
    kind: str = field(default="image", init=False)

    def __post_init__(self) -> None:
        if self.labels is not None and len(self.labels) != len(self.images):
            raise DataError(
                f"`labels` has {len(self.labels)} entries but `images` has {len(self.images)}; pass one label per image."
            )
        if self.labels is not None and self.num_labels is None and self.labels:
            _check_contiguous(self.labels, "ImageDataset")
            self.num_labels = max(self.labels) + 1

    def __len__(self) -> int:
        return len(self.images)

    @property
    def has_labels(self) -> bool:
        return self.labels is not None

    def subset(self, indices: Iterable[int]) -> "ImageDataset":
        idx = [int(i) for i in indices]
        return ImageDataset(
            images=[self.images[i] for i in idx],
            labels=None if self.labels is None else [self.labels[i] for i in idx],
            num_labels=self.num_labels,
            label_names=self.label_names,
            source=None,
        )

    def load_image(self, i: int, *, keep_greyscale: bool = False):
        """The i-th image as an RGB ``PIL.Image`` (files are opened lazily).

        ``keep_greyscale``: a greyscale ("L") image comes as it is stored, for a preprocessor that takes it
        (``accepts_greyscale``, e.g. :class:`privtune.models.vision.ImagePreprocessor`, which then resizes one
        channel instead of three)."""
        # Lazy: Pillow only for image data: keeps privtune.data light for text.
        from PIL import Image

        img = self.images[i]
        if isinstance(img, (str, os.PathLike)):
            try:
                with Image.open(img) as im:
                    return im.copy() if keep_greyscale and im.mode == "L" else im.convert("RGB")
            except Exception as exc:  # PIL raises many types
                raise DataError(f"Cannot read image {str(img)!r}: {exc}. Remove or replace the file.") from None
        return img if keep_greyscale and img.mode == "L" else img.convert("RGB")

    def canonical_rows(self) -> Iterable[bytes]:
        for i, img in enumerate(self.images):
            lab = "" if self.labels is None else str(self.labels[i])
            if isinstance(img, (str, os.PathLike)):
                yield lab.encode() + b"\t" + Path(img).read_bytes()
            else:
                yield lab.encode() + b"\t" + img.tobytes()


# --------------------------------------------------------------------------------------------- labels


def _check_texts_not_blank(texts: Sequence[Any], where: str) -> None:
    """Refuse texts that are empty or only whitespace (they would train as examples without content).  The
    message gives the first row's number and the count, never a text (it reads private data)."""
    bad = [i for i, t in enumerate(texts) if isinstance(t, str) and not t.strip()]
    if bad:
        raise DataError(
            f"{where}: row {bad[0] + 1} has an empty text (empty or only spaces; {len(bad)} row(s) affected). "
            "Fill in the text or remove the row."
        )


def _as_int_label(value: Any) -> int | None:
    """Return value as int if it is a whole number (int, float 1.0, or string '1'), else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return int(f) if math.isfinite(f) and f.is_integer() else None
    if isinstance(value, str):
        s = value.strip()
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                return None
            return int(f) if math.isfinite(f) and f.is_integer() else None
    return None


def _check_contiguous(labels: Sequence[int], where: str, column: str | None = None) -> None:
    """Integer labels whose class count is inferred (num_labels not given) must be exactly 0..K-1.

    Labels such as {0, 7} would otherwise create an 8-class head with six classes that never occur,
    and 1-based labels {1, 2} a 3-class head; both are almost always a mistake.  A single class is
    left to the caller.  The message names no label value (the data may be private)."""
    try:
        present = sorted({int(x) for x in labels})
    except (TypeError, ValueError):
        raise DataError(
            f"{where}: `labels` must be integer class indices 0..K-1. Map class names to indices (or load the "
            "file with load_text_dataset, which does it)."
        ) from None
    if len(present) < 2 or present == list(range(present[-1] + 1)):
        return
    col = f" in column {column!r}" if column else ""
    raise DataError(
        f"{where}: the integer labels{col} skip at least one class index between 0 and the largest label; "
        "integer labels must be the class indices 0..K-1. Renumber them, or declare the number of classes "
        "explicitly: load_text_dataset(..., labels=[0, 1, ..., K-1]) or TextDataset(..., num_labels=K)."
    )


def _encode_labels(
    raw: Sequence[Any], where: str, column: str, num_labels: int | None, label_names: Sequence[str] | None,
    contiguous: bool = True,
) -> tuple[list[int], int, list[str] | None]:
    """Turn raw label values into class indices.

    With a declared label set (``label_names``, or ``num_labels`` alone for integer classes 0..K-1)
    every label must be in it: names are matched exactly, never remapped by sorted order or by
    position.  Without one (public files only: training never infers its label set) integer labels
    give K = max + 1 (with ``contiguous``: every index present) and names are sorted.  Missing
    (empty/nan/null/None), fractional and mixed integer/name labels are refused in every format.
    Messages give row numbers and counts, never a row's label value (the file may be private)."""
    kinds = [label_kind(v) for v in raw]
    col = f"column {column!r}"
    for i, (k, _) in enumerate(kinds):
        if k == "missing":
            raise DataError(
                f"{where}: row {i + 1} has an empty value in label {col} (empty, nan, null or None count as "
                "missing). Fill in the label or remove the row."
            )
        if k == "fraction":
            raise DataError(
                f"{where}: row {i + 1} has a label in {col} that is a number but not a whole number; labels are "
                "class names or the integer class indices 0..K-1. Fix the label."
            )
    first_int = next((i for i, (k, _) in enumerate(kinds) if k == "int"), None)
    first_name = next((i for i, (k, _) in enumerate(kinds) if k == "name"), None)
    if first_int is not None and first_name is not None:
        raise DataError(
            f"{where}: {col} mixes integer labels (e.g. row {first_int + 1}) and class names (e.g. row "
            f"{first_name + 1}). Use class names throughout or the integer class indices 0..K-1 throughout."
        )
    values = [v for _, v in kinds]
    is_int = first_name is None
    if label_names is not None:
        names = [str(n) for n in label_names]
        index = {n: k for k, n in enumerate(names)}
        if is_int and not any(label_kind(n)[0] == "int" for n in names):
            raise DataError(
                f"{where}: {col} holds integer class indices, but the declared labels are the names "
                f"{describe_label_set(len(names), names)}. Write the labels as those names (integers are never "
                "mapped onto names)."
            )
        bad = [i for i, v in enumerate(values) if str(v) not in index]
        if bad:
            raise DataError(
                f"{where}: row {bad[0] + 1} has a label in {col} that is not one of the declared labels "
                f"{describe_label_set(len(names), names)} ({len(bad)} row(s) affected). Use only these labels, "
                "or declare the full label set (e.g. --labels)."
            )
        return [index[str(v)] for v in values], len(names), names
    if num_labels is not None:
        if not is_int:
            raise DataError(
                f"{where}: {col} holds class names, but the declared classes are "
                f"{describe_label_set(num_labels, None)} (names are never mapped onto integers). Write the labels "
                "as those integers, or use a model / label set declared with names (e.g. --labels neg,pos)."
            )
        bad = [i for i, v in enumerate(values) if not 0 <= v < num_labels]
        if bad:
            raise DataError(
                f"{where}: row {bad[0] + 1} has a label in {col} that is out of range: not among the declared classes "
                f"{describe_label_set(num_labels, None)} ({len(bad)} row(s) affected). Renumber the classes "
                "0..K-1, or declare the full label set (e.g. --labels 0,1,2)."
            )
        return values, num_labels, None
    if is_int:
        bad = [i for i, v in enumerate(values) if v < 0]
        if bad:
            raise DataError(
                f"{where}: row {bad[0] + 1} has a label in {col} that is out of range (negative; {len(bad)} row(s) "
                "affected); integer labels are the class indices 0..K-1. Renumber the classes."
            )
        if contiguous:
            _check_contiguous(values, where, column)
        return values, max(values) + 1, None
    names = sorted({str(v) for v in values})
    index = {n: k for k, n in enumerate(names)}
    return [index[str(v)] for v in values], len(names), names


def _pick_column(columns: list[str], given: str | None, candidates: tuple[str, ...], what: str, where: str,
                 flag: str, exclude: str | None = None) -> str | None:
    if given is not None:
        if given not in columns:
            close = difflib.get_close_matches(given, columns, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise DataError(
                f"{where}: {what} column {given!r} (from `{flag}`) not found; the columns are {columns}.{hint}"
            )
        return given
    lower = {c.lower(): c for c in columns if c != exclude}
    for cand in candidates:
        if cand in lower:
            return lower[cand]
    return None


# --------------------------------------------------------------------------------------------- readers


def read_table(path: Path, fmt: str, single_column_ok: bool = False) -> tuple[list[str], list[dict[str, Any]]]:
    """Header and rows of a text table.  A TSV/CSV with a single column is an error unless
    ``single_column_ok`` (unlabelled data for prediction: the one column is the text)."""
    where = str(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise DataError(f"{where} is a directory; for text data pass a .tsv/.csv/.jsonl file.") from None
    except OSError as exc:
        raise DataError(f"Cannot read data file {where!r}: {exc.strerror or exc}. Check the path.") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"Cannot read {where!r}: not UTF-8 text (byte {exc.start}). Save the file as UTF-8."
        ) from None
    if not text.strip():
        raise DataError(f"{where} is empty: no header and no rows. Pass a file with a header line and examples.")
    if fmt == "jsonl":
        rows: list[dict[str, Any]] = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: line {n} is not valid JSON ({exc.msg}). One JSON object per line.") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: line {n} is a JSON {type(obj).__name__}, not an object with named fields.")
            rows.append(obj)
        columns: list[str] = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
        return columns, rows
    delim = "\t" if fmt == "tsv" else ","
    quoting = csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL
    csv.field_size_limit(1 << 30)
    reader = csv.reader(io.StringIO(text), delimiter=delim, quoting=quoting)
    try:
        header = next(reader)
    except (StopIteration, csv.Error) as exc:  # pragma: no cover - guarded by the empty check
        raise DataError(f"Cannot parse {where!r}: {exc}.") from None
    header = [h.strip() for h in header]
    if len(header) < 1 or (len(header) == 1 and not single_column_ok):
        raise DataError(
            f"{where}: found a single column {header} in the header; expected a text and a label column "
            f"separated by {'tabs' if fmt == 'tsv' else 'commas'}. Check the file's delimiter and extension "
            "(a single text column is accepted only for prediction, where labels are optional)."
        )
    out = []
    try:
        for n, rec in enumerate(reader, start=2):
            if not rec or all(not c.strip() for c in rec):
                continue
            if len(rec) != len(header):
                raise DataError(
                    f"{where}: line {n} has {len(rec)} fields but the header has {len(header)} ({header}). "
                    "Fix the row (a stray delimiter inside the text?)."
                )
            out.append(dict(zip(header, rec)))
    except csv.Error as exc:
        raise DataError(f"Cannot parse {where!r}: {exc}.") from None
    return header, out


def load_text_dataset(
    data: Any,
    text_column: str | None = None,
    label_column: str | None = None,
    *,
    num_labels: int | None = None,
    label_names: Sequence[str] | None = None,
    require_labels: bool = True,
    labels: Sequence[str | int] | str | None = None,
) -> TextDataset:
    """Load labelled text from a ``.tsv``/``.csv``/``.jsonl`` file or a Hugging Face ``datasets.Dataset``.

    Parameters
    ----------
    data : path or ``datasets.Dataset``
        A file (format from the extension: ``.tsv``, ``.csv``, ``.jsonl``/``.json``) with a header
        (TSV/CSV) or one JSON object per line; or an in-memory ``datasets.Dataset``.
    text_column, label_column : str, optional
        Column names.  Auto-detected when omitted: text from ``sentence``, ``text``, ``review``, ...;
        label from ``label``, ``labels``, ``target``, ``class``, ...  (case-insensitive).
    labels : list or comma-separated str, optional
        The declared label set in class-index order (see :func:`check_label_set`): ``["neg", "pos"]``
        makes ``neg`` class 0 and ``pos`` class 1; ``[0, 1]`` declares integer classes.  Every row's
        label must be in it.  Give this for private data: without a declared set the label set is
        inferred from the rows (integers: max + 1 classes; names: sorted), which is fine for public
        files only.
    num_labels : int, optional
        Integer classes ``0..num_labels-1`` (the same as ``labels=range(num_labels)``).
    label_names : list of str, optional
        The class names of an existing model, in class-index order; every label must be one of them.
    require_labels : bool, default True
        If False, a missing label column gives an unlabelled dataset (for prediction).

    Raises
    ------
    DataError
        Unreadable or empty file, missing columns, empty text; a label that is missing (empty, nan,
        null, None), fractional (0.5), outside the declared set, or a column mixing integers and
        names.  Messages give row numbers, never a row's text or label.
    """
    if data is None:
        raise DataError("`data` is None. Pass a .tsv/.csv/.jsonl file or a datasets.Dataset.")
    num_labels, label_names = _declared(labels, num_labels, label_names)
    if not isinstance(data, (str, os.PathLike)):
        return _from_hf_dataset(data, text_column, label_column, num_labels, label_names, require_labels)
    path = Path(data).expanduser()
    where = str(path)
    fmt = TEXT_SUFFIXES.get(path.suffix.lower())
    if not path.exists():
        raise DataError(f"Data file {where!r} does not exist. Check the path (relative to {os.getcwd()}).")
    if path.is_dir():
        raise DataError(
            f"{where!r} is a directory; text data must be a .tsv/.csv/.jsonl file "
            "(a directory of class sub-folders is loaded with load_image_folder)."
        )
    if fmt is None:
        raise DataError(
            f"Cannot tell the format of {where!r} from its extension {path.suffix!r}; "
            f"allowed: {sorted(TEXT_SUFFIXES)}. Rename the file or convert it."
        )
    columns, rows = read_table(path, fmt, single_column_ok=not require_labels)
    return _build_text(rows, columns, where, text_column, label_column, num_labels, label_names,
                       require_labels, source=str(path.resolve()))


def _build_text(rows, columns, where, text_column, label_column, num_labels, label_names, require_labels, source):
    if not rows:
        raise DataError(f"{where} has a header but no examples. Add rows or pass a different file.")
    tcol = _pick_column(columns, text_column, TEXT_COLUMN_CANDIDATES, "text", where, "text_column")
    lcol = _pick_column(columns, label_column, LABEL_COLUMN_CANDIDATES, "label", where, "label_column", exclude=tcol)
    if tcol is None:
        others = [c for c in columns if c != lcol]
        if len(others) == 1:
            tcol = others[0]
        else:
            raise DataError(
                f"{where}: cannot tell which column holds the text among {columns}. "
                "Pass text_column=... (CLI: --text-column)."
            )
    if lcol is None and label_column is None and len(columns) == 2:
        other = [c for c in columns if c != tcol][0]
        if all(_as_int_label(r.get(other)) is not None for r in rows[:100]):
            lcol = other
    if lcol is None:
        if require_labels:
            raise DataError(
                f"{where}: no label column found among {columns} (looked for {list(LABEL_COLUMN_CANDIDATES)}). "
                "Pass label_column=... (CLI: --label-column)."
            )
    texts = []
    for i, r in enumerate(rows):
        t = r.get(tcol)
        if t is None or (isinstance(t, float) and math.isnan(t)):
            raise DataError(f"{where}: row {i + 1} has no value in text column {tcol!r}. Fill it in or remove the row.")
        if not isinstance(t, str):
            t = str(t)
        texts.append(t)
    _check_texts_not_blank(texts, f"{where}: text column {tcol!r}")
    labels = None
    k = num_labels
    names = list(label_names) if label_names is not None else None
    if lcol is not None:
        raw = [r.get(lcol) for r in rows]
        labels, k, names = _encode_labels(raw, where, lcol, num_labels, label_names, contiguous=require_labels)
        if num_labels is None and label_names is None:
            k = max(k, 2)  # a binary file whose rows happen to hold one class still has two classes
    return TextDataset(texts=texts, labels=labels, num_labels=k, label_names=names, source=source,
                       text_column=tcol, label_column=lcol)


def _from_hf_dataset(ds, text_column, label_column, num_labels, label_names, require_labels) -> TextDataset:
    try:
        # Lazy: optional Hugging Face datasets, only for a Dataset object passed in.
        import datasets as hf_datasets
    except ImportError:  # pragma: no cover
        hf_datasets = None
    if hf_datasets is not None and isinstance(ds, hf_datasets.DatasetDict):
        raise DataError(
            f"Got a DatasetDict with splits {list(ds)}; pass one split, e.g. ds['train']."
        )
    if hf_datasets is None or not isinstance(ds, hf_datasets.Dataset):
        raise DataError(
            f"`data` must be a path to a .tsv/.csv/.jsonl file or a datasets.Dataset; got {type(ds).__name__}."
        )
    where = f"datasets.Dataset({ds.num_rows} rows)"
    columns = list(ds.column_names)
    if ds.num_rows == 0:
        raise DataError(f"{where} is empty. Pass a dataset with examples.")
    features = ds.features
    lcol_guess = _pick_column(columns, label_column, LABEL_COLUMN_CANDIDATES, "label", where, "label_column")
    rows = ds.to_list()
    feat = features.get(lcol_guess) if lcol_guess is not None else None
    if isinstance(feat, hf_datasets.ClassLabel):
        # a ClassLabel column stores class indices of the schema's names: compare names, never positions
        class_names = list(feat.names)
        for r in rows:
            v = r.get(lcol_guess)
            r[lcol_guess] = class_names[v] if isinstance(v, int) and 0 <= v < len(class_names) else None
        if label_names is None and num_labels is None:  # the schema (not the rows) declares the label set
            num_labels, label_names = check_label_set(class_names, "the ClassLabel names of the label column")
    out = _build_text(rows, columns, where, text_column, label_column or lcol_guess, num_labels, label_names,
                      require_labels, source=None)
    return out


def load_image_folder(path: str | os.PathLike, *, label_names: Sequence[str] | None = None,
                      labels: Sequence[str | int] | str | None = None,
                      num_labels: int | None = None, require_labels: bool = True) -> ImageDataset:
    """Load ``ROOT/<class name>/<image file>`` as an :class:`ImageDataset`.

    Every image is opened once with PIL to check that it is readable.  ``labels`` (the declared
    label set, see :func:`check_label_set`) or ``label_names`` (the classes of an existing model)
    fix the classes and their order: every class folder must be one of them.  Without either, the
    classes are the sorted folder names (fine for public data only).  With ``require_labels=False`` (for
    prediction) a folder without class sub-folders loads its own images unlabelled, and so does one image file.

    Raises
    ------
    DataError
        Missing directory, no class sub-folders, no images, an unreadable image, an unknown class.
    """
    root = Path(path).expanduser()
    where = str(root)
    if not root.exists():
        what = "Image file" if root.suffix.lower() in IMAGE_EXTENSIONS else "Image folder"
        raise DataError(f"{what} {where!r} does not exist. Check the path.")
    if not root.is_dir():
        if not require_labels and root.suffix.lower() in IMAGE_EXTENSIONS:
            return _unlabelled_images([root], root, num_labels, label_names, labels)
        raise DataError(f"{where!r} is a file; an image dataset is a folder with one sub-folder per class.")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes and not require_labels:
        files = sorted(f for f in root.iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
        if files:
            return _unlabelled_images(files, root, num_labels, label_names, labels)
    if not classes:
        raise DataError(f"{where!r} has no class sub-folders. Put images in ROOT/<class name>/<file>"
                        + ("." if require_labels else ", or the images to predict directly in it."))
    num_labels, label_names = _declared(labels, num_labels, label_names)
    declared = label_names is not None or num_labels is not None
    if label_names is not None:
        names = list(label_names)
    elif num_labels is not None:
        names = [str(i) for i in range(num_labels)]
    else:
        names = classes
    unknown = [c for c in classes if c not in names]
    if unknown:  # folder names are the private rows' labels: count them, do not list them
        raise DataError(
            f"{where!r}: {len(unknown)} class folder(s) are not among the declared labels "
            f"{describe_label_set(len(names), label_names if declared else names)}. Use only these classes, or "
            "declare the full label set (e.g. --labels)."
        )
    images, labels_out = [], []
    for c in classes:
        for f in sorted((root / c).iterdir()):
            if f.suffix.lower() not in IMAGE_EXTENSIONS or not f.is_file():
                continue
            _check_readable_image(f)
            images.append(str(f))
            labels_out.append(names.index(c))
    if not images:
        raise DataError(
            f"{where!r} contains no images with extensions {list(IMAGE_EXTENSIONS)} in its class folders."
        )
    return ImageDataset(images=images, labels=labels_out, num_labels=len(names),
                        label_names=None if declared and label_names is None else names, source=str(root.resolve()))


def _check_readable_image(path: Path) -> None:
    """Open ``path`` once with Pillow (lazily imported: privtune.data stays light for text); DataError if it is
    not a readable image."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as exc:
        raise DataError(f"Cannot read image {str(path)!r}: {exc}. Remove or replace the file.") from None


def _unlabelled_images(files: list[Path], root: Path, num_labels: int | None, label_names: Sequence[str] | None,
                       labels: Any) -> ImageDataset:
    """Unlabelled images (for prediction), each opened once to check that it is readable."""
    for f in files:
        _check_readable_image(f)
    num_labels, label_names = _declared(labels, num_labels, label_names)
    return ImageDataset(images=[str(f) for f in files], labels=None, num_labels=num_labels,
                        label_names=None if label_names is None else list(label_names), source=str(root.resolve()))


def load_idx_dataset(images_file: str | os.PathLike, labels_file: str | os.PathLike | None = None, *,
                     labels: Sequence[str | int] | str | None = None, num_labels: int | None = None,
                     label_names: Sequence[str] | None = None, require_labels: bool = True) -> ImageDataset:
    """Load an IDX images file (and its labels file) as an :class:`ImageDataset` (the format, the labels file's
    name and the label conventions: :mod:`privtune.data.idx`).

    Parameters
    ----------
    images_file : path
        An unsigned-byte IDX file of N greyscale images, ``.gz``-compressed or not.
    labels_file : path, optional
        The matching labels file.  Default: the file found by the standard naming (module docstring).
    labels, num_labels, label_names
        The declared (public) label set: integer classes ``0..K-1`` (``labels=[0, ..., K-1]`` or
        ``num_labels=K``).  Every label in the file must be one of them.  Undeclared (public files only):
        K = largest label + 1, and every index below it must occur.
    require_labels : bool, default True
        False: images without a labels file load unlabelled (for prediction).

    Raises
    ------
    DataError
        A file that is missing, truncated, damaged or of the wrong kind (magic number); image and label
        counts that differ; a label outside the declared classes; declared class names (the format has none).
    """
    # Lazy: numpy and the IDX reader only for IDX files.
    from privtune.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, idx_labels_path, read_idx

    num_labels, label_names = _declared(labels, num_labels, label_names)
    images_path = Path(images_file).expanduser()
    where = str(images_path)
    if label_names is not None and any(label_kind(n)[0] != "int" for n in label_names):
        raise DataError(
            f"{where!r}: IDX label files hold class indices and no class names, but the declared labels are the names "
            f"{describe_label_set(len(label_names), list(label_names))} (names are never mapped onto integers). "
            "Declare the classes as integers, e.g. --labels 0,1,...,9 (Python: num_labels=10)."
        )
    pixels = read_idx(images_path, IDX_IMAGES_MAGIC, "images")
    lab_path = Path(labels_file).expanduser() if labels_file is not None else idx_labels_path(images_path)
    values = None
    if lab_path is None:
        if require_labels:
            raise DataError(
                f"No labels file found for the IDX images {where!r}: looked for the standard name (images → labels, "
                "idx3 → idx1, e.g. train-labels-idx1-ubyte.gz) in the same folder. Put the labels file there under "
                "that name, or pass it: load_idx_dataset(images_file, labels_file)."
            )
    else:
        values = read_idx(lab_path, IDX_LABELS_MAGIC, "labels")
        if values.shape[0] != pixels.shape[0]:
            raise DataError(
                f"The IDX images file {where!r} holds {pixels.shape[0]} images but the labels file {str(lab_path)!r} "
                f"holds {values.shape[0]} labels; pass the labels file of these images."
            )
    # Lazy: Pillow only for image data: keeps privtune.data light for text.
    from PIL import Image

    images: list[Any] = [Image.fromarray(a) for a in pixels]
    if values is None:
        k = num_labels if label_names is None else len(label_names)
        return ImageDataset(images=images, labels=None, num_labels=k, label_names=None,
                            source=str(images_path.resolve()))
    encoded, k, _ = _encode_labels(values.tolist(), f"IDX labels file {str(lab_path)!r}", "label", num_labels,
                                   label_names, contiguous=True)
    if num_labels is None and label_names is None:
        k = max(k, 2)
    # the images file identifies the data set for the ledger (one budget, whichever labels file is used)
    return ImageDataset(images=images, labels=encoded, num_labels=k, label_names=None,
                        source=str(images_path.resolve()))


def load_dataset(data: Any, text_column: str | None = None, label_column: str | None = None, *,
                 label_names: Sequence[str] | None = None, num_labels: int | None = None,
                 require_labels: bool = True,
                 labels: Sequence[str | int] | str | None = None) -> TextDataset | ImageDataset:
    """Load any supported dataset: a directory is an image folder, an IDX file (``*-ubyte[.gz]``, see
    :mod:`privtune.data.idx`) holds images, another file is a text table, a ``datasets.Dataset`` is converted.
    An existing TextDataset/ImageDataset is returned unchanged, or, with a declared label set (``labels``, ``label_names`` or ``num_labels``), checked against it
    and re-indexed in the declared order (:func:`with_label_set`)."""
    num_labels, label_names = _declared(labels, num_labels, label_names)
    if isinstance(data, (TextDataset, ImageDataset)):
        if label_names is None and num_labels is None:
            return data
        return with_label_set(data, num_labels if label_names is None else len(label_names), label_names)
    if isinstance(data, (str, os.PathLike)) and (Path(data).expanduser().is_dir()
                                                  or Path(data).suffix.lower() in IMAGE_EXTENSIONS):
        return load_image_folder(data, label_names=label_names, num_labels=num_labels, require_labels=require_labels)
    if isinstance(data, (str, os.PathLike)):
        # Lazy: numpy and the IDX reader only for IDX files.
        from privtune.data.idx import is_idx_path

        if is_idx_path(data):  # MNIST-style IDX images; the labels file by the standard naming
            return load_idx_dataset(data, label_names=label_names, num_labels=num_labels,
                                    require_labels=require_labels)
    return load_text_dataset(data, text_column, label_column, num_labels=num_labels, label_names=label_names,
                             require_labels=require_labels)


def _declared(labels: Any, num_labels: int | None, label_names: Sequence[str] | None
              ) -> tuple[int | None, list[str] | None]:
    """Merge the ways of declaring a label set into ``(num_labels, label_names)`` (both None: undeclared)."""
    if labels is None:
        return num_labels, (list(label_names) if label_names is not None else None)
    if label_names is not None or num_labels is not None:
        raise InvalidParameterError("Pass the label set once: `labels`, or `label_names` / `num_labels`, not both.")
    return check_label_set(labels)


def with_label_set(ds: TextDataset | ImageDataset, num_labels: int, label_names: Sequence[str] | None,
                   what: str = "data") -> TextDataset | ImageDataset:
    """``ds`` with its labels re-indexed into a declared label set (``label_names`` in class order, or
    integer classes ``0..num_labels-1`` when ``label_names`` is None).

    Names are matched by name, integers by value; names are never mapped onto integers or the other way
    round.  DataError (with a row number, never the row's label) when a label is not in the set."""
    if ds.labels is None:
        return dataclasses.replace(ds, num_labels=num_labels,
                                   label_names=list(label_names) if label_names is not None else None)
    where = f"`{what}` ({ds.source or 'in-memory dataset'})"
    if ds.label_names is not None:
        raw = [ds.label_names[k] if 0 <= k < len(ds.label_names) else None for k in ds.labels]
    else:
        raw = list(ds.labels)
    new, k, names = _encode_labels(raw, where, "label", num_labels if label_names is None else None,
                                   label_names)
    return dataclasses.replace(ds, labels=new, num_labels=k, label_names=names)


def check_disjoint(train: Any, other: Any, what: str, against: str | None = None) -> None:
    """Refuse a split that shares an example with the training data (text compared after stripping
    whitespace; images by content); ``against`` names ``train`` when it is another split than the
    training data (e.g. ``"public_eval_data"``).

    This check reads the private data and can abort the run; it happens before anything is reserved
    or written, and its message gives the number of shared examples, never their text.  The abort
    itself is outside the (ε, δ) guarantee (docs/privacy-model.md)."""
    if other is None:
        return
    if len(other) == 0:
        raise DataError(f"`{what}` is empty. Pass a split with labelled examples or leave it out.")
    if getattr(other, "labels", None) is None:
        raise DataError(f"`{what}` has no labels; accuracy cannot be computed. Add a label column.")
    overlap = _rows(train) & _rows(other)
    if overlap and against is not None:
        raise DataError(
            f"`{what}` overlaps `{against}`: {len(overlap)} example(s) appear in both. The reported accuracy must "
            "come from examples the selection did not see; remove the shared examples from one of the files."
        )
    if overlap:
        raise DataError(
            f"`{what}` overlaps the training data: {len(overlap)} example(s) appear in both. Selection and "
            "reported accuracy must use held-out examples; remove the shared examples from one of the files."
        )


def _rows(ds: Any) -> set:
    if getattr(ds, "kind", None) == "text":
        return {t.strip() for t in ds.texts}
    return set(ds.canonical_rows())


def declared_label_set(labels: Any = None, *, model: Any = None, public_data: Any = None,
                       public_what: str = "public_eval_data") -> tuple[int, list[str] | None, str]:
    """The run's label set from PUBLIC sources only: ``(num_labels, label_names, where it came from)``.

    In this order: ``labels`` (``--labels``, ``labels=[...]``, config key ``labels``); the labels of a
    split declared public (``public_data``, a loaded dataset); the model's own label set (a privtune
    model directory, a loaded Classifier, or a Hugging Face config whose ``id2label`` names real classes,
    not the ``LABEL_0`` defaults).  The private training data is never consulted: its label set would be
    released in the model (head shape, names).

    Raises
    ------
    InvalidParameterError
        No source, or an invalid declaration (see :func:`check_label_set`).
    """
    if labels is not None:
        k, names = check_label_set(labels)
        return k, names, "declared labels"
    if public_data is not None and getattr(public_data, "labels", None) is not None:
        k = int(public_data.num_labels)
        names = list(public_data.label_names) if public_data.label_names is not None else None
        if k < 2:
            raise InvalidParameterError(
                f"`{public_what}` has labels of a single class, so it cannot declare the label set. "
                + LABELS_HOWTO)
        return k, names, f"the labels of `{public_what}`"
    # Lazy: models.classifier imports torch and transformers helpers, which loading data does not need.
    from privtune.models.classifier import saved_label_set

    found = saved_label_set(model)  # model None: the bundled backbone (whose config names no classes)
    if found is not None:
        return found[0], found[1], "the model's label set"
    raise InvalidParameterError(
        "The label set is not declared. privtune does not read it from the private training data, because "
        "the class count and names are written into the released model. " + LABELS_HOWTO
        + " (`privtune tune --public-eval-data FILE` also takes it from the public split; every command takes "
        "it from a model whose config names its classes.)"
    )



# --------------------------------------------------------------------------------------------- embedded

# the demo's label set, declared (public): SST-2's 0 = negative, 1 = positive
EMBEDDED_LABELS = (0, 1)

EMBEDDED_FILES = {"train": "sst2_train.tsv", "public_validation": "sst2_public_validation.tsv", "test": "sst2_dev.tsv"}


def embedded_path(split: str) -> Path:
    """Path of an embedded SST-2 split file: ``"train"``, ``"public_validation"`` or ``"test"``."""
    if split not in EMBEDDED_FILES:
        raise DataError(f"`split` must be one of {list(EMBEDDED_FILES)}. Got {split!r}.")
    return Path(str(resources.files("privtune.data").joinpath("embedded", EMBEDDED_FILES[split])))


def embedded_sst2() -> tuple[TextDataset, TextDataset, TextDataset]:
    """The SST-2 subset shipped with privtune: ``(train, public_validation, test)``.

    * ``train``: 3,000 phrases from the GLUE SST-2 training set (the private data of the demo);
    * ``public_validation``: 500 other training-set phrases, disjoint from ``train``, which the demo
      *declares public* so that hyperparameter selection can use them without privacy cost;
    * ``test``: the 872 GLUE dev sentences, the reported split (never used for selection).

    Labels: 0 = negative, 1 = positive.  Built by ``scripts/make_embedded_data.py`` (seeded).
    """
    names = ("train", "public_validation", "test")
    return tuple(load_text_dataset(embedded_path(s), labels=EMBEDDED_LABELS) for s in names)  # type: ignore[return-value]


#: ``--data`` value of the image demo: the Fashion-MNIST subset shipped with privtune
EMBEDDED_IMAGE_DEMO = "embedded:fashion-mnist"
#: the image demo's backbone (``--model`` unset): ImageNet EfficientNet-Lite0 (privtune.models.vision)
EMBEDDED_IMAGE_MODEL = "efficientnet-lite0"
#: what its head reads (``--image-features`` unset): each stage's pooled output with the final features, which
#: suit Fashion-MNIST's greyscale garments better than ImageNet's last stage alone (docs/benchmarks.md)
EMBEDDED_IMAGE_FEATURES = "stages"
#: the image demo's label set, declared (public): Fashion-MNIST's ten classes, by their integers 0-9
EMBEDDED_IMAGE_LABELS = tuple(range(10))
EMBEDDED_IMAGE_FILES = {"train": "fashion_train-images-idx3-ubyte.gz",
                        "public_validation": "fashion_public-images-idx3-ubyte.gz",
                        "test": "fashion_test-images-idx3-ubyte.gz"}


def embedded_fashion_mnist() -> tuple[ImageDataset, ImageDataset, ImageDataset]:
    """The Fashion-MNIST subset shipped with privtune: ``(train, public_validation, test)``, 28 × 28 greyscale.

    * ``train``: 3,000 Fashion-MNIST training images (the private data of the image demo);
    * ``public_validation``: 500 other training images, which the demo *declares public* for selection;
    * ``test``: 1,000 test-set images, the reported split (never used for selection).

    Labels 0-9 (0 T-shirt/top, 1 Trouser, 2 Pullover, 3 Dress, 4 Coat, 5 Sandal, 6 Shirt, 7 Sneaker, 8 Bag,
    9 Ankle boot).  Fashion-MNIST: Xiao, Rasul and Vollgraf (2017), Zalando SE, MIT licence.  Built by
    ``scripts/make_embedded_fashion_mnist.py`` (seeded).
    """
    folder = resources.files("privtune.data").joinpath("embedded")
    return tuple(load_dataset(str(folder.joinpath(EMBEDDED_IMAGE_FILES[s])), labels=EMBEDDED_IMAGE_LABELS)  # type: ignore[return-value]
                 for s in ("train", "public_validation", "test"))
