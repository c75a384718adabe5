"""``privtune budget ...`` end to end through the real entry point (SQLite ledger in tmp)."""

from __future__ import annotations

import json
import sqlite3

import pytest

from privtune.accounting import compute_epsilon
from privtune.accounting.events import DPSGDEvent
from privtune.cli import main


@pytest.fixture
def setup(tmp_path, capsys):
    data = tmp_path / "train.csv"
    data.write_text("text,label\na,1\nb,0\n")
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(["budget", *args, "--ledger", ledger])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return data, ledger, run


def test_init_spend_show_history_verify(setup):
    data, ledger, run = setup
    rc, out, _ = run("init", "--dataset", str(data), "--epsilon", "4", "--delta", "1e-5", "--name", "tickets",
                     "--accountant", "rdp")
    assert rc == 0 and "total ε=4" in out
    for _ in range(2):
        rc, out, _ = run("spend", "--dataset", "tickets", "--noise-multiplier", "1.0", "--sample-rate", "0.01",
                         "--steps", "500")
        assert rc == 0 and "recorded DP-SGD σ=1 q=0.01 T=500" in out
    rc, out, _ = run("show", "--dataset", str(data), "--json")
    assert rc == 0
    st = json.loads(out)
    assert {"total_epsilon", "delta", "spent_epsilon", "reserved_epsilon", "remaining_epsilon", "entries"} <= set(st)
    composed = compute_epsilon([DPSGDEvent(1.0, 0.01, 500)] * 2, 1e-5, accountant="rdp")
    assert st["spent_epsilon"] == pytest.approx(composed, rel=1e-9)
    assert st["remaining_epsilon"] == pytest.approx(4 - composed, rel=1e-9)
    assert st["reserved_epsilon"] == 0.0 and st["total_epsilon"] == 4.0 and st["delta"] == 1e-5
    assert [e["state"] for e in st["entries"]] == ["committed", "committed"]
    assert st["entries"][0]["events"] == [
        {"kind": "dpsgd", "noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 500, "sampling": "poisson",
         "assume_poisson": False, "label": ""}
    ]
    assert st["entries"][0]["command"].startswith("privtune budget spend --dataset tickets")
    assert st["entries"][0]["privtune_version"] and st["entries"][0]["created_at"]

    rc, out, _ = run("show", "--dataset", "tickets")
    assert rc == 0 and "remaining ε" in out and f"{4 - composed:.6g}" in out
    from privtune.ledger import Ledger

    Ledger(ledger).record_spend("tickets", [DPSGDEvent(1.0, 0.01, 5, label="trial 1/3: lora")], command="tune")
    rc, out, _ = run("history", "--dataset", "tickets")
    assert rc == 0 and "[trial 1/3: lora] DP-SGD σ=1" in out  # a bracketed event label is text, not console markup
    for word in ("time (UTC)", "command", "events", "ε after", "state", "init", "committed", "DP-SGD σ=1"):
        assert word in out
    rc, out, _ = run("history", "--dataset", "tickets", "--json")
    assert [r["state"] for r in json.loads(out)] == ["init"] + ["reserved", "committed"] * 3
    rc, out, _ = run("verify")
    assert rc == 0 and "OK" in out
    rc, out, _ = run("show", "--json")
    assert json.loads(out)["datasets"][0]["name"] == "tickets"


