"""How a run reaches its outputs: checks before the ledger, private state files, a staged release.

The order every budget-spending run follows (``privtune train`` and ``privtune tune``):

1. validate the arguments and the data (nothing is written, nothing is charged);
2. prepare the output directory (:func:`prepare_output_dir`): a path that is a file, an entry of
   the wrong kind where a released file goes, or a directory that cannot be written is one clear
   error *before* the ledger is touched;
3. reserve the planned privacy cost in the ledger, then train (the private state of an unfinished run
   lives in files created 0600 in 0700 directories: :func:`private_dir`, :func:`private_torch_save`);
4. write the released files into a private staging directory inside RUN_DIR and move them into
   place, ``certificate.json`` last (:func:`release_files`);
5. commit the actual cost in the ledger, then delete the private state.

A crash anywhere leaves the reservation charged (it is never refunded: the run may have read data)
and the private state in place, so ``--resume`` finishes the run without a second charge.

``PRIVTUNE_TEST_FAULT`` (read by :func:`fault_point`) is for the fault-injection tests only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from privtune.errors import InvalidParameterError, PrivtuneError

#: environment switch read only by the tests: ``STAGE`` raises at that stage, ``STAGE@kill`` sends the
#: process SIGKILL there (no ``finally``, no ``except``, no ``atexit``)
FAULT_ENV = "PRIVTUNE_TEST_FAULT"
#: RUN_DIR/STAGING_DIR: private directory where the released files are written before they are moved
STAGING_DIR = ".privtune-release"
#: the staged files move into RUN_DIR in this order; ``certificate.json`` (a finished run) comes last
CERTIFICATE = "certificate.json"


class InjectedFault(RuntimeError):
    """Raised by :func:`fault_point` in the fault-injection tests."""


def fault_point(stage: str) -> None:
    """Fail (``PRIVTUNE_TEST_FAULT=stage``) or die (``=stage@kill``) here; a no-op otherwise."""
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    name, _, how = want.partition("@")
    if name != stage:
        return
    if how == "kill":  # a real SIGKILL: nothing after this line runs (no finally, except or atexit)
        if hasattr(signal, "SIGKILL"):
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # pragma: no cover - platforms without SIGKILL
    raise InjectedFault(f"injected fault at stage {stage!r} ({FAULT_ENV})")


# ------------------------------------------------------------------------------ private state


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) and make it 0700 whatever the umask."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_open(path: Path, flags: int) -> int:
    """``os.open`` of a file that holds private state: created 0600, and made 0600 if it existed."""
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask could only remove bits; an older file may have had more
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically (temporary file + rename), mode 0600."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    fd = private_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else set back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_modes(path: Path) -> None:
    """Give ``path`` (a file, or a directory and everything in it) the modes of a file anyone may read:
    what a plain ``open``/``mkdir`` gives under the umask (0644 and 0755 under the usual 022).

    Released files are meant to be shared, and some libraries write theirs 0600 (safetensors writes
    through a private temporary file): without this a model's weights would be 0600 beside its
    0644 configuration.  Private state keeps its own modes (:func:`private_dir`, :func:`private_open`).
    """
    mask = _umask()
    items = [path] + (sorted(path.rglob("*")) if path.is_dir() and not path.is_symlink() else [])
    for p in items:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


# ------------------------------------------------------------------------------ output directory


def default_run_dir(prefix: str = "") -> Path:
    """``runs/[PREFIX-]YYYYmmdd-HHMMSS`` under the working directory: where a run writes when no directory is given
    (local time, to the second)."""
    import datetime

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / (f"{prefix}-{stamp}" if prefix else stamp)


def _kind_error(path: Path, want_dir: bool) -> InvalidParameterError:
    have = "a directory" if path.is_dir() else "a file"
    return InvalidParameterError(
        f"`output_dir`: {str(path)!r} is {have}, but the run writes its {'directory' if want_dir else 'file'} "
        f"{path.name!r} there. Nothing was charged. Move it away or pass another output directory (--output)."
    )


def check_output_path(out: Path, released: Sequence[str] = (), released_dirs: Sequence[str] = ()) -> None:
    """Refuse an output path that cannot hold a run, without creating anything.

    ``out`` must be a directory or not exist; each of ``released`` (files) and ``released_dirs``
    that already exists there must be of the same kind.
    """
    if out.exists() and not out.is_dir():
        raise InvalidParameterError(
            f"`output_dir` {str(out)!r} is an existing file, not a directory. Nothing was charged. Pass a new "
            "directory (--output RUN_DIR)."
        )
    for anc in out.parents:
        if anc.exists():
            if not anc.is_dir():
                raise InvalidParameterError(
                    f"`output_dir` {str(out)!r} cannot be created: {str(anc)!r} is a file. Nothing was charged. "
                    "Pass another directory (--output RUN_DIR)."
                )
            break
    for name in released:
        p = out / name
        if p.is_dir():
            raise _kind_error(p, want_dir=False)
    for name in released_dirs:
        p = out / name
        if (p.exists() or p.is_symlink()) and not p.is_dir():
            raise _kind_error(p, want_dir=True)


def prepare_output_dir(out: Path, released: Sequence[str] = (), released_dirs: Sequence[str] = ()) -> list[Path]:
    """Check ``out`` (:func:`check_output_path`), create it and prove it writable; before any reservation.

    Returns the directories this call created (outermost first), for :func:`discard_unreserved`.
    """
    check_output_path(out, released, released_dirs)
    created: list[Path] = []
    p = out
    while not p.exists():
        created.append(p)
        p = p.parent
    created.reverse()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".privtune-write-test-{uuid.uuid4().hex}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        discard_unreserved(created)
        raise InvalidParameterError(
            f"`output_dir` {str(out)!r} cannot be written ({exc.strerror or exc}). Nothing was charged. Fix its "
            "permissions or pass another directory (--output RUN_DIR)."
        ) from None
    return created


def discard_unreserved(created: Sequence[Path], files: Sequence[Path] = ()) -> None:
    """Remove what a run made before its reservation was refused: ``files``, then the (empty)
    directories of ``created``, innermost first.  Anything else found there is left alone."""
    for f in files:
        try:
            f.unlink()
        except OSError:
            pass
    for d in reversed(list(created)):
        try:
            d.rmdir()
        except OSError:
            pass


# ------------------------------------------------------------------------------ the release


def _move_into_place(src: Path, dst: Path, trash: Path) -> None:
    if dst.is_dir() and not dst.is_symlink():
        old = trash / f"old-{dst.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)  # a directory cannot be renamed over a non-empty one
    os.replace(src, dst)


#: released entries that keep the modes their writer gave them: the NOT PRIVATE directory is 0700 with
#: files 0600 (:data:`privtune.report.release.NOT_PRIVATE_DIR`)
KEEP_MODES = ("not_private",)


def release_files(out: Path, writers: Sequence[tuple[str, Callable[[Path], None]]],
                  derived: Callable[[Path], None] | None = None) -> None:
    """Write a run's released files into RUN_DIR without ever leaving half of them there.

    Each ``(name, write)`` writes ``name`` into the directory it is given: a private (0700) staging
    directory inside ``out``.  When all are written they are moved into ``out``, ``certificate.json``
    last (its presence marks a finished run).  ``derived(out)`` then writes what is regenerated from
    those files (report, model card; ``privtune report`` rewrites them).  Released files get the modes
    of shared files (:func:`public_modes`), except :data:`KEEP_MODES`.  Every step is idempotent: a
    resumed run calls this again after any interruption.

    Raises PrivtuneError (one line: what failed, that the reservation stays charged, and that
    ``--resume`` finishes the run) when a file cannot be written (a full disk, a permission changed
    during the run).
    """
    with charged_write("the run's files", out, "it writes the files again from the run's final state"):
        _release_files(out, writers, derived)


def write_failure(exc: BaseException) -> str | None:
    """The operating system's words when writing a file failed for a reason outside the run (a full disk, a
    permission changed); None when ``exc`` is any other error."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    # safetensors reports the I/O errors of its writer (a full disk) as SafetensorError, not OSError
    if type(exc).__name__ == "SafetensorError" and "I/O error" in str(exc):
        return str(exc).split("I/O error:", 1)[1].strip()
    return None


