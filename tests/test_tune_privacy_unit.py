"""`privtune tune --privacy-unit COLUMN`: every pilot, trial, charged score, the private feature centre and the final
run at the unit level, through the one pipeline; the certificate states the unit, `privtune account` re-verifies it,
the ledger records it; splits outside the private data must be disjoint from it by unit."""

from __future__ import annotations

import json

import pytest
import torch

import privtune
from privtune.accounting import verify_certificate
from privtune.cli import main
from privtune.errors import DataError, InvalidParameterError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files

USERS = 20  # 80 training rows, 4 per user, interleaved


def _with_units(path, name, unit_of_line):
    lines = open(path, encoding="utf-8").read().splitlines()
    out = path.parent / name
    out.write_text("\n".join([lines[0] + "\tuser_id"] + [f"{line}\t{unit_of_line(i)}" for i, line in
                                                          enumerate(lines[1:])]) + "\n", encoding="utf-8")
    return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    f = make_toy_text_files(tmp_path_factory.mktemp("tune-unit"), {"train": ("rows.tsv", 80, 0),
                                                                    "public": ("pub.tsv", 30, 1),
                                                                    "dev": ("dev.tsv", 24, 2)})
    f["train"] = _with_units(f["root"] / "rows.tsv", "train.tsv", lambda i: f"u{i % USERS}")
    f["public_units"] = _with_units(f["root"] / "pub.tsv", "public_units.tsv", lambda i: f"p{i}")
    f["public_shared"] = _with_units(f["root"] / "pub.tsv", "public_shared.tsv", lambda i: f"u{i % 3}" if i == 7
                                     else f"p{i}")  # one row of a private unit
    return f


