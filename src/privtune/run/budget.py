"""The one reservation path of every budget-spending run (:mod:`privtune.run.pipeline`): open the
ledger, register a new dataset with the run's total ε, find the committed entry of a resumed run,
reserve the planned events.  Everything here happens before any computation on the data.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privtune.errors import InvalidParameterError, UnknownDatasetError
from privtune.ledger import Ledger, demo_key_path, mask_url, open_ledger


def register_dataset(ledger: Any, fingerprint: str, *, total_epsilon: float, delta: float, name: str | None,
                     command: str, accountant: str = "pld", file_name: str | None = None) -> tuple[Any, bool]:
    """The dataset's ledger status, registering it first (total ``total_epsilon``, ``delta``) if new.

    Returns ``(status, registered_now)``.  Built on ``Ledger.ensure_dataset``: when another process
    registers the same dataset at the same moment, its total stands and ``status`` says which.
    ``file_name`` (the local name of the data file) is recorded with a registration, in the ledger only.
    """
    try:
        return ledger.status(fingerprint), False
    except UnknownDatasetError:
        pass
    try:
        status = ledger.ensure_dataset(fingerprint, total_epsilon, delta, name=name, accountant=accountant,
                                       command=command, file_name=file_name)
    except UnknownDatasetError:
        # ensure_dataset turned the registration's own refusal (e.g. the name belongs to another
        # dataset) into "unknown dataset"; registering again raises that clear error instead
        ledger.init_dataset(fingerprint, total_epsilon, delta, name=name, accountant=accountant, command=command,
                            file_name=file_name)
        raise
    return status, True


def open_ledger_for(ledger: Any, *, run_dir: Path | None = None, in_run_dir: bool = False) -> tuple[Any, str]:
    """The ledger a run charges and how its URL is published (a password masked).

    ``in_run_dir`` (the embedded demo with no ``ledger``): a ledger kept inside ``run_dir`` (a
    temporary directory without one), its key outside it; otherwise the ledger ``ledger`` names
    (:func:`privtune.ledger.open_ledger`: a Ledger, a URL, or None for the default ledger).
    """
    if in_run_dir and ledger is None:
        if run_dir is None:
            run_dir = Path(tempfile.mkdtemp(prefix="privtune-demo-"))
        url = f"sqlite:///{(Path(run_dir) / 'ledger.db').resolve()}"
        # the demo ledger sits in the run directory, its key never does
        return Ledger(url, key_file=demo_key_path(Path(run_dir) / "ledger.db")), mask_url(url)
    led = open_ledger(ledger)
    shown = getattr(led, "url", None) if not isinstance(ledger, (str, os.PathLike)) else ledger
    return led, mask_url(str(shown or os.environ.get("PRIVTUNE_LEDGER") or "~/.privtune/ledger.db"))


@dataclass(frozen=True)
class BudgetRequest:
    """What a job asks of the ledger (:func:`reserve`), fixed before any computation on the data."""

    fingerprint: str  # the dataset's content digest: the ledger's key, never published
    total_epsilon: float  # a new dataset's lifetime total
    delta: float  # a new dataset's δ
    accountant: str
    command: str  # "train", "tune": recorded with the reservation
    config: Any  # recorded with the reservation
    resume_key: str  # the run's id: a resumed run continues its reservation
    #: the events to reserve: a list, or a callable given the ledger once the dataset is registered (a plan
    #: measured by the ledger's own δ and accountant)
    events: Any
    resuming: bool = False
    file_name: str | None = None  # the data file's local name, recorded with a registration (ledger only)
    reserve_delta: float | None = None  # δ the reservation is measured at (None: the dataset's)
    #: resuming: True when a run that holds neither an open nor a committed entry in this ledger is refused
    #: if it has an entry of another state or ``replayed`` work (which would then sit under no reservation);
    #: False: such a run reserves anew
    strict_resume: bool = False
    replayed: bool = False  # the resumed run replays completed work recorded under its reservation
    run_dir: Any = None  # named in the refusal of a resume that finds no reservation
    #: False: the dataset must already be registered (an unknown one raises UnknownDatasetError); the audit
    #: charges a budget the user set up, never one it registers itself
    register: bool = True
    #: the unit the events protect (None: one example; else user-level DP over that unit), recorded with the spend
    privacy_unit: str | None = None


def resumed_entry(status: Any, request: BudgetRequest) -> Any | None:
    """A resumed run's committed ledger entry (its release is written again, charged once), or None when
    the run holds an open reservation or none yet (then :func:`reserve` reserves, continuing an open one).

    With ``request.strict_resume``, refuses a run that has neither an open nor a committed entry in this
    ledger but another entry or replayed work."""
    if request.resume_key is None:
        return None
    mine = [e for e in status.entries if e.resume_key == request.resume_key]
    if any(e.state == "reserved" for e in mine):
        return None
    committed = [e for e in mine if e.state == "committed"]
    if committed:
        return committed[-1]
    if request.strict_resume and (mine or request.replayed):
        raise InvalidParameterError(
                f"`resume`: the ledger has no open reservation for the run in {str(request.run_dir)!r} (it was "
                "released, or this is another ledger). Resume with the ledger of the interrupted run, or start a "
            "new run in a new directory.")
    return None


@dataclass(frozen=True)
class Reserved:
    """Outcome of :func:`reserve`."""

    #: the open reservation to commit after the release; None when the ledger already holds this
    #: run's commit (a resumed run whose release was interrupted after the commit)
    reservation: Any | None
    #: the dataset's status before the reservation
    status: Any
    #: True when this call registered the dataset
    registered: bool
    #: the events reserved (or, committed, planned)
    events: list = field(default_factory=list)
    #: the committed ledger entry of a resumed run (``reservation`` is None)
    committed: Any = None

    @property
    def dataset_id(self) -> str:
        """The ledger's random id of the dataset (published instead of any hash of the data)."""
        return self.status.dataset_id


def reserve(ledger: Any, request: BudgetRequest, *, before_reserving=None) -> Reserved:
    """Register the dataset if new (:func:`register_dataset`), then reserve the request's events.

    A resumed run whose entry is committed in the ledger and holds no open reservation is not charged
    again (``Reserved.reservation`` is None, ``Reserved.committed`` its entry).  ``before_reserving()``
    runs after the checks and before the reservation (tune writes its state file there).
    """
    if request.register:
        status, registered = register_dataset(ledger, request.fingerprint, total_epsilon=request.total_epsilon,
                                              delta=request.delta, name=None, command=request.command,
                                              accountant=request.accountant, file_name=request.file_name)
    else:
        status, registered = ledger.status(request.fingerprint), False
    events = request.events(ledger) if callable(request.events) else list(request.events)
    if request.resuming and (not registered or request.strict_resume):
        committed = resumed_entry(status, request)
        if committed is not None:
            return Reserved(reservation=None, status=status, registered=registered, events=events,
                            committed=committed)
    if before_reserving is not None:
        before_reserving()
    reservation = ledger.reserve(request.fingerprint, events, command=request.command, config=request.config,
                                 resume_key=request.resume_key, delta=request.reserve_delta,
                                 privacy_unit=request.privacy_unit)
    return Reserved(reservation=reservation, status=status, registered=registered, events=events)
