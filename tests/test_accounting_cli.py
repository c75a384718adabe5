"""`privtune account` through privtune.cli.main (exit codes, one-line errors, JSON keys)."""

import json

import pytest

from privtune.accounting import Certificate, DPSGDEvent, compute_epsilon
from privtune.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_epsilon_table_pld_and_rdp(capsys):
    code, out, _ = run(capsys, "account", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "5000",
                       "--delta", "1e-5")
    assert code == 0
    assert "pld" in out and "rdp" in out
    assert "4.20" in out and "4.589" in out


def test_json_output_keys(capsys):
    code, out, _ = run(capsys, "account", "-s", "1.0", "-q", "0.01", "-T", "1000", "-d", "1e-5", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "accountant"):
        assert key in data
    assert data["accountant"] == "pld"
    assert data["epsilon"] == pytest.approx(compute_epsilon(DPSGDEvent(1.0, 0.01, 1000), 1e-5))
    assert data["epsilons"]["rdp"] > data["epsilons"]["pld"]


def test_calibration_and_dataset_size_form(capsys):
    code, out, _ = run(capsys, "account", "--epsilon", "3", "--delta", "1e-6", "--dataset-size", "60000",
                       "--batch-size", "600", "--epochs", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["sample_rate"] == pytest.approx(0.01) and data["steps"] == 200
    assert data["epsilon"] <= 3.0
    assert compute_epsilon(DPSGDEvent(data["noise_multiplier"], 0.01, 200), 1e-6) <= 3.0
    code, out, _ = run(capsys, "account", "--epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.01",
                       "--steps", "500")
    assert code == 0 and "calibrated σ" in out


def test_certificate_verification(capsys, tmp_path):
    path = Certificate.from_events([DPSGDEvent(1.0, 0.01, 100, label="trial 1/3: lora")], 1e-5).save(tmp_path / "c.json")
    code, out, _ = run(capsys, "account", "--certificate", str(path))
    assert code == 0 and "VERIFIED" in out
    assert "[trial 1/3: lora] DP-SGD σ=1" in out  # the event's label is text, not console markup
    assert "union bound" not in out
    # --mode auto: the events that ran are one of 3 plans, each made at δ/3: the guarantee is the union bound's
    auto = Certificate.from_events([DPSGDEvent(1.0, 0.01, 100)], 1e-5, metadata={
        "mode_plans": 3, "total_epsilon_requested": 8.0}).save(tmp_path / "auto.json")
    code, out, _ = run(capsys, "account", "--certificate", str(auto))
    assert code == 0 and "the run's guarantee is (ε = 8, δ = 1e-05) by a union bound over the 3 mode plans" in out
    data = json.loads(path.read_text())
    data["epsilon"] = 0.01
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, "account", "--certificate", str(path))
    assert code == 2 and "mismatch" in err


