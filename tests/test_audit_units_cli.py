"""`privtune audit --privacy-unit COLUMN`: canary units of several rows, white-box and black-box, on the CLI; the
audit stays below the claim on the real build and flags a build that clips per row instead of per unit."""

from __future__ import annotations

import json

import pytest
import torch

from privtune.audit import AuditSpec, audit
from privtune.cli import main
from privtune.engine.units import UnitIndex
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files

USERS = 15  # 60 rows, 4 per user


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    f = make_toy_text_files(tmp_path_factory.mktemp("audit-unit"), {"train": ("rows.tsv", 60, 0)})
    lines = open(f["train"], encoding="utf-8").read().splitlines()
    path = f["root"] / "train.tsv"
    path.write_text("\n".join([lines[0] + "\tuser_id"] + [f"{line}\tu{i % USERS}" for i, line in
                                                           enumerate(lines[1:])]) + "\n", encoding="utf-8")
    f["train"] = str(path)
    return f


WHITEBOX = ["--epsilon", "1", "--delta", "1e-5", "--steps", "10", "--batch-size", str(USERS), "--sampling",
            "full_batch", "--canaries", "1000", "--no-blackbox", "--seed", "0", "--quiet", "--privacy-unit",
            "user_id", "--max-rows-per-unit", "4"]


def test_cli_whitebox_with_canary_units_stays_below_the_claim(files, capsys, tmp_path):
    rc = main(["audit", "--data", files["train"], "--labels", "0,1", *WHITEBOX, "--output", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert rc == 0 and "VIOLATION" not in out
    config = json.loads((tmp_path / "a" / "whitebox" / "audit.json").read_text())["config"]
    assert config["rows_per_unit"] == 4  # canary units of k rows: the most one unit can put into a step


def test_cli_whitebox_flags_clipping_per_row_instead_of_per_unit(files, capsys, monkeypatch):
    """The broken build: every row clipped to C and summed with weight 1, so a canary unit of 4 rows adds 4·C."""
    monkeypatch.setattr(UnitIndex, "row_weights", lambda self, idx: torch.ones(idx.numel(), dtype=torch.float64))
    rc = main(["audit", "--data", files["train"], "--labels", "0,1", *WHITEBOX])
    out = capsys.readouterr().out
    assert rc == 1 and "VIOLATION" in out


def test_blackbox_with_canary_units_trains_on_units_and_charges_the_unit(files, tmp_path, monkeypatch):
    from privtune import training

    seen = []
    real_train = training.train

    def spy(data, **kw):
        seen.append((len(data), kw.get("privacy_unit"), kw.get("max_rows_per_unit"), kw.get("batch_size")))
        return real_train(data, **kw)

    monkeypatch.setattr(training, "train", spy)
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = Ledger(url)
    led.init_dataset(files["train"], 50.0, 1e-3)
    spec = AuditSpec.create(mode="last-layer", epsilon=2.0, delta=1e-3, steps=3, batch_size=5, learning_rate=0.5,
                            num_canaries=12, seed=0, whitebox=False, privacy_unit="user_id", max_rows_per_unit=2,
                            canary_rows=3)
    rep = audit(files["train"], spec, model=files["model"], labels=[0, 1], ledger=url)
    r = rep.blackbox
    assert len(r.scores) == 12 and r.config["canary_rows"] == 3 and r.config["privacy_unit"] == "user_id"
    assert r.epsilon_lower_bound <= r.claimed_epsilon
    (n_rows, keys, k, batch), = seen
    included = sum(r.included)
    assert n_rows == 60 + 3 * included  # each included canary unit adds its 3 rows
    assert len(keys) == n_rows and len(set(keys)) == USERS + included and k == 2 and batch == 5
    entries = Ledger(url).status(files["train"]).entries
    assert [e.privacy_unit for e in entries] == ["user_id"]
    assert r.claimed_epsilon == pytest.approx(2.0, abs=1e-3)


def test_unit_options_without_a_unit_are_refused(files):
    with pytest.raises(Exception, match="only with `privacy_unit`"):
        AuditSpec.create(epsilon=1.0, blackbox=False, canary_rows=3)
