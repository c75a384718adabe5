"""Privacy certificates: a JSON record of everything needed to re-derive ε.

A certificate lists every event that touched the private data (tuning trials, the final run,
loss releases, ...), the accountant, (ε, δ), the neighbouring relation, the sampling
assumptions and the library versions.  :func:`verify_certificate` recomputes ε from the
events with the stated accountant and fails when it differs from the stated ε by more than
:data:`VERIFY_RTOL` (relative) + :data:`VERIFY_ATOL` (absolute); recomputation with the same
library versions is deterministic and matches to the last digit, so the tolerance only
absorbs floating-point differences across platforms/versions.

A certificate whose events include a :class:`~privtune.accounting.events.NonPrivateEvent` states
ε = ∞ (no guarantee).  JSON has no infinity, so that ε is written as the string ``"inf"``
(:data:`INFINITE_EPSILON`), never as the non-standard ``Infinity`` that strict JSON readers refuse;
it is read back only together with such an event.
"""

from __future__ import annotations

import json
import math
import platform
import re
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from privtune import __version__
from privtune._validation import check_choice, check_delta
from privtune.accounting import accountant as acc
from privtune.accounting.events import NonPrivateEvent, event_from_dict, event_to_dict
from privtune.errors import CertificateError, PrivtuneError

NEIGHBOURING = "add/remove one example"
#: The user-level relation, with the unit's name (docs/privacy-unit.md): ``UNIT_NEIGHBOURING.format(unit="user_id")``.
UNIT_NEIGHBOURING = "add/remove all rows of one {unit}"
_UNIT_RELATION = re.compile(r"add/remove all rows of one (\S.*)")


def neighbouring_relation(unit: str | None = None) -> str:
    """The neighbouring relation of a run: one example, or all rows of one ``unit`` (user-level DP)."""
    return NEIGHBOURING if unit is None else UNIT_NEIGHBOURING.format(unit=unit)


def privacy_unit_of(neighbouring: str) -> str | None:
    """The unit of a user-level relation ("add/remove all rows of one user_id" → "user_id"); None for one example."""
    m = _UNIT_RELATION.fullmatch(str(neighbouring))
    return m.group(1) if m else None


def privacy_statement(neighbouring: str) -> str:
    """The sentence a report prints: "(ε, δ)-DP with respect to adding or removing ..." for a relation."""
    unit = privacy_unit_of(neighbouring)
    what = f"all rows of one {unit}" if unit else "one training example"
    return f"(ε, δ)-DP with respect to adding or removing {what}"
FORMAT_VERSION = 1
#: Relative tolerance of :func:`verify_certificate` on ε.
VERIFY_RTOL = 1e-6
#: Absolute tolerance of :func:`verify_certificate` on ε.
VERIFY_ATOL = 1e-9
#: How an infinite ε (a certificate of NOT PRIVATE events) is written in JSON.
INFINITE_EPSILON = "inf"
#: how ``metadata.label`` begins for a run whose release is not private (seeded, or an uncharged selection)
NOT_PRIVATE_LABEL = "NOT PRIVATE"


def union_bound_epsilon(epsilon: float, mode_plans: Any, total_epsilon: Any) -> float:
    """The ε of a run's (ε, δ) guarantee: ``epsilon`` (its events' ε at δ), or, where ``--mode auto``'s pilots
    chose one of ``mode_plans`` = k > 1 plans, each made to reach ``total_epsilon`` at δ/k, the larger of the two:
    by a union bound over the plans the run is (total ε, δ)-DP whichever was chosen (docs/accounting.md)."""
    if (isinstance(mode_plans, int) and not isinstance(mode_plans, bool) and mode_plans > 1
            and isinstance(total_epsilon, (int, float)) and not isinstance(total_epsilon, bool)):
        return max(float(epsilon), float(total_epsilon))
    return float(epsilon)


