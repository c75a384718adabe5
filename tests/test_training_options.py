"""Options of `privtune train` / `privtune predict` beyond the basics: unlabelled prediction files, click
usage errors on one line, label contiguity, recorded seeds, shuffling accounted as Poisson only when
asked, LoRA flags, and the device option (plumbing tested on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from privtune.errors import DataError, InvalidParameterError, ModelError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_dataset, make_toy_text_files
from privtune.training import fit, train
from privtune.specs import NoiseSpec, OptimizerSpec



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("opts"), {"train": ("train.tsv", 60, 0), "eval": ("dev.tsv", 12, 1)})


def _run(files, tmp_path, **kw):
    args = dict(eval_data=files["eval"], model=files["model"], mode="last-layer", epsilon=2.0, delta=1e-3,
                steps=3, batch_size=20, learning_rate=1e-2, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                output_dir=tmp_path / "run", seed=0, progress=False, device="cpu", labels=[0, 1])
    data = kw.pop("data", files["train"])
    args.update(kw)
    return train(data, **args)


def _cli(capsys, *argv):
    from privtune.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def trained(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    _run(files, out.parent, output_dir=out)
    return out


# ------------------------------------------------------------------------------ 1. unlabelled prediction


@pytest.mark.parametrize("suffix, header, sep", [(".tsv", "sentence", "\t"), (".csv", "text", ",")])
def test_predict_on_a_single_text_column(files, trained, tmp_path, capsys, suffix, header, sep):
    p = tmp_path / f"nolabel{suffix}"
    p.write_text(header + "\n" + "\n".join(["good great film", "awful boring plot", "the movie"]) + "\n",
                 encoding="utf-8")
    rc, out, err = _cli(capsys, "predict", "--model", trained / "model", "--data", p, "--json", "--device", "cpu")
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["n"] == 3 and len(obj["predictions"]) == 3 and len(obj["probabilities"]) == 3
    assert "accuracy" not in obj
    rc, out, err = _cli(capsys, "predict", "--model", trained, "--data", p)
    assert rc == 0 and "accuracy" not in out and len(out.strip().splitlines()) == 4  # header + 3 rows


def test_training_still_needs_a_label_column(files, tmp_path):
    p = tmp_path / "nolabel.tsv"
    p.write_text("sentence\ngood\nbad\n", encoding="utf-8")
    with pytest.raises(DataError, match="single column"):
        _run(files, tmp_path, data=p)
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []


# ------------------------------------------------------------------------------ 2. click usage errors


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--mode", "nonsense"], ["--mode", "nonsense", "bitfit"]),
        (["train", "--steps", "abc"], ["--steps", "abc", "integer"]),
        (["predict", "--model", "m", "--data", "d", "--batch-size", "x"], ["--batch-size", "integer"]),
        (["train", "--no-such-flag"], ["--no-such-flag"]),
    ],
)
def test_click_usage_errors_are_one_line(capsys, argv, words):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Usage:" not in err and "Try " not in err
    for w in words:
        assert w in err


# ------------------------------------------------------------------------------ 3. label contiguity


def test_labels_outside_the_declared_set_are_refused_without_their_value(files, tmp_path, capsys):
    p = tmp_path / "gap.tsv"
    p.write_text("label\tsentence\n" + "".join(f"{7 if i % 2 else 0}\ttext {i}\n" for i in range(20)),
                 encoding="utf-8")
    with pytest.raises(DataError, match=r"row 2 .*not among the declared classes .*0\.\.1 \(10 row\(s\)") as e:
        _run(files, tmp_path, data=p)
    assert "7" not in str(e.value).replace(str(p), "") and "text 1" not in str(e.value)
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []
    rc, _, err = _cli(capsys, "train", "--data", p, "--labels", "0,1", "--mode", "bitfit", "--epsilon", "1",
                      "--output", tmp_path / "x", "--model", files["model"], "--device", "cpu")
    assert rc == 2 and err.count("\n") == 1 and "declared classes" in err
    # a declared class count: absent classes are then a deliberate choice, not inferred from the rows
    from privtune.data import TextDataset, load_text_dataset

    assert load_text_dataset(p, labels=list(range(8))).num_labels == 8
    # public files loaded without a declaration still refuse integer labels with gaps (no values shown)
    with pytest.raises(DataError, match=r"skip at least one class index"):
        load_text_dataset(p)
    with pytest.raises(DataError, match="num_labels=K"):
        TextDataset(texts=["a", "b"], labels=[0, 2])
    assert TextDataset(texts=["a", "b"], labels=[0, 2], num_labels=3).num_labels == 3


# ------------------------------------------------------------------------------ 4. seeds in the certificate


def test_certificate_records_the_explicit_seed_or_os_seeding(files, tmp_path):
    _run(files, tmp_path, seed=123, output_dir=tmp_path / "seeded")
    seeds = json.loads((tmp_path / "seeded" / "certificate.json").read_text())["metadata"]["seeds"]
    assert seeds["explicit_seed"] == 123 and seeds["sampler"] == 123 and seeds["noise"] == 124
    assert seeds["noise_seed_source"].startswith("explicit seed")
    _run(files, tmp_path, seed=None, output_dir=tmp_path / "os", ledger=f"sqlite:///{tmp_path / 'l2.db'}")
    seeds = json.loads((tmp_path / "os" / "certificate.json").read_text())["metadata"]["seeds"]
    assert seeds["explicit_seed"] is None and seeds["sampler"] is None and seeds["noise"] is None
    assert seeds["noise_seed_source"].startswith("OS entropy")


# ------------------------------------------------------------------------------ 5. shuffling and assume_poisson


def test_shuffle_is_accounted_without_amplification_unless_assumed(files, tmp_path, capsys):
    common = dict(sampling="shuffle", epsilon=None, noise_multiplier=1.0, steps=6, batch_size=19)  # 60 mod 19 = 3
    plain = _run(files, tmp_path, output_dir=tmp_path / "plain", **common)
    assumed = _run(files, tmp_path, output_dir=tmp_path / "assumed", assume_poisson=True,
                   ledger=f"sqlite:///{tmp_path / 'l2.db'}", **common)
    assert plain.events[0].assume_poisson is False and assumed.events[0].assume_poisson is True
    assert assumed.certificate.epsilon < plain.certificate.epsilon  # amplification claimed only when assumed
    cert = json.loads((tmp_path / "assumed" / "certificate.json").read_text())
    assert cert["events"][0]["sampling"] == "shuffle" and cert["events"][0]["assume_poisson"] is True
    assert any("AS IF Poisson" in n for n in cert["notes"])
    assert any("ASSUMED" in a for a in cert["sampling_assumptions"])
    assert cert["metadata"]["assume_poisson"] is True
    plain_cert = json.loads((tmp_path / "plain" / "certificate.json").read_text())
    assert any("no amplification" in a for a in plain_cert["sampling_assumptions"])
    from privtune.accounting import verify_certificate

    assert verify_certificate(tmp_path / "assumed" / "certificate.json").epsilon == pytest.approx(
        assumed.certificate.epsilon)
    # the effective config keeps the assumption, and the CLI flag / YAML key reach the same run
    assert "assume_poisson: true" in (tmp_path / "assumed" / "config.yaml").read_text()
    rc, out, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--model", files["model"], "--mode", "last-layer",
                        "--noise-multiplier", "1", "--delta", "1e-3", "--steps", "6", "--batch-size", "20",
                        "--sampling", "shuffle", "--assume-poisson", "--ledger", f"sqlite:///{tmp_path / 'l3.db'}",
                        "--output", tmp_path / "cli", "--seed", "0", "--quiet", "--device", "cpu")
    assert rc == 0, err
    assert json.loads((tmp_path / "cli" / "certificate.json").read_text())["events"][0]["assume_poisson"] is True


def test_shuffled_train_refuses_sizes_the_accounting_does_not_cover(files, tmp_path):
    # 60 examples in batches of 20: adding one example opens a 4th batch per epoch
    with pytest.raises(InvalidParameterError, match=r"60 mod 20 = 0.*19 \(sample_rate 19/60\)"):
        _run(files, tmp_path, sampling="shuffle", epsilon=None, noise_multiplier=1.0, steps=6, batch_size=20)


def test_assume_poisson_needs_shuffling(files, tmp_path, capsys):
    with pytest.raises(InvalidParameterError, match="assume_poisson.*sampling='shuffle'"):
        _run(files, tmp_path, assume_poisson=True)
    with pytest.raises(InvalidParameterError, match="assume_poisson"):
        _run(files, tmp_path, assume_poisson="yes", sampling="shuffle")
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []
    rc, _, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--mode", "bitfit", "--epsilon", "1",
                      "--output", tmp_path / "x", "--assume-poisson")
    assert rc == 2 and err.count("\n") == 1 and "shuffle" in err
    cfg = tmp_path / "run.yaml"
    cfg.write_text("assume_poisson: 3\n", encoding="utf-8")
    rc, _, err = _cli(capsys, "train", "--config", cfg, "--data", files["train"], "--labels", "0,1", "--mode", "bitfit",
                      "--epsilon", "1", "--output", tmp_path / "y")
    assert rc == 2 and "assume_poisson" in err
    from privtune.data import load_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    m = load_classifier(files["model"], seed=0)
    apply_mode(m, "last-layer")
    ds = load_dataset(files["train"])
    with pytest.raises(InvalidParameterError, match="assume_poisson"):
        fit(m, ds, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1, assume_poisson=True),
            optimizer=OptimizerSpec(learning_rate=0.1), device="cpu")
    r = fit(m, ds,
            noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1, sampling="shuffle", assume_poisson=True),
            optimizer=OptimizerSpec(learning_rate=0.1), device="cpu")
    assert r.events[0].assume_poisson is True and r.events[0].sampling == "shuffle"


# ------------------------------------------------------------------------------ 6. LoRA options


def test_lora_flags_reach_the_adapters(files, tmp_path, capsys):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    rc, _, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--model", files["model"], "--mode", "lora",
                      "--epsilon", "2", "--delta", "1e-3", "--steps", "2", "--batch-size", "20",
                      "--lora-rank", "3", "--lora-alpha", "6", "--lora-target-modules", "query, key",
                      "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", out, "--seed", "0", "--quiet",
                      "--device", "cpu")
    assert rc == 0, err
    hyper = json.loads((out / "metrics.json").read_text())["hyperparameters"]
    assert (hyper["lora_rank"], hyper["lora_alpha"], hyper["lora_target_modules"]) == (3, 6.0, ["query", "key"])
    merged = json.loads((out / "model" / "privtune_classifier.json").read_text())["lora_merged"]
    assert merged == {"r": 3, "alpha": 6.0, "target_modules": ["query", "key"]}
    # the effective config reloads with --config (lists and all)
    from privtune.config import resolve_options

    opts = resolve_options("train", out / "config.yaml", {})
    assert opts["lora_target_modules"] == ["query", "key"] and opts["lora_rank"] == 3
    # the same keys from the Python API: adapters have the requested rank on the requested modules only
    r = _run(files, tmp_path, mode="lora", lora_rank=2, lora_alpha=4.0, lora_target_modules=["value"],
             output_dir=None, ledger=f"sqlite:///{tmp_path / 'l2.db'}")
    shapes = {n: tuple(p.shape) for n, p in r.model.named_parameters() if "lora_A" in n}
    assert shapes and all(n.split(".lora_A")[0].endswith("value") for n in shapes)
    assert all(s[0] == 2 for s in shapes.values())


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-rank", "0"], ["lora_rank", "[1, inf)"]),
        (["--lora-alpha", "-1"], ["lora_alpha"]),
        (["--lora-target-modules", "querry"], ["['querry']", "match no module", "query", "value"]),
        (["--lora-target-modules", ","], ["lora_target_modules"]),
    ],
)
def test_bad_lora_options_fail_before_any_budget(files, tmp_path, capsys, flags, words):
    pytest.importorskip("peft")
    rc, _, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--model", files["model"], "--mode", "lora",
                      "--epsilon", "1", "--delta", "1e-3", "--ledger", f"sqlite:///{tmp_path / 'l.db'}",
                      "--output", tmp_path / "x", "--quiet", "--device", "cpu", *flags)
    assert rc == 2 and err.count("\n") == 1, err
    for w in words:
        assert w in err
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []


def test_lora_options_need_lora_mode(files, tmp_path):
    with pytest.raises(InvalidParameterError, match="lora_rank.*only applies to mode='lora'"):
        _run(files, tmp_path, mode="bitfit", lora_rank=4)
    with pytest.raises(InvalidParameterError, match="lora_rank"):
        _run(files, tmp_path, mode="lora", lora_rank=0)
    with pytest.raises(InvalidParameterError, match="lora_target_modules"):
        _run(files, tmp_path, mode="lora", lora_target_modules=[])
    with pytest.raises(ModelError, match="match no module"):
        _run(files, tmp_path, mode="lora", lora_target_modules="nothing_here")
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []


# ------------------------------------------------------------------------------ 10. device


def test_device_cpu_explicit_and_recorded(files, tmp_path):
    r = _run(files, tmp_path, mode="bitfit", device="cpu")
    assert r.metrics["device"] == "cpu" and r.certificate.metadata["device"] == "cpu"
    assert all(p.device.type == "cpu" for p in r.model.parameters())
    assert "device: cpu" in (tmp_path / "run" / "config.yaml").read_text()


def test_default_device_follows_cuda_availability(monkeypatch):
    """No device given: CUDA exactly when torch says it is available (both answers checked on any machine)."""
    from privtune.models import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")


def test_a_run_without_a_device_trains_on_the_cpu_when_cuda_is_absent(files, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = _run(files, tmp_path, device=None, output_dir=None)
    assert r.metrics["device"] == "cpu" and r.certificate.metadata["device"] == "cpu"
    assert all(p.device.type == "cpu" for p in r.model.parameters())


@pytest.mark.parametrize("device, match", [("tpu", "device"), ("", "device"), (3, "device"), ("meta", "not supported")])
def test_unknown_device_is_a_clear_error(files, tmp_path, device, match):
    with pytest.raises(InvalidParameterError, match=match):
        _run(files, tmp_path, device=device)
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: 'cuda' is a valid device here")
def test_cuda_requested_without_cuda(files, tmp_path, capsys):
    with pytest.raises(InvalidParameterError, match="CUDA is not available.*device='cpu'"):
        _run(files, tmp_path, device="cuda")
    from privtune.models import load_classifier

    m = load_classifier(files["model"], seed=0)
    from privtune.finetune import apply_mode

    apply_mode(m, "bitfit")
    with pytest.raises(InvalidParameterError, match="CUDA is not available"):
        fit(m, make_toy_text_dataset(8), noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
            optimizer=OptimizerSpec(learning_rate=0.1), device="cuda:0")
    rc, _, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--mode", "bitfit", "--epsilon", "1",
                      "--output", tmp_path / "x", "--device", "cuda")
    assert rc == 2 and err.count("\n") == 1 and "CUDA is not available" in err
    rc, _, err = _cli(capsys, "predict", "--model", tmp_path, "--data", files["eval"], "--device", "cuda")
    assert rc == 2 and "CUDA is not available" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU-only run)")
def test_train_on_cuda_and_resume_on_cpu(files, tmp_path, monkeypatch):  # pragma: no cover - needs a GPU
    import privtune.training as training

    real_step = training._Loop._one_step

    def crashing_step(self):
        if self.step == 2:
            raise RuntimeError("simulated crash")
        return real_step(self)

    common = dict(mode="bitfit", steps=4, checkpoint_every=1, seed=5)
    monkeypatch.setattr(training._Loop, "_one_step", crashing_step)
    with pytest.raises(RuntimeError):
        _run(files, tmp_path, device="cuda", **common)
    monkeypatch.setattr(training._Loop, "_one_step", real_step)
    r = _run(files, tmp_path, device="cpu", resume=True, **common)  # checkpoint written on the GPU
    assert r.metrics["device"] == "cpu" and r.metrics["steps"] == 4
    g = _run(files, tmp_path, device="cuda", output_dir=tmp_path / "gpu", ledger=f"sqlite:///{tmp_path / 'g.db'}",
             **common)
    assert g.metrics["device"].startswith("cuda") and next(g.model.parameters()).is_cuda


# ------------------------------------------------------------------------------ 11. the pre-trained-layer multiplier α


def test_backbone_lr_scale_flag_is_recorded_and_reloads(files, tmp_path, capsys):
    out = tmp_path / "alpha"
    rc, _, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--model", files["model"],
                      "--mode", "full", "--epsilon", "2", "--delta", "1e-3", "--steps", "2", "--batch-size", "20",
                      "--learning-rate", "1e-2", "--backbone-lr-scale", "0.1",
                      "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", out, "--seed", "0", "--quiet",
                      "--device", "cpu")
    assert rc == 0, err
    hyper = json.loads((out / "metrics.json").read_text())["hyperparameters"]
    assert (hyper["learning_rate"], hyper["backbone_lr_scale"]) == (1e-2, 0.1)
    from privtune.config import resolve_options

    assert resolve_options("train", out / "config.yaml", {})["backbone_lr_scale"] == 0.1


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "nan"])
def test_bad_backbone_lr_scale_fails_before_any_budget(files, tmp_path, capsys, value):
    rc, _, err = _cli(capsys, "train", "--data", files["train"], "--labels", "0,1", "--model", files["model"],
                      "--mode", "full", "--epsilon", "1", "--delta", "1e-3", "--backbone-lr-scale", value,
                      "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", tmp_path / "x", "--quiet",
                      "--device", "cpu")
    assert rc == 2 and err.count("\n") == 1, err
    assert "backbone_lr_scale" in err and "(0, 1]" in err
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []


def test_backbone_lr_scale_needs_a_mode_that_trains_more_than_the_head(files, tmp_path):
    with pytest.raises(InvalidParameterError, match="backbone_lr_scale.*only applies"):
        _run(files, tmp_path, mode="last-layer", backbone_lr_scale=0.5)
    assert Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []
