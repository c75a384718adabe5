"""``privtune.config``: the configuration-file API, kept at the name the Python API documents.

The schema and its functions live in :mod:`privtune.cli.config_file` (the command line's layer); this
module re-exports them so that ``from privtune.config import resolve_options`` keeps working.
"""

from __future__ import annotations

from privtune.cli.config_file import (
    COMMANDS,
    SCHEMAS,
    Option,
    check_config_file,
    explicit_cli_values,
    load_effective_config,
    load_yaml,
    resolve_options,
    save_effective_config,
    template,
    validate_options,
    validate_value,
)

__all__ = ["COMMANDS", "SCHEMAS", "Option", "check_config_file", "explicit_cli_values", "load_effective_config",
           "load_yaml", "resolve_options", "save_effective_config", "template", "validate_options", "validate_value"]
