"""The privacy budget ledger: every spend on a dataset recorded, composed and enforced.

Model
-----
A **dataset** is its keyed content fingerprint (HMAC-SHA256 with the ledger's secret key of
:func:`~privtune.ledger.dataset_fingerprint`, see ``_key.py``), a random public ``dataset_id``
(what run directories publish) and an optional unique human name.  It has a total budget (ε, δ) and an accountant, set once by
:meth:`Ledger.init_dataset`; :meth:`Ledger.raise_budget` is the only way to change the total,
and it is recorded like everything else.

Each dataset has an append-only **hash chain of records**: ``init``, ``raise``, ``reserve``,
``resume``, ``commit``, ``release``.  A spend is an **entry** (the records sharing one
``entry_id``): its accounting events, who/what spent it (command, config hash, privtune
version, user, host, time) and a state ``reserved`` -> ``committed`` (or ``released``, only
when no example was touched).  Every record stores an HMAC (keyed with the ledger's secret) of
its content and of the previous record's MAC, and the dataset row a keyed MAC of the last
record, so :meth:`Ledger.verify` detects an edited, inserted or deleted record, at the end too,
unless the editor holds the key.

Remaining ε = total ε − ε(composition of the events of all committed and reserved entries),
computed at the dataset's δ by the accounting core (:func:`privtune.accounting.compute_epsilon`);
ε's are never added.

Concurrency: the check of the remaining budget and the reservation are one transaction that
holds the dataset's write lock (SQLite ``BEGIN IMMEDIATE``, PostgreSQL ``SELECT ... FOR
UPDATE`` on the dataset row), so concurrent processes can never overspend together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hashlib
import json
import math
import os
import re
import secrets
import socket
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from privtune import __version__
from privtune._validation import check_choice, check_delta, check_epsilon
from privtune.accounting.accountant import ACCOUNTANTS
from privtune.accounting.events import (
    EVENT_TYPES,
    NonPrivateEvent,
    describe_event,
    event_from_dict,
    event_to_dict,
)
from privtune.errors import (
    BudgetExceededError,
    CertificateError,
    InvalidParameterError,
    LedgerError,
    UnknownDatasetError,
)
from privtune.ledger import _backend as backend
from privtune.ledger import _key
from privtune.ledger._compose import composed_epsilon, group_events
from privtune.ledger.fingerprint import dataset_fingerprint, is_fingerprint

STATES = ("reserved", "committed", "released")
_RTOL = 1e-9  # float noise allowed when comparing a composed ε with the total
_GENESIS = "privtune-ledger/v1/genesis/"  # schema 1 (unkeyed chains), read only to migrate them
_PUBLIC_ID = re.compile(r"ds-[0-9a-f]{16}")
_ENTRY_ID = re.compile(r"[0-9a-f]{8,32}")
_ACTION_STATE = {
    "init": "init",
    "raise": "raised",
    "reserve": "reserved",
    "resume": "resumed",
    "commit": "committed",
    "release": "released",
}


# --------------------------------------------------------------------------- value objects


@dataclass(frozen=True)
class Entry:
    """One spend on a dataset, as it stands now.

    ``events`` are what the entry charges: the planned events while ``reserved``, the actually
    spent events once ``committed``; a ``released`` entry charges nothing.  ``epsilon_after``
    is the dataset's composed ε right after the entry's latest record.  Times are ISO 8601 UTC.
    """

    entry_id: str
    state: str
    events: tuple
    planned_events: tuple
    command: str
    config_hash: str | None
    privtune_version: str
    username: str
    host: str
    created_at: str
    updated_at: str
    resume_key: str | None
    delta: float | None
    note: str
    epsilon_after: float
    resumed: int = 0
    privacy_unit: str | None = None  # None: one example; else the unit whose all rows are protected

    @property
    def charged(self) -> bool:
        """True for reserved and committed entries (they count against the budget)."""
        return self.state in ("reserved", "committed")

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict (events as event dicts)."""
        return {
            "entry_id": self.entry_id,
            "state": self.state,
            "events": [event_to_dict(e) for e in self.events],
            "planned_events": [event_to_dict(e) for e in self.planned_events],
            "events_summary": "; ".join(describe_event(e) for e in self.events),
            "command": self.command,
            "config_hash": self.config_hash,
            "privtune_version": self.privtune_version,
            "user": self.username,
            "host": self.host,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "resume_key": self.resume_key,
            "delta": self.delta,
            "note": self.note,
            "epsilon_after": self.epsilon_after,
            "resumed": self.resumed,
            "privacy_unit": self.privacy_unit,
        }


@dataclass(frozen=True)
class Record:
    """One link of a dataset's hash chain (what ``privtune budget history`` prints)."""

    seq: int
    action: str
    state: str
    entry_id: str | None
    created_at: str
    command: str
    events: tuple
    epsilon_after: float
    payload: dict
    config_hash: str | None
    privtune_version: str
    username: str
    host: str
    hash: str

    def summary(self) -> str:
        """Events summary, or what an administrative record did."""
        p = self.payload
        if self.events:
            text = "; ".join(describe_event(e) for e in self.events)
            if self.action == "commit" and p.get("closed_orphan"):
                text += f" (orphaned reservation closed, charged in full: {p.get('reason', '')})"
            if p.get("privacy_unit"):  # user level: what the events protect (docs/privacy-unit.md)
                text += f" [privacy unit: all rows of one {p['privacy_unit']}]"
            return text
        if self.action == "init":
            return f"total ε={p['total_epsilon']:g}, δ={p['delta']:g}, accountant={p['accountant']}"
        if self.action == "raise":
            return f"total ε {p['previous_total_epsilon']:g} → {p['total_epsilon']:g} ({p.get('reason', '')})"
        if self.action == "resume":
            return f"resumed reservation (resume_key={p.get('resume_key')!r})"
        if self.action == "release":
            return f"released, no example touched ({p.get('reason', '')})"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "action": self.action,
            "state": self.state,
            "entry_id": self.entry_id,
            "time": self.created_at,
            "command": self.command,
            "events": [event_to_dict(e) for e in self.events],
            "events_summary": self.summary(),
            "epsilon_after": self.epsilon_after,
            "config_hash": self.config_hash,
            "privtune_version": self.privtune_version,
            "user": self.username,
            "host": self.host,
            "hash": self.hash,
        }


