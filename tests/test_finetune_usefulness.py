"""A useless model is never released without a word, and --mode auto spends nothing where it knows the answer:
the pre-run warning (n·ε where DP fine-tuning was measured at chance), the post-run warning (a model that predicts
nearly one class on a split that is not private), --mode auto without fine-tuning pilots at small n·ε, and the
refusal of mode pilots scored on a one-class public split (privtune.finetune.usefulness)."""

from __future__ import annotations

import importlib
import json
import warnings

import pytest
import torch

import privtune
import privtune.training as training
from privtune.cli import main
from privtune.errors import InvalidParameterError, OneClassModelWarning, UnlikelyToLearnWarning
from privtune.finetune import usefulness
from privtune.hpo.registry import REGISTRY
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_dataset, make_toy_text_files, write_toy_tsv

tune_mod = importlib.import_module("privtune.hpo.tune")  # the module (privtune.hpo.tune is also the function)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("usefulness")
    out = make_toy_text_files(root, {"train": ("train.tsv", 80, 0), "public": ("public.tsv", 24, 1),
                                     "dev": ("dev.tsv", 24, 2)})
    pub = make_toy_text_dataset(24, seed=1)
    ones = [i for i, y in enumerate(pub.labels) if y == 1]
    out["public_one_class"] = write_toy_tsv(root / "public_one_class.tsv", pub.subset(ones))
    return out


def _ledger(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'l.db'}"


def _train(files, tmp_path, **kw):
    args = dict(eval_data=files["dev"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3, steps=2,
                batch_size=20, ledger=_ledger(tmp_path), output_dir=tmp_path / "run", seed=0, progress=False,
                labels=[0, 1])
    args.update(kw)
    return privtune.train(files["train"], **args)


def _tune(files, tmp_path, **kw):
    args = dict(eval_data=files["dev"], public_eval_data=files["public"], model=files["model"], epsilon=2.0,
                delta=1e-3, ledger=_ledger(tmp_path), output_dir=tmp_path / "run", seed=0, quiet=True,
                labels=[0, 1])
    args.update(kw)
    return privtune.tune(files["train"], **args)


# ------------------------------------------------------------------------- the rule (public quantities only)
def test_the_rule_reads_n_times_epsilon_and_the_mode_only():
    line = usefulness.FINETUNE_AT_CHANCE_N_EPS
    assert line == 4_000  # the largest n·ε measured (4,000 SST-2 phrases at ε = 1), every DP fine-tuning at chance
    for mode in ("bitfit", "lora", "full", "two-phase"):
        assert usefulness.backbone_cannot_learn(mode, 2_000, 1.0)  # README: DP-BiTFiT 51-53 % on 2,000 at ε = 1
        assert usefulness.backbone_cannot_learn(mode, 4_000, 1.0)
        assert usefulness.backbone_cannot_learn(mode, 500, 8.0)
        assert not usefulness.backbone_cannot_learn(mode, 2_000, 8.0)  # n·ε = 16,000: DP-BiTFiT 75.9 %
        assert not usefulness.backbone_cannot_learn(mode, 20_000, 1.0)
    assert not usefulness.backbone_cannot_learn("last-layer", 10, 0.1)  # the probe: 76-77 % at n·ε = 3,000
    msg = usefulness.unlikely_to_learn_message("bitfit", 2_000, 1.0, command="train")
    assert "n·ε = 2,000" in msg and "--mode last-layer" in msg and "--mode auto" in msg and "larger ε" in msg
    assert usefulness.unlikely_to_learn_message("bitfit", 20_000, 1.0, command="train") is None


def test_majority_prediction_flags_nearly_one_class():
    check = usefulness.majority_prediction([16, 856], ["neg", "pos"], "test.csv")  # the newcomer's bitfit model
    assert check == {"split": "test.csv", "class": "pos", "share": pytest.approx(0.9817, abs=1e-4), "one_class": True}
    assert "'pos'" in usefulness.one_class_message(check) and "test.csv" in usefulness.one_class_message(check)
    balanced = usefulness.majority_prediction([400, 472], None, "dev")
    assert balanced["class"] == "1" and not balanced["one_class"] and usefulness.one_class_message(balanced) is None
    assert usefulness.majority_prediction([0, 0], None, "empty") is None


# ------------------------------------------------------------------------- train: before and after the run
def test_train_warns_before_the_reservation_and_can_be_stopped_there(files, tmp_path):
    # n·ε = 80 · 2 = 160: far below what DP fine-tuning was measured to need
    with pytest.warns(UnlikelyToLearnWarning, match=r"n·ε = 160"):
        r = _train(files, tmp_path)
    assert r.metrics["warnings"][0].startswith("mode bitfit on n = 80 private examples")
    log = (tmp_path / "run" / "log.txt").read_text()
    assert log.index("warning: mode bitfit") < log.index("registered in the ledger")  # before the reservation
    # turned into an error (as the warning class documents), the run stops before anything is charged
    other = tmp_path / "other"
    other.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnlikelyToLearnWarning)
        with pytest.raises(UnlikelyToLearnWarning):
            _train(files, tmp_path, ledger=_ledger(other), output_dir=None)
    assert Ledger(_ledger(other)).datasets() == []
    # the probe on cached features is not warned of
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnlikelyToLearnWarning)
        r = _train(files, tmp_path, mode="last-layer", output_dir=None, ledger=_ledger(other))
    assert "warnings" not in r.metrics or not any("unlikely" in w for w in r.metrics["warnings"])


