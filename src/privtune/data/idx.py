"""IDX image and label files (the MNIST / Fashion-MNIST format), plain or gzip-compressed.

An IDX file is a 4-byte magic number, one big-endian uint32 per dimension, then the data in C order.
privtune reads unsigned-byte files only: images ``0x00000803`` (N × rows × columns, greyscale 0–255)
and labels ``0x00000801`` (N class indices).  This module reads the format; :func:`privtune.data.load_idx_dataset`
turns a pair of files into an :class:`~privtune.data.ImageDataset` of greyscale ``PIL`` images (the model's
preprocessing turns them into 3 channels and resizes them).

**Which labels file.**  :func:`~privtune.data.load_idx_dataset` takes the labels file explicitly (``labels_file``) or
finds it next to the images by the standard naming: ``images`` → ``labels`` and ``idx3`` → ``idx1`` in
the file name, compressed or not (``train-images-idx3-ubyte.gz`` → ``train-labels-idx1-ubyte.gz``,
``t10k-images.idx3-ubyte`` → ``t10k-labels.idx1-ubyte``).  :func:`privtune.data.load_dataset` (and so
every ``--data`` / ``--eval-data`` path) uses the standard naming; without a labels file the images
load unlabelled (prediction only), or, when labels are required, the error names the file it looked for.

**Labels are class indices.**  The format stores integers and no class names, so the declared label set
(public input, never read from the file) is a class count: ``num_labels=10`` or ``labels=range(10)``
(CLI ``--labels 0,1,...,9``).  Class names are not mapped onto the file's integers by position.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from privtune.errors import DataError

__all__ = ["IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "is_idx_path", "idx_labels_path", "read_idx"]

#: magic number of an unsigned-byte IDX file with 3 dimensions (images: N × rows × columns)
IDX_IMAGES_MAGIC = 0x00000803
#: magic number of an unsigned-byte IDX file with 1 dimension (labels: N)
IDX_LABELS_MAGIC = 0x00000801
_UNSIGNED_BYTE = 0x08
_TYPE_NAMES = {0x08: "unsigned byte", 0x09: "signed byte", 0x0B: "int16", 0x0C: "int32", 0x0D: "float32",
               0x0E: "float64"}


def _stem(path: Path) -> str:
    name = path.name.lower()
    return name[:-3] if name.endswith(".gz") else name


def is_idx_path(path: str | os.PathLike) -> bool:
    """Whether a file name is an IDX file's (``*-ubyte``, ``*.idx``, ``*.idx1``/``*.idx3``; ``.gz`` or not):
    the names MNIST-style data sets use.  The name decides, so that a damaged IDX file gets the IDX error."""
    stem = _stem(Path(path))
    return stem.endswith("ubyte") or stem.rsplit(".", 1)[-1] in ("idx", "idx1", "idx3")


def idx_labels_path(images_path: str | os.PathLike) -> Path | None:
    """The labels file next to an images file by the standard naming (``images`` → ``labels``, ``idx3`` →
    ``idx1``; the compressed or the plain file), or None when the name has no ``images`` part or no such
    file exists."""
    p = Path(images_path).expanduser()
    name = p.name
    lower = name.lower()
    k = lower.rfind("images")
    if k < 0:
        return None
    name = name[:k] + "labels" + name[k + len("images"):]
    j = name.lower().rfind("idx3")
    if j >= 0:
        name = name[:j] + "idx1" + name[j + 4:]
    plain = name[:-3] if name.lower().endswith(".gz") else name
    for cand in (name, plain + ".gz", plain):
        if (p.parent / cand).is_file():
            return p.parent / cand
    return None


def _read_bytes(path: Path, what: str) -> bytes:
    where = str(path)
    if not path.exists():
        raise DataError(f"IDX {what} file {where!r} does not exist. Check the path.")
    if path.is_dir():
        raise DataError(f"{where!r} is a directory; pass the IDX {what} file (e.g. train-images-idx3-ubyte.gz).")
    try:
        if path.name.lower().endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(
            f"IDX {what} file {where!r} is a truncated or damaged gzip file ({type(exc).__name__}: {exc}). "
            "Download or copy it again."
        ) from None
    except OSError as exc:
        raise DataError(f"Cannot read IDX {what} file {where!r}: {exc.strerror or exc}.") from None


def read_idx(path: str | os.PathLike, magic: int, what: str = "images") -> np.ndarray:
    """The array in an unsigned-byte IDX file whose magic number must be ``magic``
    (:data:`IDX_IMAGES_MAGIC` or :data:`IDX_LABELS_MAGIC`): uint8, shape as the header says.

    Raises
    ------
    DataError
        A missing, truncated or damaged file; a wrong magic number (another data type or number of
        dimensions, or not an IDX file); a zero dimension; bytes left over after the data."""
    p = Path(path).expanduser()
    where = str(p)
    raw = _read_bytes(p, what)
    ndim = magic & 0xFF
    kind = "images (N × rows × columns)" if ndim == 3 else "labels (N)"
    if len(raw) < 4:
        raise DataError(f"IDX {what} file {where!r} is truncated: {len(raw)} bytes, shorter than the 4-byte magic "
                        "number. Download or copy it again.")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        if raw[0] == 0 and raw[1] == 0 and raw[2] != _UNSIGNED_BYTE and raw[2] in _TYPE_NAMES:
            detail = f"it holds {_TYPE_NAMES[raw[2]]} values with {raw[3]} dimension(s); privtune reads unsigned bytes"
        elif raw[0] == 0 and raw[1] == 0 and raw[2] == _UNSIGNED_BYTE:
            detail = (f"it has {raw[3]} dimension(s), {what} files have {ndim} "
                      f"({'is it the labels file?' if raw[3] == 1 else 'is it the images file?'})")
        else:
            detail = "this is not an IDX file"
        raise DataError(
            f"IDX {what} file {where!r} has the magic number 0x{found:08X}, expected 0x{magic:08X} for unsigned-byte "
            f"{kind}: {detail}. Pass the {what} file of an MNIST-style data set."
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"IDX {what} file {where!r} is truncated inside its header ({len(raw)} of {header} bytes). "
                        "Download or copy it again.")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    if any(d == 0 for d in dims):
        raise DataError(f"IDX {what} file {where!r} has the dimensions {list(dims)}: no {what} (a zero dimension). "
                        f"Pass a file with {what}.")
    size = int(np.prod(dims, dtype=np.int64))
    have = len(raw) - header
    if have < size:
        raise DataError(
            f"IDX {what} file {where!r} is truncated: its header declares {' × '.join(map(str, dims))} = {size} "
            f"bytes of data but the file holds {have}. Download or copy it again."
        )
    if have > size:
        raise DataError(
            f"IDX {what} file {where!r} has {have - size} bytes after the {' × '.join(map(str, dims))} values its "
            "header declares: the dimensions do not match the data. Download or copy it again."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