@dataclass(frozen=True)
class BudgetStatus:
    """A dataset's budget now.

    ``spent_epsilon`` composes the committed entries; ``reserved_epsilon`` is what the open
    reservations add on top (``spent + reserved`` = ε of all charged entries composed);
    ``remaining_epsilon = total_epsilon − spent_epsilon − reserved_epsilon`` (negative only if an
    external spend was forced past the total).  All ε's are at the dataset's ``delta``.
    """

    fingerprint: str
    name: str | None
    total_epsilon: float
    delta: float
    accountant: str
    spent_epsilon: float
    reserved_epsilon: float
    remaining_epsilon: float
    entries: tuple = ()
    ledger_url: str = ""
    dataset_id: str | None = None
    #: the local file name the dataset was registered under (kept in the ledger only, to tell datasets apart in
    #: ``privtune budget show``; never written into a run directory); None when registered by fingerprint
    file_name: str | None = None

    @property
    def used_epsilon(self) -> float:
        """ε of all committed and reserved entries composed."""
        return self.spent_epsilon + self.reserved_epsilon

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.fingerprint,
            "dataset_id": self.dataset_id,
            "fingerprint": self.fingerprint,
            "name": self.name,
            "file_name": self.file_name,
            "total_epsilon": self.total_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "spent_epsilon": self.spent_epsilon,
            "reserved_epsilon": self.reserved_epsilon,
            "used_epsilon": self.used_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "ledger": self.ledger_url,
            "entries": [e.to_dict() for e in self.entries],
        }


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`Ledger.verify`: ``ok`` is False when any problem was found."""

    ok: bool
    problems: tuple
    datasets: tuple  # dicts: fingerprint, name, records, head_hash

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": list(self.problems), "datasets": list(self.datasets)}


# --------------------------------------------------------------------------- replay


@dataclass
class _EntryState:
    entry_id: str
    state: str
    planned: tuple
    actual: tuple | None
    resume_key: str | None
    delta: float | None
    note: str
    first: Any  # the reserve record row
    last: Any  # latest record row of the entry
    resumed: int = 0
    privacy_unit: str | None = None

    @property
    def charged_events(self) -> tuple:
        if self.state == "committed":
            return self.actual or ()
        if self.state == "reserved":
            return self.planned
        return ()

    def to_entry(self) -> Entry:
        f = self.first
        return Entry(
            entry_id=self.entry_id,
            state=self.state,
            events=self.charged_events if self.state != "released" else self.planned,
            planned_events=self.planned,
            command=f.command,
            config_hash=f.config_hash,
            privtune_version=f.privtune_version,
            username=f.username,
            host=f.host,
            created_at=f.created_at,
            updated_at=self.last.created_at,
            resume_key=self.resume_key,
            delta=self.delta,
            note=self.note,
            epsilon_after=self.last.epsilon_after,
            resumed=self.resumed,
            privacy_unit=self.privacy_unit,
        )


@dataclass
class _DatasetState:
    row: Any
    total_epsilon: float = 0.0
    delta: float = 0.0
    accountant: str = "pld"
    name: str | None = None
    file_name: str | None = None  # the local file name the dataset was registered under (ledger only)
    entries: dict = field(default_factory=dict)  # entry_id -> _EntryState, creation order
    records: list = field(default_factory=list)
    last_hash: str = ""  # MAC of the chain's last record (the next record's prev_hash)
    public_id: str | None = None  # the dataset id its records carry (None: no record carries one)

    def charged_events(self, exclude: str | None = None) -> list:
        out: list = []
        for e in self.entries.values():
            if e.entry_id != exclude:
                out.extend(e.charged_events)
        return out

    def committed_events(self) -> list:
        out: list = []
        for e in self.entries.values():
            if e.state == "committed":
                out.extend(e.charged_events)
        return out


def _parse_events(text: Any, where: str) -> tuple:
    try:
        return tuple(event_from_dict(d) for d in text)
    except (CertificateError, InvalidParameterError, TypeError) as exc:
        raise LedgerError(f"The ledger holds an unreadable event in {where}: {exc}") from None


def _replay(ds_row: Any, rows: list, problems: list | None = None) -> _DatasetState:
    """Rebuild a dataset's state from its records.  With ``problems`` given, inconsistencies are
    collected there (for verify); otherwise the first one raises LedgerError."""

    def bad(msg: str) -> None:
        full = f"{_tag(ds_row)}: {msg}"
        if problems is None:
            raise LedgerError(f"The ledger is inconsistent ({full}). Run `privtune budget verify`.")
        problems.append(full)

    st = _DatasetState(row=ds_row, records=rows, last_hash=rows[-1].hash if rows else "")
    for r in rows:
        try:
            p = json.loads(r.payload)
        except (TypeError, ValueError):
            bad(f"record {r.seq} has a payload that is not JSON")
            continue
        where = f"record {r.seq} ({r.action})"
        chain_id = p.get("dataset_id") if isinstance(p, dict) else None
        if chain_id is not None:
            # every record names the dataset id (MACed with it): an edited id in the row shows here
            if st.public_id is None and chain_id != _row_public_id(ds_row):
                bad(f"{where}: the dataset row's id {_row_public_id(ds_row)!r} differs from the id {chain_id!r} "
                    "its records carry: the dataset id was edited")
            st.public_id = st.public_id or chain_id
        if r.action == "init":
            if r.seq != 0:
                bad(f"{where}: init is not the first record")
            st.total_epsilon, st.delta = float(p["total_epsilon"]), float(p["delta"])
            st.accountant, st.name, st.file_name = p["accountant"], p.get("name"), p.get("file_name")
            if p.get("fingerprint") != ds_row.fingerprint:
                bad(f"{where}: belongs to fingerprint {p.get('fingerprint')!r}")
        elif r.action == "raise":
            st.total_epsilon = float(p["total_epsilon"])
        elif r.action == "reserve":
            if r.entry_id in st.entries:
                bad(f"{where}: entry {r.entry_id} reserved twice")
                continue
            st.entries[r.entry_id] = _EntryState(
                entry_id=r.entry_id,
                state="reserved",
                planned=_parse_events(p["events"], where),
                actual=None,
                resume_key=p.get("resume_key"),
                delta=p.get("delta"),
                note=p.get("note") or "",
                first=r,
                last=r,
                privacy_unit=p.get("privacy_unit"),
            )
        elif r.action in ("commit", "release", "resume"):
            e = st.entries.get(r.entry_id)
            if e is None:
                bad(f"{where}: refers to entry {r.entry_id}, which was never reserved")
                continue
            if e.state != "reserved":
                bad(f"{where}: entry {r.entry_id} is already {e.state}")
                continue
            if r.action == "commit":
                e.state, e.actual = "committed", _parse_events(p["events"], where)
            elif r.action == "release":
                e.state = "released"
            else:
                e.resumed += 1
            e.last = r
        else:
            bad(f"{where}: unknown action {r.action!r}")
    if not rows or rows[0].action != "init":
        bad("the chain does not start with an init record")
    return st


# --------------------------------------------------------------------------- hashing


def _row_public_id(row: Any) -> str | None:
    return row.public_id if "public_id" in row._mapping else None


def _tag(row: Any) -> str:
    """How messages name a dataset: its public id (never a hash of its content) and its name."""
    public_id = getattr(row, "public_id", None) if "public_id" in row._mapping else None
    return f"dataset {public_id or '#' + str(row.id)}" + (f" ({row.name})" if row.name else "")


def _v1_genesis(fingerprint: str) -> str:
    """Schema 1's unkeyed first link (only read, to verify a chain before migrating it)."""
    return hashlib.sha256((_GENESIS + fingerprint).encode()).hexdigest()


def _v1_record_hash(fingerprint: str, r: Mapping[str, Any]) -> str:
    """Schema 1's unkeyed record hash (only read, to verify a chain before migrating it)."""
    return hashlib.sha256(_record_body(fingerprint, r).encode()).hexdigest()


def _record_mac(key: bytes, fingerprint: str, r: Mapping[str, Any]) -> str:
    return _key.record_mac(key, _record_body(fingerprint, r))