def _tune_cli(capsys, files, tmp_path, *extra):
    argv = ["tune", "--data", files["train"], "--eval-data", files["dev"], "--model", str(files["model"]),
            "--epsilon", "3", "--delta", "1e-3", "--labels", "0,1", "--seed", "0", "--quiet",
            "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "run"), *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_tune_with_a_privacy_unit_certifies_at_the_unit_level(capsys, files, tmp_path):
    code, out, err = _tune_cli(capsys, files, tmp_path, "--public-eval-data", files["public_units"], "--mode",
                               "last-layer", "--strategy", "hyperfree", "--privacy-unit", "user_id",
                               "--max-rows-per-unit", "2")
    assert code == 0, err
    assert "privacy unit: user_id (20 units" in out
    run = tmp_path / "run"
    cert = json.loads((run / "certificate.json").read_text())
    assert cert["neighbouring"] == "add/remove all rows of one user_id"
    assert cert["metadata"]["privacy_unit"] == {"unit": "user_id", "column": "user_id", "max_rows_per_unit": 2,
                                                "num_units": USERS}
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["n_train"] == USERS and metrics["privacy_unit"]["num_units"] == USERS
    # q is a rate over units: every event's expected batch q·N_u is a whole number of units, planned from N_u
    for e in cert["events"]:
        if e.get("sample_rate") is not None and e["sample_rate"] < 1:
            assert round(e["sample_rate"] * USERS, 6) == pytest.approx(e["sample_rate"] * USERS)
    verify_certificate(run / "certificate.json")
    assert main(["account", "--certificate", str(run / "certificate.json")]) == 0
    shown = capsys.readouterr().out
    assert "VERIFIED" in shown and "all rows of one user_id" in shown
    entries = Ledger(f"sqlite:///{tmp_path / 'l.db'}").status(metrics["dataset_id"]).entries
    assert [e.privacy_unit for e in entries] == ["user_id"]
    log = (run / "log.txt").read_text()
    assert "N_u=20 units of user_id" in log and "n=80" not in log  # the number of rows is not published


def test_every_run_score_and_centre_of_a_tune_is_unit_level(files, tmp_path, monkeypatch):
    """--mode auto pilots, the charged feature centre, charged scores and the final run all work on units."""
    import importlib

    import privtune.hpo.backends as backends
    from privtune.hpo import common

    tune_mod = importlib.import_module("privtune.hpo.tune")

    fits, centres, scores = [], [], []
    real_fit, real_centre, real_score = backends.fit, tune_mod.noisy_feature_sum, common.Selector.score

    def fit(*a, **kw):
        fits.append((kw["noise"].privacy_unit, kw["noise"].max_rows_per_unit))
        return real_fit(*a, **kw)

    def centre(X, sigma, g, weights=None):
        centres.append(weights)
        return real_centre(X, sigma, g, weights=weights)

    def score(self, outputs, label=""):
        scores.append((self.row_weights, self.public_size))
        return real_score(self, outputs, label)

    monkeypatch.setattr(backends, "fit", fit)
    monkeypatch.setattr(tune_mod, "noisy_feature_sum", centre)
    monkeypatch.setattr(common.Selector, "score", score)
    # pilot both a head and a model mode (at this toy size the rule alone would train last-layer without pilots)
    monkeypatch.setattr(tune_mod, "_auto_candidates", lambda modes, n, eps, **_: ["last-layer", "bitfit"])
    r = privtune.tune(files["train"], eval_data=files["dev"], model=files["model"], mode="auto",
                      strategy="hyperfree", selection="train-accuracy", epsilon=40.0, delta=1e-3, labels=[0, 1],
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run", seed=0, quiet=True,
                      privacy_unit="user_id", max_rows_per_unit=3)
    assert r.certificate.neighbouring == "add/remove all rows of one user_id"
    pilots = [t for t in r.trials if t["phase"] == "mode-auto pilot"]
    assert len(pilots) == 2  # pilots ran, charged per unit: the model pilot's q is over the 20 units
    assert pilots[1]["hyperparameters"]["sample_rate"] == pytest.approx(5 / USERS)
    assert fits and all(u is not None and u.num_units == USERS and k == 3 for u, k in fits)
    assert centres and all(w is not None for w in centres)  # the private centre: each unit's rows sum to one
    assert scores and all(w is not None and n == USERS for w, n in scores)
    w = centres[0]
    assert float(w.sum()) == pytest.approx(USERS)  # 20 units, each of weight 1


def test_a_public_split_sharing_a_unit_is_refused_before_the_reservation(capsys, files, tmp_path):
    code, _, err = _tune_cli(capsys, files, tmp_path, "--public-eval-data", files["public_shared"], "--mode",
                             "last-layer", "--privacy-unit", "user_id")
    assert code != 0
    assert "public_eval_data" in err and "shares privacy units" in err and "Traceback" not in err
    assert "u0" not in err and "u1" not in err  # no unit is named
    assert not (tmp_path / "l.db").exists() or not Ledger(f"sqlite:///{tmp_path / 'l.db'}").list_datasets()


@pytest.mark.parametrize("kw,words", [
    ({"delta": 0.1}, "1/N_u"),
    ({"selection": "private-validation"}, "private-validation"),
    ({"privacy_unit": None, "max_rows_per_unit": 2}, "max_rows_per_unit"),
    ({"privacy_unit": "nope"}, "not found"),
])
def test_unit_refusals_come_before_the_reservation(files, tmp_path, kw, words):
    args = dict(eval_data=files["dev"], model=files["model"], mode="last-layer", epsilon=3.0, delta=1e-3,
                labels=[0, 1], ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run", seed=0,
                quiet=True, privacy_unit="user_id")
    args.update(kw)
    with pytest.raises((InvalidParameterError, DataError), match=words):
        privtune.tune(files["train"], **args)
    assert not (tmp_path / "l.db").exists() or not Ledger(f"sqlite:///{tmp_path / 'l.db'}").list_datasets()
    assert not (tmp_path / "run").exists()


def test_user_level_tune_after_example_level_train_on_one_file_is_refused(capsys, files, tmp_path):
    code = main(["train", "--data", files["train"], "--model", str(files["model"]), "--mode", "last-layer",
                 "--epsilon", "1", "--delta", "1e-3", "--steps", "2", "--batch-size", "8", "--labels", "0,1",
                 "--quiet", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "t")])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    code, _, err = _tune_cli(capsys, files, tmp_path, "--mode", "last-layer", "--privacy-unit", "user_id",
                             "--public-eval-data", files["public_units"])
    assert code != 0 and "privacy unit" in err.lower() and "Traceback" not in err


