"""`privtune train --privacy-unit COLUMN` on text, end to end: refusals before the reservation, the certificate's
statement, `privtune account` re-verifying it, the model card and the ledger's unit."""

from __future__ import annotations

import json

import pytest

from privtune.cli import main
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files

USERS = 20  # 80 rows, 4 per user, interleaved


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    f = make_toy_text_files(tmp_path_factory.mktemp("unit"), {"train": ("rows.tsv", 80, 0), "eval": ("dev.tsv", 24, 1)})
    lines = open(f["train"], encoding="utf-8").read().splitlines()
    with_unit = f["root"] / "train.tsv"
    with_unit.write_text("\n".join([lines[0] + "\tuser_id"]
                                   + [f"{line}\tu{i % USERS}" for i, line in enumerate(lines[1:])]) + "\n",
                         encoding="utf-8")
    f["train"] = str(with_unit)
    return f


def _train(capsys, files, tmp_path, *extra, seeded=True):
    argv = ["train", "--data", files["train"], "--eval-data", files["eval"], "--model", str(files["model"]),
            "--mode", "bitfit", "--epsilon", "3", "--steps", "3", "--batch-size", "5", "--learning-rate", "0.01",
            "--labels", "0,1", *(["--seed", "0"] if seeded else []), "--quiet", "--ledger", f"sqlite:///{tmp_path / 'l.db'}",
            "--output", str(tmp_path / "run"), *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_train_with_a_privacy_unit_states_the_unit_everywhere(capsys, files, tmp_path):
    code, out, err = _train(capsys, files, tmp_path, "--privacy-unit", "user_id", "--max-rows-per-unit", "2",
                            "--delta", "1e-3")
    assert code == 0, err
    run = tmp_path / "run"
    cert = json.loads((run / "certificate.json").read_text())
    assert cert["neighbouring"] == "add/remove all rows of one user_id"
    event = cert["events"][0]
    assert event["sample_rate"] == pytest.approx(5 / USERS)  # q over units: expected units per batch / N_u
    hyper = json.loads((run / "metrics.json").read_text())["hyperparameters"]
    assert hyper["privacy_unit"] == {"unit": "user_id", "column": "user_id", "max_rows_per_unit": 2,
                                     "num_units": USERS}
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())  # reloadable with --config
    assert config["privacy_unit"] == "user_id" and config["max_rows_per_unit"] == 2
    # privtune account re-verifies it and says what it protects
    code = main(["account", "--certificate", str(run / "certificate.json")])
    shown = capsys.readouterr().out
    assert code == 0 and "VERIFIED" in shown
    assert "(ε, δ)-DP with respect to adding or removing all rows of one user_id" in shown
    from privtune.report.model_card import render_model_card
    from privtune.report.run import load_run

    card = render_model_card(load_run(run))
    # a seeded run's card withdraws the claim, and names what the events would have protected
    assert "with respect to adding or removing all rows of one user_id" in card and "one training example" not in card
    entries = Ledger(f"sqlite:///{tmp_path / 'l.db'}").status(json.loads((run / "metrics.json").read_text())
                                                              ["dataset_id"]).entries
    assert [e.privacy_unit for e in entries] == ["user_id"]


def test_the_report_and_model_card_of_an_unseeded_run_state_the_unit(capsys, files, tmp_path):
    code, _, err = _train(capsys, files, tmp_path, "--privacy-unit", "user_id", "--delta", "1e-3", seeded=False)
    assert code == 0, err
    from privtune.report.html import render_report
    from privtune.report.model_card import render_model_card
    from privtune.report.run import load_run

    run = load_run(tmp_path / "run")
    page = render_report(run)[0]
    assert "with respect to adding or removing all rows of one user_id" in page
    assert "add/remove all rows of one user_id" in page and "one training example" not in page
    card = render_model_card(run)
    assert "**all rows of one user_id are added or removed** (add/remove all rows of one user_id" in card


def test_example_level_certificate_keeps_its_statement(capsys, files, tmp_path):
    code, _, err = _train(capsys, files, tmp_path, "--delta", "1e-3")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "certificate.json").read_text())["neighbouring"] == "add/remove one example"


@pytest.mark.parametrize("extra, words", [
    (("--privacy-unit", "user", "--delta", "1e-3"), "privacy-unit column 'user'"),
    (("--privacy-unit", "user_id", "--delta", "0.05"), "not below 1/N_u = 1/20"),
    (("--privacy-unit", "user_id", "--sampling", "shuffle", "--delta", "1e-3"), "Poisson sampling over units"),
    (("--privacy-unit", "user_id", "--max-rows-per-unit", "0", "--delta", "1e-3"), "max_rows_per_unit"),
    (("--max-rows-per-unit", "4", "--delta", "1e-3"), "applies only with --privacy-unit"),
])
def test_refusals_come_before_the_reservation(capsys, files, tmp_path, extra, words):
    code, _, err = _train(capsys, files, tmp_path, *extra)
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], err
    assert "Traceback" not in err
    ledger_file = tmp_path / "l.db"
    assert not ledger_file.exists() or not Ledger(f"sqlite:///{ledger_file}").datasets()
    assert not (tmp_path / "run" / "certificate.json").exists()


def test_mixing_example_and_user_level_spends_on_one_file_is_refused(capsys, files, tmp_path):
    assert _train(capsys, files, tmp_path, "--delta", "1e-3")[0] == 0
    code, _, err = _train(capsys, files, tmp_path, "--privacy-unit", "user_id", "--delta", "1e-3", "--output",
                          str(tmp_path / "run2"))
    assert code != 0 and "cannot be composed" in err and "Nothing was charged" in err


def test_a_user_level_run_resumes_exactly(files, tmp_path, monkeypatch):
    """Last-layer (cached features) at user level, interrupted after a mid-training checkpoint and resumed: the
    release equals an uninterrupted run's (the unit sampler's two generators are in the checkpoint)."""
    import torch

    from privtune._release import FAULT_ENV, InjectedFault
    from privtune.training import train

    def args(tag):
        return dict(device="cpu", eval_data=files["eval"], model=str(files["model"]), mode="last-layer",
                    labels=["0", "1"], epsilon=2.0, delta=1e-3, steps=4, batch_size=6, seed=0, progress=False,
                    ledger=f"sqlite:///{tmp_path / (tag + '.db')}", output_dir=str(tmp_path / tag),
                    checkpoint_every=1, privacy_unit="user_id", max_rows_per_unit=2)

    ref = train(files["train"], **args("ref"))
    monkeypatch.setenv(FAULT_ENV, "mid-training")
    with pytest.raises(InjectedFault):
        train(files["train"], **args("cut"))
    monkeypatch.delenv(FAULT_ENV)
    res = train(files["train"], resume=True, **args("cut"))
    a, b = ref.model.state_dict(), res.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert res.certificate.neighbouring == "add/remove all rows of one user_id"