def test_train_warns_after_the_run_when_the_model_predicts_one_class(files, tmp_path, monkeypatch):
    """The final model is forced to class 1 (a large head bias); the check runs on the evaluation split
    (public by declaration) through the run's own evaluation and lands in metrics.json."""
    real_run = training._Loop.run

    def run_then_force_one_class(loop, *a, **k):
        real_run(loop, *a, **k)
        head = loop.model.classification_head
        with torch.no_grad():
            head.bias.copy_(torch.tensor([-50.0, 50.0]))

    monkeypatch.setattr(training._Loop, "run", run_then_force_one_class)
    with pytest.warns(OneClassModelWarning, match=r"predicts class '1' for 100.0% of dev.tsv"):
        r = _train(files, tmp_path, mode="last-layer")
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["majority_prediction"] == {"split": "dev.tsv", "class": "1", "share": 1.0, "one_class": True}
    assert m["accuracy"] == pytest.approx(0.5) and any("predicts class '1'" in w for w in m["warnings"])
    assert "warning: the released model predicts class '1'" in (tmp_path / "run" / "log.txt").read_text()
    assert r.metrics["majority_prediction"]["one_class"]


def test_train_without_evaluation_split_makes_no_claim(files, tmp_path):
    r = _train(files, tmp_path, mode="last-layer", eval_data=None, output_dir=None)
    assert "majority_prediction" not in r.metrics  # never computed on the private training data


def test_cli_prints_the_warning_as_one_line_before_the_run(files, tmp_path, capfd):
    rc = main(["train", "--data", files["train"], "--labels", "0,1", "--eval-data", files["dev"], "--model",
               files["model"], "--mode", "bitfit", "--epsilon", "2", "--delta", "1e-3", "--steps", "2",
               "--batch-size", "20", "--ledger", _ledger(tmp_path), "--output", str(tmp_path / "run"), "--quiet"])
    out, err = capfd.readouterr()
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.startswith("warning: mode bitfit")]
    assert len(lines) == 1 and "UnlikelyToLearnWarning" not in err and "usefulness.py" not in err


def test_cli_with_the_warning_made_an_error_stops_with_one_error_line_and_nothing_charged(files, tmp_path, capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnlikelyToLearnWarning)  # what `python -W error::...` does
        rc = main(["train", "--data", files["train"], "--labels", "0,1", "--model", files["model"], "--mode", "bitfit",
                   "--epsilon", "2", "--delta", "1e-3", "--steps", "2", "--batch-size", "20",
                   "--ledger", _ledger(tmp_path), "--output", str(tmp_path / "run"), "--quiet"])
    err = capfd.readouterr().err
    assert rc == 2 and err.startswith("error: mode bitfit") and "Traceback" not in err
    assert Ledger(_ledger(tmp_path)).datasets() == []


# ------------------------------------------------------------------------- tune: the same two warnings
def test_tune_with_an_explicit_fine_tuning_mode_warns_before_the_reservation(files, tmp_path):
    with pytest.warns(UnlikelyToLearnWarning, match="mode bitfit"):
        r = _tune(files, tmp_path, mode="bitfit", steps=2, batch_size=20)
    log = (r.run_dir / "log.txt").read_text()
    assert log.index("warning: mode bitfit") < log.index("ledger: new dataset")
    assert any(w.startswith("mode bitfit") for w in r.metrics["warnings"])