def _non_private(events) -> bool:
    return any(isinstance(e, NonPrivateEvent) for e in events)


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries that determine the accounting result."""
    import numpy
    import scipy

    return {
        "privtune": __version__,
        "dp-accounting": _version("dp-accounting"),
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "python": platform.python_version(),
    }


@dataclass
class Certificate:
    """A privacy certificate: events + accountant + (ε, δ), JSON-serialisable.

    Build it with :meth:`from_events` (which computes ε), save with :meth:`save`, check with
    :func:`verify_certificate`.  ``epsilon`` covers *every* listed event (composition), under
    the ``neighbouring`` relation (add/remove one example).
    """

    events: list
    epsilon: float
    delta: float
    accountant: str
    neighbouring: str = NEIGHBOURING
    sampling_assumptions: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    value_discretization_interval: float | None = None

    @classmethod
    def from_events(cls, events, delta: float, accountant: str = "pld", metadata: dict | None = None,
                    *, dataset_size: int | None = None, neighbouring: str = NEIGHBOURING) -> Certificate:
        """Account ``events`` at ``delta`` and record the result (ε in add/remove DP).

        ``neighbouring``: the relation the events are accounted under (:func:`neighbouring_relation`); the
        accounting is the same for a unit whose clipped contribution has norm ≤ C (docs/privacy-unit.md)."""
        if neighbouring != NEIGHBOURING and not _UNIT_RELATION.fullmatch(str(neighbouring)):
            raise CertificateError(f"`neighbouring` must be {NEIGHBOURING!r} or {UNIT_NEIGHBOURING!r}. Got "
                                   f"{neighbouring!r}.")
        events = acc.as_event_list(events)
        if not events:
            raise CertificateError("A certificate needs at least one event; got an empty list.")
        res = acc.account(events, delta, accountant, dataset_size=dataset_size)
        if not math.isfinite(res.epsilon) and not _non_private(events):
            raise CertificateError(
                f"These events have no finite ε at δ = {res.delta:g}, so no certificate can be issued: "
                f"{' '.join(res.notes[-1:])}"
            )
        md = dict(metadata or {})
        try:
            json.dumps(md)
        except (TypeError, ValueError) as exc:
            raise CertificateError(f"`metadata` must be JSON-serialisable: {exc}") from None
        return cls(
            events=list(events),
            epsilon=res.epsilon,
            delta=res.delta,
            accountant=res.accountant,
            neighbouring=neighbouring,
            sampling_assumptions=list(res.sampling_assumptions),
            versions=library_versions(),
            metadata=md,
            notes=list(res.notes),
            value_discretization_interval=res.value_discretization_interval,
        )

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "epsilon": self.epsilon if math.isfinite(self.epsilon) else INFINITE_EPSILON,
            "delta": self.delta,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "events": [event_to_dict(e) for e in self.events],
            "sampling_assumptions": list(self.sampling_assumptions),
            "notes": list(self.notes),
            "value_discretization_interval": self.value_discretization_interval,
            "versions": dict(self.versions),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Certificate:
        if not isinstance(data, dict):
            raise CertificateError(f"A certificate must be a JSON object; got {type(data).__name__}.")
        missing = [k for k in ("epsilon", "delta", "events", "accountant") if k not in data]
        if missing:
            raise CertificateError(f"Certificate is missing required keys {missing}.")
        fv = data.get("format_version", FORMAT_VERSION)
        if fv != FORMAT_VERSION:
            raise CertificateError(
                f"Certificate format_version {fv!r} is not supported (this privtune reads {FORMAT_VERSION}); "
                "upgrade privtune."
            )
        known = {"format_version", "epsilon", "delta", "accountant", "neighbouring", "events",
                 "sampling_assumptions", "notes", "value_discretization_interval", "versions", "metadata"}
        extra = set(data) - known
        if extra:
            raise CertificateError(f"Certificate has unknown keys {sorted(extra)}; refusing to ignore them.")
        if not isinstance(data["events"], list) or not data["events"]:
            raise CertificateError("Certificate `events` must be a non-empty list of event objects.")
        events = [event_from_dict(e) for e in data["events"]]
        try:
            not_private = data["epsilon"] == INFINITE_EPSILON and _non_private(events)
            eps = math.inf if not_private else float(data["epsilon"])  # "inf": NOT PRIVATE events only
            delta = check_delta(data["delta"])
            accountant = check_choice(data["accountant"], "accountant", acc.ACCOUNTANTS)
        except (TypeError, ValueError) as exc:
            raise CertificateError(f"Malformed certificate: {exc}") from None
        if math.isnan(eps) or eps < 0 or (math.isinf(eps) and not not_private):
            raise CertificateError(
                f"Certificate `epsilon` must be a finite number ≥ 0 (or {INFINITE_EPSILON!r} for a certificate "
                f"of NOT PRIVATE events). Got {data['epsilon']!r}."
            )
        neigh = data.get("neighbouring", NEIGHBOURING)
        if neigh != NEIGHBOURING and not (isinstance(neigh, str) and _UNIT_RELATION.fullmatch(neigh)):
            raise CertificateError(
                f"Certificate neighbouring relation {neigh!r} is not supported; privtune accounts "
                f"{NEIGHBOURING!r} or {UNIT_NEIGHBOURING!r}."
            )
        vdi = data.get("value_discretization_interval")
        return cls(
            events=events,
            epsilon=eps,
            delta=delta,
            accountant=accountant,
            neighbouring=neigh,
            sampling_assumptions=list(data.get("sampling_assumptions", [])),
            versions=dict(data.get("versions", {})),
            metadata=dict(data.get("metadata", {})),
            notes=list(data.get("notes", [])),
            value_discretization_interval=None if vdi is None else float(vdi),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    @property
    def private(self) -> bool:
        """False when the events include a :class:`NonPrivateEvent` (then ε = ∞: no guarantee) or the run is
        labelled NOT PRIVATE (``metadata.label``: a seeded run, whose noise anyone with the seed can draw again,
        or the grid oracle, whose selection is uncharged); ε then describes the events, not the release."""
        labelled = str(self.metadata.get("label", "")).startswith(NOT_PRIVATE_LABEL)
        return not _non_private(self.events) and not labelled

    def save(self, path) -> Path:
        """Write the certificate as JSON to ``path`` (parent folders are created)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json() + "\n", encoding="utf-8")
        return p

    @classmethod
    def load(cls, path) -> Certificate:
        p = Path(path)
        if not p.is_file():
            raise CertificateError(f"Certificate file {str(p)!r} does not exist; pass the path of a certificate.json.")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CertificateError(f"Certificate file {str(p)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def recompute_epsilon(cert: Certificate) -> float:
    """ε of the certificate's events with its accountant (and its PLD discretisation, if recorded)."""
    return acc.account(cert.events, cert.delta, cert.accountant,
                       value_discretization_interval=cert.value_discretization_interval).epsilon


def verify_certificate(path_or_certificate, *, rtol: float = VERIFY_RTOL, atol: float = VERIFY_ATOL) -> Certificate:
    """Re-derive ε from the certificate's events; return the certificate if it matches.

    Raises :class:`~privtune.errors.CertificateError` if the file is malformed or if the
    recomputed ε differs from the stated one by more than ``rtol``·ε + ``atol``
    (defaults 1e-6 and 1e-9).
    """
    cert = path_or_certificate if isinstance(path_or_certificate, Certificate) else Certificate.load(path_or_certificate)
    try:
        eps = recompute_epsilon(cert)
    except CertificateError:
        raise
    except PrivtuneError as exc:
        raise CertificateError(f"Certificate events cannot be accounted: {exc}") from None
    if math.isinf(eps) or math.isinf(cert.epsilon):
        mismatch = eps != cert.epsilon  # ∞ matches only ∞ (inf − inf would be nan and compare False)
    else:
        mismatch = abs(eps - cert.epsilon) > rtol * max(abs(eps), abs(cert.epsilon)) + atol
    if mismatch:
        raise CertificateError(
            f"Certificate ε mismatch: it states ε = {cert.epsilon!r} but its events give ε = {eps!r} "
            f"at δ = {cert.delta:g} with the {cert.accountant} accountant (tolerance {rtol:g}·ε + {atol:g}). "
            "The certificate was altered or made by an incompatible accountant; do not trust its ε."
        )
    return cert


__all__ = ["Certificate", "verify_certificate", "recompute_epsilon", "library_versions", "NEIGHBOURING",
           "UNIT_NEIGHBOURING", "neighbouring_relation", "privacy_statement", "privacy_unit_of", "NOT_PRIVATE_LABEL",
           "VERIFY_RTOL", "VERIFY_ATOL", "INFINITE_EPSILON"]