def _record_body(fingerprint: str, r: Mapping[str, Any]) -> str:
    body = {
        "fingerprint": fingerprint,
        "seq": r["seq"],
        "action": r["action"],
        "entry_id": r["entry_id"],
        "payload": r["payload"],
        "epsilon_after": float(r["epsilon_after"]),
        "command": r["command"],
        "config_hash": r["config_hash"],
        "privtune_version": r["privtune_version"],
        "username": r["username"],
        "host": r["host"],
        "created_at": r["created_at"],
        "prev_hash": r["prev_hash"],
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


# --------------------------------------------------------------------------- input checks


def _check_spend_delta(delta: float | None, dataset_delta: float) -> None:
    """A spend's δ above the dataset's δ would not be covered by the dataset's budget: refuse it."""
    if delta is not None and delta > dataset_delta:
        raise BudgetExceededError(
            f"`delta` of the spend ({delta:g}) is larger than the dataset's δ = {dataset_delta:g}, so the "
            f"run's guarantee would not be covered by the dataset's budget. Pass delta <= {dataset_delta:g} "
            "(the dataset's δ)."
        )


def _check_events(events: Any, name: str) -> tuple:
    types = tuple(EVENT_TYPES.values())
    if isinstance(events, types) or isinstance(events, Mapping):
        events = [events]
    if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
        raise InvalidParameterError(
            f"`{name}` must be a privtune event or a list of events (GaussianEvent, DPSGDEvent, "
            f"RepeatAndSelectEvent). Got {events!r}."
        )
    out = []
    for e in events:
        if isinstance(e, Mapping):
            try:
                e = event_from_dict(dict(e))
            except CertificateError as exc:
                raise InvalidParameterError(f"`{name}` holds a malformed event dict: {exc}") from None
        if not isinstance(e, types):
            raise InvalidParameterError(
                f"`{name}` must hold privtune events from privtune.accounting.events. Got {e!r}."
            )
        if isinstance(e, NonPrivateEvent):
            raise BudgetExceededError(
                f"`{name}` holds a NonPrivateEvent ({describe_event(e)}): a release without a privacy "
                "guarantee has ε = ∞ and would exhaust this dataset's finite budget forever, so the ledger "
                "refuses to charge it; nothing was recorded. Keep non-private runs (noise_multiplier=0, "
                "fit_nonprivate) out of the ledger and out of anything released, or run with noise "
                "(noise_multiplier > 0 or a target epsilon)."
            )
        out.append(e)
    if not out:
        raise InvalidParameterError(
            f"`{name}` must not be empty. Pass the events the run will spend, e.g. "
            "[DPSGDEvent(noise_multiplier=1.0, sample_rate=0.01, steps=1000)]."
        )
    return tuple(out)


def _unit_payload(privacy_unit: str | None) -> dict[str, Any]:
    """The reserve record's privacy-unit key: absent at example level (records as before), else the unit."""
    return {} if privacy_unit is None else {"privacy_unit": privacy_unit}


def _check_same_unit(st: "_DatasetState", privacy_unit: str | None, exclude: str | None = None) -> None:
    """Refuse a spend whose privacy unit differs from a charged spend's on the same dataset.

    Example-level and user-level ε do not compose into one number without the row count of the largest unit
    (group privacy at that count, which is private; the public cap k bounds only the rows a user-level step
    uses, not the rows an example-level run used), so one dataset's budget is kept in one unit
    (docs/privacy-unit.md, "The ledger")."""
    def words(unit: str | None) -> str:
        return "example level (one row)" if unit is None else f"privacy unit {unit!r}"

    for e in st.entries.values():
        if e.entry_id != exclude and e.state in ("reserved", "committed") and e.privacy_unit != privacy_unit:
            raise LedgerError(
                f"This dataset's budget is spent at {words(e.privacy_unit)} (entry {e.entry_id}); a spend at "
                f"{words(privacy_unit)} cannot be composed with it: the conversion needs the row count of the largest "
                "unit, which is private. Nothing was charged. Use the same privacy unit as the earlier spends, or "
                "register the data under a new dataset name (a separate budget) only if that is truly a separate "
                "data set."
            )


def _check_text(value: Any, name: str, *, allow_none: bool = False, max_len: int | None = None) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidParameterError(f"`{name}` must be a non-empty string. Got {value!r}.")
    if max_len is not None and len(value) > max_len:
        raise InvalidParameterError(f"`{name}` must be at most {max_len} characters. Got {len(value)} characters.")
    return value.strip()


def _config_hash(config: Any) -> str | None:
    if config is None:
        return None
    if isinstance(config, (bytes, bytearray)):
        return hashlib.sha256(bytes(config)).hexdigest()
    if isinstance(config, str):
        return hashlib.sha256(config.encode()).hexdigest()
    if isinstance(config, os.PathLike):
        return dataset_fingerprint(config)
    if isinstance(config, Mapping):
        try:
            text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
        except (TypeError, ValueError) as exc:
            raise InvalidParameterError(f"`config` must be JSON-serialisable: {exc}.") from None
        return hashlib.sha256(text.encode()).hexdigest()
    raise InvalidParameterError(
        f"`config` must be a dict of options, a string, a path to a config file, or None. Got {type(config).__name__}."
    )


def _who(command: Any, config: Any) -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (containers)
        user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
    return {
        "command": _check_text(command, "command"),
        "config_hash": _config_hash(config),
        "privtune_version": __version__,
        "username": user[:128],
        "host": socket.gethostname()[:256],
        "created_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
    }


def _identify(dataset: Any) -> tuple[str, str]:
    """How a dataset argument names a dataset: ('content', SHA-256 of its content) for data or a
    path, ('hex', 64 hex digits: the ledger's keyed fingerprint or a content SHA-256 from
    :func:`dataset_fingerprint`), ('public_id', 'ds-…') or ('name', name)."""
    if isinstance(dataset, (bytes, bytearray, memoryview)):
        return "content", dataset_fingerprint(dataset)
    if isinstance(dataset, os.PathLike):
        return "content", dataset_fingerprint(dataset)
    if isinstance(dataset, str):
        s = dataset.strip()
        if not s:
            raise InvalidParameterError(
                "`dataset` must be a dataset path, a fingerprint, a dataset id or a registered name. Got ''."
            )
        if is_fingerprint(s):
            return "hex", s.lower()
        if os.path.exists(os.path.expanduser(s)):
            return "content", dataset_fingerprint(s)
        if _PUBLIC_ID.fullmatch(s):
            return "public_id", s
        return "name", s
    raise InvalidParameterError(
        f"`dataset` must be a dataset path, a fingerprint (64 hex digits) or a registered name. "
        f"Got {type(dataset).__name__}: {dataset!r}."
    )


def _new_public_id() -> str:
    """A random dataset id ('ds-' and 16 hex digits): independent of the data, safe to publish."""
    return "ds-" + secrets.token_hex(8)


def _fmt(eps: float) -> str:
    return f"{eps:.4g}"


def _refuse_infinite(eps_after: float, events: tuple, delta: float) -> None:
    """A forced record must still have a finite ε: the books cannot compose an infinite one."""
    if not math.isfinite(eps_after):
        raise BudgetExceededError(
            f"The events [{'; '.join(describe_event(e) for e in events)}] have no finite ε at δ = {delta:g} "
            "(a noise multiplier below 1e-06, or an accountant overflow), so they cannot be recorded, even "
            "with force=True: the ledger composes finite ε's only. Such a run is not differentially private; "
            "if it really touched this dataset, the dataset's privacy guarantee is gone."
        )


# --------------------------------------------------------------------------- the ledger


class Reservation:
    """A reservation of planned events on a dataset (returned by :meth:`Ledger.spend`).

    Attributes: ``entry_id``, ``fingerprint``, ``planned_events``, ``resumed`` (True when an
    existing reservation was continued), ``epsilon_after`` (the dataset's composed ε with this
    reservation), ``remaining_epsilon`` (what is left after it), ``state``.
    """

    def __init__(self, ledger: Ledger, fingerprint: str, entry_id: str, planned_events: tuple, *,
                 resumed: bool, epsilon_after: float, remaining_epsilon: float,
                 dataset_id: str | None = None) -> None:
        self.ledger = ledger
        self.fingerprint = fingerprint
        self.entry_id = entry_id
        self.planned_events = planned_events
        self.resumed = resumed
        self.epsilon_after = epsilon_after
        self.remaining_epsilon = remaining_epsilon
        self.dataset_id = dataset_id  # the dataset's random public id (what run directories may publish)
        self.state = "reserved"

    def commit(self, actual_events: Any = None, *, command: str | None = None, force: bool = False) -> Entry:
        """Record the actually spent events (default: the planned ones) and close the entry.

        Committed events must not cost more than the reservation (their composed ε on their own,
        at the dataset's δ, with the dataset's accountant): otherwise BudgetExceededError is
        raised, nothing is written and the reservation stays charged.  ``force=True`` records
        such events anyway (a run that really spent more: the books must show it), with a
        warning and ``exceeded_reservation`` in the record; BudgetExceededError then follows
        if the dataset's total is overspent.
        """
        entry = self.ledger._commit(self.fingerprint, self.entry_id, actual_events, command=command,
                                    force=bool(force))
        self.state = "committed"
        return entry

    def release(self, reason: str, *, command: str | None = None) -> Entry:
        """Cancel the reservation.  Only call this when **no example was read**: after data has
        been touched, commit (the spend happened) or leave it reserved."""
        entry = self.ledger._release(self.fingerprint, self.entry_id, reason, command=command)
        self.state = "released"
        return entry

    def __repr__(self) -> str:
        return (f"Reservation(entry_id={self.entry_id!r}, state={self.state!r}, resumed={self.resumed}, "
                f"epsilon_after={self.epsilon_after:.4g}, remaining_epsilon={self.remaining_epsilon:.4g})")


class Ledger:
    """A persistent, tamper-evident, per-dataset privacy budget ledger.

    Parameters
    ----------
    url : str, os.PathLike or None
        ``None`` -> ``$PRIVTUNE_LEDGER`` or ``sqlite:///~/.privtune/ledger.db``;
        ``"sqlite:////abs/path.db"`` (or a bare file path) for a file on this machine;
        ``"postgresql://user:password@host:5432/dbname"`` for a ledger shared by a team.

    allow_in_memory : bool, default False
        Accept an SQLite URL without a file (``sqlite:///:memory:``, ``sqlite:///``): a throw-away
        ledger that forgets everything when the process exits (tests only).  Without it such a
        URL raises InvalidParameterError, so that ``--ledger sqlite:///`` cannot silently keep no
        books.

    key_file : path or None
        The ledger's secret key file (default: ``$PRIVTUNE_LEDGER_KEY_FILE``, else ``<ledger
        file>.key`` beside an SQLite file, else ``$PRIVTUNE_HOME/ledger-keys/…`` for PostgreSQL).
        Created (mode 0600) with a new ledger; required for an existing one.  See docs/ledger.md.

    The database is opened (and its schema created when empty) on first use.  A file that is
    not a privtune ledger, or is corrupted, raises LedgerError; it is never reset.  A schema-1
    ledger (written before ledgers were keyed) is verified and upgraded on first use.
    """

    def __init__(self, url: str | os.PathLike | None = None, *, allow_in_memory: bool = False,
                 key_file: str | os.PathLike | None = None) -> None:
        self._sa_url, self._sqlite_path, self._default_location = backend.resolve_url(
            url, allow_in_memory=bool(allow_in_memory))
        self._engine: sa.Engine | None = None
        self._pid: int | None = None
        self._replays: dict[int, tuple] = {}  # dataset id -> ((head_seq, head_hash), replayed state)
        self._key_path = (Path(os.fspath(key_file)).expanduser() if key_file is not None else
                          _key.key_path(self._sqlite_path, self._server_address(), self._sa_url.database))
        self._key: bytes | None = None
        if self._key_path is None:  # in-memory ledger: its key lives as long as the process
            self._key = secrets.token_bytes(32)

    # ---- plumbing

    def _server_address(self) -> str:
        """'sqlite' or 'host:port/database' of a PostgreSQL ledger (no user, no password)."""
        u = self._sa_url
        if u.get_backend_name() == "sqlite":
            return "sqlite"
        host = u.host or u.query.get("host") or "localhost"
        port = u.port or u.query.get("port") or 5432
        return f"{host}:{port}/{u.database or ''}"

    @property
    def url(self) -> str:
        """The resolved URL with any password masked."""
        return backend.mask_url(self._sa_url)

    @property
    def backend(self) -> str:
        """``'sqlite'`` or ``'postgresql'``."""
        return self._sa_url.get_backend_name()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r})"

    def _where(self) -> str:
        return backend._describe(self._sa_url, self._sqlite_path)

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return backend.translate_errors(self._sa_url, self._sqlite_path)

    def _get_engine(self) -> sa.Engine:
        if self._engine is not None and self._pid != os.getpid():  # forked: never share connections
            self._engine.dispose(close=False)
            self._engine = None
        if self._engine is None:
            if self._sqlite_path is not None:
                backend.check_sqlite_location(self._sqlite_path, self._default_location)
            with self._errors():
                engine = backend.create_engine(self._sa_url, self._sqlite_path)
                try:
                    self._open_schema(engine)
                except BaseException:
                    engine.dispose()
                    raise
            self._engine, self._pid = engine, os.getpid()
        return self._engine

    def _open_schema(self, engine: sa.Engine) -> None:
        """Create the schema (and the key) of an empty database, migrate a schema-1 ledger, and
        check that the key file belongs to this ledger."""
        where = self._where()
        state = backend.current_schema(engine, where)
        if state in ("empty", "legacy") and self._key is None:
            self._key = _key.read_key(self._key_path) or _key.create_key(self._key_path)
        if state == "empty":
            backend.create_schema(engine, where, _key.key_check(self._key))
        elif state == "legacy":
            self._migrate_legacy(engine)
        if self._key is None:
            self._key = _key.read_key(self._key_path)
            if self._key is None:
                raise _key.missing_key_error(self._key_path, where)
        with backend.read_connection(engine) as conn:
            stored = backend.read_meta(conn).get("key_check")
        if stored != _key.key_check(self._key):
            raise _key.wrong_key_error(self._key_path, where)

    def _migrate_legacy(self, engine: sa.Engine) -> None:
        """Upgrade a schema-1 ledger (unkeyed SHA-256 chains, raw content fingerprints) in one transaction.

        Every chain is verified with the old, unkeyed hashes first: re-MACing a tampered chain would
        launder the tampering, so a ledger that fails verification is refused (and left untouched).
        Then each dataset's fingerprint becomes the keyed one (computed from the stored SHA-256, so
        no data is needed), it gets a random public id, and its chain is re-MACed with the key,
        record by record, in order; budgets, entries and history carry over unchanged."""
        t, r = backend.datasets_table, backend.records_table
        key = self._key
        where = self._where()
        with backend.write_connection(engine) as conn:
            backend.pg_advisory_lock(conn, backend.PG_SCHEMA_LOCK)
            if backend.schema_state(conn, where) != "legacy":  # migrated concurrently
                return
            cols = [c for c in t.c if c.name != "public_id"]  # the schema-1 table has no such column
            rows = conn.execute(sa.select(*cols).order_by(t.c.id)).all()
            problems: list[str] = []
            chains = {}
            for row in rows:
                recs = conn.execute(sa.select(r).where(r.c.dataset_id == row.id).order_by(r.c.seq)).all()
                self._check_chain(row, recs, problems, _v1_genesis(row.fingerprint),
                                  lambda m, fp=row.fingerprint: _v1_record_hash(fp, m),
                                  lambda seq, h: h, "dataset #" + str(row.id))
                chains[row.id] = recs
            ids = {row.id for row in rows}
            for ds_id, n in conn.execute(sa.select(r.c.dataset_id, sa.func.count()).group_by(r.c.dataset_id)).all():
                if ds_id not in ids:
                    problems.append(f"{n} record(s) belong to dataset id {ds_id}, which was deleted")
            if problems:
                raise LedgerError(
                    f"The {where} uses the old, unkeyed ledger format and fails verification, so privtune will not "
                    f"upgrade it (re-keying a tampered chain would hide the tampering): {'; '.join(problems[:5])}. "
                    "Restore the ledger from a backup, or keep using it with the privtune version that wrote it."
                )
            backend.add_public_id_column(conn)
            for row in rows:
                fp = _key.keyed_fingerprint(key, row.fingerprint)
                prev = _key.genesis_mac(key, fp)
                last_seq = -1
                for rec in chains[row.id]:
                    m = dict(rec._mapping)
                    if rec.action == "init":  # the stored payload named the raw SHA-256: replace it
                        p = json.loads(rec.payload)
                        p["fingerprint"] = fp
                        m["payload"] = _canonical_json(p)
                    m["prev_hash"] = prev
                    m["hash"] = _record_mac(key, fp, m)
                    conn.execute(r.update().where(r.c.id == rec.id).values(
                        payload=m["payload"], prev_hash=m["prev_hash"], hash=m["hash"]))
                    prev, last_seq = m["hash"], rec.seq
                conn.execute(t.update().where(t.c.id == row.id).values(
                    fingerprint=fp, public_id=_new_public_id(), head_seq=last_seq,
                    head_hash=_key.head_mac(key, fp, last_seq, prev)))
            m = backend.meta_table
            conn.execute(m.update().where(m.c.key == "schema_version").values(value=str(backend.SCHEMA_VERSION)))
            conn.execute(m.insert(), [
                {"key": "key_check", "value": _key.key_check(key)},
                {"key": "migrated_from_schema_1_at", "value": datetime.now(timezone.utc).isoformat()},
            ])
        self._replays.clear()

    @staticmethod
    def _check_chain(row: Any, rows: list, problems: list, genesis: str, record_hash: Any, head: Any,
                     tag: str) -> None:
        """Links, record hashes and the head of one chain; problems appended to ``problems``."""
        prev = genesis
        n_before = len(problems)
        for i, rec in enumerate(rows):
            if rec.seq != i:
                problems.append(f"{tag}: record {i} is missing (next is {rec.seq}); a record was deleted")
                break
            if rec.prev_hash != prev:
                problems.append(f"{tag}: record {rec.seq} does not link to the previous record (deleted or replaced)")
            if record_hash(rec._mapping) != rec.hash:
                problems.append(f"{tag}: record {rec.seq} ({rec.action}) was edited: its hash does not match")
            prev = rec.hash
        if rows and len(problems) == n_before:
            if row.head_seq != rows[-1].seq or row.head_hash != head(rows[-1].seq, rows[-1].hash):
                problems.append(
                    f"{tag}: the chain ends at record {rows[-1].seq} but the dataset's head (record {row.head_seq}) "
                    "does not match it: the latest record(s) were deleted, or the head was edited"
                )
        elif not rows:
            problems.append(f"{tag}: has no records at all (deleted)")

    # ---- keyed identities

    def _require_key(self) -> bytes:
        self._get_engine()
        assert self._key is not None
        return self._key

    def fingerprint(self, data: Any) -> str:
        """This ledger's keyed fingerprint of a dataset (64 hex digits).

        ``data``: a file or folder path, bytes, an iterable of chunks (as :func:`dataset_fingerprint`
        takes them), or a content SHA-256 returned by :func:`dataset_fingerprint`.  It is
        HMAC-SHA256 with the ledger's secret key: it identifies the content for this ledger only and,
        without the key, reveals nothing about it.  Run directories publish the dataset's random
        ``dataset_id`` instead."""
        if isinstance(data, str) and is_fingerprint(data.strip()):
            return _key.keyed_fingerprint(self._require_key(), data.strip().lower())
        return _key.keyed_fingerprint(self._require_key(), dataset_fingerprint(data))

    def _lookup(self, dataset: Any) -> tuple[str, Any, list]:
        """(kind, shown value, [(column, value), ...] to try in order) for a dataset argument."""
        kind, value = _identify(dataset)
        t = backend.datasets_table
        if kind == "content":
            return kind, value, [(t.c.fingerprint, _key.keyed_fingerprint(self._require_key(), value))]
        if kind == "hex":  # the keyed fingerprint itself, or a content SHA-256 from dataset_fingerprint()
            return kind, value, [(t.c.fingerprint, value),
                                 (t.c.fingerprint, _key.keyed_fingerprint(self._require_key(), value))]
        return kind, value, [(t.c.public_id if kind == "public_id" else t.c.name, value)]

    @contextlib.contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        engine = self._get_engine()
        with self._errors(), backend.write_connection(engine) as conn:
            yield conn

    @contextlib.contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        engine = self._get_engine()
        with self._errors(), backend.read_connection(engine) as conn:
            yield conn

    def close(self) -> None:
        """Release database connections (the ledger reopens on next use)."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- dataset rows

    def _find(self, conn: sa.Connection, dataset: Any, *, lock: bool) -> Any:
        kind, value, tries = self._lookup(dataset)
        t = backend.datasets_table
        row = None
        for column, candidate in tries:
            q = sa.select(t).where(column == candidate)
            if lock:
                q = q.with_for_update()
            row = conn.execute(q).first()
            if row is not None:
                break
        if row is None:
            shown = value if kind in ("name", "public_id") else "(given by its content)"
            hint = str(dataset) if kind in ("content", "hex") and isinstance(dataset, (str, os.PathLike)) else "PATH"
            raise UnknownDatasetError(
                f"`dataset` {shown!r} has no privacy budget in the {self._where()}. Give it one first: "
                f"`privtune budget init --dataset {hint} --epsilon EPS --delta DELTA` "
                "(or Ledger.init_dataset), or check --ledger / PRIVTUNE_LEDGER points at your team's ledger."
            )
        return row

    def _load(self, conn: sa.Connection, row: Any) -> _DatasetState:
        """Replay the dataset's records; reuse the last replay while the chain's head is unchanged
        (a long ledger is then read once, not on every check).  ``verify`` never uses this cache."""
        key = (row.head_seq, row.head_hash)
        cached = self._replays.get(row.id)
        if cached is not None and cached[0] == key:
            return dataclasses.replace(cached[1], row=row)
        r = backend.records_table
        rows = conn.execute(sa.select(r).where(r.c.dataset_id == row.id).order_by(r.c.seq)).all()
        st = _replay(row, rows)
        # O(1) check of the keyed head: records deleted at the end (with the head moved back) are refused
        # here too, not only by verify
        if not rows or rows[-1].seq != row.head_seq or row.head_hash != _key.head_mac(
                self._key, row.fingerprint, rows[-1].seq, rows[-1].hash):
            raise LedgerError(
                f"The ledger is inconsistent ({_tag(row)}: its last record does not match the dataset's keyed head; "
                "records were deleted at the end, or the ledger was edited without its key). Run `privtune budget "
                "verify`."
            )
        self._replays[row.id] = (key, dataclasses.replace(st))
        return st

    def _append(self, conn: sa.Connection, st: _DatasetState, action: str, entry_id: str | None,
                payload: dict, epsilon_after: float, who: dict, *, total_epsilon: float | None = None) -> Any:
        row = st.row
        public_id = st.public_id or _row_public_id(row)
        if public_id is not None:  # MACed into every record: verify and every read detect an edited id
            payload = {**payload, "dataset_id": public_id}
        rec = {
            "seq": row.head_seq + 1,
            "action": action,
            "entry_id": entry_id,
            "payload": _canonical_json(payload),
            "epsilon_after": float(epsilon_after),
            **who,
            "prev_hash": st.last_hash,
        }
        rec["hash"] = _record_mac(self._key, row.fingerprint, rec)
        conn.execute(backend.records_table.insert().values(dataset_id=row.id, **rec))
        upd = {"head_seq": rec["seq"], "head_hash": _key.head_mac(self._key, row.fingerprint, rec["seq"], rec["hash"])}
        st.last_hash = rec["hash"]
        if total_epsilon is not None:
            upd["total_epsilon"] = total_epsilon
        t = backend.datasets_table
        conn.execute(t.update().where(t.c.id == row.id).values(**upd))
        # keep the in-memory row current for a second append in the same transaction
        st.row = _RowView({**row._mapping, **upd})
        return rec

    def _status_from(self, st: _DatasetState) -> BudgetStatus:
        charged = st.charged_events()
        used = composed_epsilon(charged, st.delta, st.accountant)
        spent = composed_epsilon(st.committed_events(), st.delta, st.accountant)
        spent = min(spent, used)
        return BudgetStatus(
            fingerprint=st.row.fingerprint,
            name=st.row.name,
            total_epsilon=st.total_epsilon,
            delta=st.delta,
            accountant=st.accountant,
            spent_epsilon=spent,
            reserved_epsilon=used - spent,
            remaining_epsilon=st.total_epsilon - used,
            entries=tuple(e.to_entry() for e in st.entries.values()),
            ledger_url=self.url,
            dataset_id=st.row.public_id,
            file_name=st.file_name,
        )

    # ---- public API

    def init_dataset(self, dataset: Any, epsilon: float, delta: float, name: str | None = None, *,
                     accountant: str = "pld", command: str | None = None,
                     file_name: str | None = None) -> BudgetStatus:
        """Give a dataset its total budget (ε, δ), once.

        Parameters
        ----------
        dataset : path of the dataset file/folder, its bytes, or its content SHA-256
            (:func:`dataset_fingerprint`).  The ledger stores only the keyed fingerprint
            (:meth:`fingerprint`) and assigns the dataset a random ``dataset_id``.
        epsilon : total ε (> 0) for everything ever run on this dataset.
        delta : total δ in (0, 1); every spend is composed at this δ.
        name : optional unique human name to refer to the dataset later.
        accountant : ``"pld"`` (tight, default) or ``"rdp"`` (fast, looser); fixed for the dataset.
        file_name : the local file name the data was read from, recorded with the registration so that
            ``privtune budget show`` can tell datasets apart (default: the name of ``dataset`` when it is a
            path).  Only the name is kept, not its directory; it stays in the ledger.

        Initialising again with the same ε, δ and accountant is a no-op; a different total raises
        LedgerError pointing at :meth:`raise_budget` (an explicit, recorded action).
        """
        epsilon = check_epsilon(epsilon)
        delta = check_delta(delta)
        accountant = check_choice(accountant, "accountant", ACCOUNTANTS)
        kind, value, tries = self._lookup(dataset)
        if kind in ("name", "public_id"):
            raise InvalidParameterError(
                f"`dataset` {value!r} is neither an existing file/folder nor a fingerprint. Pass the dataset's "
                "path (its content is fingerprinted) and give the human name with name=/--name."
            )
        fp = tries[-1][1]  # the keyed fingerprint of the content (a 64-hex argument: read as a content SHA-256)
        if file_name is None and kind == "content" and isinstance(dataset, (str, os.PathLike)):
            file_name = os.path.basename(os.path.normpath(os.path.expanduser(os.fspath(dataset)).strip())) or None
        if file_name is not None:
            file_name = _check_text(os.path.basename(os.fspath(file_name)), "file_name", max_len=255)
        if name is not None:
            name = _check_text(name, "name", max_len=200)
            if is_fingerprint(name) or _PUBLIC_ID.fullmatch(name) or os.path.exists(os.path.expanduser(name)):
                raise InvalidParameterError(
                    f"`name` must not be a fingerprint, a dataset id (ds-…) or an existing path (it would be "
                    f"ambiguous). Got {name!r}."
                )
        who = _who(command or "privtune budget init (Python API)", None)
        with self._write() as conn:
            backend.pg_advisory_lock(conn, backend.PG_INIT_LOCK)
            t = backend.datasets_table
            existing = None
            for column, candidate in tries:
                existing = existing or conn.execute(sa.select(t).where(column == candidate)).first()
            if existing is not None:
                st = self._load(conn, existing)
                same = (st.total_epsilon == epsilon and st.delta == delta and st.accountant == accountant
                        and (name is None or name == existing.name))
                if same:
                    return self._status_from(st)
                raise LedgerError(
                    f"{_tag(existing).capitalize()} already has a budget: total ε="
                    f"{_fmt(st.total_epsilon)}, δ={st.delta:g}, accountant={st.accountant}. A budget is set once; "
                    "raising the total is an explicit, recorded action: `privtune budget raise --dataset ... "
                    "--epsilon NEW --reason WHY` (Ledger.raise_budget)."
                )
            if name is not None:
                clash = conn.execute(sa.select(t.c.fingerprint).where(t.c.name == name)).first()
                if clash is not None:
                    raise LedgerError(f"`name` {name!r} already belongs to another dataset. Choose another name.")
            genesis = _key.genesis_mac(self._key, fp)
            res = conn.execute(t.insert().values(
                fingerprint=fp, name=name, public_id=_new_public_id(), total_epsilon=epsilon, delta=delta,
                accountant=accountant, created_at=who["created_at"], head_seq=-1, head_hash=genesis,
            ))
            row = conn.execute(sa.select(t).where(t.c.id == res.inserted_primary_key[0])).one()
            st = _DatasetState(row=row, total_epsilon=epsilon, delta=delta, accountant=accountant, name=name,
                               last_hash=genesis)
            payload = {"fingerprint": fp, "name": name, "total_epsilon": epsilon, "delta": delta,
                       "accountant": accountant}
            if file_name:
                payload["file_name"] = file_name
            self._append(conn, st, "init", None, payload, 0.0, who)
        return self.status(fp)

    def ensure_dataset(self, dataset: Any, epsilon: float, delta: float, name: str | None = None, *,
                       accountant: str = "pld", command: str | None = None,
                       file_name: str | None = None) -> BudgetStatus:
        """Register the dataset with total (ε, δ) if the ledger does not know it yet; otherwise
        return its status and leave its existing total alone (a run's own ε is not a new total).

        This is what ``train``/``tune`` call on first contact with a dataset.
        """
        try:
            return self.status(dataset)
        except UnknownDatasetError:
            pass
        try:
            return self.init_dataset(dataset, epsilon, delta, name=name, accountant=accountant, command=command,
                                     file_name=file_name)
        except LedgerError:  # registered concurrently with other values (or the name is taken)
            return self.status(dataset)

    def raise_budget(self, dataset: Any, epsilon: float, *, reason: str, command: str | None = None) -> BudgetStatus:
        """Raise a dataset's total ε to ``epsilon`` (an explicit, recorded decision; δ is fixed).

        ``reason`` is stored in the hash chain.  Lowering the total is refused.
        """
        epsilon = check_epsilon(epsilon)
        reason = _check_text(reason, "reason")
        who = _who(command or "privtune budget raise (Python API)", None)
        with self._write() as conn:
            row = self._find(conn, dataset, lock=True)
            st = self._load(conn, row)
            if epsilon <= st.total_epsilon:
                raise InvalidParameterError(
                    f"`epsilon` must be larger than the current total ε={_fmt(st.total_epsilon)} to raise it. "
                    f"Got {epsilon!r}. A total is never lowered or reset."
                )
            used = composed_epsilon(st.charged_events(), st.delta, st.accountant)
            payload = {"total_epsilon": epsilon, "previous_total_epsilon": st.total_epsilon, "reason": reason}
            self._append(conn, st, "raise", None, payload, used, who, total_epsilon=epsilon)
        return self.status(row.fingerprint)

    def status(self, dataset: Any) -> BudgetStatus:
        """The dataset's total, spent, reserved and remaining ε, and its entries."""
        with self._read() as conn:
            row = self._find(conn, dataset, lock=False)
            st = self._load(conn, row)
        return self._status_from(st)

    def history(self, dataset: Any) -> list[Record]:
        """Every record of the dataset's hash chain, oldest first."""
        with self._read() as conn:
            row = self._find(conn, dataset, lock=False)
            st = self._load(conn, row)
        out = []
        for r in st.records:
            p = json.loads(r.payload)
            events = _parse_events(p["events"], f"record {r.seq}") if "events" in p else ()
            out.append(Record(
                seq=r.seq, action=r.action, state=_ACTION_STATE.get(r.action, r.action), entry_id=r.entry_id,
                created_at=r.created_at, command=r.command, events=events, epsilon_after=r.epsilon_after,
                payload=p, config_hash=r.config_hash, privtune_version=r.privtune_version,
                username=r.username, host=r.host, hash=r.hash,
            ))
        return out

    def datasets(self) -> list[dict[str, Any]]:
        """All datasets in the ledger: dataset_id, fingerprint (keyed), name, file_name (the local file name
        it was registered under, or None), total_epsilon, delta, accountant, created_at."""
        t, r = backend.datasets_table, backend.records_table
        with self._read() as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.id)).all()
            inits = conn.execute(sa.select(r.c.dataset_id, r.c.payload).where(r.c.action == "init")).all()
        file_names = {}
        for dataset_id, payload in inits:
            try:
                file_names[dataset_id] = json.loads(payload).get("file_name")
            except (TypeError, ValueError, AttributeError):  # a damaged record: verify names it
                file_names[dataset_id] = None
        return [{"dataset_id": d.public_id, "fingerprint": d.fingerprint, "name": d.name,
                 "file_name": file_names.get(d.id), "total_epsilon": d.total_epsilon,
                 "delta": d.delta, "accountant": d.accountant, "created_at": d.created_at} for d in rows]

    def spent_events(self, dataset: Any) -> list:
        """The events of all charged (committed and reserved) entries, merged where exactly additive.

        Pass them as ``spent_events`` to ``calibrate_noise_multiplier`` to size a new run so that
        it fits: the ledger composes ``spent_events + new_events`` in the same order.
        """
        with self._read() as conn:
            st = self._load(conn, self._find(conn, dataset, lock=False))
        return group_events(st.charged_events())

    def preview_epsilon(self, dataset: Any, events: Any) -> float:
        """The dataset's composed ε if ``events`` were added now (nothing is recorded)."""
        events = _check_events(events, "events")
        with self._read() as conn:
            st = self._load(conn, self._find(conn, dataset, lock=False))
        return composed_epsilon(st.charged_events(), st.delta, st.accountant, new=events)

    def _exceeded(self, st: _DatasetState, planned: tuple, eps_after: float, what: str) -> BudgetExceededError:
        used = composed_epsilon(st.charged_events(), st.delta, st.accountant)
        alone = composed_epsilon((), st.delta, st.accountant, new=planned)
        label = f"{st.row.name!r} " if st.row.name else ""
        return BudgetExceededError(
            f"{what} does not fit the privacy budget of dataset {label}({st.row.public_id}): remaining "
            f"ε = {_fmt(st.total_epsilon - used)} of total ε = {_fmt(st.total_epsilon)} (δ = {st.delta:g}); "
            f"it asks for ε = {_fmt(alone)} on its own ({'; '.join(describe_event(e) for e in planned)}), and "
            f"composed with the {sum(1 for e in st.entries.values() if e.state != 'released')} earlier "
            f"spend(s) the total would be ε = {_fmt(eps_after)}. No example was used for training and nothing was "
            "recorded. Use more noise, fewer steps or a smaller sample rate, or raise the total explicitly with "
            "`privtune budget raise`."
        )

    def reserve(self, dataset: Any, planned_events: Any, *, command: str, config: Any = None,
                resume_key: str | None = None, delta: float | None = None, note: str | None = None,
                privacy_unit: str | None = None) -> Reservation:
        """Reserve ``planned_events`` on ``dataset`` before any data is read (see :meth:`spend`).

        ``privacy_unit``: None for example-level events, else the name of the unit they protect (user-level DP);
        recorded with the spend.  A dataset's charged spends all have one unit: another is refused."""
        planned = _check_events(planned_events, "planned_events")
        privacy_unit = _check_text(privacy_unit, "privacy_unit", allow_none=True, max_len=200)
        resume_key = _check_text(resume_key, "resume_key", allow_none=True, max_len=500)
        note = _check_text(note, "note", allow_none=True) or ""
        if delta is not None:
            delta = check_delta(delta)
        who = _who(command, config)
        with self._write() as conn:
            row = self._find(conn, dataset, lock=True)
            st = self._load(conn, row)
            _check_spend_delta(delta, st.delta)
            if resume_key is not None:
                previous = [e for e in st.entries.values() if e.resume_key == resume_key and e.state != "released"]
                if previous:
                    e = previous[-1]
                    if e.state == "committed":
                        raise LedgerError(
                            f"The run with resume_key {resume_key!r} was already committed (entry {e.entry_id}, "
                            f"{e.last.created_at}); there is nothing to resume. Start a new run with a new resume_key."
                        )
                    if group_events(e.planned) != group_events(planned):
                        raise LedgerError(
                            f"resume_key {resume_key!r} continues reservation {e.entry_id}, planned as "
                            f"[{'; '.join(describe_event(x) for x in e.planned)}], but the resumed run plans "
                            f"[{'; '.join(describe_event(x) for x in planned)}]. A resumed run must keep its plan; "
                            "use a new resume_key for a different run."
                        )
                    _check_same_unit(st, privacy_unit)
                    used = composed_epsilon(st.charged_events(), st.delta, st.accountant)
                    self._append(conn, st, "resume", e.entry_id, {"resume_key": resume_key}, used, who)
                    return Reservation(self, row.fingerprint, e.entry_id, e.planned, resumed=True,
                                       epsilon_after=used, remaining_epsilon=st.total_epsilon - used,
                                       dataset_id=row.public_id)
            _check_same_unit(st, privacy_unit)
            eps_after = composed_epsilon(st.charged_events(), st.delta, st.accountant, new=planned)
            if eps_after > st.total_epsilon * (1 + _RTOL):
                raise self._exceeded(st, planned, eps_after, "The planned run")
            entry_id = uuid.uuid4().hex
            payload = {"events": [event_to_dict(e) for e in planned], "resume_key": resume_key,
                       "delta": delta, "note": note, **_unit_payload(privacy_unit)}
            self._append(conn, st, "reserve", entry_id, payload, eps_after, who)
        return Reservation(self, row.fingerprint, entry_id, planned, resumed=False,
                           epsilon_after=eps_after, remaining_epsilon=st.total_epsilon - eps_after,
                           dataset_id=row.public_id)

    @contextlib.contextmanager
    def spend(self, dataset: Any, planned_events: Any, *, command: str, config: Any = None,
              resume_key: str | None = None, delta: float | None = None,
              note: str | None = None, privacy_unit: str | None = None) -> Iterator[Reservation]:
        """Reserve on entry, commit on success, stay charged on failure.

        ::

            with ledger.spend(fp, [DPSGDEvent(1.1, 0.01, 1000)], command="privtune train ...") as res:
                ...                       # read data and train only inside the block
                res.commit(actual_events) # optional; default commits the planned events

        Raises BudgetExceededError on entry (before the block runs, so before any data is read)
        when the plan does not fit the remaining budget.  If the block raises (or the process
        dies) the reservation stays charged: a crash may have touched data.  ``resume_key``
        (e.g. the run directory) makes a restarted run continue its open reservation instead
        of reserving again.  ``delta``: the run's own δ, which must not exceed the dataset's.
        ``privacy_unit``: as in :meth:`reserve`.
        """
        res = self.reserve(dataset, planned_events, command=command, config=config,
                           resume_key=resume_key, delta=delta, note=note, privacy_unit=privacy_unit)
        yield res
        if res.state == "reserved":
            res.commit()

    def record_spend(self, dataset: Any, events: Any, *, command: str, config: Any = None,
                     delta: float | None = None, note: str | None = None, force: bool = False,
                     privacy_unit: str | None = None) -> Entry:
        """Record a run that already happened elsewhere (e.g. trained with another library).

        Reserve and commit are written in one transaction.  When the events do not fit,
        BudgetExceededError is raised and nothing is written, unless ``force=True``: then they are
        recorded anyway (the run happened; the books must show it) and the remaining ε goes negative.
        """
        events = _check_events(events, "events")
        note = _check_text(note, "note", allow_none=True) or ""
        privacy_unit = _check_text(privacy_unit, "privacy_unit", allow_none=True, max_len=200)
        if delta is not None:
            delta = check_delta(delta)
        who = _who(command, config)
        with self._write() as conn:
            row = self._find(conn, dataset, lock=True)
            st = self._load(conn, row)
            _check_spend_delta(delta, st.delta)
            _check_same_unit(st, privacy_unit)
            eps_after = composed_epsilon(st.charged_events(), st.delta, st.accountant, new=events)
            if eps_after > st.total_epsilon * (1 + _RTOL) and not force:
                raise self._exceeded(st, events, eps_after, "The external run")
            _refuse_infinite(eps_after, events, st.delta)
            entry_id = uuid.uuid4().hex
            dicts = [event_to_dict(e) for e in events]
            self._append(conn, st, "reserve", entry_id,
                         {"events": dicts, "resume_key": None, "delta": delta, "note": note or "external run",
                          **_unit_payload(privacy_unit)},
                         eps_after, who)
            self._append(conn, st, "commit", entry_id, {"events": dicts}, eps_after, who)
        return self._entry(row.fingerprint, entry_id)

    def _entry(self, fingerprint: str, entry_id: str) -> Entry:
        with self._read() as conn:  # replay only: no accountant call
            st = self._load(conn, self._find(conn, fingerprint, lock=False))
        e = st.entries.get(entry_id)
        if e is not None:
            return e.to_entry()
        raise LedgerError(f"Entry {entry_id} vanished from the ledger. Run `privtune budget verify`.")

    def _open_entry(self, conn: sa.Connection, fingerprint: str, entry_id: str) -> tuple[_DatasetState, _EntryState]:
        row = self._find(conn, fingerprint, lock=True)
        st = self._load(conn, row)
        e = st.entries.get(entry_id)
        if e is None:
            raise LedgerError(f"Entry {entry_id} does not exist in the {self._where()}.")
        if e.state != "reserved":
            raise LedgerError(
                f"Entry {entry_id} is already {e.state} ({e.last.created_at}); only a reserved entry can be "
                "committed or released."
            )
        return st, e

    def _commit(self, fingerprint: str, entry_id: str, actual_events: Any, *, command: str | None,
                force: bool = False) -> Entry:
        overspent = False
        with self._write() as conn:
            st, e = self._open_entry(conn, fingerprint, entry_id)
            actual = e.planned if actual_events is None else _check_events(actual_events, "actual_events")
            who = _who(command or e.first.command, None)
            who["config_hash"] = e.first.config_hash
            eps_after = composed_epsilon(st.charged_events(exclude=entry_id), st.delta, st.accountant, new=actual)
            _refuse_infinite(eps_after, actual, st.delta)
            payload: dict[str, Any] = {"events": [event_to_dict(x) for x in actual]}
            if group_events(actual) != group_events(e.planned):
                eps_actual = composed_epsilon((), st.delta, st.accountant, new=actual)
                eps_planned = composed_epsilon((), st.delta, st.accountant, new=e.planned)
                if eps_actual > eps_planned * (1 + _RTOL):
                    if not force:
                        raise BudgetExceededError(
                            f"Entry {entry_id} reserved ε = {_fmt(eps_planned)} "
                            f"([{'; '.join(describe_event(x) for x in e.planned)}]) but the commit's events cost "
                            f"ε = {_fmt(eps_actual)} on their own ([{'; '.join(describe_event(x) for x in actual)}]) "
                            f"at δ = {st.delta:g} ({st.accountant}). Committed events must not exceed the "
                            "reservation: the commit was refused, nothing was written and the reservation stays "
                            "charged. If the run really spent this much, commit with force=True to record it "
                            "(the dataset may become overspent)."
                        )
                    payload["exceeded_reservation"] = True
                    warnings.warn(
                        f"Entry {entry_id} spent ε = {_fmt(eps_actual)} alone, more than its reservation "
                        f"(ε = {_fmt(eps_planned)}); recorded because force=True.",
                        UserWarning, stacklevel=3,
                    )
            self._append(conn, st, "commit", entry_id, payload, eps_after, who)
            overspent = eps_after > st.total_epsilon * (1 + _RTOL)
            total = st.total_epsilon
        if overspent:
            raise BudgetExceededError(
                f"Entry {entry_id} was committed with more than it reserved and the dataset's composed ε is now "
                f"{_fmt(eps_after)} > total {_fmt(total)}. The spend is recorded; the dataset is overspent."
            )
        return self._entry(fingerprint, entry_id)

    def _release(self, fingerprint: str, entry_id: str, reason: str, *, command: str | None) -> Entry:
        reason = _check_text(reason, "reason")
        with self._write() as conn:
            st, e = self._open_entry(conn, fingerprint, entry_id)
            who = _who(command or e.first.command, None)
            who["config_hash"] = e.first.config_hash
            eps_after = composed_epsilon(st.charged_events(exclude=entry_id), st.delta, st.accountant)
            self._append(conn, st, "release", entry_id, {"reason": reason}, eps_after, who)
        return self._entry(fingerprint, entry_id)

    def verify(self, dataset: Any = None) -> VerifyReport:
        """Check every dataset's hash chain (or one dataset's) and its cached totals.

        Every record carries an HMAC (keyed with the ledger's secret key) of its content and of the
        previous record's MAC, and the dataset row carries a keyed MAC of the last record.  Without
        the key, therefore, verify detects: an edited record, a deleted, inserted or re-ordered
        record (anywhere, including at the end even if the head was moved back), a re-hashed chain,
        and an edited total, δ, accountant, name or dataset id (the id is carried by every record).  It cannot detect: edits by someone holding the
        key; a dataset deleted together with all its records; the whole database and key rolled
        back to an earlier copy (keep the printed head MACs elsewhere to anchor them).
        """
        problems: list[str] = []
        infos: list[dict] = []
        t, r = backend.datasets_table, backend.records_table
        with self._read() as conn:
            if dataset is None:
                rows = conn.execute(sa.select(t).order_by(t.c.id)).all()
                ids = {row.id for row in rows}
                orphans = conn.execute(
                    sa.select(r.c.dataset_id, sa.func.count()).group_by(r.c.dataset_id)
                ).all()
                for ds_id, n in orphans:
                    if ds_id not in ids:
                        problems.append(f"{n} record(s) belong to dataset id {ds_id}, which was deleted")
            else:
                rows = [self._find(conn, dataset, lock=False)]
            for row in rows:
                infos.append(self._verify_one(conn, row, problems))
        return VerifyReport(ok=not problems, problems=tuple(problems), datasets=tuple(infos))

    def _verify_one(self, conn: sa.Connection, row: Any, problems: list) -> dict:
        fp, key = row.fingerprint, self._key
        tag = _tag(row)
        r = backend.records_table
        rows = conn.execute(sa.select(r).where(r.c.dataset_id == row.id).order_by(r.c.seq)).all()
        self._check_chain(row, rows, problems, _key.genesis_mac(key, fp), lambda m: _record_mac(key, fp, m),
                          lambda seq, h: _key.head_mac(key, fp, seq, h), tag)
        if not row.public_id or not _PUBLIC_ID.fullmatch(row.public_id):
            problems.append(f"{tag}: its dataset id {row.public_id!r} was edited")
        sub: list[str] = []
        try:
            st = _replay(row, rows, sub)
        except LedgerError as exc:  # unreadable events
            sub.append(str(exc))
            st = None
        problems.extend(sub)
        if st is not None and not sub and rows:
            if (st.total_epsilon, st.delta, st.accountant, st.name) != (
                row.total_epsilon, row.delta, row.accountant, row.name
            ):
                problems.append(
                    f"{tag}: the dataset row says total ε={row.total_epsilon:g}, δ={row.delta:g}, "
                    f"accountant={row.accountant}, name={row.name!r} but its chain says ε={st.total_epsilon:g}, "
                    f"δ={st.delta:g}, accountant={st.accountant}, name={st.name!r}; the row was edited"
                )
        return {"dataset_id": row.public_id, "fingerprint": fp, "name": row.name, "records": len(rows),
                "head_hash": row.head_hash}

    def close_reservation(self, entry_id: str, *, reason: str, dataset: Any = None,
                          command: str | None = None) -> Entry:
        """Close an orphaned ``reserved`` entry (a run that crashed and will not be resumed) by
        **charging** it: its planned events are committed in full.  Never a refund: the crashed run
        may have read data.  ``entry_id``: the entry's id or a unique prefix of at least 8 hex digits
        (``privtune budget show --json`` lists them); ``dataset`` narrows the search.  Only close an
        entry whose process is gone: a live run's own commit would then be refused.

        Raises LedgerError for an unknown, ambiguous, committed or released entry."""
        reason = _check_text(reason, "reason")
        if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id.strip().lower()):
            raise InvalidParameterError(
                f"`entry` must be an entry id (or a prefix of at least 8 of its hex digits), as listed by "
                f"`privtune budget show --dataset D --json`. Got {entry_id!r}."
            )
        prefix = entry_id.strip().lower()
        r, t = backend.records_table, backend.datasets_table
        with self._write() as conn:
            q = sa.select(r.c.dataset_id, r.c.entry_id).where(r.c.entry_id.like(prefix + "%")).distinct()
            if dataset is not None:
                q = q.where(r.c.dataset_id == self._find(conn, dataset, lock=False).id)
            found = conn.execute(q).all()
            if not found:
                raise LedgerError(
                    f"No entry {prefix!r} in the {self._where()}"
                    f"{' for that dataset' if dataset is not None else ''}. List the entries with "
                    "`privtune budget show --dataset D --json` (entry_id, state)."
                )
            if len(found) > 1:
                raise LedgerError(
                    f"Entry prefix {prefix!r} matches {len(found)} entries; give more digits of the entry id."
                )
            ds_id, full_id = found[0]
            row = conn.execute(sa.select(t).where(t.c.id == ds_id).with_for_update()).one()
            st = self._load(conn, row)
            e = st.entries.get(full_id)
            if e is None:  # pragma: no cover - a record names it, so the replay has it
                raise LedgerError(f"Entry {full_id} is not in the replayed chain. Run `privtune budget verify`.")
            if e.state != "reserved":
                raise LedgerError(
                    f"Entry {full_id} is already {e.state} ({e.last.created_at}); only an open (reserved) entry can "
                    f"be closed{', and it is charged as committed' if e.state == 'committed' else ''}. Nothing "
                    "was changed."
                )
            who = _who(command or "privtune budget close (Python API)", None)
            who["config_hash"] = e.first.config_hash
            # the planned events are already charged: closing changes no ε, it only closes the entry
            eps_after = composed_epsilon(st.charged_events(), st.delta, st.accountant)
            payload = {"events": [event_to_dict(x) for x in e.planned], "closed_orphan": True, "reason": reason}
            self._append(conn, st, "commit", full_id, payload, eps_after, who)
            fingerprint = row.fingerprint
        return self._entry(fingerprint, full_id)


