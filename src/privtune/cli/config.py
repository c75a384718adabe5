"""``privtune config init`` and ``privtune config check``: YAML configuration files."""

from __future__ import annotations

from pathlib import Path

import click

from privtune.cli.config_file import COMMANDS, check_config_file, template


@click.group("config")
def config() -> None:
    """Write or check YAML configuration files for `privtune train` and `privtune tune`."""


@config.command("init")
@click.option("--command", "command", type=click.Choice(COMMANDS), default="tune", show_default=True,
              help="Which command the template is for.")
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
@click.argument("path", required=False, type=click.Path(dir_okay=False, path_type=Path))
def init(command: str, force: bool, path: Path | None) -> None:
    """Write a commented configuration template to PATH (default: privtune-<command>.yaml).

    Use PATH - to print it instead.
    """
    from privtune.errors import InvalidParameterError

    text = template(command)
    if path is not None and str(path) == "-":
        click.echo(text, nl=False)
        return
    path = path or Path(f"privtune-{command}.yaml")
    if path.exists() and not force:
        raise InvalidParameterError(
            f"`path` {str(path)!r} already exists; refusing to overwrite it. Pass --force or choose another PATH."
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:  # a read-only directory, a file where a directory should be, a full disk
        raise InvalidParameterError(
            f"`path` {str(path)!r} cannot be written ({exc.strerror or exc}). Choose a writable location, or pass "
            "PATH - to print the template."
        ) from None
    click.echo(f"wrote {path}  (use it with: privtune {command} --config {path})")


@config.command("check")
@click.option("--command", "command", type=click.Choice(COMMANDS), default=None,
              help="Check against this command only (default: whichever the file fits).")
@click.argument("file", type=click.Path(path_type=Path))
def check(command: str | None, file: Path) -> None:
    """Validate FILE: unknown keys (with the closest valid key), wrong types, bad values."""
    results = check_config_file(file, command)
    for cmd, opts in results.items():
        keys = ", ".join(opts) if opts else "(no keys set: all defaults)"
        click.echo(f"{file}: valid for `privtune {cmd}`: {keys}")