def test_tune_warns_after_the_run_when_the_model_predicts_one_class(files, tmp_path, monkeypatch):
    real = tune_mod.head_into_classifier

    def forced(*a, **k):
        clf = real(*a, **k)
        with torch.no_grad():
            clf.classification_head.bias.copy_(torch.tensor([50.0, -50.0]))
        return clf

    monkeypatch.setattr(tune_mod, "head_into_classifier", forced)
    with pytest.warns(OneClassModelWarning, match="predicts class '0'"):
        r = _tune(files, tmp_path, mode="last-layer")
    m = json.loads((r.run_dir / "metrics.json").read_text())
    assert m["majority_prediction"]["one_class"] and m["majority_prediction"]["split"] == m["reported_split"]
    log = (r.run_dir / "log.txt").read_text()  # released: the warning names the split, not a path of this machine
    assert "warning: the released model predicts class '0' for 100.0% of dev.tsv" in log
    assert str(files["root"]) not in log and str(files["root"]) not in json.dumps(m)
    # without a reported split: the public split (declared public), never the training data
    with pytest.warns(OneClassModelWarning, match="the public validation split"):
        r = _tune(files, tmp_path, mode="last-layer", eval_data=None, output_dir=None, write_files=False,
                  ledger=_ledger(tmp_path / "run"))
    assert r.metrics["majority_prediction"]["split"] == "the public validation split"


# ------------------------------------------------------------------------- --mode auto at small n·ε
def test_mode_auto_runs_no_fine_tuning_pilot_where_fine_tuning_was_measured_at_chance():
    modes = REGISTRY["hyperfree"].modes
    assert tune_mod._auto_candidates(modes, 3_000, 1.0) == ["last-layer"]  # the demo: no pilots
    assert tune_mod._auto_candidates(modes, 4_000, 1.0) == ["last-layer"]
    assert tune_mod._auto_candidates(modes, 3_000, 2.0) == ["last-layer", "bitfit", "lora"]  # n·ε = 6,000
    assert tune_mod._auto_candidates(modes, 2_000, 8.0) == ["last-layer", "bitfit", "lora"]
    assert tune_mod._auto_candidates(modes, 20_000, 1.0) == ["bitfit", "full"]


def test_mode_auto_at_small_n_eps_plans_reserves_and_certifies_last_layer_alone(files, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnlikelyToLearnWarning)  # nothing to warn of: last-layer is chosen
        r = _tune(files, tmp_path, mode="auto")
    assert r.metrics["mode"] == "last-layer"
    assert not [t for t in r.trials if t["phase"] == "mode-auto pilot"]
    cert = json.loads((r.run_dir / "certificate.json").read_text())
    assert not [e for e in cert["events"] if "pilot" in str(e.get("label", ""))]
    assert any("without mode pilots" in n and "n·ε = 160" in n for n in cert["metadata"]["plan"])
    assert "without mode pilots" in (r.run_dir / "log.txt").read_text()
    st = Ledger(_ledger(tmp_path)).status(r.metrics["dataset_id"])
    assert st.spent_epsilon == pytest.approx(cert["epsilon"], rel=1e-3)


# ------------------------------------------------------------------------- --mode auto on a one-class public split
def test_mode_auto_refuses_pilots_scored_on_a_one_class_public_split(files, tmp_path, monkeypatch):
    monkeypatch.setattr(usefulness, "FINETUNE_AT_CHANCE_N_EPS", 0)  # toy data: let --mode auto pilot
    with pytest.raises(InvalidParameterError, match=r"all 12 of its examples are of class '1'.*Nothing was charged"):
        _tune(files, tmp_path, mode="auto", public_eval_data=files["public_one_class"])
    assert Ledger(_ledger(tmp_path)).datasets() == []
    rc = main(["tune", "--data", files["train"], "--labels", "0,1", "--eval-data", files["dev"], "--public-eval-data",
               files["public_one_class"], "--model", files["model"], "--epsilon", "2", "--delta", "1e-3",
               "--ledger", _ledger(tmp_path), "--output", str(tmp_path / "cli"), "--quiet"])
    assert rc == 2 and Ledger(_ledger(tmp_path)).datasets() == []
    # the same split with an explicit mode: no pilots to compare, nothing refused
    r = _tune(files, tmp_path, mode="last-layer", public_eval_data=files["public_one_class"])
    assert r.metrics["mode"] == "last-layer"
    # ... unless the strategy compares trials on it (hyperfree's η trials on a model)
    with pytest.raises(InvalidParameterError, match=r"all 12 of its examples.*cannot compare the trials of strategy "
                                                    r"'hyperfree'.*--selection private-validation"):
        _tune(files, tmp_path, mode="bitfit", public_eval_data=files["public_one_class"], output_dir=tmp_path / "b")