@contextlib.contextmanager
def charged_write(what: str, where: Path, resume_does: str) -> Iterator[None]:
    """Turn a failed write after the ledger reservation (:func:`write_failure`) into one error line: what
    failed, that the reservation stays charged, and that ``--resume`` (``resume_does``) finishes the run."""
    try:
        yield
    except Exception as exc:
        reason = write_failure(exc)
        if reason is None:
            raise
        raise PrivtuneError(
            f"Writing {what} into {str(where)!r} failed ({reason}). The ledger reservation stays charged (it is "
            "never refunded); fix the cause (e.g. free disk space), then run the same command with --resume "
            f"(resume=True): {resume_does} without a new charge."
        ) from None


def _release_files(out: Path, writers: Sequence[tuple[str, Callable[[Path], None]]],
                   derived: Callable[[Path], None] | None) -> None:
    root = out / STAGING_DIR
    if root.exists():
        shutil.rmtree(root)  # left by an interrupted release: written again from the run's state
    private_dir(root)
    # the staging directory has RUN_DIR's own name: whatever reads it by name sees the same run
    stage = private_dir(root / (out.resolve().name or "run"))
    for name, write in writers:
        write(stage)
        if name not in KEEP_MODES and (stage / name).exists():
            public_modes(stage / name)
        fault_point(f"write-{name}")
    order = sorted((name for name, _ in writers), key=lambda n: n == CERTIFICATE)
    for name in order:
        if (stage / name).exists():
            _move_into_place(stage / name, out / name, root)
        fault_point(f"publish-{name}")
    shutil.rmtree(root)
    if derived is not None:
        derived(out)
        fault_point("write-report")
