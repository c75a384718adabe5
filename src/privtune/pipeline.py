"""The shared leaves of the run pipeline, under their first name: see :mod:`privtune.run.release` (the
files of RUN_DIR) and :mod:`privtune.run.budget` (the ledger)."""

from privtune.run.budget import Reserved, register_dataset, reserve
from privtune.run.release import (
    CERTIFICATE,
    PUBLIC_CONFIG_NOTE,
    commit,
    run_log,
    write_json,
    write_model,
    write_release,
)

__all__ = ["CERTIFICATE", "PUBLIC_CONFIG_NOTE", "Reserved", "commit", "register_dataset", "reserve", "run_log",
           "write_json", "write_model", "write_release"]
