"""`--image-size` and `--batchnorm` (a vision backbone's input resolution and BatchNorm policy): flags of
`privtune train` and `privtune tune`, keys of the YAML configuration, checked at the boundary with one clear error
(train-mode BatchNorm refused with its reason), recorded with the model and in config.yaml."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from privtune.cli import main
from privtune.cli.config_file import check_config_file, template
from privtune.errors import InvalidParameterError
from privtune.models import load_classifier
from privtune.models.testing import make_toy_text_files

from test_data_idx import _idx_bytes, _write
from test_engine_vision_layers import require


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _idx_files(folder, n=48, classes=3):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    images = _write(folder / "train-images-idx3-ubyte.gz", _idx_bytes(rng.integers(0, 256, (n, 28, 28))))
    _write(folder / "train-labels-idx1-ubyte.gz", _idx_bytes(np.arange(n) % classes))
    return images


def _timm_weights(tmp_path) -> str:
    timm = require("timm")
    torch.manual_seed(0)
    net = timm.create_model("test_efficientnet", num_classes=1000).eval()
    torch.save(net.state_dict(), tmp_path / "w.pth")
    return f"timm:test_efficientnet@{tmp_path / 'w.pth'}"


def test_yaml_keys_are_checked_and_train_mode_batchnorm_is_refused_with_its_reason(tmp_path):
    for command in ("train", "tune"):
        assert "# image_size: 64" in template(command) and "# batchnorm: eval" in template(command)
    good = tmp_path / "good.yaml"
    good.write_text("image_size: 96\nbatchnorm: group\n")
    assert check_config_file(good, "tune")["tune"] == {"image_size": 96, "batchnorm": "group"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("batchnorm: train\n")
    with pytest.raises(InvalidParameterError, match="cannot be 'train'.*per-example gradients"):
        check_config_file(bad, "train")
    bad.write_text("image_size: 4\n")
    with pytest.raises(InvalidParameterError, match=r"`image_size` must be an integer in \[8, 4096\]"):
        check_config_file(bad, "tune")


@pytest.mark.parametrize("flags, words", [
    (["--batchnorm", "train"], "cannot be 'train'"),
    (["--batchnorm", "evl"], "Did you mean 'eval'"),
    (["--image-size", "0"], "`image_size` must be an integer in [8, 4096]"),
])
@pytest.mark.parametrize("command", ["train", "tune"])
def test_bad_values_are_one_error_before_anything_is_written_or_charged(tmp_path, capsys, flags, words, command):
    data = _idx_files(tmp_path / "data")
    args = [command, "--data", str(data), "--labels", "0,1,2", "--epsilon", "1", "--delta", "1e-3",
            "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "run"), "--quiet", *flags]
    if command == "train":
        args += ["--mode", "last-layer"]
    assert main(args) == 2
    assert words in _one_error(capsys)
    assert not (tmp_path / "run").exists() and not (tmp_path / "l.db").exists()


def test_a_text_model_refuses_the_vision_options_with_one_clear_error(tmp_path, capsys):
    files = make_toy_text_files(tmp_path, {"train": ("train.tsv", 60, 0)})
    capsys.readouterr()  # the toy model's own writing
    with pytest.raises(InvalidParameterError, match="applies to the vision backbones.*--image-size"):
        load_classifier(files["model"], num_labels=2, image_size=96)
    with pytest.raises(InvalidParameterError, match="applies to the vision backbones.*--batchnorm"):
        load_classifier(files["model"], num_labels=2, batchnorm="group")
    assert main(["train", "--data", str(files["train"]), "--model", str(files["model"]), "--mode", "last-layer",
                 "--labels", "0,1", "--epsilon", "1", "--delta", "1e-3", "--ledger", f"sqlite:///{tmp_path / 'l.db'}",
                 "--output", str(tmp_path / "run"), "--quiet", "--image-size", "96"]) == 2
    assert "--image-size" in _one_error(capsys)
    assert not (tmp_path / "run").exists()


def test_train_flags_reach_the_model_its_files_and_config_yaml(tmp_path, capsys):
    spec = _timm_weights(tmp_path)
    data = _idx_files(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--model", spec, "--mode", "bitfit", "--labels", "0,1,2",
                 "--epsilon", "8", "--delta", "1e-3", "--steps", "2", "--batch-size", "16", "--image-size", "24",
                 "--batchnorm", "group", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(run),
                 "--quiet", "--seed", "0"]) == 0
    capsys.readouterr()
    saved = json.loads((run / "model" / "config.json").read_text())["privtune_vision"]
    assert saved["image_size"] == 24 and saved["batchnorm"] == "group"
    config = (run / "config.yaml").read_text()
    assert "image_size: 24" in config and "batchnorm: group" in config
    model = load_classifier(run / "model")
    assert model.processor.image_size == 24
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    with pytest.raises(InvalidParameterError, match="differs from the saved model's own"):
        load_classifier(run / "model", image_size=32)


def test_tune_reads_the_options_from_a_config_file(tmp_path, capsys):
    spec = _timm_weights(tmp_path)
    data = _idx_files(tmp_path / "data", n=60)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"data: {data}\nmodel: '{spec}'\nmode: last-layer\nlabels: [0, 1, 2]\nepsilon: 1.0\n"
                   f"delta: 1.0e-3\nimage_size: 20\nbatchnorm: eval\nledger: sqlite:///{tmp_path / 'l.db'}\n"
                   f"output: {tmp_path / 'run'}\nquiet: true\nseed: 0\n")
    assert main(["tune", "--config", str(cfg)]) == 0
    capsys.readouterr()
    pre = json.loads((tmp_path / "run" / "model" / "privtune_image_preprocessor.json").read_text())
    assert pre["image_size"] == 20
    assert "image_size: 20" in (tmp_path / "run" / "config.yaml").read_text()
