"""privtune.training.train and the `privtune train` / `privtune predict` commands."""

from __future__ import annotations

import json

import pytest
import torch

import privtune.training as training
from privtune.errors import DataError, InvalidParameterError, ModelError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files
from privtune.training import train



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("train"), {"train": ("train.tsv", 80, 0), "eval": ("dev.tsv", 24, 1)})


def _run(files, tmp_path, **kw):
    args = dict(eval_data=files["eval"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3,
                steps=4, batch_size=20, learning_rate=1e-2, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                output_dir=tmp_path / "run", seed=0, progress=False, labels=[0, 1])
    args.update(kw)
    return train(files["train"], **args)


def test_train_writes_run_dir_and_charges_ledger(files, tmp_path):
    r = _run(files, tmp_path)
    out = tmp_path / "run"
    for name in ("model/config.json", "model/privtune_classifier.json", "certificate.json", "metrics.json",
                 "history.json", "config.yaml", "log.txt"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoints").exists()
    cert = json.loads((out / "certificate.json").read_text())
    assert {"epsilon", "delta", "events"} <= set(cert)
    assert cert["epsilon"] <= 2.0 + 1e-9 and cert["epsilon"] > 1.9
    assert cert["events"][0]["kind"] == "dpsgd" and cert["events"][0]["steps"] == 4
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["mode"] == "bitfit" and 0 <= metrics["accuracy"] <= 1
    assert metrics["hyperparameters"]["batch_size"] == 20 and metrics["reported_split"] == "dev.tsv"
    hist = json.loads((out / "history.json").read_text())
    # the noise-free batch loss is NOT PRIVATE: kept out of the released history.json
    assert "train_loss" not in hist["final_run"] and "NOT PRIVATE" in hist["final_run"]["train_loss_note"]
    private = json.loads((out / "not_private" / "history.json").read_text())
    assert len(private["final_run"]["train_loss"]) == 4 and "NOT PRIVATE" in private["final_run"]["train_loss_label"]
    led = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    st = led.status(metrics["dataset_id"])
    assert st.spent_epsilon == pytest.approx(cert["epsilon"], rel=1e-6)
    from privtune.accounting import verify_certificate

    assert verify_certificate(out / "certificate.json").epsilon == pytest.approx(cert["epsilon"])
    assert r.certificate.epsilon == pytest.approx(cert["epsilon"])


def test_noise_multiplier_instead_of_epsilon(files, tmp_path):
    r = _run(files, tmp_path, epsilon=None, noise_multiplier=3.0, mode="last-layer", output_dir=None)
    assert r.events[0].noise_multiplier == 3.0 and r.output_dir is None
    assert r.metrics["epsilon"] > 0


def _ledger_datasets(tmp_path):
    return Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets()


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"mode": "bias"}, InvalidParameterError, "mode"),
        ({"noise_multiplier": 1.0}, InvalidParameterError, "exactly one"),
        ({"epsilon": -1.0}, InvalidParameterError, "epsilon"),
        ({"epochs": 1.0}, InvalidParameterError, "either `epochs` or `steps`"),
        ({"batch_size": 1000}, InvalidParameterError, "batch_size"),
        ({"delta": 0.5}, InvalidParameterError, "delta"),
        ({"model": "/nonexistent/model"}, ModelError, "does not exist"),
        ({"label_column": "stars"}, DataError, "stars"),
        ({"eval_data": "/nonexistent.tsv"}, DataError, "does not exist"),
    ],
)
def test_bad_input_fails_before_any_budget_is_spent(files, tmp_path, kw, exc, match):
    with pytest.raises(exc, match=match):
        _run(files, tmp_path, **kw)
    assert _ledger_datasets(tmp_path) == []
    assert not (tmp_path / "run" / "certificate.json").exists()


def test_single_class_data_trains_with_a_declared_label_set(files, tmp_path):
    # which classes the private rows contain must not decide whether the run happens (a membership oracle)
    p = tmp_path / "one.tsv"
    p.write_text("label\tsentence\n1\tgood\n1\tgreat\n1\tnice film\n", encoding="utf-8")
    r = train(p, model=files["model"], mode="last-layer", noise_multiplier=1.0, delta=1e-3, steps=1, batch_size=2,
              ledger=f"sqlite:///{tmp_path/'l.db'}", progress=False, labels=[0, 1])
    assert r.model.num_labels == 2


def test_budget_exceeded_in_ledger(files, tmp_path):
    from privtune.errors import BudgetExceededError

    _run(files, tmp_path)  # registers the dataset with total ε = 2 and spends it
    with pytest.raises(BudgetExceededError):
        _run(files, tmp_path, output_dir=tmp_path / "run2")
    assert not (tmp_path / "run2" / "certificate.json").exists()


