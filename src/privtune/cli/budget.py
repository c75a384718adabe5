"""``privtune budget``: the per-dataset privacy budget ledger from the command line.

Sub-commands: ``init``, ``show``, ``history``, ``verify``, ``spend`` (record an external run),
``raise`` (raise a total, explicitly and on the record), ``close`` (charge an orphaned reservation).  Every one takes ``--ledger URL``
(default ``$PRIVTUNE_LEDGER`` or ``~/.privtune/ledger.db``).
"""

from __future__ import annotations

import json
import shlex

import click

# choices and defaults come from privtune.choices, which imports nothing, so that `privtune budget --help` does not
# import the ledger and the accountant; tests/test_choices.py checks them against Ledger's and DPSGDEvent's own
from privtune.choices import ACCOUNTANTS, BUDGET_DEFAULTS, SAMPLING_SCHEMES

_INIT_ACCOUNTANT = BUDGET_DEFAULTS["accountant"]
_EVENT_SAMPLING = BUDGET_DEFAULTS["sampling"]

_LEDGER_HELP = "Ledger URL: sqlite:////abs/path.db, a file path, or postgresql://user@host/db. " \
               "Default: $PRIVTUNE_LEDGER or ~/.privtune/ledger.db."
_DATASET_HELP = ("Dataset file/folder (its content is fingerprinted with the ledger's key), its dataset id "
                 "(ds-…, as run directories show it), its fingerprint, or its registered name.")

ledger_option = click.option("--ledger", "ledger_url", default=None, metavar="URL", help=_LEDGER_HELP)
dataset_option = click.option("--dataset", "dataset", required=True, metavar="PATH_OR_NAME", help=_DATASET_HELP)


def _command_line() -> str:
    """The invoked command with the options that were set, e.g. ``privtune budget spend --steps 100 ...``."""
    ctx = click.get_current_context()
    parts = [ctx.command_path]
    for key, value in ctx.params.items():
        if value is None or value is False or key == "ledger_url":
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def _open(url: str | None):
    from privtune.errors import InvalidParameterError
    from privtune.ledger import Ledger

    try:
        return Ledger(url)
    except InvalidParameterError as exc:  # name the flag (or the variable), not the Python argument
        name = "`--ledger`" if url is not None else "`$PRIVTUNE_LEDGER`"
        raise InvalidParameterError(str(exc).replace("`url`", name, 1)) from None


def _console():
    from rich.console import Console

    # markup off: event labels are bracketed ("[trial 1/3: lora] DP-SGD …") and file names may be; they are text
    console = Console(markup=False)
    return console if console.is_terminal else Console(width=160, markup=False)  # files and pipes: do not wrap at 80


