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
:func:`seeded_notice` is the banner of a run whose noise was seeded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: the sub-directory of RUN_DIR that holds the NOT PRIVATE figures (never part of the release)
NOT_PRIVATE_DIR = "not_private"

#: metrics keys whose values are deterministic functions of the private data (no noise)
NON_PRIVATE_METRICS = ("examples_per_second", "examples_processed", "nonprivate_reference",
                       "nonfinite_examples_dropped")

#: history keys that are NOT PRIVATE wherever they appear
NON_PRIVATE_HISTORY = ("clipping_diagnostics",)

NOT_PRIVATE_README = """NOT PRIVATE: do not publish this directory.

privtune wrote here what it computed from the private training data WITHOUT noise, for the
person who trains the model: the per-step batch loss of the final run, clipping diagnostics,
the exact number of examples processed, a non-private reference.  None of it is covered by the
(epsilon, delta) of certificate.json, and none of it is part of the release (the rest of the run
directory is).  `privtune report RUN_DIR --include-non-private` draws it, into this directory.
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
    never the exact number of sampled examples Σ_t |S_t|.
    """
    pub_m = dict(metrics)
    pub_h = dict(history)
    private: dict = {"metrics": {}, "history": {}}
    for k in NON_PRIVATE_METRICS:
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


def write_not_private(run_dir: str | os.PathLike, private: dict) -> Path | None:
    """Write ``RUN_DIR/not_private/{README.txt,metrics.json,history.json}`` (0700 dir, 0600 files).

    Returns the directory, or None when there is nothing NOT PRIVATE to keep."""
    if not private:
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
