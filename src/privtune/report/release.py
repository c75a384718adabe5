"""What a run releases, and what it keeps out of the release.

Everything ``privtune train`` / ``privtune tune`` writes at the top of ``RUN_DIR`` (and in
``RUN_DIR/model/``) is meant to be shareable: each value is covered by a charged event, public by
declaration, or data-independent.  Figures computed from the private data **without noise** that
are still useful to the person training (the per-step batch loss, clipping diagnostics, the exact
number of examples processed per second, a non-private reference) go to
``RUN_DIR/not_private/`` instead: a directory created 0700 with files 0600, holding a README that
says it is NOT PRIVATE and not part of the release.  docs/privacy-model.md ("What a run releases")
lists every file and field.

:func:`split_release` does the sorting; :func:`write_not_private` writes the private side;
:func:`seeded_notice` is the banner of a run whose noise was seeded.  :class:`PublicPaths` writes the
paths of the trainer's machine (the data, the base model, the ledger, RUN_DIR itself) as names, so that
nothing released says where the files lay or whose home directory it was.
"""

from __future__ import annotations

import json
import os
import re
import site
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Iterable

#: the sub-directory of RUN_DIR that holds the NOT PRIVATE figures (never part of the release)
NOT_PRIVATE_DIR = "not_private"

#: metrics keys whose values are deterministic functions of the private data (no noise)
NON_PRIVATE_METRICS = ("examples_per_second", "examples_processed", "nonprivate_reference",
                       "nonfinite_examples_dropped")

#: metrics keys of wall time: released at example level (a side channel like every timing), NOT PRIVATE at the
#: unit level, where the time of every phase over the training rows grows with their private number
TIMING_METRICS = ("train_seconds", "steps_per_second", "wall_time_s")

#: history keys that are NOT PRIVATE wherever they appear
NON_PRIVATE_HISTORY = ("clipping_diagnostics",)

NOT_PRIVATE_README = """NOT PRIVATE: do not publish this directory.

privtune wrote here what it computed from the private training data WITHOUT noise, for the
person who trains the model: the per-step batch loss of the final run, clipping diagnostics,
the exact number of examples processed, a non-private reference.  None of it is covered by the
(epsilon, delta) of certificate.json, and none of it is part of the release (the rest of the run
directory is).  `privtune report RUN_DIR --include-non-private` draws it, into this directory.

config.yaml is the run's effective configuration with the paths of this machine (the data, the
model, the ledger): the released RUN_DIR/config.yaml names those files only.  Rerun the run with
`privtune tune --config RUN_DIR/not_private/config.yaml` (or `privtune train`, as its header says).
"""

SEEDED_LABEL = "NOT PRIVATE: seeded"


def seeded_notice(seed: Any) -> str | None:
    """The banner of a run with an explicit seed (None when the noise came from the OS).

    A seed reproduces every noise draw (and every sampled batch): anyone holding it can subtract
    the noise from the released model, so the (ε, δ) computed for the run does not hold for it."""
    if seed is None:
        return None
    return (f"{SEEDED_LABEL}. This run used an explicit seed, which reproduces all of its noise and sampling; "
            "whoever knows the seed can remove the noise, so the (ε, δ) computed for it does NOT hold. Use seeded "
            "runs for experiments only; release models trained without --seed.")


def is_private_loss_label(label: Any) -> bool:
    """True when a loss curve's label says it was privatised (charged); everything else is NOT PRIVATE."""
    return isinstance(label, str) and label.strip().lower().startswith("privatised")


