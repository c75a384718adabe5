"""The ledger records the privacy unit of every spend and keeps one dataset's budget in one unit (SQLite and
PostgreSQL: the ``pg_url`` fixture of conftest.py)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from privtune.accounting.events import GaussianEvent
from privtune.errors import LedgerError
from privtune.ledger import Ledger


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_url")


def test_the_unit_is_recorded_with_every_spend(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"chat rows", 20.0, 1e-6, accountant="rdp").fingerprint
    with ledger.spend(fp, [GaussianEvent(4.0)], command="train", privacy_unit="sender"):
        pass
    ledger.record_spend(fp, [GaussianEvent(5.0)], command="elsewhere", privacy_unit="sender")
    entries = Ledger(url).status(fp).entries  # a fresh handle: read back from the records
    assert [e.privacy_unit for e in entries] == ["sender", "sender"]
    assert entries[0].to_dict()["privacy_unit"] == "sender"
    assert Ledger(url).verify().ok  # the unit is part of the MACed record
    reserve = [r for r in Ledger(url).history(fp) if r.action == "reserve"]
    assert all("[privacy unit: all rows of one sender]" in r.summary() for r in reserve)


@pytest.mark.parametrize("first, second", [(None, "sender"), ("sender", None), ("sender", "conversation")])
def test_mixing_privacy_units_on_one_dataset_is_refused_before_any_charge(url, first, second):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"mixed rows", 20.0, 1e-6, accountant="rdp").fingerprint
    with ledger.spend(fp, [GaussianEvent(4.0)], command="first", privacy_unit=first):
        pass
    before = ledger.status(fp)
    with pytest.raises(LedgerError, match="cannot be composed") as info:
        ledger.reserve(fp, [GaussianEvent(4.0)], command="second", privacy_unit=second)
    assert "Nothing was charged" in str(info.value)
    with pytest.raises(LedgerError, match="cannot be composed"):
        ledger.record_spend(fp, [GaussianEvent(4.0)], command="external", privacy_unit=second)
    after = ledger.status(fp)
    assert len(after.entries) == len(before.entries) and after.spent_epsilon == before.spent_epsilon


def test_a_released_spend_does_not_fix_the_unit(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"released rows", 20.0, 1e-6, accountant="rdp").fingerprint
    ledger.reserve(fp, [GaussianEvent(4.0)], command="abandoned").release("never ran")
    with ledger.spend(fp, [GaussianEvent(4.0)], command="user level", privacy_unit="user_id"):
        pass
    assert [e.privacy_unit for e in ledger.status(fp).entries] == [None, "user_id"]


def test_an_edited_unit_is_detected(url):
    ledger = Ledger(url)
    fp = ledger.init_dataset(b"edited unit", 20.0, 1e-6, name="edited", accountant="rdp").fingerprint
    with ledger.spend(fp, [GaussianEvent(4.0)], command="train", privacy_unit="user_id"):
        pass
    eng = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with eng.begin() as c:
        c.execute(sa.text("UPDATE privtune_records SET payload = REPLACE(payload, 'user_id', 'xuser_id')"))
    eng.dispose()
    assert not ledger.verify("edited").ok


def test_budget_spend_records_an_external_user_level_run(tmp_path, capsys):
    from privtune.cli import main

    data = tmp_path / "chats.csv"
    data.write_text("text,label,sender\na,1,s1\nb,0,s2\n")
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"

    def run(*args):
        capsys.readouterr()
        rc = main(["budget", *args, "--ledger", ledger])
        out = capsys.readouterr()
        return rc, out.out, out.err

    assert run("init", "--dataset", str(data), "--epsilon", "8", "--delta", "1e-6", "--name", "chats",
               "--accountant", "rdp")[0] == 0
    spend = ("spend", "--dataset", "chats", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "100")
    assert run(*spend, "--privacy-unit", "sender")[0] == 0
    assert [e.privacy_unit for e in Ledger(ledger).status("chats").entries] == ["sender"]
    rc, _, err = run(*spend)  # an example-level spend on the same data
    assert rc != 0 and err.startswith("error:") and "cannot be composed" in err
    rc, out, _ = run("history", "--dataset", "chats", "--json")
    assert rc == 0 and any("[privacy unit: all rows of one sender]" in r["events_summary"] for r in json.loads(out))


def test_spends_of_one_unit_compose_and_the_total_binds_at_the_unit_level(url):
    """Two spends protecting the same unit compose like any two spends (one accountant, the dataset's δ); the
    dataset's total refuses a third that would exceed it, before anything is charged; an open user-level
    reservation already fixes the unit for a concurrent example-level one."""
    from privtune.errors import BudgetExceededError
    from privtune.ledger import composed_epsilon

    ledger = Ledger(url)
    fp = ledger.init_dataset(b"composed unit rows", 3.0, 1e-6, accountant="rdp").fingerprint
    first, second = [GaussianEvent(3.0)], [GaussianEvent(4.0)]
    with ledger.spend(fp, first, command="tune", privacy_unit="user_id"):
        pass
    ledger.record_spend(fp, second, command="train", privacy_unit="user_id")
    status = Ledger(url).status(fp)
    assert status.spent_epsilon == pytest.approx(composed_epsilon([], 1e-6, "rdp", new=first + second), rel=1e-9)
    assert status.spent_epsilon > max(composed_epsilon([], 1e-6, "rdp", new=e) for e in (first, second))
    with pytest.raises(BudgetExceededError):
        ledger.reserve(fp, [GaussianEvent(0.5)], command="too much", privacy_unit="user_id")
    assert Ledger(url).status(fp).spent_epsilon == pytest.approx(status.spent_epsilon, rel=1e-12)
    open_fp = ledger.init_dataset(b"open reservation rows", 20.0, 1e-6, accountant="rdp").fingerprint
    held = ledger.reserve(open_fp, [GaussianEvent(4.0)], command="running", privacy_unit="user_id")
    with pytest.raises(LedgerError, match="cannot be composed"):
        ledger.reserve(open_fp, [GaussianEvent(4.0)], command="example level meanwhile")
    held.commit([GaussianEvent(4.0)])
