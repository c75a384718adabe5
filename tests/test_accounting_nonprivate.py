"""NonPrivateEvent: a release without a guarantee composes to ε = ∞ everywhere, survives JSON, is refused
by the ledger; the one event grouper is shared by the accountant and the ledger."""

from __future__ import annotations

import json
import math

import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import privtune.accounting.accountant as acc
import privtune.ledger._compose as compose
from privtune.accounting import (
    Certificate,
    DPSGDEvent,
    GaussianEvent,
    NonPrivateEvent,
    account,
    compute_delta,
    compute_epsilon,
    event_from_dict,
    event_to_dict,
    group_events,
    verify_certificate,
)
from privtune.errors import BudgetExceededError, CertificateError
from privtune.ledger import Ledger

NP = NonPrivateEvent(reason="noise_multiplier=0: no noise added")


def _strict_loads(text: str):
    """json.loads that refuses the non-standard constants Infinity / -Infinity / NaN."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_non_private_event_composes_to_infinity(accountant):
    events = [DPSGDEvent(1.0, 0.01, 100), NP, GaussianEvent(5.0, 2)]
    res = account(events, 1e-5, accountant)
    assert res.epsilon == math.inf
    assert any("NOT PRIVATE" in n and "no noise added" in n for n in res.notes)
    assert compute_epsilon(NP, 1e-5, accountant) == math.inf
    assert compute_delta(events, 10.0, accountant) == 1.0
    # an empty composition (nothing released) stays free; a non-private step never is
    assert compute_epsilon([], 1e-5, accountant) == 0.0


def test_non_private_event_is_dp_accountings_non_private_event():
    dp = acc.to_dp_event([DPSGDEvent(1.0, 0.01, 100), NP])
    assert any(isinstance(e, dpe.NonPrivateDpEvent) for e in dp.events)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(dp)
    assert rdp.get_epsilon(1e-5) == math.inf
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp)
    assert pld.get_epsilon(1e-5) == math.inf


def test_ledger_composition_of_non_private_is_infinite():
    assert compose.composed_epsilon([DPSGDEvent(1.0, 0.01, 100)], 1e-5, "pld", new=[NP]) == math.inf


def test_non_private_event_json_round_trip():
    d = event_to_dict(NP)
    assert d == {"kind": "non_private", "reason": NP.reason, "label": ""}
    text = json.dumps(d, allow_nan=False)
    assert event_from_dict(_strict_loads(text)) == NP
    with pytest.raises(CertificateError, match="unknown fields"):
        event_from_dict({"kind": "non_private", "reason": "x", "epsilon": 1.0})


def test_non_private_certificate_file_round_trip_and_verification(tmp_path):
    cert = Certificate.from_events([DPSGDEvent(1.0, 0.01, 100), NP], 1e-5)
    assert cert.epsilon == math.inf and not cert.private
    path = cert.save(tmp_path / "certificate.json")
    text = path.read_text(encoding="utf-8")
    assert "Infinity" not in text and "NaN" not in text
    data = _strict_loads(text)
    assert data["epsilon"] == "inf" and data["events"][1]["kind"] == "non_private"
    loaded = verify_certificate(path)
    assert loaded.epsilon == math.inf and loaded.events == cert.events
    # a finite ε stated for non-private events does not verify
    data["epsilon"] = 0.5
    with pytest.raises(CertificateError, match="mismatch"):
        verify_certificate(Certificate.from_dict(data))
    # "inf" is accepted only together with a NonPrivateEvent
    private = Certificate.from_events([DPSGDEvent(1.0, 0.01, 100)], 1e-5).to_dict()
    private["epsilon"] = "inf"
    with pytest.raises(CertificateError, match="finite number"):
        Certificate.from_dict(private)


def test_tiny_sigma_still_gets_no_certificate():
    # ε = ∞ from a σ below the accounted floor is not a declared non-private release: still refused
    with pytest.raises(CertificateError, match="no finite ε"):
        Certificate.from_events([GaussianEvent(1e-9, 1)], 1e-5)


@pytest.mark.parametrize("how", ["reserve", "record_spend"])
def test_ledger_refuses_non_private_event(tmp_path, how):
    led = Ledger(tmp_path / "ledger.db")
    led.ensure_dataset(b"data", 4.0, 1e-5, name="d")
    with pytest.raises(BudgetExceededError) as info:
        getattr(led, how)(b"data", [DPSGDEvent(1.0, 0.01, 10), NP], command="test")
    msg = str(info.value)
    assert "NonPrivateEvent" in msg and "ε = ∞" in msg and "nothing was recorded" in msg
    assert "noise_multiplier > 0" in msg  # what to do
    st = led.status(b"data")
    assert st.entries == () and st.spent_epsilon == 0.0 and st.reserved_epsilon == 0.0


def test_one_event_grouper_shared_by_accountant_and_ledger():
    assert compose.group_events is group_events and acc.group_events is group_events
    events = [GaussianEvent(2.0, 1, label="a"), NP, DPSGDEvent(1.0, 0.1, 5), GaussianEvent(2.0, 3),
              NonPrivateEvent(reason="other"), DPSGDEvent(1.0, 0.1, 7, sampling="shuffle"),
              DPSGDEvent(1.0, 0.1, 6)]
    assert group_events(events) == [GaussianEvent(2.0, 4), NP, DPSGDEvent(1.0, 0.1, 11),
                                    DPSGDEvent(1.0, 0.1, 7, sampling="shuffle")]
    # grouping never changes ε, and the accountant's notes still name the events as given
    res = account(events[:1] + events[2:4] + events[5:], 1e-5)
    grouped = account(group_events(events[:1] + events[2:4] + events[5:]), 1e-5)
    assert res.epsilon == pytest.approx(grouped.epsilon, rel=1e-12)
    assert any("[a]" in a for a in res.sampling_assumptions)


def test_cli_verifies_a_non_private_certificate(tmp_path, capsys):
    from privtune.cli import main

    path = Certificate.from_events([NP], 1e-5).save(tmp_path / "certificate.json")
    assert main(["account", "--certificate", str(path), "--json"]) == 0
    data = _strict_loads(capsys.readouterr().out)
    assert data["verified"] is True and data["epsilon"] == "inf" and data["private"] is False
    assert main(["account", "--certificate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ε = inf" in out and "NOT PRIVATE" in out