def split_release(metrics: dict, history: dict) -> tuple[dict, dict, dict]:
    """(released metrics, released history, NOT PRIVATE part): the inputs are not modified.

    Moves out of the release: :data:`NON_PRIVATE_METRICS`, :data:`NON_PRIVATE_HISTORY`, and a
    final-run loss curve that is not labelled privatised (the batch loss of DP-SGD, computed
    without noise).  The released metrics keep only data-independent timing:
    ``train_seconds`` (wall time, a side channel like every timing) with ``steps_per_second``,
    never the exact number of sampled examples Σ_t |S_t|; at the unit level (metrics naming a
    ``privacy_unit``) not even those (:data:`TIMING_METRICS`).
    """
    pub_m = dict(metrics)
    pub_h = dict(history)
    private: dict = {"metrics": {}, "history": {}}
    unit_level = bool(pub_m.get("privacy_unit") or (pub_m.get("hyperparameters") or {}).get("privacy_unit"))
    for k in NON_PRIVATE_METRICS + (TIMING_METRICS if unit_level else ()):
        if k in pub_m:
            private["metrics"][k] = pub_m.pop(k)
    for k in NON_PRIVATE_HISTORY:
        if k in pub_h:
            private["history"][k] = pub_h.pop(k)
    fr = pub_h.get("final_run")
    if isinstance(fr, dict) and fr.get("train_loss") and not is_private_loss_label(fr.get("train_loss_label")):
        fr = dict(fr)
        private["history"]["final_run"] = {k: fr.pop(k) for k in ("train_loss", "train_loss_step", "train_loss_label")
                                           if k in fr}
        private["history"]["final_run"]["step"] = fr.get("step")
        fr["train_loss_note"] = (f"the per-step batch loss is computed without noise (NOT PRIVATE): kept in "
                                 f"{NOT_PRIVATE_DIR}/history.json, not part of the release")
        pub_h["final_run"] = fr
    private = {k: v for k, v in private.items() if v}
    return pub_m, pub_h, private


def write_not_private(run_dir: str | os.PathLike, private: dict, *, keep_config: bool = False) -> Path | None:
    """Write ``RUN_DIR/not_private/{README.txt,metrics.json,history.json}`` (0700 dir, 0600 files).

    ``keep_config``: the directory is also made when ``private`` is empty, for the run's configuration
    with its paths (``config.yaml``, written by the caller).  Returns the directory, or None when there
    is nothing to keep."""
    if not private and not keep_config:
        return None
    d = Path(run_dir) / NOT_PRIVATE_DIR
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)  # whatever the umask, and also when the directory already existed
    files = {"README.txt": NOT_PRIVATE_README}
    for part in ("metrics", "history"):
        if private.get(part):
            files[f"{part}.json"] = json.dumps({"label": "NOT PRIVATE: computed from private data without noise; "
                                                         "not part of the release", **private[part]},
                                               indent=2, default=str) + "\n"
    for name, text in files.items():
        path = d / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o600)
    return d


def load_not_private(run_dir: str | os.PathLike) -> dict:
    """The NOT PRIVATE part of a run ({"metrics": ..., "history": ...}); empty when there is none."""
    d = Path(run_dir) / NOT_PRIVATE_DIR
    out: dict = {}
    for part in ("metrics", "history"):
        f = d / f"{part}.json"
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                out[part] = data
    return out


def mark_seeded(cert: Any, metrics: dict, seed: Any) -> None:
    """Label a seeded run NOT PRIVATE where the model goes: the certificate's top-level ``notes``
    (first line) and ``metadata.label``, and ``metrics.json``'s ``label``; the report and the model
    card show the same banner.  Does nothing when ``seed`` is None."""
    notice = seeded_notice(seed)
    if notice is None:
        return
    cert.notes.insert(0, notice)
    cert.metadata.setdefault("label", SEEDED_LABEL)  # a run already labelled NOT PRIVATE (grid oracle) keeps it
    cert.metadata["seeded"] = notice
    metrics.setdefault("label", SEEDED_LABEL)
    metrics["seeded"] = True


#: the characters that end a path inside a line of text (a log line, a YAML value, a message)
_PATH_TOKEN = re.compile(r"(?<![\w.~/:])/[^\s'\"<>(),;`|]+")


