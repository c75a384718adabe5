"""The files of RUN_DIR, written once for every budget-spending run (:mod:`privtune.run.pipeline`).

* :data:`RELEASED_FILES` / :data:`RELEASED_DIRS`: what a run releases into RUN_DIR (checked before the
  reservation: an entry of the wrong kind is an error);
* :func:`split_name`: how a release names the reported split (its file name only, never a path);
* :func:`write_json`: the one atomic JSON writer of RUN_DIR;
* :func:`run_log`: the one ``RUN_DIR/log.txt`` writer (:class:`privtune.report.progress.RunLog` lines);
* :func:`write_model`: the released ``model/`` directory, which carries its own copy of the
  certificate so that a model never travels without its guarantee;
* :func:`write_release`: the one RUN_DIR writer (model, metrics, history, config, NOT PRIVATE
  figures, certificate last, then the derived report and model card);
* :func:`commit`: the ledger commit once the release is in place, then the private files go.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from privtune import _release
from privtune.cli.config_file import save_effective_config

#: name of the certificate inside RUN_DIR and, as a copy, inside RUN_DIR/model/
CERTIFICATE = "certificate.json"
#: what a run releases into RUN_DIR, files and directories (``checkpoints/`` holds train's private
#: checkpoint until the commit; it is never part of a release)
RELEASED_FILES = (CERTIFICATE, "metrics.json", "history.json", "config.yaml", "report.html", "log.txt")
RELEASED_DIRS = ("model", "checkpoints")


def split_name(split: Any, default: str = "eval_data") -> str:
    """How a release names a split: the file name of a path (never the directory it sits in), else the
    dataset's ``source``, else ``default``."""
    if isinstance(split, (str, os.PathLike)):
        return Path(split).name
    return getattr(split, "source", None) or default


# ------------------------------------------------------------------------------ files of RUN_DIR


def effective_config(options: dict, *, path_keys: Sequence[str]) -> tuple[dict, list]:
    """A run's effective options as ``config.yaml`` holds them (reloadable with ``--config``).

    Unset options (None) are left out; a path option (``path_keys``) is written as the path given, and an
    in-memory object there (a dataset, a model) as a path that does not exist naming the problem, so that
    a rerun from the file fails loudly instead of silently running without it.  Returns ``(config, names
    of the options that could not be written)``.
    """
    config: dict = {}
    unsaved: list = []
    for key, value in options.items():
        if value is None:
            continue
        if key in path_keys:
            if isinstance(value, (str, os.PathLike)):
                value = os.fspath(value)
            else:
                unsaved.append(key)
                value = f"<in-memory {type(value).__name__}: not reproducible from this file; pass it again>"
        config[key] = value
    return config, unsaved


def write_json(path: Path, obj: Any, *, sort_keys: bool = False) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (temporary file, then rename).

    Values JSON cannot hold (paths, numpy scalars) are written as their ``str``.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_log(path: Path | None, *, timestamps: bool = True) -> Callable[[str], None]:
    """A function that appends one timestamped line to ``path`` (``RUN_DIR/log.txt``) per call
    (``timestamps=False``: lines without the time, for runs whose durations would tell something private).

    The lines are :class:`privtune.report.progress.RunLog` lines, the format the progress display
    writes to the same file.  The file is opened per line, so a run that dies holds no handle.
    ``path=None`` (a run without RUN_DIR) gives a function that does nothing.
    """
    if path is None:
        return lambda message: None
    from privtune.report.progress import RunLog

    def write(message: str) -> None:
        with RunLog(path) as log:
            log.timestamps = timestamps
            log.write(message)

    return write


def write_model(run_dir: Path, model: Any, certificate: Any) -> None:
    """Save ``model`` to ``run_dir/model`` with a copy of ``certificate`` inside it.

    ``model/certificate.json`` equals ``run_dir/certificate.json``: whoever copies only the model
    directory still holds the (ε, δ) guarantee and the events that prove it.
    """
    model.save_pretrained(run_dir / "model")
    certificate.save(run_dir / "model" / CERTIFICATE)


