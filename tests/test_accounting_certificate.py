"""Certificates: JSON round trip, verification, tampering, malformed files."""

import json

import pytest

from privtune.accounting import (
    Certificate,
    DPSGDEvent,
    GaussianEvent,
    RepeatAndSelectEvent,
    compute_epsilon,
    verify_certificate,
)
from privtune.errors import CertificateError

EVENTS = [DPSGDEvent(1.2, 0.01, 300, label="trial 1"), DPSGDEvent(1.0, 0.02, 200, label="final"),
          GaussianEvent(8.0, 2, label="validation metric")]


def test_round_trip_and_verify(tmp_path):
    cert = Certificate.from_events(EVENTS, 1e-5, metadata={"strategy": "random-search", "seeds": [1, 2]})
    assert cert.epsilon == compute_epsilon(EVENTS, 1e-5)
    assert cert.accountant == "pld"
    assert cert.neighbouring == "add/remove one example"
    assert cert.versions["dp-accounting"]
    path = cert.save(tmp_path / "run" / "certificate.json")
    data = json.loads(path.read_text())
    for key in ("epsilon", "delta", "events", "accountant", "neighbouring", "sampling_assumptions", "versions",
                "metadata"):
        assert key in data
    assert data["events"][0]["kind"] == "dpsgd"
    loaded = verify_certificate(path)
    assert loaded.events == EVENTS
    assert loaded.epsilon == cert.epsilon
    assert loaded.metadata["seeds"] == [1, 2]
    assert verify_certificate(cert) is cert


def test_tampered_epsilon_or_events_fail(tmp_path):
    cert = Certificate.from_events(EVENTS, 1e-5)
    path = cert.save(tmp_path / "c.json")
    data = json.loads(path.read_text())
    data["epsilon"] = data["epsilon"] * 0.9
    path.write_text(json.dumps(data))
    with pytest.raises(CertificateError, match="ε mismatch"):
        verify_certificate(path)
    data = cert.to_dict()
    data["events"] = data["events"][:1]  # an event silently dropped
    path.write_text(json.dumps(data))
    with pytest.raises(CertificateError, match="ε mismatch"):
        verify_certificate(path)


def test_rdp_certificate_and_repeat_and_select(tmp_path):
    rs = RepeatAndSelectEvent(events=(DPSGDEvent(1.0, 0.01, 100),), mean=5, shape=1)
    cert = Certificate.from_events([rs, DPSGDEvent(1.0, 0.01, 200)], 1e-5)  # PLD asked
    assert cert.accountant == "rdp"
    assert any("RDP" in n for n in cert.notes)
    verify_certificate(cert.save(tmp_path / "c.json"))


def test_sampling_assumption_recorded():
    cert = Certificate.from_events([DPSGDEvent(1.0, 0.1, 30, sampling="shuffle", assume_poisson=True)], 1e-5)
    assert any("ASSUMED" in a for a in cert.sampling_assumptions)
    cert2 = Certificate.from_events([DPSGDEvent(1.0, 0.1, 30, sampling="shuffle")], 1e-5)
    assert any("no amplification" in a for a in cert2.sampling_assumptions)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.pop("epsilon"), "missing required keys"),
        (lambda d: d.update(events=[]), "non-empty list"),
        (lambda d: d.update(accountant="prv"), "accountant"),
        (lambda d: d.update(delta=2.0), "delta"),
        (lambda d: d.update(neighbouring="replace one"), "neighbouring"),
        (lambda d: d.update(surprise=1), "unknown keys"),
        (lambda d: d["events"].append({"kind": "laplace"}), "Unknown event kind"),
        (lambda d: d.update(epsilon="abc"), "Malformed|epsilon"),
    ],
)
def test_malformed_certificates(tmp_path, mutate, match):
    data = Certificate.from_events([DPSGDEvent(1.0, 0.01, 50)], 1e-5).to_dict()
    mutate(data)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(data))
    with pytest.raises(CertificateError, match=match):
        verify_certificate(p)


def test_missing_and_non_json_files(tmp_path):
    with pytest.raises(CertificateError, match="does not exist"):
        verify_certificate(tmp_path / "nope.json")
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(CertificateError, match="not valid JSON"):
        verify_certificate(p)


def test_empty_events_and_bad_metadata():
    with pytest.raises(CertificateError, match="at least one event"):
        Certificate.from_events([], 1e-5)
    with pytest.raises(CertificateError, match="JSON-serialisable"):
        Certificate.from_events([GaussianEvent(1.0)], 1e-5, metadata={"x": object()})