def _machine_roots() -> list[str]:
    """Directories whose paths say something about this machine: the home directory, the temporary
    directory, the Python installation and its site-packages, privtune's own package directory."""
    roots = [os.path.expanduser("~"), tempfile.gettempdir(), sys.prefix, sys.base_prefix,
             sysconfig.get_paths().get("purelib", ""), str(Path(__file__).resolve().parents[1])]
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # pragma: no cover - a virtualenv's old site module
        pass
    return [r for r in roots if r and r != os.sep]


class PublicPaths:
    """How paths of the trainer's machine appear in what a run releases.

    An absolute path becomes its last component: the data file ``mine.csv``, the base model's
    directory name, ``l.db`` for a ledger.  A path inside ``run_dir`` becomes relative to it (``run_dir``
    itself: its name); privtune's own ledger directory ``~/.privtune`` keeps its home-relative name.
    Relative paths, names and everything else are kept as written.

    :meth:`text` rewrites the absolute paths inside a line of text (a log line, a URL such as
    ``sqlite:////home/me/l.db``): every path given to the constructor wherever it occurs, and any other
    absolute path under the home, temporary, Python or privtune directories.  :meth:`value` does the same
    throughout a JSON-like value (dicts, lists, strings).
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, paths: Iterable[Any] = ()) -> None:
        self.run_dir = Path(os.path.abspath(run_dir)) if run_dir is not None else None
        self.home = os.path.expanduser("~")
        known: set[str] = set()
        for p in paths:
            if isinstance(p, (str, os.PathLike)) and str(p).strip():
                text = os.fspath(p)
                if text.startswith("sqlite:///"):
                    text = text[len("sqlite:///"):]
                if os.path.isabs(text) or os.path.exists(text):
                    known |= {os.path.abspath(text), os.path.realpath(text)}
        if self.run_dir is not None:
            known |= {str(self.run_dir), os.path.realpath(self.run_dir)}
        # longest first: a file inside a known directory is named before its directory is
        self.known = sorted((k for k in known if k != os.sep), key=len, reverse=True)
        roots = set(_machine_roots()) | {os.path.dirname(k) for k in self.known} | set(self.known)
        self.roots = sorted((r.rstrip(os.sep) for r in roots if r.rstrip(os.sep)), key=len, reverse=True)

    def name(self, path: str) -> str:
        """The public form of one absolute ``path``."""
        p = os.path.normpath(path)
        for base in filter(None, (self.run_dir, self.run_dir and os.path.realpath(self.run_dir))):
            base = str(base)
            if p == base:
                return Path(base).name
            if p.startswith(base + os.sep):
                return os.path.relpath(p, base)
        own = os.path.join(self.home, ".privtune")
        if p == own or p.startswith(own + os.sep):
            return "~" + p[len(self.home):]
        return Path(p).name or p

    def _is_machine_path(self, token: str) -> bool:
        return any(token == r or token.startswith(r + os.sep) for r in self.roots)

    def text(self, text: str) -> str:
        """``text`` with every absolute path of this machine in it written by its public name."""
        for k in self.known:
            if k in text:
                text = re.sub(re.escape(k) + r"(?=$|[^\w.\-/])", lambda m: self.name(m.group(0)), text)
        if os.path.isabs(text) and "\n" not in text and not text[1:2].isspace():  # a whole value that is a path
            return self.name(text)
        text = re.sub(r"sqlite:///(/[^\s'\"<>(),;`|]+)", lambda m: "sqlite:///" + self.name(m.group(1)), text)
        return _PATH_TOKEN.sub(lambda m: self.name(m.group(0)) if self._is_machine_path(m.group(0))
                               else m.group(0), text)

    def value(self, value: Any) -> Any:
        """A copy of a JSON-like ``value`` with :meth:`text` applied to every string (keys included)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, os.PathLike):
            return self.text(os.fspath(value))
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value