def test_a_charged_score_moves_by_at_most_one_per_unit():
    """Selector with unit weights: a unit of many rows (all right, or all wrong) changes the correct-count by ≤ 1."""
    from privtune.engine.units import UnitIndex
    from privtune.hpo.common import Selector

    labels = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1])
    units = UnitIndex(["a", "b", "c", "d", "big", "big", "big", "big"])
    with_big = Selector("train_noisy", None, labels, noise_std=1e-12, seed=0, public_size=5,
                        row_weights=units.mean_weights())
    right = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1])
    wrong_big = torch.tensor([0, 1, 0, 1, 0, 0, 0, 0])
    s_right, ev = with_big.score(right)
    s_wrong, _ = with_big.score(wrong_big)
    assert (s_right - s_wrong) * 5 == pytest.approx(1.0, abs=1e-9)  # the 4-row unit moved the count by 1, not 4
    assert ev[0].noise_multiplier == pytest.approx(1e-12)
    without = Selector("train_noisy", None, labels[:4], noise_std=1e-12, seed=0, public_size=4,
                       row_weights=UnitIndex(["a", "b", "c", "d"]).mean_weights())
    assert abs(s_right * 5 - without.score(right[:4])[0] * 4) <= 1.0 + 1e-9  # removing the unit: ≤ 1


def test_the_private_centre_and_the_hyperfree_loss_are_bounded_per_unit():
    from privtune.engine.mechanisms import noisy_feature_sum
    from privtune.engine.units import UnitIndex
    from privtune.hpo.hyperfree import privatize_loss

    g = torch.Generator().manual_seed(0)
    X = torch.randn(7, 5) * 10  # rows of norm ≫ 1: each is scaled to norm 1
    units = UnitIndex(["a", "b", "big", "big", "big", "big", "big"])
    total = noisy_feature_sum(X, 0.0, g, weights=units.mean_weights()).value
    without = noisy_feature_sum(X[:2], 0.0, g, weights=UnitIndex(["a", "b"]).mean_weights()).value
    assert float((total - without).norm()) <= 1.0 + 1e-6  # the 5-row unit moves the sum by ≤ 1
    losses = torch.tensor([0.1, 0.2, 9.0, 9.0, 9.0, 9.0, 9.0], dtype=torch.float64)
    w = units.row_weights(torch.arange(7))
    s = privatize_loss(losses, 2.0, 0.0, 1.0, g, weights=w)
    assert s == pytest.approx(0.3 + 2.0)  # the unit adds the mean of its clamped losses: ≤ R_l


@pytest.mark.parametrize("mode", ["last-layer", "bitfit"])
def test_a_tune_with_one_row_per_unit_equals_example_level_exactly(files, tmp_path, mode):
    """Every row its own unit: the same plan, events, charged scores, private centre and released weights as an
    example-level tune with the same seed (the unit weights are all 1 and the unit sampler draws the same rows)."""
    def run(sub, **kw):
        return privtune.tune(files["train"], eval_data=files["dev"], model=files["model"], mode=mode,
                             strategy="hyperfree", selection="train-accuracy", epsilon=4.0, delta=1e-3,
                             labels=[0, 1], ledger=f"sqlite:///{tmp_path / sub / 'l.db'}",
                             output_dir=tmp_path / sub / "run", seed=3, quiet=True, **kw)

    example = run("example")
    unit = run("unit", privacy_unit=list(range(80)), max_rows_per_unit=1)
    assert unit.certificate.neighbouring != example.certificate.neighbouring
    assert unit.certificate.epsilon == example.certificate.epsilon
    assert [t["score"] for t in unit.trials] == [t["score"] for t in example.trials]
    for (name, a), (_, b) in zip(example.model.named_parameters(), unit.model.named_parameters()):
        assert torch.equal(a, b), name
