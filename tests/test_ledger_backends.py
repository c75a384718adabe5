"""The ledger's guarantees, run identically against SQLite and a real PostgreSQL server.

The PostgreSQL server is started by the ``pg_server`` fixture (tests/conftest.py) (initdb + pg_ctl in a
temporary directory, unix socket only, run as the ``postgres``/``nobody`` user when the tests
run as root).  It is skipped only when no server binary exists (Debian: ``apt-get install
postgresql``), and never in CI: with the environment variable ``CI=true`` (set by ``.ci/run``)
a missing server FAILS the PostgreSQL tests, because CI must test the PostgreSQL backend.

The race test uses the RDP accountant: it composes ~1600 budget checks, and RDP answers in
about a millisecond where PLD takes tens to hundreds; the ledger logic under test is the same.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from privtune.accounting import compute_epsilon
from privtune.accounting.events import DPSGDEvent, GaussianEvent
from privtune.errors import BudgetExceededError, LedgerError, PrivtuneError, UnknownDatasetError
from privtune.ledger import Ledger, dataset_fingerprint

# The PostgreSQL server fixtures (pg_server, pg_url) live in conftest.py: one server per test session.
from conftest import _free_port, _unavailable  # noqa: E402


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_url")


def _raw_engine(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


# --------------------------------------------------------------------------- workers (forked)


SIGMA = 4.0


def _race_worker(url, fp, attempts, barrier, queue):
    ledger = Ledger(url)
    ok = refused = 0
    barrier.wait(timeout=60)
    for _ in range(attempts):
        try:
            ledger.reserve(fp, [GaussianEvent(SIGMA)], command=f"race worker {os.getpid()}")
            ok += 1
        except BudgetExceededError:
            refused += 1
    queue.put((ok, refused))
    ledger.close()


def _victim(url, fp, conn):
    ledger = Ledger(url)
    with ledger.spend(fp, [GaussianEvent(2.0, 5)], command="victim run", resume_key="run-dir-1") as res:
        conn.send(res.entry_id)  # "data is being read now"
        time.sleep(120)


# --------------------------------------------------------------------------- tests


def test_race_exactly_k_reservations_succeed(url):
    k, procs, attempts, delta = 37, 8, 200, 1e-5
    eps_k = compute_epsilon([GaussianEvent(SIGMA, k)], delta, accountant="rdp")
    eps_k1 = compute_epsilon([GaussianEvent(SIGMA, k + 1)], delta, accountant="rdp")
    total = (eps_k + eps_k1) / 2  # admits exactly k
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"race data", total, delta, accountant="rdp").fingerprint
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_race_worker, args=(url, fp, attempts, barrier, queue)) for _ in range(procs)]
    for p in ps:
        p.start()
    try:
        results = [queue.get(timeout=240) for _ in ps]
        for p in ps:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
    assert sum(ok for ok, _ in results) == k
    assert sum(ok + ref for ok, ref in results) == procs * attempts
    st = ledger.status(fp)
    assert len(st.entries) == k and all(e.state == "reserved" for e in st.entries)
    assert st.used_epsilon <= st.total_epsilon
    assert st.used_epsilon == pytest.approx(eps_k, rel=1e-9)
    assert ledger.verify().ok


def test_sigkill_leaves_reservation_charged_and_resume_continues_it(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"kill data", 5.0, 1e-5).fingerprint
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_victim, args=(url, fp, child))
    p.start()
    try:
        assert parent.poll(120), "victim never reserved"
        entry_id = parent.recv()
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert p.exitcode == -signal.SIGKILL

    planned_eps = compute_epsilon([GaussianEvent(2.0, 5)], 1e-5)
    st = ledger.status(fp)
    assert [e.state for e in st.entries] == ["reserved"]
    assert st.spent_epsilon == 0.0
    assert st.reserved_epsilon == pytest.approx(planned_eps, rel=1e-6)
    assert st.remaining_epsilon == pytest.approx(5.0 - planned_eps, rel=1e-6)

    touched = []
    with ledger.spend(fp, [GaussianEvent(2.0, 5)], command="resumed run", resume_key="run-dir-1") as res:
        touched.append(True)
        assert res.resumed and res.entry_id == entry_id
    st = ledger.status(fp)
    assert len(st.entries) == 1 and st.entries[0].state == "committed" and st.entries[0].resumed == 1
    assert st.spent_epsilon == pytest.approx(planned_eps, rel=1e-6) and st.reserved_epsilon == 0.0
    assert [r.state for r in ledger.history(fp)] == ["init", "reserved", "resumed", "committed"]
    with pytest.raises(LedgerError, match="already committed"):
        ledger.reserve(fp, [GaussianEvent(2.0, 5)], command="again", resume_key="run-dir-1")
    assert ledger.verify().ok


def test_exception_in_block_keeps_reservation_and_plan_change_on_resume_is_refused(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"crash data", 5.0, 1e-5, accountant="rdp").fingerprint
    with pytest.raises(RuntimeError):
        with ledger.spend(fp, [GaussianEvent(3.0, 2)], command="crashy", resume_key="k"):
            raise RuntimeError("out of memory")
    st = ledger.status(fp)
    assert st.entries[0].state == "reserved" and st.reserved_epsilon > 0
    with pytest.raises(LedgerError, match="must keep its plan"):
        ledger.reserve(fp, [GaussianEvent(3.0, 3)], command="resume", resume_key="k")


def test_remaining_is_total_minus_composition_not_a_sum(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"compose data", 10.0, 1e-5, accountant="rdp").fingerprint
    runs = [DPSGDEvent(1.0, 0.01, 500), DPSGDEvent(1.0, 0.01, 500), GaussianEvent(8.0, 3)]
    for ev in runs:
        with ledger.spend(fp, [ev], command="run"):
            pass
    st = ledger.status(fp)
    composed = compute_epsilon(runs, 1e-5, accountant="rdp")
    summed = sum(compute_epsilon([e], 1e-5, accountant="rdp") for e in runs)
    assert st.spent_epsilon == pytest.approx(composed, rel=1e-9)
    assert st.spent_epsilon < summed
    assert st.remaining_epsilon == pytest.approx(10.0 - composed, rel=1e-9)


def test_budget_exceeded_before_data_is_read(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"small budget", 1.0, 1e-5, name="small", accountant="rdp").fingerprint
    entered = []
    with pytest.raises(BudgetExceededError) as info:
        with ledger.spend("small", [DPSGDEvent(0.6, 0.1, 2000)], command="too big"):
            entered.append(True)
    assert not entered
    msg = str(info.value)
    assert "remaining ε = 1 " in msg and "asks for ε =" in msg and "privtune budget raise" in msg
    assert len(ledger.history(fp)) == 1  # only init: nothing recorded


def test_commit_actual_release_and_delta_checks(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"commit data", 20.0, 1e-5, accountant="rdp").fingerprint
    with ledger.spend(fp, [DPSGDEvent(1.0, 0.01, 1000)], command="early stop") as res:
        res.commit([DPSGDEvent(1.0, 0.01, 400)])  # stopped early
    st = ledger.status(fp)
    assert st.spent_epsilon == pytest.approx(compute_epsilon([DPSGDEvent(1.0, 0.01, 400)], 1e-5, "rdp"))
    with pytest.raises(LedgerError, match="already committed"):
        res.commit()

    res2 = ledger.reserve(fp, [GaussianEvent(1.0, 4)], command="aborted before reading")
    res2.release("validation failed before any example was read")
    st2 = ledger.status(fp)
    assert st2.entries[-1].state == "released" and st2.used_epsilon == pytest.approx(st.used_epsilon)

    # committing more than the reservation is refused: nothing written, the reservation stays charged
    r3 = ledger.reserve(fp, [GaussianEvent(5.0, 1)], command="underplanned")
    before = ledger.status(fp)
    n_records = len(ledger.history(fp))
    reserved_eps = compute_epsilon([GaussianEvent(5.0, 1)], 1e-5, "rdp")
    attempted_eps = compute_epsilon([GaussianEvent(5.0, 2)], 1e-5, "rdp")
    with pytest.raises(BudgetExceededError, match="Committed events must not exceed the reservation") as info:
        r3.commit([GaussianEvent(5.0, 2)])
    msg = str(info.value)
    assert f"reserved ε = {reserved_eps:.4g}" in msg and f"ε = {attempted_eps:.4g} on their own" in msg
    assert "force=True" in msg
    after = ledger.status(fp)
    assert len(ledger.history(fp)) == n_records
    assert after.entries[-1].state == "reserved" and after.entries[-1].entry_id == r3.entry_id
    assert after.reserved_epsilon == pytest.approx(before.reserved_epsilon)
    assert after.used_epsilon == pytest.approx(before.used_epsilon)
    # a smaller commit of the same reservation is still accepted afterwards ...
    r3.commit([GaussianEvent(6.0, 1)])
    assert ledger.status(fp).entries[-1].state == "committed"
    # ... and force=True records a real overspend of the reservation, with a warning
    r4 = ledger.reserve(fp, [GaussianEvent(5.0, 1)], command="underplanned, forced")
    with pytest.warns(UserWarning, match="more than its reservation"):
        r4.commit([GaussianEvent(5.0, 2)], force=True)
    assert ledger.status(fp).entries[-1].events == (GaussianEvent(5.0, 2),)
    assert ledger.verify().ok

    with pytest.raises(BudgetExceededError, match="`delta` of the spend"):
        ledger.reserve(fp, [GaussianEvent(5.0)], command="x", delta=1e-3)
    ledger.reserve(fp, [GaussianEvent(5.0)], command="x", delta=1e-6).commit()


def test_unknown_dataset_and_init_rules(url):
    ledger = Ledger(url)
    with pytest.raises(UnknownDatasetError, match="privtune budget init"):
        ledger.status("no-such-dataset")
    with pytest.raises(UnknownDatasetError, match="privtune budget init"):
        ledger.reserve("0" * 64, [GaussianEvent(1.0)], command="x")
    fp = ledger.init_dataset(b"init data", 3.0, 1e-5, name="tickets").fingerprint
    assert ledger.init_dataset(b"init data", 3.0, 1e-5).total_epsilon == 3.0  # same: no-op
    with pytest.raises(LedgerError, match="privtune budget raise"):
        ledger.init_dataset(b"init data", 6.0, 1e-5)
    with pytest.raises(LedgerError, match="already belongs"):
        ledger.init_dataset(b"other data", 3.0, 1e-5, name="tickets")
    with pytest.raises(PrivtuneError, match="larger than the current total"):
        ledger.raise_budget("tickets", 2.0, reason="oops")
    st = ledger.raise_budget("tickets", 6.0, reason="legal approved a larger budget")
    assert st.total_epsilon == 6.0 and st.fingerprint == fp
    assert [r.state for r in ledger.history(fp)] == ["init", "raised"]
    assert ledger.verify().ok


def test_verify_detects_edited_and_deleted_records(url):
    ledger = Ledger(url)
    fps = {}
    for tag in ("edited", "middle", "last", "total", "clean"):
        fp = ledger.init_dataset(tag.encode(), 50.0, 1e-5, name=tag, accountant="rdp").fingerprint
        for sigma in (2.0, 3.0, 4.0):
            with ledger.spend(fp, [GaussianEvent(sigma)], command=f"run {sigma}"):
                pass
        fps[tag] = fp
    assert ledger.verify().ok
    eng = _raw_engine(url)
    with eng.begin() as c:
        ids = {r.name: r.id for r in c.execute(sa.text("SELECT id, name FROM privtune_datasets"))}
        # make a spend look cheaper: σ 2 -> 20
        c.execute(sa.text("UPDATE privtune_records SET payload = REPLACE(payload, '2.0', '20.0') "
                          "WHERE dataset_id = :d AND seq = 1"), {"d": ids["edited"]})
        c.execute(sa.text("DELETE FROM privtune_records WHERE dataset_id = :d AND seq = 3"), {"d": ids["middle"]})
        c.execute(sa.text("DELETE FROM privtune_records WHERE dataset_id = :d AND seq = "
                          "(SELECT MAX(seq) FROM privtune_records WHERE dataset_id = :d)"), {"d": ids["last"]})
        c.execute(sa.text("UPDATE privtune_datasets SET total_epsilon = 500 WHERE id = :d"), {"d": ids["total"]})
    eng.dispose()
    report = ledger.verify()
    assert not report.ok
    text = "\n".join(report.problems)
    assert "(edited)" in text and "record 1 (reserve) was edited" in text
    assert "(middle)" in text and "record 3 is missing" in text
    assert "(last)" in text and "latest record(s) were deleted" in text
    assert "(total)" in text and "the row was edited" in text
    assert "(clean)" not in text
    assert ledger.verify("clean").ok and not ledger.verify("edited").ok


def test_many_entries_are_grouped_before_the_accountant(url, monkeypatch):
    import privtune.accounting as accounting
    from privtune.ledger import _compose

    ledger = Ledger(url)
    fp = ledger.init_dataset(b"many", 1000.0, 1e-5, accountant="rdp").fingerprint
    for i in range(60):
        # Gaussian entries first: each DP-SGD composition costs the RDP accountant ~50 ms
        ev = DPSGDEvent(1.0, 0.01, 100, label=f"trial {i}") if i >= 50 else GaussianEvent(10.0, 2, label=f"e{i}")
        if i in (0, 55):
            ledger.reserve(fp, [ev], command=f"trial {i}").commit()
        else:
            ledger.record_spend(fp, [ev], command=f"trial {i}")
    calls = []
    real = accounting.compute_epsilon

    def spy(events, delta, accountant="pld", **kw):
        calls.append(len(events))
        return real(events, delta, accountant=accountant, **kw)

    monkeypatch.setattr(accounting, "compute_epsilon", spy)
    _compose._cached_epsilon.cache_clear()
    st = ledger.status(fp)
    assert calls and max(calls) == 2  # 60 entries -> 2 distinct events
    expected = real([GaussianEvent(10.0, 100), DPSGDEvent(1.0, 0.01, 1000)], 1e-5, accountant="rdp")
    assert st.spent_epsilon == pytest.approx(expected, rel=1e-9)


def test_unreachable_postgres_is_a_clear_error():
    pytest.importorskip("psycopg", reason="psycopg (privtune[postgres]) is not installed: the missing driver's own "
                                          "error is tested in test_missing_driver_is_a_clear_error")
    port = _free_port()  # nothing listens there
    ledger = Ledger(f"postgresql://nobody@127.0.0.1:{port}/privtune")
    with pytest.raises(LedgerError, match="Check that the server is running"):
        ledger.status("x")


def test_missing_driver_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg now raises ImportError, installed or not
    ledger = Ledger(f"postgresql://nobody@127.0.0.1:{_free_port()}/privtune")
    with pytest.raises(LedgerError, match=r"needs psycopg 3, which is not installed\. Install it with"):
        ledger.status("x")


def test_moved_dataset_keeps_its_budget(url, tmp_path):
    a = tmp_path / "a" / "train.csv"
    a.parent.mkdir()
    a.write_text("text,label\nhello,1\n")
    ledger = Ledger(url)
    ledger.init_dataset(a, 2.0, 1e-5, accountant="rdp")
    ledger.reserve(str(a), [GaussianEvent(3.0)], command="run").commit()
    b = tmp_path / "b" / "renamed.csv"
    b.parent.mkdir()
    a.rename(b)
    st = ledger.status(b)
    # the ledger stores the keyed fingerprint, never the content SHA-256
    assert st.fingerprint == ledger.fingerprint(b) != dataset_fingerprint(b) and len(st.entries) == 1


def test_missing_server_skips_locally_but_fails_in_ci(monkeypatch):
    """CI must test the PostgreSQL backend: with CI=true a missing server is a failure, not a skip."""
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but the PostgreSQL ledger tests cannot run: no server"):
        _unavailable("no server")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no server"):
        _unavailable("no server")


# --------------------------------------------------------------------------- keyed chain, migration, close


def _public_rehash(conn, ds_id: int, fp: str) -> None:
    """Re-hash a dataset's chain with schema 1's public hash function (what a forger without the key can do)."""
    import hashlib
    import json

    rows = conn.execute(sa.text("SELECT * FROM privtune_records WHERE dataset_id = :d ORDER BY seq"), {"d": ds_id}).all()
    prev = hashlib.sha256(("privtune-ledger/v1/genesis/" + fp).encode()).hexdigest()
    for r in rows:
        m = dict(r._mapping)
        body = {k: m[k] for k in ("seq", "action", "entry_id", "payload", "command", "config_hash", "privtune_version",
                                  "username", "host", "created_at")}
        body.update(fingerprint=fp, epsilon_after=float(m["epsilon_after"]), prev_hash=prev)
        h = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        conn.execute(sa.text("UPDATE privtune_records SET prev_hash = :p, hash = :h WHERE id = :i"),
                     {"p": prev, "h": h, "i": m["id"]})
        prev = h
    conn.execute(sa.text("UPDATE privtune_datasets SET head_hash = :h WHERE id = :d"), {"h": prev, "d": ds_id})


def test_keyed_chain_detects_tail_deletion_with_moved_head_and_rehashing(url):
    """Review cases d04 (delete the last two records and move the head back: two SQL statements) and
    d09 (edit a payload and re-hash the chain with the public hash function): both need the key now."""
    ledger = Ledger(url)
    for tag in ("d04", "d09", "clean"):
        ledger.init_dataset(tag.encode(), 50.0, 1e-5, name=tag, accountant="rdp")
        for sigma in (2.0, 3.0, 4.0):
            with ledger.spend(tag, [GaussianEvent(sigma)], command=f"run {sigma}"):
                pass
    assert ledger.verify().ok
    before = ledger.status("d04").used_epsilon
    eng = _raw_engine(url)
    with eng.begin() as c:
        ids = {r.name: (r.id, r.fingerprint) for r in c.execute(sa.text("SELECT id, name, fingerprint FROM privtune_datasets"))}
        d, _ = ids["d04"]
        c.execute(sa.text("DELETE FROM privtune_records WHERE dataset_id = :d AND seq >= 5"), {"d": d})
        c.execute(sa.text("UPDATE privtune_datasets SET head_seq = 4, head_hash = (SELECT hash FROM privtune_records "
                          "WHERE dataset_id = :d AND seq = 4) WHERE id = :d"), {"d": d})
        d, fp = ids["d09"]
        c.execute(sa.text("UPDATE privtune_records SET payload = REPLACE(payload, '3.0', '30.0') "
                          "WHERE dataset_id = :d AND action = 'commit'"), {"d": d})
        _public_rehash(c, d, fp)
    eng.dispose()
    fresh = Ledger(url)
    report = fresh.verify()
    assert not report.ok
    text = "\n".join(report.problems)
    assert "(d04)" in text and "latest record(s) were deleted, or the head was edited" in text
    assert "(d09)" in text and "was edited" in text
    assert "(clean)" not in text and fresh.verify("clean").ok
    # ordinary reads check the keyed head too (O(1)): the erased spend is not silently forgotten
    with pytest.raises(LedgerError, match="does not match the dataset's keyed head"):
        fresh.status("d04")
    assert before > 0


def _load_schema1(url: str) -> None:
    """Write the schema-1 ledger of tests/data/ledger_schema1.json (made by privtune before ledgers were keyed)."""
    import json

    data = json.loads((Path(__file__).parent / "data" / "ledger_schema1.json").read_text())
    md = sa.MetaData()
    meta = sa.Table("privtune_meta", md, sa.Column("key", sa.String(64), primary_key=True),
                    sa.Column("value", sa.Text, nullable=False))
    ds = sa.Table("privtune_datasets", md, sa.Column("id", sa.Integer, primary_key=True),
                  sa.Column("fingerprint", sa.String(64), nullable=False, unique=True),
                  sa.Column("name", sa.String(200), unique=True), sa.Column("total_epsilon", sa.Float, nullable=False),
                  sa.Column("delta", sa.Float, nullable=False), sa.Column("accountant", sa.String(16), nullable=False),
                  sa.Column("created_at", sa.String(40), nullable=False),
                  sa.Column("head_seq", sa.Integer, nullable=False), sa.Column("head_hash", sa.String(64), nullable=False))
    rec = sa.Table("privtune_records", md, sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("dataset_id", sa.Integer, sa.ForeignKey("privtune_datasets.id"), nullable=False, index=True),
                   sa.Column("seq", sa.Integer, nullable=False), sa.Column("action", sa.String(16), nullable=False),
                   sa.Column("entry_id", sa.String(32), index=True), sa.Column("payload", sa.Text, nullable=False),
                   sa.Column("epsilon_after", sa.Float, nullable=False), sa.Column("command", sa.Text, nullable=False),
                   sa.Column("config_hash", sa.String(64)), sa.Column("privtune_version", sa.String(32), nullable=False),
                   sa.Column("username", sa.String(128), nullable=False), sa.Column("host", sa.String(256), nullable=False),
                   sa.Column("created_at", sa.String(40), nullable=False),
                   sa.Column("prev_hash", sa.String(64), nullable=False), sa.Column("hash", sa.String(64), nullable=False),
                   sa.UniqueConstraint("dataset_id", "seq"))
    eng = _raw_engine(url)
    with eng.begin() as c:
        md.create_all(c)
        c.execute(meta.insert(), data["privtune_meta"])
        c.execute(ds.insert(), data["privtune_datasets"])
        c.execute(rec.insert(), data["privtune_records"])
        if c.dialect.name == "postgresql":  # rows inserted with their ids: move the serial sequences past them
            for table in ("privtune_datasets", "privtune_records"):
                c.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT MAX(id) FROM {table}))"))
    eng.dispose()


def test_schema1_ledger_is_verified_rekeyed_and_keeps_its_budgets(url):
    _load_schema1(url)
    one, two = b"legacy dataset one\n", b"legacy dataset two\n"
    ledger = Ledger(url)
    st = ledger.status(one)  # first open: key created, old chains verified, re-keyed, schema bumped
    # budgets carry over exactly (values printed by the schema-1 code that wrote the fixture)
    assert (st.total_epsilon, st.name, st.accountant) == (6.0, "legacy-one", "rdp")
    assert st.spent_epsilon == pytest.approx(1.3862750468052074, rel=1e-9)
    assert st.reserved_epsilon == pytest.approx(0.7119640833666103, rel=1e-9)
    assert [e.state for e in st.entries] == ["committed", "reserved"]
    assert ledger.status(two).remaining_epsilon == pytest.approx(1.2513695968336638, rel=1e-9)
    assert ledger.verify().ok
    eng = _raw_engine(url)
    with eng.connect() as c:
        version = c.execute(sa.text("SELECT value FROM privtune_meta WHERE key = 'schema_version'")).scalar()
        stored = [r[0] for r in c.execute(sa.text("SELECT fingerprint FROM privtune_datasets"))]
        payloads = " ".join(r[0] for r in c.execute(sa.text("SELECT payload FROM privtune_records")))
    eng.dispose()
    assert version == "2"
    for raw in (dataset_fingerprint(one), dataset_fingerprint(two)):  # no raw SHA-256 is left in the ledger
        assert raw not in stored and raw not in payloads
    # the interrupted run resumes its reservation; new spends extend the re-keyed chain
    res = ledger.reserve(one, [GaussianEvent(4.0, 2)], command="privtune train --resume", resume_key="runs/a")
    assert res.resumed
    res.commit()
    with ledger.spend("legacy-one", [GaussianEvent(5.0)], command="new run"):
        pass
    assert Ledger(url).verify().ok and Ledger(url).status(st.dataset_id).name == "legacy-one"


def test_tampered_schema1_ledger_is_not_migrated(url):
    _load_schema1(url)
    eng = _raw_engine(url)
    with eng.begin() as c:  # review case d01 on the old format: a spend made to look cheaper
        c.execute(sa.text("UPDATE privtune_records SET payload = REPLACE(payload, '3.0', '30.0') WHERE seq = 2"))
    eng.dispose()
    with pytest.raises(LedgerError, match="fails verification, so privtune will not upgrade it"):
        Ledger(url).status(b"legacy dataset one\n")
    eng = _raw_engine(url)
    with eng.connect() as c:  # left as it was
        assert c.execute(sa.text("SELECT value FROM privtune_meta WHERE key = 'schema_version'")).scalar() == "1"
    eng.dispose()


def test_close_orphaned_reservation_charges_it_in_full(url):
    ledger = Ledger(url)
    ledger.init_dataset(b"d", 10.0, 1e-5, name="d", accountant="rdp")
    orphan = ledger.reserve("d", [GaussianEvent(2.0, 3)], command="privtune train (killed)", resume_key="run1")
    used = ledger.status("d").used_epsilon
    entry = ledger.close_reservation(orphan.entry_id[:8], reason="killed before the first checkpoint")
    st = ledger.status("d")
    assert entry.state == "committed" and entry.events == orphan.planned_events  # charged in full, not refunded
    assert st.spent_epsilon == pytest.approx(used) and st.reserved_epsilon == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(LedgerError, match="already committed"):
        ledger.close_reservation(orphan.entry_id, reason="again")
    with pytest.raises(LedgerError, match="No entry"):
        ledger.close_reservation("0123456789abcdef", reason="typo")
    with pytest.raises(LedgerError, match="already committed"):  # the crashed run cannot be resumed any more
        ledger.reserve("d", [GaussianEvent(2.0, 3)], command="resume", resume_key="run1")
    assert ledger.verify().ok


def test_verify_and_reads_detect_an_edited_dataset_id(url):
    """The dataset id names a dataset in run directories and certificates: an edited (or swapped) id in the
    dataset row is detected by verify and refused by ordinary reads, on both backends."""
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"renamed id", 5.0, 1e-5, name="demo", accountant="rdp").fingerprint
    other = ledger.init_dataset(b"other id", 5.0, 1e-5, name="other", accountant="rdp").fingerprint
    with ledger.spend(fp, [GaussianEvent(3.0)], command="run"):
        pass
    original = ledger.status(fp).dataset_id
    assert ledger.verify().ok
    eng = _raw_engine(url)
    with eng.begin() as c:
        c.execute(sa.text("UPDATE privtune_datasets SET public_id = 'ds-0000000000000000' WHERE name = 'demo'"))
    eng.dispose()
    fresh = Ledger(url)
    report = fresh.verify()
    assert not report.ok
    text = "\n".join(report.problems)
    assert "(demo)" in text and "dataset id was edited" in text and original in text
    assert "(other)" not in text and fresh.verify(other).ok
    with pytest.raises(LedgerError, match="dataset id was edited"):
        fresh.status(fp)


def test_a_dataset_is_listed_by_the_local_file_name_it_was_registered_under(url, tmp_path, capsys):
    """`budget show` names datasets by file name; the name is part of the registration record (so `budget
    verify` covers it) and nothing but the ledger holds it."""
    from privtune.cli import main
    from privtune.pipeline import register_dataset

    data = tmp_path / "reviews_2024.csv"
    data.write_text("text,label\nhello,1\nbye,0\n")
    other = tmp_path / "other.csv"
    other.write_text("text,label\nagain,1\n")
    ledger = Ledger(url)
    # as `train`/`tune` register: by content fingerprint, with the file name given alongside
    status, registered = register_dataset(ledger, dataset_fingerprint(data), total_epsilon=1.0, delta=1e-5,
                                          name=None, command="tune", file_name="reviews_2024.csv")
    assert registered and status.file_name == "reviews_2024.csv"
    ledger.init_dataset(str(other), 2.0, 1e-5)  # `budget init --dataset PATH`: the path's file name
    ledger.init_dataset(dataset_fingerprint(b"not a file"), 3.0, 1e-5)  # by fingerprint: no file name
    names = {d["total_epsilon"]: d["file_name"] for d in Ledger(url).datasets()}
    assert names == {1.0: "reviews_2024.csv", 2.0: "other.csv", 3.0: None}
    assert ledger.status(data).to_dict()["file_name"] == "reviews_2024.csv"
    assert ledger.history(data)[0].payload["file_name"] == "reviews_2024.csv"
    assert ledger.verify().ok
    assert main(["budget", "show", "--ledger", url]) == 0
    table = capsys.readouterr().out
    assert "registered as" in table and "reviews_2024.csv" in table and "other.csv" in table
    assert main(["budget", "show", "--dataset", str(data), "--ledger", url]) == 0
    assert "reviews_2024.csv" in capsys.readouterr().out