class _RowView:
    """Attribute access over a mapping (a dataset row updated inside a transaction)."""

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self._m = dict(mapping)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._m[key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def _mapping(self) -> Mapping[str, Any]:
        return self._m


def check_ledger_argument(ledger: Any) -> None:
    """Refuse a ``ledger=`` argument that is not None, a URL or path, or a Ledger (checked before any work)."""
    if ledger is None or isinstance(ledger, (str, os.PathLike)):
        return
    if not all(callable(getattr(ledger, name, None)) for name in ("reserve", "status", "init_dataset", "ensure_dataset")):
        raise InvalidParameterError(
            f"`ledger` must be a Ledger, a ledger URL such as 'sqlite:////path/ledger.db', or None "
            f"($PRIVTUNE_LEDGER or ~/.privtune/ledger.db). Got {ledger!r} ({type(ledger).__name__})."
        )


def open_ledger(ledger: Any) -> Ledger:
    """The ledger a ``ledger=`` argument names: None is the default ledger ($PRIVTUNE_LEDGER or
    ~/.privtune/ledger.db), a URL or path opens that ledger, a Ledger is returned as it is."""
    check_ledger_argument(ledger)
    if ledger is None or isinstance(ledger, (str, os.PathLike)):
        return Ledger(None if ledger is None else str(ledger))
    return ledger


__all__ = ["Ledger", "Reservation", "BudgetStatus", "Entry", "Record", "VerifyReport", "ACCOUNTANTS",
           "check_ledger_argument", "open_ledger"]
