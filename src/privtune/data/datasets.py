"""Dataset containers and loaders (text tables, HF ``datasets`` objects, image folders)."""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from privtune.errors import DataError

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

    def load_image(self, i: int):
        """The i-th image as an RGB ``PIL.Image`` (files are opened lazily)."""
        from PIL import Image

        img = self.images[i]
        if isinstance(img, (str, os.PathLike)):
            try:
                with Image.open(img) as im:
                    return im.convert("RGB")
            except Exception as exc:  # PIL raises many types
                raise DataError(f"Cannot read image {str(img)!r}: {exc}. Remove or replace the file.") from None
        return img.convert("RGB")

    def canonical_rows(self) -> Iterable[bytes]:
        for i, img in enumerate(self.images):
            lab = "" if self.labels is None else str(self.labels[i])
            if isinstance(img, (str, os.PathLike)):
                yield lab.encode() + b"\t" + Path(img).read_bytes()
            else:
                yield lab.encode() + b"\t" + img.tobytes()


# --------------------------------------------------------------------------------------------- labels


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
    left to the caller (training reports "needs at least two classes")."""
    try:
        present = sorted({int(x) for x in labels})
    except (TypeError, ValueError):
        raise DataError(
            f"{where}: `labels` must be integer class indices 0..K-1. Got {list(labels)[:5]!r}. Map class names "
            "to indices (or load the file with load_text_dataset, which does it)."
        ) from None
    if len(present) < 2 or present == list(range(present[-1] + 1)):
        return
    missing = sorted(set(range(present[-1] + 1)) - set(present))
    shown = ", ".join(map(str, present[:10])) + (", ..." if len(present) > 10 else "")
    gaps = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
    col = f" in column {column!r}" if column else ""
    raise DataError(
        f"{where}: the integer labels{col} are {{{shown}}}, which skips class(es) {{{gaps}}}; integer labels must "
        f"be the class indices 0..K-1 with every class present, or class names (e.g. neg/pos). Renumber them "
        f"0..{len(present) - 1} or use names. If some classes are genuinely absent, give the number of classes "
        f"explicitly: load_text_dataset(..., num_labels={present[-1] + 1}) or TextDataset(..., "
        f"num_labels={present[-1] + 1}), and pass that dataset."
    )


def _encode_labels(
    raw: Sequence[Any], where: str, column: str, num_labels: int | None, label_names: Sequence[str] | None,
    contiguous: bool = True,
) -> tuple[list[int], int, list[str] | None]:
    """Turn raw label values into class indices; DataError on missing/out-of-range/mixed labels, and (with
    ``contiguous``, for training data whose class count is inferred) on integer labels that skip a class."""
    for i, v in enumerate(raw):
        if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v)):
            raise DataError(
                f"{where}: row {i + 1} has an empty value in label column {column!r}. "
                "Fill in the label or remove the row."
            )
    if label_names is not None:
        index = {str(n): k for k, n in enumerate(label_names)}
        ints = [_as_int_label(v) for v in raw]
        out = []
        for i, v in enumerate(raw):
            if str(v).strip() in index:
                out.append(index[str(v).strip()])
            elif ints[i] is not None and 0 <= ints[i] < len(label_names):
                out.append(ints[i])
            else:
                raise DataError(
                    f"{where}: row {i + 1} has label {v!r} in column {column!r}, which is not one of the "
                    f"model's classes {list(label_names)}. Use the same label set as the training data."
                )
        return out, len(label_names), list(label_names)
    ints = [_as_int_label(v) for v in raw]
    if all(x is not None for x in ints):
        labels = [int(x) for x in ints]  # type: ignore[arg-type]
        bad = [(i, x) for i, x in enumerate(labels) if x < 0 or (num_labels is not None and x >= num_labels)]
        if bad:
            i, x = bad[0]
            allowed = f"[0, {num_labels})" if num_labels is not None else "[0, ∞)"
            raise DataError(
                f"{where}: label {x} in row {i + 1} (column {column!r}) is out of range; labels must be "
                f"integers in {allowed} ({len(bad)} row(s) affected). Renumber the classes 0..K-1"
                + (f" or pass num_labels > {max(b[1] for b in bad)}." if num_labels is not None else ".")
            )
        if num_labels is None and contiguous:
            _check_contiguous(labels, where, column)
        k = num_labels if num_labels is not None else max(labels) + 1
        return labels, k, None
    if any(x is not None for x in ints) and any(isinstance(v, (numbers.Real,)) for v in raw):
        i = next(i for i, x in enumerate(ints) if x is None)
        raise DataError(
            f"{where}: label {raw[i]!r} in row {i + 1} (column {column!r}) is not a whole number while other "
            "labels are numeric. Use integer class indices 0..K-1 or class names throughout."
        )
    names = sorted({str(v).strip() for v in raw})
    if num_labels is not None and len(names) > num_labels:
        raise DataError(
            f"{where}: column {column!r} has {len(names)} distinct labels {names[:10]} but num_labels={num_labels}. "
            "Pass a larger num_labels or fix the labels."
        )
    index = {n: k for k, n in enumerate(names)}
    return [index[str(v).strip()] for v in raw], num_labels or len(names), names


def _pick_column(columns: list[str], given: str | None, candidates: tuple[str, ...], what: str, where: str,
                 flag: str, exclude: str | None = None) -> str | None:
    if given is not None:
        if given not in columns:
            import difflib

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


def _read_table(path: Path, fmt: str, single_column_ok: bool = False) -> tuple[list[str], list[dict[str, Any]]]:
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
    num_labels : int, optional
        Number of classes; integer labels must lie in ``[0, num_labels)``.  Default: max label + 1.
    label_names : list of str, optional
        The class names of an existing model; string labels are mapped onto them.
    require_labels : bool, default True
        If False, a missing label column gives an unlabelled dataset (for prediction).

    Raises
    ------
    DataError
        Unreadable or empty file, missing columns, empty text, labels out of range.
    """
    if data is None:
        raise DataError("`data` is None. Pass a .tsv/.csv/.jsonl file or a datasets.Dataset.")
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
    columns, rows = _read_table(path, fmt, single_column_ok=not require_labels)
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
    if lcol_guess is not None and label_names is None:
        feat = features.get(lcol_guess)
        if isinstance(feat, hf_datasets.ClassLabel):
            label_names = list(feat.names)
            num_labels = feat.num_classes
    rows = ds.to_list()
    out = _build_text(rows, columns, where, text_column, label_column or lcol_guess, num_labels, label_names,
                      require_labels, source=None)
    return out


