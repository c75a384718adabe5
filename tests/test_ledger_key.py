"""The ledger's secret key (issue 13 item 2, issue 18 items 2, 7 and 8, ledger parts): key file
modes, missing/wrong keys, nothing hash-derived from the data in a run directory, `budget close`,
`budget init` refusing δ ≥ 1/n, and a locked SQLite ledger that says it waits."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import pytest

from privtune.accounting.events import GaussianEvent
from privtune.cli import main
from privtune.errors import LedgerError
from privtune.ledger import Ledger, dataset_fingerprint
from privtune.ledger import _backend


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the most permissive umask: modes must not depend on it
    try:
        yield
    finally:
        os.umask(old)


def test_key_file_is_created_0600_with_the_ledger_whatever_the_umask(tmp_path, open_umask):
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.init_dataset(b"data", 1.0, 1e-5)
    key = tmp_path / "ledger.db.key"
    assert key.is_file() and _mode(key) == 0o600
    assert len(key.read_text().strip()) == 64
    # the default location's directory is created private too
    home = tmp_path / "home"
    os.environ["PRIVTUNE_HOME"] = str(home)
    os.environ.pop("PRIVTUNE_LEDGER", None)
    Ledger().init_dataset(b"data", 1.0, 1e-5)
    assert _mode(home) == 0o700 and _mode(home / "ledger.db.key") == 0o600
    # $PRIVTUNE_LEDGER_KEY_FILE puts the key elsewhere (e.g. another disk than the database)
    os.environ["PRIVTUNE_LEDGER_KEY_FILE"] = str(tmp_path / "keys" / "team.key")
    try:
        Ledger(tmp_path / "other.db").init_dataset(b"data", 1.0, 1e-5)
    finally:
        del os.environ["PRIVTUNE_LEDGER_KEY_FILE"]
    assert _mode(tmp_path / "keys") == 0o700 and _mode(tmp_path / "keys" / "team.key") == 0o600
    assert not (tmp_path / "other.db.key").exists()


def test_missing_or_wrong_key_is_a_clear_error_never_a_fresh_budget(tmp_path):
    path = tmp_path / "ledger.db"
    Ledger(path).init_dataset(b"data", 1.0, 1e-5, name="d")
    key = tmp_path / "ledger.db.key"
    saved = key.read_bytes()
    key.unlink()
    with pytest.raises(LedgerError, match="is keyed, but its key file .* does not exist.*Restore the key file"):
        Ledger(path).status("d")
    assert not key.exists()  # never re-created for an existing ledger
    key.write_text("ab" * 32 + "\n")
    with pytest.raises(LedgerError, match="does not belong to the SQLite ledger"):
        Ledger(path).init_dataset(b"data", 1.0, 1e-5)
    key.write_text("not a key")
    with pytest.raises(LedgerError, match="does not hold a privtune ledger key"):
        Ledger(path).status("d")
    key.write_bytes(saved)
    assert Ledger(path).status(b"data").name == "d"


def test_fingerprints_are_keyed_per_ledger_and_the_sha256_still_finds_the_dataset(tmp_path):
    a, b = Ledger(tmp_path / "a.db"), Ledger(tmp_path / "b.db")
    raw = dataset_fingerprint(b"same data")
    sa_, sb = a.init_dataset(b"same data", 1.0, 1e-5), b.init_dataset(b"same data", 1.0, 1e-5)
    assert raw not in (sa_.fingerprint, sb.fingerprint) and sa_.fingerprint != sb.fingerprint
    assert sa_.dataset_id != sb.dataset_id and sa_.dataset_id.startswith("ds-")
    # the content SHA-256 (Python API: dataset_fingerprint), the keyed fingerprint and the id all find it
    assert a.status(raw).dataset_id == a.status(sa_.fingerprint).dataset_id == a.status(sa_.dataset_id).dataset_id
    con = sqlite3.connect(tmp_path / "a.db")
    dump = "\n".join(con.iterdump())
    con.close()
    assert raw not in dump and raw[:8] not in dump


def test_budget_close_charges_an_orphaned_reservation(tmp_path, capsys):
    data = tmp_path / "train.csv"
    data.write_text("text,label\n" + "".join(f"row {i},{i % 2}\n" for i in range(50)))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    led = Ledger(url)
    led.init_dataset(data, 5.0, 1e-5, name="tickets", accountant="rdp")
    orphan = led.reserve("tickets", [GaussianEvent(2.0, 2)], command="privtune train (killed)", resume_key="run")
    used = led.status("tickets").used_epsilon
    capsys.readouterr()
    rc = main(["budget", "close", "--entry", orphan.entry_id[:8], "--reason", "killed", "--ledger", url])
    out = capsys.readouterr()
    assert rc == 0 and "charging its planned events in full" in out.out
    st = Ledger(url).status(str(data))  # `--dataset FILE` still works: the ledger keys its SHA-256
    assert [e.state for e in st.entries] == ["committed"] and st.spent_epsilon == pytest.approx(used)
    rc = main(["budget", "close", "--entry", orphan.entry_id, "--reason", "again", "--ledger", url])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "already committed" in err and "Traceback" not in err
    rc = main(["budget", "close", "--entry", "zz", "--reason", "x", "--ledger", url])
    err = capsys.readouterr().err
    assert rc == 2 and "`entry` must be an entry id" in err
    rc = main(["budget", "show", "--dataset", str(data), "--json", "--ledger", url])
    shown = json.loads(capsys.readouterr().out)
    assert rc == 0 and shown["dataset_id"] == st.dataset_id


def test_budget_init_refuses_delta_at_least_one_over_n(tmp_path, capsys):
    data = tmp_path / "tiny.tsv"
    data.write_text("text\tlabel\n" + "".join(f"row {i}\t{i % 2}\n" for i in range(4)))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    capsys.readouterr()
    rc = main(["budget", "init", "--dataset", str(data), "--epsilon", "1", "--delta", "0.5", "--ledger", url])
    err = capsys.readouterr().err
    assert rc == 2 and "`--delta` must be < 1/n = 0.25 for a dataset of n = 4 examples" in err
    assert not (tmp_path / "ledger.db").exists() or not Ledger(url).datasets()  # nothing registered
    rc = main(["budget", "init", "--dataset", str(data), "--epsilon", "1", "--delta", "0.01", "--ledger", url])
    assert rc == 0 and "ds-" in capsys.readouterr().out


def test_locked_sqlite_ledger_says_that_it_waits(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ledger.db"
    led = Ledger(path)
    led.init_dataset(b"data", 5.0, 1e-5, name="d")
    monkeypatch.setattr(_backend, "LOCK_NOTICE_S", 0.05)
    monkeypatch.setattr(_backend, "LOCK_WAIT_S", 0.3)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program holds the file
    try:
        capsys.readouterr()
        with pytest.raises(LedgerError, match="stayed locked by another process for 0.3 s"):
            led.reserve("d", [GaussianEvent(3.0)], command="x")
        err = capsys.readouterr().err
        assert "is locked by another process" in err and "waiting up to 0.25 s more to record a change" in err
        with pytest.raises(LedgerError, match="stayed locked"):
            Ledger(path).status("d")  # opening and reading wait (and say so) too
        assert "more to read it" in capsys.readouterr().err
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert Ledger(path).status("d").reserved_epsilon == 0.0


# --------------------------------------------------------------------------- what run directories publish


def _hash_traces(data_file, ledger_url) -> list[str]:
    """Every hash of the data a run directory must not contain: the content SHA-256, its 8/12/16-digit
    prefixes (the old ledger name and messages used them) and the ledger's keyed fingerprint."""
    raw = dataset_fingerprint(data_file)
    keyed = Ledger(ledger_url).fingerprint(data_file)
    return [raw, raw[:16], raw[:12], raw[:8], keyed, keyed[:12]]


