"""Lines the run commands print about the ledger, shared by ``train`` and ``tune`` (imports nothing heavy)."""

from __future__ import annotations

import os
import shlex


def registration_notice(data: str, *, dataset_id: str | None, total_epsilon: float, delta: float,
                        ledger_url: str | None = None) -> str:
    """The line that says a run has just registered ``data`` (the path as the user gave it) in the ledger with
    a lifetime total ε, and the command that raises it (every later run on the same content is charged
    against that total)."""
    ledger = f" --ledger {shlex.quote(ledger_url)}" if ledger_url else ""
    shown = f" (dataset {dataset_id})" if dataset_id else ""
    return (f"registered {os.path.basename(os.path.normpath(data))}{shown} with a lifetime ε = {total_epsilon:g}, "
            f"δ = {delta:g}: every later run on this data is charged against it; raise it with "
            f"`privtune budget raise --dataset {shlex.quote(data)} --epsilon NEW --reason WHY{ledger}`")


__all__ = ["registration_notice"]