def test_errors_exit_2_with_the_fix(setup):
    data, ledger, run = setup
    rc, _, err = run("show", "--dataset", "unknown-name")
    assert rc == 2 and "privtune budget init" in err
    run("init", "--dataset", str(data), "--epsilon", "1", "--delta", "1e-5", "--accountant", "rdp")
    rc, _, err = run("init", "--dataset", str(data), "--epsilon", "2", "--delta", "1e-5", "--accountant", "rdp")
    assert rc == 2 and "privtune budget raise" in err
    rc, _, err = run("spend", "--dataset", str(data), "--noise-multiplier", "0.5", "--sample-rate", "0.1",
                     "--steps", "1000")
    assert rc == 2 and "remaining ε = 1 " in err and "asks for ε =" in err
    rc, _, err = run("spend", "--dataset", str(data), "--noise-multiplier", "5", "--sample-rate", "0.01",
                     "--steps", "10", "--delta", "1e-3")
    assert rc == 2 and "`delta` of the spend" in err
    # errors name the flags, not the Python arguments
    for flags, name in [
        (["--noise-multiplier", "-1", "--sample-rate", "0.01", "--steps", "10"], "`--noise-multiplier`"),
        (["--noise-multiplier", "1e-10", "--sample-rate", "0.01", "--steps", "10"], "`--noise-multiplier` must be ≥ 1e-06"),
        (["--noise-multiplier", "1", "--sample-rate", "0", "--steps", "10"], "`--sample-rate`"),
        (["--noise-multiplier", "1", "--sample-rate", "1.5", "--steps", "10"], "`--sample-rate`"),
        (["--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "0"], "`--steps`"),
        (["--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "2"], "`--delta`"),
    ]:
        rc, out, err = run("spend", "--dataset", str(data), *flags)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {name}"), (flags, err)
        assert "noise_multiplier" not in err and "sample_rate" not in err
    rc, _, err = run("spend", "--dataset", str(data), "--noise-multiplier", "1", "--sample-rate", "0.5",
                     "--steps", "10", "--sampling", "full_batch")
    assert rc == 2 and "--sample-rate" in err
    rc, _, err = run("spend", "--dataset", str(data), "--noise-multiplier", "1", "--sample-rate", "0.01")
    assert rc == 2  # click usage error: --steps missing
    # an external run that already happened is recorded with --force, and the overspend is visible
    rc, out, err = run("spend", "--dataset", str(data), "--noise-multiplier", "0.5", "--sample-rate", "0.1",
                       "--steps", "1000", "--force", "--note", "trained with opacus last year")
    assert rc == 0 and "OVERSPENT" in err
    rc, out, _ = run("show", "--dataset", str(data), "--json")
    assert json.loads(out)["remaining_epsilon"] < 0
    rc, _, err = run("spend", "--dataset", str(data), "--noise-multiplier", "100", "--sample-rate", "0.001",
                     "--steps", "1")
    assert rc == 2 and "does not fit" in err


def test_raise_is_recorded_and_verify_fails_on_tampering(setup):
    data, ledger, run = setup
    run("init", "--dataset", str(data), "--epsilon", "1", "--delta", "1e-5", "--accountant", "rdp")
    run("spend", "--dataset", str(data), "--noise-multiplier", "3", "--sample-rate", "0.01", "--steps", "100")
    rc, out, _ = run("raise", "--dataset", str(data), "--epsilon", "3", "--reason", "approved by DPO")
    assert rc == 0 and "raised to 3" in out
    rc, out, _ = run("history", "--dataset", str(data), "--json")
    assert json.loads(out)[-1]["state"] == "raised" and "approved by DPO" in json.loads(out)[-1]["events_summary"]
    rc, _, err = run("raise", "--dataset", str(data), "--epsilon", "2", "--reason", "lower")
    assert rc == 2 and "larger than the current total" in err

    con = sqlite3.connect(ledger[len("sqlite:///"):])
    con.execute("UPDATE privtune_records SET payload = replace(payload, '\"steps\":100', '\"steps\":10') "
                "WHERE action = 'commit'")
    con.commit()
    con.close()
    rc, out, err = run("verify")
    assert rc == 1 and "TAMPERED" in err and "was edited" in err and "FAILED" in out
    rc, out, _ = run("verify", "--json")
    assert rc == 1 and json.loads(out)["ok"] is False


@pytest.mark.parametrize("url", ["sqlite:///", "sqlite://", "sqlite:///:memory:"])
def test_ledger_without_a_file_is_refused(tmp_path, capsys, url):
    """`--ledger sqlite:///` used to give an in-memory ledger: `init` printed success and kept nothing."""
    data = tmp_path / "train.csv"
    data.write_text("text,label\na,1\n")
    rc = main(["budget", "init", "--dataset", str(data), "--epsilon", "1", "--delta", "1e-5", "--ledger", url])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and out == "" and len(lines) == 1
    assert lines[0].startswith("error: `--ledger`") and "names no SQLite file" in lines[0]
    assert "sqlite:////absolute/path/ledger.db" in lines[0]


def test_env_ledger_without_a_file_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PRIVTUNE_LEDGER", "sqlite:///")
    rc = main(["budget", "show"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: `$PRIVTUNE_LEDGER`") and "names no SQLite file" in err


@pytest.mark.parametrize("command", ["train", "tune"])
def test_the_first_run_says_it_fixed_the_lifetime_budget_and_how_to_raise_it(command, tmp_path, capsys):
    """A first run registers its dataset with the run's ε as the lifetime total; it says so on one line, with a
    `budget raise` command that works as printed.  The file name it was registered under is kept in the ledger
    (`budget show` lists it), not in the run's metrics or certificate."""
    import shlex

    from privtune.ledger import Ledger
    from privtune.models.testing import make_toy_text_files

    files = make_toy_text_files(tmp_path / "data", {"train": ("reviews_q3.tsv", 60, 0), "eval": ("dev.tsv", 20, 1)})
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    out = tmp_path / "run"
    argv = [command, "--data", str(files["train"]), "--eval-data", str(files["eval"]), "--model",
            str(files["model"]), "--mode", "last-layer", "--epsilon", "1", "--delta", "1e-3", "--labels", "0,1",
            "--ledger", url, "--output", str(out), "--quiet"]
    argv += ["--steps", "2", "--batch-size", "20"] if command == "train" else ["--strategy", "single-step"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    (line,) = [ln for ln in text.splitlines() if ln.startswith("registered ")]
    assert line.startswith("registered reviews_q3.tsv (dataset ds-") and "with a lifetime ε = 1, δ = 0.001" in line
    assert "note: dataset registered" not in text
    raise_cmd = line.split("`")[1]
    assert raise_cmd.startswith("privtune budget raise --dataset ")
    assert main(shlex.split(raise_cmd.replace("NEW", "3").replace("WHY", "more"))[1:]) == 0
    assert Ledger(url).status(str(files["train"])).total_epsilon == 3.0
    assert [d["file_name"] for d in Ledger(url).datasets()] == ["reviews_q3.tsv"]
    for name in ("metrics.json", "certificate.json", "model/certificate.json"):
        assert "reviews_q3" not in (out / name).read_text(), name
    assert "registered reviews_q3" not in (out / "log.txt").read_text()
    # a second run on the same data is charged against the (raised) total and says nothing about registering
    argv[argv.index("--output") + 1] = str(tmp_path / "run2")
    assert main(argv) == 0
    assert "registered " not in capsys.readouterr().out