def _assert_no_traces(run_dir, traces, extra_text=""):
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files and not any(p.name.endswith(".key") for p in files)  # the key never goes into a run directory
    for p in files:
        blob = p.read_bytes()
        for t in traces:
            assert t.encode() not in blob, (p.name, t)
    for t in traces:
        assert t not in extra_text


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    from privtune.models.testing import make_toy_text_files

    return make_toy_text_files(tmp_path_factory.mktemp("published"),
                               {"train": ("train.tsv", 80, 0), "eval": ("dev.tsv", 24, 1), "public": ("public.tsv", 24, 2)})


def test_train_run_directory_and_output_carry_only_the_random_dataset_id(toy_files, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    out = tmp_path / "run"
    capsys.readouterr()
    rc = main(["train", "--data", str(toy_files["train"]), "--eval-data", str(toy_files["eval"]), "--model",
               str(toy_files["model"]), "--mode", "bitfit", "--labels", "0,1", "--epsilon", "2", "--delta", "1e-3",
               "--steps", "3",
               "--batch-size", "20", "--ledger", url, "--output", str(out), "--quiet"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    metrics = json.loads((out / "metrics.json").read_text())
    cert = json.loads((out / "certificate.json").read_text())
    dataset_id = metrics["dataset_id"]
    assert dataset_id.startswith("ds-") and cert["metadata"]["dataset_id"] == dataset_id
    assert "dataset_fingerprint" not in metrics and "dataset_fingerprint" not in cert["metadata"]
    # the ledger maps the published id back to the dataset and its spend
    assert Ledger(url).status(dataset_id).spent_epsilon == pytest.approx(cert["epsilon"], rel=1e-6)
    _assert_no_traces(out, _hash_traces(toy_files["train"], url), printed.out + printed.err)


def test_tune_run_directory_and_output_carry_only_the_random_dataset_id(toy_files, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    out = tmp_path / "run"
    capsys.readouterr()
    rc = main(["tune", "--data", str(toy_files["train"]), "--eval-data", str(toy_files["eval"]),
               "--public-eval-data", str(toy_files["public"]), "--model", str(toy_files["model"]),
               "--mode", "last-layer", "--labels", "0,1", "--strategy", "single-step", "--epsilon", "2", "--delta", "1e-3",
               "--ledger", url, "--output", str(out), "--quiet"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["dataset_id"].startswith("ds-") and metrics["dataset_id"] in printed.out
    _assert_no_traces(out, _hash_traces(toy_files["train"], url), printed.out + printed.err)


def test_embedded_demo_ledger_keeps_its_key_outside_the_run_directory(tmp_path):
    from privtune.run.budget import open_ledger_for, register_dataset

    def demo_ledger():
        led, _ = open_ledger_for(None, run_dir=run_dir, in_run_dir=True)
        return led, register_dataset(led, raw, total_epsilon=1.0, delta=1e-5, name=None, command="tune")[1]

    run_dir = tmp_path / "demo-run"
    run_dir.mkdir()
    raw = dataset_fingerprint(b"demo rows")
    led, registered = demo_ledger()
    assert registered and (run_dir / "ledger.db").is_file()
    assert not any(p.name.endswith(".key") for p in run_dir.rglob("*"))
    keys = list((tmp_path / "privtune_home" / "demo-ledger-keys").glob("*.key"))  # $PRIVTUNE_HOME (conftest)
    assert len(keys) == 1 and _mode(keys[0]) == 0o600
    again, registered = demo_ledger()  # a resumed demo
    assert not registered and again.status(raw).dataset_id == led.status(raw).dataset_id


def test_postgresql_key_file_name_does_not_depend_on_the_user():
    a = Ledger("postgresql://alice:secret@db.internal:5432/ledger")._key_path
    b = Ledger("postgresql://bob@db.internal/ledger")._key_path
    assert a == b and a.name.startswith("ledger-") and a.parent.name == "ledger-keys"
    assert Ledger("postgresql://alice@db.internal/other")._key_path != a


def test_a_key_file_others_can_read_is_used_with_one_warning_line(tmp_path, capsys):
    """The key lets its reader rewrite the ledger undetected: a world-readable key file gets one `warning:` line
    with the chmod that fixes it (and still works: refusing would lock the owner out of their budget)."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    Ledger(url).init_dataset(b"data", 1.0, 1e-5, name="d")
    key = tmp_path / "l.db.key"
    assert main(["budget", "show", "--dataset", "d", "--ledger", url]) == 0
    assert "warning" not in capsys.readouterr().err  # created 0600: nothing to say
    os.chmod(key, 0o644)
    assert main(["budget", "show", "--dataset", "d", "--ledger", url]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("warning:")]
    assert len(lines) == 1 and "0644" in lines[0] and f"chmod 600 {key}" in lines[0]
    assert "Traceback" not in err and "warnings.warn" not in err