def load_image_folder(path: str | os.PathLike, *, label_names: Sequence[str] | None = None) -> ImageDataset:
    """Load ``ROOT/<class name>/<image file>`` as an :class:`ImageDataset` (classes sorted by name).

    Every image is opened once with PIL to check that it is readable.  ``label_names`` (the
    classes of an existing model) fixes the class order instead of sorting.

    Raises
    ------
    DataError
        Missing directory, no class sub-folders, no images, an unreadable image, an unknown class.
    """
    root = Path(path).expanduser()
    where = str(root)
    if not root.exists():
        raise DataError(f"Image folder {where!r} does not exist. Check the path.")
    if not root.is_dir():
        raise DataError(f"{where!r} is a file; an image dataset is a folder with one sub-folder per class.")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{where!r} has no class sub-folders. Put images in ROOT/<class name>/<file>.")
    names = list(label_names) if label_names is not None else classes
    unknown = [c for c in classes if c not in names]
    if unknown:
        raise DataError(f"{where!r}: class folders {unknown} are not among the model's classes {names}.")
    from PIL import Image

    images, labels = [], []
    for c in classes:
        for f in sorted((root / c).iterdir()):
            if f.suffix.lower() not in IMAGE_EXTENSIONS or not f.is_file():
                continue
            try:
                with Image.open(f) as im:
                    im.verify()
            except Exception as exc:
                raise DataError(f"Cannot read image {str(f)!r}: {exc}. Remove or replace the file.") from None
            images.append(str(f))
            labels.append(names.index(c))
    if not images:
        raise DataError(
            f"{where!r} contains no images with extensions {list(IMAGE_EXTENSIONS)} in its class folders."
        )
    return ImageDataset(images=images, labels=labels, num_labels=len(names), label_names=names,
                        source=str(root.resolve()))


def load_dataset(data: Any, text_column: str | None = None, label_column: str | None = None, *,
                 label_names: Sequence[str] | None = None, num_labels: int | None = None,
                 require_labels: bool = True) -> TextDataset | ImageDataset:
    """Load any supported dataset: an existing TextDataset/ImageDataset is returned unchanged, a
    directory is an image folder, a file is a text table, a ``datasets.Dataset`` is converted."""
    if isinstance(data, (TextDataset, ImageDataset)):
        return data
    if isinstance(data, (str, os.PathLike)) and Path(data).expanduser().is_dir():
        return load_image_folder(data, label_names=label_names)
    return load_text_dataset(data, text_column, label_column, num_labels=num_labels, label_names=label_names,
                             require_labels=require_labels)


# --------------------------------------------------------------------------------------------- embedded

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
    return tuple(load_text_dataset(embedded_path(s), num_labels=2) for s in names)  # type: ignore[return-value]
