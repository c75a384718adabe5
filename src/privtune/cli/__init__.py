"""The ``privtune`` command line: a thin edge over the Python API.

Each sub-command lives in its own module (``privtune.cli.account``, ``.budget``,
``.train``, ``.tune``, ``.report``, ``.config``, ``.audit``) and is imported only when it is run,
so ``privtune account`` does not pay for importing torch.

Errors caused by the user (:class:`privtune.errors.PrivtuneError`) and click's own usage
errors (an invalid choice, a value that is not a number, an unknown option) are printed as one
line, ``error: ...``, and exit with status 2.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import click

from privtune.errors import PrivtuneError, PrivtuneWarning

# sub-command name -> (module, attribute, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "account": ("privtune.cli.account", "account", "Compute ε for a DP-SGD run, calibrate σ, or verify a certificate."),
    "budget": ("privtune.cli.budget", "budget", "Manage the per-dataset privacy budget ledger."),
    "train": ("privtune.cli.train", "train", "Fine-tune a model privately with fixed hyperparameters."),
    "predict": ("privtune.cli.train", "predict", "Predict with a fine-tuned model; accuracy when labels are present."),
    "tune": ("privtune.cli.tune", "tune", "Tune hyperparameters privately and train: one (ε, δ) for everything."),
    "recommend": ("privtune.cli.tune", "recommend", "Recommend batch size, σ and clipping for a budget (Rehn et al.)."),
    "report": ("privtune.cli.report", "report", "Regenerate RUN_DIR/report.html from a finished run."),
    "config": ("privtune.cli.config", "config", "Write or check YAML configuration files."),
    "audit": ("privtune.cli.audit", "audit", "Measure an empirical ε lower bound of a configuration in one run."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = _COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(spec[0])
        return getattr(module, spec[1])

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="privtune")
def cli() -> None:
    """privtune: differentially private fine-tuning with privately chosen hyperparameters."""


def _one_line_click_message(exc: click.ClickException) -> str:
    """``exc``'s message on one line, with the command to ask for help (usage errors only)."""
    msg = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        msg += f" Run '{ctx.command_path} --help' for the options."
    return msg


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """privtune's own warnings as one ``warning:`` line on stderr; any other warning as Python prints it."""
    if isinstance(category, type) and issubclass(category, PrivtuneWarning):
        click.echo(f"warning: {message}", err=True)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``privtune`` executable; returns the exit status."""
    with warnings.catch_warnings():
        # every time (not once per process); appended, so that a filter the user set (e.g.
        # ``python -W error::privtune.errors.UnlikelyToLearnWarning``) still wins
        warnings.filterwarnings("always", category=PrivtuneWarning, append=True)
        warnings.showwarning = _show_warning
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="privtune", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.ClickException as exc:
        # click's own usage errors (bad choice, not an integer, unknown option, ...) as one line, like ours
        click.echo(f"error: {_one_line_click_message(exc)}", err=True)
        return exc.exit_code
    except (PrivtuneError, PrivtuneWarning) as exc:  # a warning the user turned into an error (python -W error::...)
        click.echo(f"error: {exc}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return 130
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def run() -> None:
    """Console-script entry point: ``sys.exit(main())``."""
    sys.exit(main())