def test_resume_is_bit_for_bit(files, tmp_path, monkeypatch):
    # on the CPU: bit-for-bit is a CPU promise (on the H100 the resumed weights differed from the uninterrupted
    # run's: CUDA sums some gradients, the embeddings' among them, in a non-deterministic order)
    common = dict(steps=6, mode="full", epsilon=4.0, checkpoint_every=1, seed=11, device="cpu")
    ref = _run(files, tmp_path, ledger=f"sqlite:///{tmp_path / 'ref.db'}", output_dir=tmp_path / "ref", **common)

    real_step = training._Loop._one_step

    def crashing_step(self):
        if self.step == 3:
            raise RuntimeError("simulated crash")
        return real_step(self)

    monkeypatch.setattr(training._Loop, "_one_step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(files, tmp_path, output_dir=tmp_path / "cut", **common)
    assert (tmp_path / "cut" / "checkpoints" / "checkpoint.pt").is_file()
    monkeypatch.setattr(training._Loop, "_one_step", real_step)
    with pytest.raises(InvalidParameterError, match="resume"):
        _run(files, tmp_path, output_dir=tmp_path / "cut", **common)  # must ask for --resume
    res = _run(files, tmp_path, output_dir=tmp_path / "cut", resume=True, **common)
    a, b = ref.model.state_dict(), res.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert res.not_private["history"]["final_run"]["train_loss"] == ref.not_private["history"]["final_run"]["train_loss"]
    assert res.certificate.epsilon == pytest.approx(ref.certificate.epsilon)
    # the ledger charged the run once
    st = Ledger(f"sqlite:///{tmp_path / 'l.db'}").status(res.metrics["dataset_id"])
    assert st.spent_epsilon == pytest.approx(res.certificate.epsilon, rel=1e-6)


def test_resume_with_other_arguments_is_refused(files, tmp_path, monkeypatch):
    real_step = training._Loop._one_step

    def crashing_step(self):
        if self.step == 2:
            raise RuntimeError("simulated crash")
        return real_step(self)

    monkeypatch.setattr(training._Loop, "_one_step", crashing_step)
    with pytest.raises(RuntimeError):
        _run(files, tmp_path, checkpoint_every=1)
    monkeypatch.setattr(training._Loop, "_one_step", real_step)
    with pytest.raises(InvalidParameterError, match="learning_rate"):
        _run(files, tmp_path, checkpoint_every=1, resume=True, learning_rate=0.5)


def test_cli_train_and_predict(files, tmp_path, capsys):
    from privtune.cli import main

    out = tmp_path / "clirun"
    rc = main(["train", "--data", str(files["train"]), "--labels", "0,1", "--eval-data", str(files["eval"]),
               "--model", str(files["model"]), "--mode", "last-layer", "--epsilon", "3", "--delta", "1e-3", "--steps", "3",
               "--batch-size", "40", "--ledger", f"sqlite:///{tmp_path / 'cli.db'}", "--output", str(out),
               "--seed", "0", "--quiet"])
    assert rc == 0
    assert "ε = 3" in capsys.readouterr().out
    assert json.loads((out / "certificate.json").read_text())["epsilon"] <= 3.0 + 1e-9
    rc = main(["predict", "--model", str(out / "model"), "--data", str(files["eval"]), "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert 0 <= obj["accuracy"] <= 1 and len(obj["predictions"]) == 24
    rc = main(["predict", "--model", str(out), "--data", str(files["eval"])])
    assert rc == 0 and "accuracy:" in capsys.readouterr().out


def test_cli_config_file_and_errors(files, tmp_path, capsys):
    from privtune.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"data: {files['train']}\nlabels: [0, 1]\nmodel: {files['model']}\nmode: bitfit\nepsilon: 2.0\ndelta: 1.0e-3\n"
                   f"steps: 2\nbatch_size: 20\nledger: sqlite:///{tmp_path / 'c.db'}\n", encoding="utf-8")
    rc = main(["train", "--config", str(cfg), "--output", str(tmp_path / "cfgrun"), "--quiet", "--mode", "last-layer"])
    assert rc == 0
    assert json.loads((tmp_path / "cfgrun" / "metrics.json").read_text())["mode"] == "last-layer"  # flag wins
    capsys.readouterr()
    rc = main(["train", "--data", str(files["train"]), "--mode", "bitfit", "--epsilon", "-1", "--output", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "epsilon" in err and err.count("\n") == 1
    rc = main(["train", "--data", str(files["train"]), "--mode", "bitfit", "--output", "x"])
    assert rc == 2 and "--epsilon" in capsys.readouterr().err
    rc = main(["train", "--data", str(tmp_path / "missing.tsv"), "--labels", "0,1", "--mode", "bitfit", "--epsilon", "1",
               "--output", str(tmp_path / "y")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc = main(["predict", "--model", str(tmp_path), "--data", str(files["eval"])])
    assert rc == 2 and "model" in capsys.readouterr().err


def test_resume_with_shuffled_batches_mid_epoch(files, tmp_path, monkeypatch):
    common = dict(steps=5, mode="last-layer", noise_multiplier=2.0, epsilon=None, sampling="shuffle",
                  batch_size=30, checkpoint_every=1, seed=3)
    ref = _run(files, tmp_path, ledger=f"sqlite:///{tmp_path / 'ref.db'}", output_dir=tmp_path / "ref", **common)
    assert ref.events[0].sampling == "shuffle"
    real_step = training._Loop._one_step

    def crashing_step(self):
        if self.step == 2:  # 80 examples / 30 per batch: the crash is inside the first epoch
            raise RuntimeError("simulated crash")
        return real_step(self)

    monkeypatch.setattr(training._Loop, "_one_step", crashing_step)
    with pytest.raises(RuntimeError):
        _run(files, tmp_path, output_dir=tmp_path / "cut", **common)
    monkeypatch.setattr(training._Loop, "_one_step", real_step)
    res = _run(files, tmp_path, output_dir=tmp_path / "cut", resume=True, **common)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, res.model.state_dict()[k]), k


def test_train_on_an_image_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from privtune.models.testing import make_tiny_image_model

    for cls, color in (("cat", (250, 10, 10)), ("dog", (10, 10, 250))):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), tuple(max(0, c - 20 * i) for c in color)).save(tmp_path / "imgs" / cls / f"{i}.png")
    for cls, color in (("cat", (240, 30, 30)), ("dog", (30, 30, 240))):  # held-out images (other shades)
        (tmp_path / "imgs_eval" / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8), color).save(tmp_path / "imgs_eval" / cls / "0.png")
    vit = make_tiny_image_model(tmp_path / "vit")
    r = train(tmp_path / "imgs", eval_data=tmp_path / "imgs_eval", model=vit, mode="bitfit", noise_multiplier=1.0,
              delta=1e-3, steps=2, batch_size=6, ledger=f"sqlite:///{tmp_path / 'l.db'}",
              output_dir=tmp_path / "run", seed=0, progress=False, labels=["cat", "dog"])
    assert r.metrics["accuracy"] is not None and (tmp_path / "run" / "model" / "preprocessor_config.json").is_file()
    from privtune.cli import main

    assert main(["predict", "--model", str(tmp_path / "run"), "--data", str(tmp_path / "imgs"), "--json"]) == 0


def test_per_layer_clipping_same_budget_different_update(files, tmp_path):
    flat = _run(files, tmp_path / "flat", mode="full", clip=0.01)
    layer = _run(files, tmp_path / "layer", mode="full", clip=0.01, per_layer_clipping=True)
    # the privacy cost does not depend on how the norm C is split over layers
    assert layer.certificate.epsilon == pytest.approx(flat.certificate.epsilon, rel=1e-12)
    assert layer.metrics["hyperparameters"]["per_layer_clipping"] is True
    wf = dict(flat.model.named_parameters())
    changed = [n for n, p in layer.model.named_parameters() if not torch.equal(p, wf[n])]
    assert changed, "per-layer clipping (C/sqrt(K) per layer, clip active) must change the trained weights"
    with pytest.raises(InvalidParameterError, match="per_layer"):
        _run(files, tmp_path / "bad", per_layer_clipping="yes")



def test_blank_texts_are_refused_before_anything_is_reserved(files, tmp_path):
    rows = open(files["train"], encoding="utf-8").read().splitlines()
    rows[3] = rows[3].split("\t")[0] + "\t   "  # data row 3: only spaces
    blank = tmp_path / "blank.tsv"
    blank.write_text("\n".join(rows) + "\n", encoding="utf-8")
    args = dict(eval_data=files["eval"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3, steps=4,
                batch_size=20, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run", progress=False,
                labels=[0, 1])
    with pytest.raises(DataError, match=r"row 3 has an empty text \(empty or only spaces; 1 row\(s\) affected\)"):
        train(str(blank), **args)
    assert not (tmp_path / "l.db").exists() or not Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets()
    assert not (tmp_path / "run").exists()