def _status_table(st) -> object:
    from rich.table import Table

    t = Table(title=f"Privacy budget of {st.name or st.file_name or 'dataset'} ({st.dataset_id})", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    t.add_row("ledger", st.ledger_url)
    if st.file_name:
        t.add_row("registered as", st.file_name)
    t.add_row("total ε", f"{st.total_epsilon:.6g}")
    t.add_row("δ", f"{st.delta:g}")
    t.add_row("accountant", st.accountant)
    t.add_row("spent ε (committed)", f"{st.spent_epsilon:.6g}")
    t.add_row("reserved ε (open runs)", f"{st.reserved_epsilon:.6g}")
    t.add_row("remaining ε", f"{st.remaining_epsilon:.6g}")
    counts = {s: sum(1 for e in st.entries if e.state == s) for s in ("committed", "reserved", "released")}
    t.add_row("entries", ", ".join(f"{n} {s}" for s, n in counts.items()))
    return t


@click.group("budget")
def budget() -> None:
    """Manage the per-dataset privacy budget ledger.

    Every run on a dataset is recorded with its privacy events; the remaining ε is the total
    minus the *composition* of all spends (never a sum of ε's). See docs/ledger.md.
    """


def _count_examples(dataset: str) -> int | None:
    """Rows of a .tsv/.csv/.jsonl dataset file, read as ``train`` reads it; None for anything else
    (a folder, another format, a fingerprint), whose size budget init cannot know."""
    import os
    from pathlib import Path

    from privtune.errors import PrivtuneError

    path = Path(os.path.expanduser(dataset))
    fmt = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl"}.get(path.suffix.lower())
    if fmt is None or not path.is_file():
        return None
    try:
        from privtune.data.datasets import read_table

        return len(read_table(path, fmt)[1]) or None
    except PrivtuneError:  # not a table privtune reads: any file may be a dataset, its size is unknown
        return None


@budget.command("init")
@click.option("--dataset", "dataset", required=True, metavar="PATH",
              help="Dataset file or folder (its content is fingerprinted with the ledger's key), or the SHA-256 "
                   "that privtune.ledger.dataset_fingerprint returns for it.")
@click.option("--epsilon", type=float, required=True, help="Total ε for everything ever run on this dataset.")
@click.option("--delta", type=float, required=True, help="Total δ (e.g. 1e-5, well below 1/n).")
@click.option("--name", default=None, help="Unique human name to refer to the dataset later.")
@click.option("--accountant", type=click.Choice(ACCOUNTANTS), default=_INIT_ACCOUNTANT, show_default=True,
              help="Accountant used to compose this dataset's spends (fixed once set).")
@ledger_option
def init(dataset: str, epsilon: float, delta: float, name: str | None, accountant: str,
         ledger_url: str | None) -> None:
    """Give a dataset its total privacy budget (set once).

    For a .tsv/.csv/.jsonl file, δ must be below 1/n (n: its number of examples), as for train.
    The dataset gets a random id (ds-…): what run directories publish instead of any hash of the data.
    """
    from privtune._validation import check_delta

    n = _count_examples(dataset)
    check_delta(delta, "--delta", dataset_size=n)
    ledger = _open(ledger_url)
    st = ledger.init_dataset(dataset, epsilon, delta, name=name, accountant=accountant, command=_command_line())
    click.echo(
        f"dataset {st.dataset_id}{f' ({st.name})' if st.name else ''}: total ε={st.total_epsilon:g}, "
        f"δ={st.delta:g}, accountant={st.accountant}, remaining ε={st.remaining_epsilon:.6g}  [{ledger.url}]"
    )


@budget.command("show")
@click.option("--dataset", "dataset", default=None, metavar="PATH_OR_NAME",
              help=_DATASET_HELP + " Without it, list all datasets.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@ledger_option
def show(dataset: str | None, as_json: bool, ledger_url: str | None) -> None:
    """Show a dataset's total, spent, reserved and remaining ε (or list all datasets, with the local file name
    each was registered under: kept in the ledger only)."""
    ledger = _open(ledger_url)
    if dataset is None:
        rows = ledger.datasets()
        if as_json:
            click.echo(json.dumps({"ledger": ledger.url, "datasets": rows}, indent=2))
            return
        from rich.table import Table

        t = Table(title=f"Datasets in {ledger.url}")
        for col in ("dataset id", "registered as", "name", "total ε", "δ", "accountant", "created"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["dataset_id"] or "", r["file_name"] or "", r["name"] or "", f"{r['total_epsilon']:g}",
                      f"{r['delta']:g}", r["accountant"], r["created_at"][:19])
        _console().print(t)
        return
    st = ledger.status(dataset)
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    _console().print(_status_table(st))


@budget.command("history")
@dataset_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON records instead of a table.")
@ledger_option
def history(dataset: str, as_json: bool, ledger_url: str | None) -> None:
    """Every record of a dataset: time, command, events, ε after it, state."""
    ledger = _open(ledger_url)
    records = ledger.history(dataset)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in records], indent=2))
        return
    from rich.table import Table

    st = ledger.status(dataset)
    t = Table(title=f"History of {st.name or 'dataset'} ({st.dataset_id}): total ε={st.total_epsilon:g}, "
                    f"δ={st.delta:g}, remaining ε={st.remaining_epsilon:.4g}")
    t.add_column("#", justify="right")
    t.add_column("time (UTC)")
    t.add_column("command", overflow="fold", max_width=40)
    t.add_column("events", overflow="fold")
    t.add_column("ε after", justify="right")
    t.add_column("state")
    t.add_column("entry")
    for r in records:
        t.add_row(str(r.seq), r.created_at[:19].replace("T", " "), r.command, r.summary(),
                  f"{r.epsilon_after:.4g}", r.state, (r.entry_id or "")[:8])
    _console().print(t)