def write_release(run_dir: Path, *, model: Any, certificate: Any, metrics: dict, history: dict, config: dict,
                  command: str, not_private: dict, log: Callable[[str], None]) -> None:
    """Release a finished run into ``run_dir``: staged, then moved into place, certificate last
    (:func:`privtune._release.release_files`).

    ``model`` (None: nothing to release, e.g. a NOT PRIVATE reference) goes to ``model/`` with a copy
    of the certificate; ``metrics``/``history`` (plain JSON values) to their JSON files; ``config``
    (the effective options of ``command``) to ``config.yaml``; ``not_private`` (NOT PRIVATE figures,
    not part of the release) to ``not_private/``.  Then ``report.html`` and the model card are
    written from those files.  Writing the config, the report or the card may fail without losing
    the run (a warning goes to ``log``; ``privtune report RUN_DIR`` rewrites the last two).

    Nothing released names a path of this machine (:class:`privtune.report.release.PublicPaths`): the
    data, the base model, the ledger and RUN_DIR are written by their names, in the JSON files, the
    certificate, ``config.yaml`` and ``log.txt`` alike.  The returned objects of the run keep the paths.
    """
    # lazy: the report package pulls in the plotting stack, which only a run that writes files needs
    from privtune.report.release import PublicPaths

    public = PublicPaths(run_dir, [v for v in config.values() if isinstance(v, (str, os.PathLike))])
    if dataclasses.is_dataclass(certificate):
        certificate = dataclasses.replace(certificate, metadata=public.value(certificate.metadata),
                                          notes=public.value(certificate.notes))
    metrics, history = public.value(metrics), public.value(history)
    writers = [("model", lambda d: write_model(d, model, certificate))] if model is not None else []
    writers += [
        ("metrics.json", lambda d: write_json(d / "metrics.json", metrics, sort_keys=True)),
        ("history.json", lambda d: write_json(d / "history.json", history)),
        ("config.yaml", lambda d: _write_config(d, config, command, log, public)),
        ("not_private", lambda d: _write_kept(d, not_private or {}, config, command, log)),
        (CERTIFICATE, lambda d: certificate.save(d / CERTIFICATE)),
    ]
    _release.release_files(run_dir, writers, derived=lambda d: _write_derived(d, model is not None, log))
    _publish_log(run_dir / "log.txt", public)


#: the first lines of a released config.yaml whose paths were written as names
PUBLIC_CONFIG_NOTE = ("# Paths of the machine that ran it are written as file names (this directory is meant to be "
                      "shared).\n# The same configuration with the full paths, to rerun it: "
                      "not_private/config.yaml (not part of the release).\n")


def _write_config(run_dir: Path, config: dict, command: str, log: Callable[[str], None], public: Any) -> None:
    """``run_dir/config.yaml``: with ``public`` (:class:`PublicPaths`) the released copy, paths as names;
    without, the copy kept in ``not_private/`` (0600) that reruns the run."""
    try:
        full = {k: v for k, v in config.items() if v is not None}
        options = {k: public.value(v) for k, v in full.items()} if public is not None else full
        path = save_effective_config(options, run_dir, command=command)
        if public is None:
            os.chmod(path, 0o600)
        elif options != full:
            path.write_text(PUBLIC_CONFIG_NOTE + path.read_text(encoding="utf-8"), encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - config is informative; never lose a finished run over it
        log(f"warning: config.yaml not written ({type(exc).__name__}: {exc})")


def _write_kept(run_dir: Path, not_private: dict, config: dict, command: str, log: Callable[[str], None]) -> None:
    """``not_private/``: the NOT PRIVATE figures and the configuration with its paths, outside the release."""
    from privtune.report.release import write_not_private

    kept = write_not_private(run_dir, not_private, keep_config=True)
    if kept is not None:
        _write_config(kept, config, command, log, None)


def _publish_log(path: Path, public: Any) -> None:
    """Rewrite ``log.txt`` in place with the machine's paths as names (the progress display may still
    hold it open for appending, so it keeps its inode)."""
    try:
        with open(path, "r+", encoding="utf-8") as f:
            text = f.read()
            shown = "".join(public.text(line) for line in text.splitlines(keepends=True))
            if shown != text:
                f.seek(0)
                f.write(shown)
                f.truncate()
    except FileNotFoundError:
        pass


def _write_derived(run_dir: Path, has_model: bool, log: Callable[[str], None]) -> None:
    """``report.html`` and (with a model) the model card, from the released files."""
    try:
        from privtune.report import write_model_card, write_report
    except ImportError as exc:  # pragma: no cover - a dependency of the report is not installed
        log(f"warning: report.html not written ({exc}); install it and run `privtune report {run_dir}`")
        return
    # the run (and its privacy spend) is complete at this point: a failing report must not hide it
    for write in (write_report, write_model_card) if has_model else (write_report,):
        try:
            write(run_dir)
        except Exception as exc:  # noqa: BLE001 - a derived file; regenerate with `privtune report`
            log(f"warning: {write.__name__} failed ({type(exc).__name__}: {exc}); rerun `privtune report {run_dir}`")


def commit(reservation: Any | None, events: Sequence[Any], private_files: Sequence[Path] = ()) -> None:
    """Commit ``events`` to the ledger ``reservation`` (None: nothing to commit), then delete the run's
    ``private_files`` (noise seeds, checkpoints) and their directories left empty.

    Called only once the release is in place: a crash before it leaves the reservation charged (never
    refunded) and ``--resume`` writes the release again.  The private files go right after: with the
    noise seeds anyone could subtract the noise from the released model.
    """
    if reservation is not None:
        reservation.commit(events)
    _release.fault_point("after-commit")
    for path in private_files:
        if path.exists():
            path.unlink()
        if path.parent.is_dir() and not any(path.parent.iterdir()):
            path.parent.rmdir()