@pytest.mark.parametrize(
    "argv,name",
    [
        (["-s", "0", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--noise-multiplier"),
        (["-s", "nan", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--noise-multiplier"),
        (["-e", "0", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--epsilon"),
        (["-e", "-1", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--epsilon"),
        (["-e", "inf", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--epsilon"),
        (["-e", "nan", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--epsilon"),
        (["-s", "1", "-q", "0.01", "-T", "10", "-d", "0"], "--delta"),
        (["-s", "1", "-q", "0.01", "-T", "10", "-d", "1"], "--delta"),
        (["-s", "1", "-q", "0.01", "-T", "10"], "--delta"),
        (["-s", "1", "-n", "1000", "-b", "10", "--epochs", "1", "-d", "1e-3"], "--delta"),
        (["-s", "1", "-q", "0", "-T", "10", "-d", "1e-5"], "--sample-rate"),
        (["-s", "1", "-q", "1.5", "-T", "10", "-d", "1e-5"], "--sample-rate"),
        (["-s", "1", "-q", "0.01", "-T", "0", "-d", "1e-5"], "--steps"),
        (["-s", "1", "-q", "0.01", "-T", "2.5", "-d", "1e-5"], "--steps"),
        (["-s", "1", "-q", "0.01", "-d", "1e-5"], "--steps"),
        (["-s", "1", "-e", "1", "-q", "0.01", "-T", "10", "-d", "1e-5"], "--noise-multiplier"),
        (["-q", "0.01", "-T", "10", "-d", "1e-5"], "--noise-multiplier"),
        (["-e", "1e-4", "-q", "1", "-T", "1000", "-d", "1e-5"], "--epsilon"),
        (["-s", "1", "-n", "100", "-b", "200", "--epochs", "1", "-d", "1e-5"], "--batch-size"),
        (["-s", "1", "-n", "1000", "-b", "10", "-d", "1e-5"], "--epochs"),
        (["-s", "1", "-q", "0.01", "-T", "10", "-d", "1e-5", "--accountant", "prv"], "--accountant"),
        (["-s", "1", "-q", "0.01", "-T", "10", "-d", "1e-5", "--sampling", "uniform"], "--sampling"),
        (["--certificate", "/nonexistent/c.json"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, name):
    code, out, err = run(capsys, "account", *argv)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and name in lines[0]


# --------------------------------------------------------------------------- extreme σ and T


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sigma", ["1e-300", "1e-10", "1e-5", "1e-3"])
def test_tiny_noise_multiplier_is_answered_or_refused_quickly(capsys, sigma):
    code, out, err = run(capsys, "account", "--noise-multiplier", sigma, "--sample-rate", "0.01", "--steps", "5000",
                         "--delta", "1e-5", "--json")
    if float(sigma) < 1e-6:  # below the stated floor: exit 2, one line naming the flag and the floor
        assert code == 2 and out == ""
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: `--noise-multiplier` must be ≥ 1e-06"), err
        assert "Traceback" not in err
        return
    assert code == 0, err
    data = json.loads(out)
    # PLD would need ~1e8-1e12 grid points: RDP instead, said so, never optimistic (a valid upper bound)
    assert data["requested_accountant"] == "pld" and data["accountant"] == "rdp"
    assert data["epsilon"] == data["epsilons"]["rdp"] and data["epsilon"] > 1e9
    assert any("accounted with RDP" in n for n in data["notes"])


@pytest.mark.timeout(60)
def test_a_billion_steps_is_answered_quickly(capsys):
    code, out, err = run(capsys, "account", "-s", "1", "-q", "0.01", "--steps", "1e9", "-d", "1e-5")
    assert code == 0, err
    assert "pld → rdp" in out and "self-compositions" in out and "1000000000" in out
    code, out, _ = run(capsys, "account", "-s", "1", "-q", "0.01", "--steps", "1e9", "-d", "1e-5", "--json")
    data = json.loads(out)
    assert data["steps"] == 10**9 and data["accountant"] == "rdp"
    assert data["epsilon"] == pytest.approx(compute_epsilon(DPSGDEvent(1.0, 0.01, 10**9), 1e-5, "rdp"), rel=1e-12)


def test_a_seeded_certificate_is_verified_but_not_private(capsys, tmp_path):
    """A seeded run's events verify, but anyone with the seed can draw its noise again: `account` must not
    call it private, in the table or in the JSON."""
    from privtune.report.release import mark_seeded

    cert = Certificate.from_events([DPSGDEvent(1.0, 0.01, 100)], 1e-5)
    path = cert.save(tmp_path / "plain.json")
    code, out, _ = run(capsys, "account", "--certificate", str(path), "--json")
    assert code == 0 and json.loads(out)["private"] is True and json.loads(out)["label"] is None
    mark_seeded(cert, {}, 7)
    path = cert.save(tmp_path / "seeded.json")
    code, out, _ = run(capsys, "account", "--certificate", str(path), "--json")
    data = json.loads(out)
    assert code == 0 and data["verified"] is True and data["private"] is False
    assert data["label"].startswith("NOT PRIVATE")
    code, out, _ = run(capsys, "account", "--certificate", str(path))
    assert code == 0 and "VERIFIED" in out
    assert "NOT PRIVATE: seeded: no guarantee for this release; its events alone would give (ε, δ)-DP" in out


@pytest.mark.parametrize("extra,flag", [
    (["--epochs", "3"], "--epochs"),
    (["--dataset-size", "1000"], "--dataset-size"),
    (["--batch-size", "10"], "--batch-size"),
    (["--sampling", "shuffle"], "--sampling"),
    (["--accountant", "rdp"], "--accountant"),
    (["--noise-multiplier", "1"], "--noise-multiplier"),
])
def test_certificate_rejects_schedule_options(capsys, tmp_path, extra, flag):
    path = Certificate.from_events([DPSGDEvent(1.0, 0.01, 100)], 1e-5).save(tmp_path / "c.json")
    code, out, err = run(capsys, "account", "--certificate", str(path), *extra)
    assert code == 2 and out == ""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: `{flag}` cannot be combined with --certificate")
    code, out, _ = run(capsys, "account", "--certificate", str(path), "--json")
    assert code == 0 and json.loads(out)["verified"] is True
