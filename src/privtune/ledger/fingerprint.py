"""Content fingerprints: a dataset is identified by what it contains, not where it lives.

:func:`dataset_fingerprint` returns the SHA-256 (64 lowercase hex digits) of a dataset's
canonical bytes, so renaming or moving a file keeps its privacy budget.  That digest is a
deterministic function of the private data: anyone holding the data minus one row can test
candidate rows against it, so it is **never published**.  The ledger stores only
``HMAC-SHA256(ledger key, digest)`` (:meth:`privtune.ledger.Ledger.fingerprint`), and run
directories carry the ledger's random ``dataset_id``.  What is hashed:

* a **file**: its bytes, read in 1 MiB chunks (the file name and location are not hashed);
  ``dataset_fingerprint(path) == dataset_fingerprint(path.read_bytes())``;
* ``bytes`` / ``bytearray`` / ``memoryview``: those bytes;
* an **iterable of chunks** (``bytes`` or ``str``, the latter encoded as UTF-8) for data too
  large to hold in memory: the hash of their concatenation, so the way a stream is cut into
  chunks does not matter;
* a **directory** (e.g. an image folder or a saved Hugging Face dataset): every regular file
  below it, in sorted order of its path *relative to the directory* (relative paths matter,
  class folders carry labels; the directory's own name and location do not).

What the fingerprint cannot see: a re-encoded, re-ordered or converted copy of the same
examples has different bytes and therefore a different fingerprint, i.e. a fresh budget.
Keep one canonical copy of a dataset and fingerprint that.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from privtune.errors import DataError, InvalidParameterError

_CHUNK = 1 << 20
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_DIR_MAGIC = b"privtune-dataset-directory-v1\0"


def is_fingerprint(value: Any) -> bool:
    """True when ``value`` is a string of exactly 64 hexadecimal digits (a SHA-256 fingerprint)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def _hash_file(path: Path, h: Any) -> None:
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                h.update(chunk)
    except OSError as exc:
        raise DataError(f"Cannot read dataset file {str(path)!r}: {exc.strerror or exc}.") from None


def _fingerprint_path(path: Path) -> str:
    if path.is_file():
        h = hashlib.sha256()
        _hash_file(path, h)
        return h.hexdigest()
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file()),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise DataError(f"Dataset directory {str(path)!r} contains no files; nothing to fingerprint.")
        outer = hashlib.sha256(_DIR_MAGIC)
        for p in files:
            inner = hashlib.sha256()
            _hash_file(p, inner)
            rel = p.relative_to(path).as_posix().encode("utf-8")
            outer.update(len(rel).to_bytes(8, "big") + rel + inner.digest())
        return outer.hexdigest()
    raise DataError(
        f"`dataset` path {str(path)!r} does not exist (or is not a regular file or directory). "
        "Pass the path of the dataset file or folder."
    )


def dataset_fingerprint(data: str | os.PathLike | bytes | bytearray | memoryview | Iterable) -> str:
    """SHA-256 of a dataset's canonical content, independent of its file name and location.

    Parameters
    ----------
    data : path (``str`` or ``os.PathLike``) of a file or directory, ``bytes``-like, or an
        iterable of ``bytes``/``str`` chunks (a stream; chunk boundaries do not matter).

    Returns
    -------
    str
        64 lowercase hexadecimal digits.

    Raises
    ------
    DataError
        the path does not exist, cannot be read, or a directory is empty.
    InvalidParameterError
        ``data`` is of an unsupported type, or a stream yields something other than bytes/str.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(data)).hexdigest()
    if isinstance(data, (str, os.PathLike)):
        return _fingerprint_path(Path(os.fspath(data)).expanduser())
    if isinstance(data, Iterable) and not isinstance(data, dict):
        h = hashlib.sha256()
        for i, chunk in enumerate(data):
            if isinstance(chunk, str):
                chunk = chunk.encode("utf-8")
            elif not isinstance(chunk, (bytes, bytearray, memoryview)):
                raise InvalidParameterError(
                    f"`data` must yield bytes or str chunks when it is a stream. Chunk {i} is "
                    f"{type(chunk).__name__}. Serialise records first (e.g. one JSON line per example)."
                )
            h.update(chunk)
        return h.hexdigest()
    raise InvalidParameterError(
        f"`data` must be a path, bytes, or an iterable of bytes/str chunks. Got {type(data).__name__}. "
        "Pass the dataset's file or folder path."
    )


__all__ = ["dataset_fingerprint", "dataset_identity", "is_fingerprint"]


def dataset_identity(data) -> tuple[str, str | None]:
    """(content SHA-256, local file name) of a loaded privtune dataset, as ``train`` and ``tune`` charge it.

    The SHA-256 is that of the file the dataset was read from (so renaming or moving the file does
    not reset its budget) or, for in-memory data, of its canonical rows.  It is private: pass it to
    the ledger, which stores only its keyed fingerprint, and never publish it (nor a prefix of it).
    The file name (without its directory; None for in-memory data) is what the ledger records with a
    registration so that ``privtune budget show`` can tell datasets apart; it stays in the ledger, and
    a run directory publishes the dataset's random ``dataset_id`` instead.  Fingerprint the *whole*
    training set, before any split, or each part would get a budget of its own.
    """
    src = getattr(data, "source", None)
    if src is not None and Path(src).exists():
        return dataset_fingerprint(src), Path(src).name
    return dataset_fingerprint(data.canonical_rows()), None