@budget.command("verify")
@click.option("--dataset", "dataset", default=None, metavar="PATH_OR_NAME", help="Verify one dataset only.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@ledger_option
@click.pass_context
def verify(ctx: click.Context, dataset: str | None, as_json: bool, ledger_url: str | None) -> None:
    """Check the keyed hash chains: exit 0 if intact, 1 if any record was edited or deleted.

    Needs the ledger's key. Cannot detect edits by someone holding the key, a dataset deleted with all
    its records, or the database and key rolled back to an older copy (see docs/ledger.md).
    """
    ledger = _open(ledger_url)
    report = ledger.verify(dataset)
    if as_json:
        click.echo(json.dumps({"ledger": ledger.url, **report.to_dict()}, indent=2))
    else:
        for d in report.datasets:
            click.echo(f"{d['dataset_id'] or '?':19s}  {d['name'] or '':20s} {d['records']:6d} records  "
                       f"head {d['head_hash'][:16]}…")
        for p in report.problems:
            click.echo(f"TAMPERED: {p}", err=True)
        click.echo(f"ledger {ledger.url}: " + ("OK, all hash chains intact" if report.ok
                                               else f"FAILED, {len(report.problems)} problem(s)"))
    if not report.ok:
        ctx.exit(1)


@budget.command("spend")
@dataset_option
@click.option("--noise-multiplier", type=float, required=True, help="σ: noise std divided by the clipping norm.")
@click.option("--sample-rate", type=float, required=True, help="q: Poisson sampling probability per step (1 = full batch).")
@click.option("--steps", type=int, required=True, help="T: number of noisy steps.")
@click.option("--sampling", type=click.Choice(SAMPLING_SCHEMES), default=_EVENT_SAMPLING,
              show_default=True, help="How batches were drawn.")
@click.option("--delta", type=float, default=None, help="The run's own δ (must not exceed the dataset's δ).")
@click.option("--note", default=None, help="What the run was (stored in the ledger).")
@click.option("--privacy-unit", "privacy_unit", default=None, metavar="UNIT",
              help="The run was user-level DP: (ε, δ) with respect to adding or removing all rows of one UNIT "
                   "(e.g. user_id). A dataset's spends all have one unit; see docs/privacy-unit.md.")
@click.option("--force", is_flag=True,
              help="Record the run even if it exceeds the budget (it already happened; the books must show it).")
@ledger_option
def spend(dataset: str, noise_multiplier: float, sample_rate: float, steps: int, sampling: str,
          delta: float | None, note: str | None, privacy_unit: str | None, force: bool, ledger_url: str | None) -> None:
    """Record an external DP-SGD run (e.g. trained with another library) so the books stay complete."""
    from privtune._validation import (
        check_accounted_noise_multiplier,
        check_delta,
        check_sample_rate,
        check_steps,
    )
    from privtune.accounting.events import DPSGDEvent, describe_event
    from privtune.errors import InvalidParameterError

    # validate here so that errors name the flags (--noise-multiplier), not the Python arguments
    noise_multiplier = check_accounted_noise_multiplier(noise_multiplier, "--noise-multiplier")
    sample_rate = check_sample_rate(sample_rate, "--sample-rate")
    steps = check_steps(steps, "--steps")
    if delta is not None:
        delta = check_delta(delta, "--delta")
    if sampling == "full_batch" and sample_rate != 1.0:
        raise InvalidParameterError(f"`--sample-rate` must be 1 with --sampling full_batch. Got {sample_rate!r}.")
    event = DPSGDEvent(noise_multiplier, sample_rate, steps, sampling=sampling)
    ledger = _open(ledger_url)
    entry = ledger.record_spend(dataset, [event], command=_command_line(), delta=delta, note=note, force=force,
                                privacy_unit=privacy_unit)
    st = ledger.status(dataset)
    click.echo(f"recorded {describe_event(event)} as entry {entry.entry_id[:8]}: dataset ε now "
               f"{st.used_epsilon:.6g} of {st.total_epsilon:g} (δ={st.delta:g}); remaining ε={st.remaining_epsilon:.6g}")
    if st.remaining_epsilon < 0:
        click.echo("warning: the dataset is now OVERSPENT; further runs will be refused.", err=True)


@budget.command("raise")
@dataset_option
@click.option("--epsilon", type=float, required=True, help="New total ε (must be larger than the current one).")
@click.option("--reason", required=True, help="Why the total is raised (stored in the ledger).")
@ledger_option
def raise_(dataset: str, epsilon: float, reason: str, ledger_url: str | None) -> None:
    """Raise a dataset's total ε: an explicit decision, recorded in the hash chain."""
    ledger = _open(ledger_url)
    st = ledger.raise_budget(dataset, epsilon, reason=reason, command=_command_line())
    click.echo(f"dataset {st.dataset_id}: total ε raised to {st.total_epsilon:g}; "
               f"remaining ε={st.remaining_epsilon:.6g}")


@budget.command("close")
@click.option("--entry", "entry", required=True, metavar="ENTRY_ID",
              help="The open entry's id, or at least its first 8 hex digits (budget show --json, budget history).")
@click.option("--reason", required=True, help="Why it is closed, e.g. 'train killed before its first checkpoint'.")
@click.option("--dataset", "dataset", default=None, metavar="PATH_OR_NAME",
              help="Look for the entry in this dataset only. " + _DATASET_HELP)
@ledger_option
def close(entry: str, reason: str, dataset: str | None, ledger_url: str | None) -> None:
    """Close an orphaned reservation after a crash by CHARGING it in full (never a refund).

    A run that died before it could commit leaves its entry `reserved`; it stays charged either way.
    Closing it commits its planned events, so the books show a finished spend and the run can no longer
    be resumed. Only close an entry whose process is gone.
    """
    ledger = _open(ledger_url)
    e = ledger.close_reservation(entry, reason=reason, dataset=dataset, command=_command_line())
    from privtune.accounting.events import describe_event

    click.echo(f"closed entry {e.entry_id[:8]} by charging its planned events in full "
               f"({'; '.join(describe_event(x) for x in e.events)}); dataset ε now {e.epsilon_after:.6g}")


__all__ = ["budget"]
