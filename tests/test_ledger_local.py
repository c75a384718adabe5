"""Ledger pieces that do not need a database server: fingerprints, URLs, SQLite files that are
missing, read-only, corrupted or foreign, input validation, and event grouping."""

from __future__ import annotations

import os
import pwd
import sqlite3
import tempfile
from pathlib import Path

import pytest

from privtune.accounting.events import DPSGDEvent, GaussianEvent, RepeatAndSelectEvent
from privtune.errors import DataError, InvalidParameterError, LedgerError
from privtune.ledger import Ledger, dataset_fingerprint, default_ledger_url, group_events

# --------------------------------------------------------------------------- fingerprints


def test_fingerprint_is_content_not_name_or_location(tmp_path):
    data = b"text,label\nhello world,1\ngoodbye,0\n"
    a = tmp_path / "x" / "train.csv"
    b = tmp_path / "y" / "copy-with-another-name.tsv"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data)
    fp = dataset_fingerprint(a)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == dataset_fingerprint(b) == dataset_fingerprint(str(b)) == dataset_fingerprint(data)
    assert fp == dataset_fingerprint([data[:5], data[5:17].decode(), data[17:]])  # a stream, any chunking
    assert fp != dataset_fingerprint(data + b"x")


def test_directory_fingerprint_depends_on_relative_paths_only(tmp_path):
    for root in ("d1", "elsewhere/d2"):
        (tmp_path / root / "cat").mkdir(parents=True)
        (tmp_path / root / "dog").mkdir(parents=True)
        (tmp_path / root / "cat" / "1.png").write_bytes(b"\x89PNG a")
        (tmp_path / root / "dog" / "2.png").write_bytes(b"\x89PNG b")
    assert dataset_fingerprint(tmp_path / "d1") == dataset_fingerprint(tmp_path / "elsewhere" / "d2")
    (tmp_path / "d1" / "dog" / "2.png").rename(tmp_path / "d1" / "cat" / "2.png")  # label changed
    assert dataset_fingerprint(tmp_path / "d1") != dataset_fingerprint(tmp_path / "elsewhere" / "d2")


