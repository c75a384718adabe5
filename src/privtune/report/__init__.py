"""What a user sees after a run: the HTML report, the model card, progress and logs.

* :func:`write_report` (``privtune report RUN_DIR``): ``RUN_DIR/report.html``, self-contained,
  plus one PNG per plot, from ``certificate.json``, ``metrics.json``, ``history.json`` and
  ``config.yaml`` (every part but the certificate is optional).
* :func:`write_model_card`: ``RUN_DIR/model/README.md`` in the Hugging Face model-card
  convention, stating the privacy guarantee in words.
* :class:`Progress` / :class:`RunLog` (:mod:`privtune.report.progress`): terminal progress
  and the plain ``RUN_DIR/log.txt``.

Imports are lazy so that using :class:`Progress` does not import matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "write_report": "privtune.report.html",
    "write_model_card": "privtune.report.model_card",
    "load_run": "privtune.report.run",
    "Progress": "privtune.report.progress",
    "RunLog": "privtune.report.progress",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'privtune.report' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = list(_EXPORTS)