def test_fingerprint_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        dataset_fingerprint(tmp_path / "missing.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="contains no files"):
        dataset_fingerprint(tmp_path / "empty")
    with pytest.raises(InvalidParameterError, match="`data` must yield bytes or str"):
        dataset_fingerprint([b"ok", 3])
    with pytest.raises(InvalidParameterError, match="`data` must be a path"):
        dataset_fingerprint(12)


# --------------------------------------------------------------------------- grouping


def test_group_events_merges_only_exactly_additive_events():
    rs = RepeatAndSelectEvent(events=(GaussianEvent(2.0),), mean=3.0)
    events = [
        DPSGDEvent(1.0, 0.01, 100, label="a"), GaussianEvent(5.0, 2), DPSGDEvent(1.0, 0.01, 50),
        DPSGDEvent(1.0, 0.02, 10), GaussianEvent(5.0, 1, label="eval"),
        DPSGDEvent(1.0, 0.5, 1, sampling="shuffle"), DPSGDEvent(1.0, 0.5, 1, sampling="shuffle"), rs, rs,
    ]
    assert group_events(events) == [
        DPSGDEvent(1.0, 0.01, 150), GaussianEvent(5.0, 3), DPSGDEvent(1.0, 0.02, 10),
        # shuffled runs are not merged: two half-epoch runs are two releases, not one
        DPSGDEvent(1.0, 0.5, 1, sampling="shuffle"), DPSGDEvent(1.0, 0.5, 1, sampling="shuffle"), rs, rs,
    ]


# --------------------------------------------------------------------------- URLs


def test_url_selection(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVTUNE_LEDGER", f"sqlite:///{tmp_path / 'env.db'}")
    assert Ledger().url == f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.delenv("PRIVTUNE_LEDGER")
    home = tmp_path / "home" / ".privtune"  # does not exist yet: the default location is created
    monkeypatch.setenv("PRIVTUNE_HOME", str(home))
    assert default_ledger_url() == f"sqlite:///{home / 'ledger.db'}"
    led = Ledger()
    led.init_dataset(b"d", 1.0, 1e-5)
    assert (home / "ledger.db").is_file()
    assert Ledger(tmp_path / "bare.db").url == f"sqlite:///{tmp_path / 'bare.db'}"
    pg = Ledger("postgres://alice:s3cret@db.example:5432/privacy")
    assert pg.backend == "postgresql" and "s3cret" not in pg.url and "postgresql+psycopg" in pg.url
    with pytest.raises(InvalidParameterError, match="`url` must use one of the schemes"):
        Ledger("mysql://user@host/db")
    with pytest.raises(InvalidParameterError, match="`url` must be a ledger URL"):
        Ledger(42)


@pytest.mark.parametrize("url", ["sqlite:///", "sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?cache=shared&uri=true",
                                 "sqlite:///file:x.db?mode=memory&uri=true"])
def test_in_memory_sqlite_needs_an_explicit_opt_in(url):
    with pytest.raises(InvalidParameterError, match="names no SQLite file"):
        Ledger(url)
    led = Ledger("sqlite:///:memory:", allow_in_memory=True)  # throw-away ledger, explicitly asked for
    st = led.init_dataset(b"memory data", 2.0, 1e-5)
    assert led.status(st.fingerprint).total_epsilon == 2.0


# --------------------------------------------------------------------------- bad files and directories


def test_missing_directory_is_a_clear_error(tmp_path):
    led = Ledger(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'ledger.db'}")
    with pytest.raises(LedgerError, match="does not exist.*mkdir -p"):
        led.init_dataset(b"d", 1.0, 1e-5)
    assert not (tmp_path / "no").exists()


def test_corrupted_file_is_never_reset(tmp_path):
    path = tmp_path / "ledger.db"
    junk = b"this is not a database at all\n" * 200
    path.write_bytes(junk)
    with pytest.raises(LedgerError, match="corrupted or is not a privtune ledger.*never resets"):
        Ledger(path).status("x")
    assert path.read_bytes() == junk


def test_damaged_sqlite_pages_are_a_clear_error(tmp_path):
    path = tmp_path / "ledger.db"
    led = Ledger(path)
    led.init_dataset(b"d", 1.0, 1e-5)
    led.close()
    raw = bytearray(path.read_bytes())
    raw[100:len(raw)] = b"\xff" * (len(raw) - 100)  # keep the header, smash every page
    path.write_bytes(bytes(raw))
    with pytest.raises(LedgerError):
        Ledger(path).status(b"d")
    assert path.read_bytes() == bytes(raw)


def test_foreign_sqlite_database_is_refused(tmp_path):
    path = tmp_path / "app.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="another application"):
        Ledger(path).init_dataset(b"d", 1.0, 1e-5)
    assert path.read_bytes() == before


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "ledger.db"
    Ledger(path).init_dataset(b"d", 1.0, 1e-5)
    con = sqlite3.connect(path)
    con.execute("UPDATE privtune_meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    with pytest.raises(LedgerError, match="Upgrade privtune"):
        Ledger(path).status(b"d")


def test_read_only_ledger_file_is_a_clear_error(tmp_path):
    path = tmp_path / "ledger.db"
    Ledger(path).init_dataset(b"d", 5.0, 1e-5)
    ro = Ledger(f"sqlite:///file:{path}?mode=ro&uri=true")
    assert ro.status(b"d").total_epsilon == 5.0  # reading works
    with pytest.raises(LedgerError, match="read-only"):
        ro.reserve(b"d", [GaussianEvent(3.0)], command="x")


def _as_unprivileged(fn) -> int:
    """Run ``fn`` in a forked child as 'nobody' (root ignores permissions); return its exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 3
        try:
            nobody = pwd.getpwnam("nobody")
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_read_only_directory_is_a_clear_error():
    base = Path(tempfile.mkdtemp(prefix="privtune-ro-"))
    try:
        Ledger(base / "existing.db").init_dataset(b"d", 5.0, 1e-5)
        os.chmod(base / "existing.db", 0o644)
        os.chmod(base / "existing.db.key", 0o644)  # the other user holds the key: only the directory is read-only
        os.chmod(base, 0o555)

        def check() -> int:
            try:
                Ledger(base / "new.db").status(b"d")
            except LedgerError as exc:
                if "not writable" not in str(exc):
                    return 10
            else:
                return 11
            try:
                Ledger(base / "existing.db").reserve(b"d", [GaussianEvent(3.0)], command="x")
            except LedgerError as exc:
                if "read-only" not in str(exc) and "not writable" not in str(exc):
                    return 12
            else:
                return 13
            return 0

        if os.geteuid() == 0:
            try:
                pwd.getpwnam("nobody")
            except KeyError:
                pytest.skip("running as root without a 'nobody' user: cannot make a directory read-only")
            assert _as_unprivileged(check) == 0
        else:
            assert check() == 0
    finally:
        os.chmod(base, 0o755)
        for p in base.iterdir():
            p.unlink()
        base.rmdir()


# --------------------------------------------------------------------------- argument validation


def test_bad_arguments_name_the_argument(tmp_path):
    led = Ledger(tmp_path / "l.db")
    with pytest.raises(InvalidParameterError, match="`epsilon`"):
        led.init_dataset(b"d", -1.0, 1e-5)
    with pytest.raises(InvalidParameterError, match="`delta`"):
        led.init_dataset(b"d", 1.0, 1.5)
    with pytest.raises(InvalidParameterError, match="`accountant`.*'pld'"):
        led.init_dataset(b"d", 1.0, 1e-5, accountant="pdl")
    with pytest.raises(InvalidParameterError, match="neither an existing file"):
        led.init_dataset("some-name-without-data", 1.0, 1e-5)
    with pytest.raises(InvalidParameterError, match="`name` must not be a fingerprint"):
        led.init_dataset(b"d", 1.0, 1e-5, name="a" * 64)
    fp = led.init_dataset(b"d", 1.0, 1e-5).fingerprint
    with pytest.raises(InvalidParameterError, match="`planned_events` must not be empty"):
        led.reserve(fp, [], command="x")
    with pytest.raises(InvalidParameterError, match="`planned_events` must hold privtune events"):
        led.reserve(fp, [0.5], command="x")
    with pytest.raises(InvalidParameterError, match="`command` must be a non-empty string"):
        led.reserve(fp, [GaussianEvent(3.0)], command="")
    with pytest.raises(InvalidParameterError, match="`reason`"):
        led.raise_budget(fp, 2.0, reason=" ")
    with pytest.raises(InvalidParameterError, match="`dataset` must be"):
        led.status(3.5)
    # event dicts (as stored in certificates) are accepted too
    res = led.reserve(fp, [{"kind": "gaussian", "noise_multiplier": 4.0, "count": 1, "label": ""}],
                      command="x", config={"lr": 0.1})
    assert res.planned_events == (GaussianEvent(4.0),)
    assert led.status(fp).entries[0].config_hash is not None


def test_a_run_calibrated_to_the_remaining_budget_fits_exactly(tmp_path):
    """Training sizes its σ with calibrate_noise_multiplier(spent_events=ledger.spent_events(...));
    the ledger composes the same event list, so the calibrated run fits and a noisier-less one does not."""
    from privtune.accounting import calibrate_noise_multiplier
    from privtune.errors import BudgetExceededError

    led = Ledger(tmp_path / "l.db")
    fp = led.init_dataset(b"calibrate", 3.0, 1e-5).fingerprint  # PLD, the default
    led.record_spend(fp, [DPSGDEvent(1.0, 0.01, 300), GaussianEvent(20.0, 2)], command="earlier tuning")
    spent = led.spent_events(fp)
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.02, 200, spent_events=spent)
    with pytest.raises(BudgetExceededError):
        led.reserve(fp, [DPSGDEvent(sigma * 0.97, 0.02, 200)], command="too little noise")
    res = led.reserve(fp, [DPSGDEvent(sigma, 0.02, 200)], command="final run")
    assert -1e-6 <= res.remaining_epsilon <= 0.05


def test_ensure_dataset_registers_once_and_never_changes_a_total(tmp_path):
    led = Ledger(tmp_path / "l.db")
    assert led.ensure_dataset(b"data", 2.0, 1e-5, name="d").total_epsilon == 2.0
    st = led.ensure_dataset(b"data", 9.0, 1e-6)  # a later run's own target is not a new total
    assert (st.total_epsilon, st.delta, st.name) == (2.0, 1e-5, "d")
    assert [r.state for r in led.history("d")] == ["init"]


def test_events_without_a_finite_epsilon_are_never_recorded(tmp_path):
    from privtune.errors import BudgetExceededError

    led = Ledger(tmp_path / "inf.db")
    fp = led.init_dataset(b"inf data", 1.0, 1e-5).fingerprint
    tiny = [DPSGDEvent(1e-10, 0.01, 10)]  # below the 1e-6 floor: ε = inf
    for attempt in (lambda: led.record_spend(fp, tiny, command="x"),
                    lambda: led.record_spend(fp, tiny, command="x", force=True),
                    lambda: led.reserve(fp, tiny, command="x")):
        with pytest.raises(BudgetExceededError, match="inf|no finite ε"):
            attempt()
    res = led.reserve(fp, [DPSGDEvent(10.0, 0.01, 10)], command="y")
    with pytest.raises(BudgetExceededError, match="no finite ε"):
        res.commit(tiny, force=True)
    st = led.status(fp)
    assert st.entries[-1].state == "reserved" and 0.0 < st.used_epsilon < 1.0
    assert [r.state for r in led.history(fp)] == ["init", "reserved"] and led.verify().ok
