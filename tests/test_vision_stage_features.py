"""``image_features="stages"``: a timm backbone's head reads each stage's pooled output with the final features,
each L2-normalised.  What the head reads, per-example gradients through it, examples kept independent, the choice
saved with the model and in the feature-cache key, one clear error where it cannot apply."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from privtune.cli import main
from privtune.data import ImageDataset
from privtune.errors import InvalidParameterError, ModelError
from privtune.models import load_classifier
from privtune.models.vision import build_vision_classifier

from test_engine_vision_layers import PixelsIn, _bn_with_stats, check_against_loop, require
from test_models_vision import _others_unchanged, tiny_bn_net
from test_vision_options import _idx_files, _one_error


def _timm_spec(tmp_path) -> tuple[str, nn.Module]:
    timm = require("timm")
    torch.manual_seed(0)
    src = timm.create_model("test_efficientnet", num_classes=1000).eval()
    for m in src.modules():
        if isinstance(m, nn.BatchNorm2d):
            _bn_with_stats(m)  # running statistics that are not the defaults, as in a pretrained network
    torch.save(src.state_dict(), tmp_path / "w.pth")
    src.reset_classifier(0)
    return f"timm:test_efficientnet@{tmp_path / 'w.pth'}", src


def test_the_head_reads_each_stage_mean_and_the_final_features_each_at_unit_norm(tmp_path):
    spec, src = _timm_spec(tmp_path)
    clf = load_classifier(spec, num_labels=3, seed=0, image_size=32, image_features="stages")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got = clf.features(pixel_values=x)
        final, stages = src.forward_intermediates(x)
        parts = [t.mean((2, 3)) for t in stages] + [src.forward_head(final)]
    sizes = [p.shape[1] for p in parts]
    assert len(parts) > 2 and got.shape == (2, sum(sizes)) and clf.head.in_features == sum(sizes)
    for piece, part in zip(torch.split(got, sizes, dim=1), parts):
        assert torch.allclose(piece.norm(dim=1), torch.ones(2), atol=1e-5)
        assert torch.allclose(piece, part / part.norm(dim=1, keepdim=True), atol=1e-6)
    final_only = load_classifier(spec, num_labels=3, seed=0, image_size=32)
    assert final_only.head.in_features == src.num_features  # the default is unchanged


def test_examples_stay_independent_and_per_example_gradients_match_the_loop(tmp_path):
    spec, _ = _timm_spec(tmp_path)
    clf = load_classifier(spec, num_labels=3, seed=0, image_size=16, image_features="stages")
    clf.train()  # BatchNorm stays in eval mode
    changed, others_same = _others_unchanged(clf, 16)
    assert changed and others_same
    model = PixelsIn(clf.double())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64)
    check_against_loop(model, x, torch.tensor([0, 1, 2, 1]), kinds=["conv", "batchnorm", "linear"])


def test_the_choice_is_saved_with_the_model_and_a_different_one_is_refused(tmp_path):
    spec, _ = _timm_spec(tmp_path)
    clf = load_classifier(spec, num_labels=3, seed=0, image_size=32, image_features="stages")
    clf.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["privtune_vision"]["features"] == "stages"
    again = load_classifier(tmp_path / "saved")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert again.backbone.features == "stages" and torch.allclose(again(pixel_values=x), clf(pixel_values=x))
    with pytest.raises(InvalidParameterError, match="image_features.*differs from the saved model's own"):
        load_classifier(tmp_path / "saved", image_features="final")


def test_where_stage_features_cannot_apply_one_clear_error(tmp_path):
    with pytest.raises(ModelError, match="forward_intermediates.*timm backbone.*image_features='final'"):
        build_vision_classifier(tiny_bn_net().eval(), 2, image_size=16, image_features="stages")
    with pytest.raises(InvalidParameterError, match=r"`image_features` must be one of 'final', 'stages'"):
        build_vision_classifier(tiny_bn_net().eval(), 2, image_size=16, image_features="layers")
    from privtune.models.testing import make_toy_text_files

    files = make_toy_text_files(tmp_path, {"train": ("train.tsv", 20, 0)})
    with pytest.raises(InvalidParameterError, match="applies to the vision backbones.*--image-features"):
        load_classifier(files["model"], num_labels=2, image_features="stages")


def test_the_feature_cache_keys_final_and_stage_features_apart(tmp_path):
    from privtune.finetune.last_layer import cache_features

    spec, _ = _timm_spec(tmp_path)
    rng = np.random.default_rng(0)
    ds = ImageDataset(images=[Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)) for _ in range(3)],
                      labels=[0, 1, 0])
    final = cache_features(load_classifier(spec, num_labels=2, image_size=16), ds, cache_dir=tmp_path / "c")
    stages = cache_features(load_classifier(spec, num_labels=2, image_size=16, image_features="stages"), ds,
                            cache_dir=tmp_path / "c")
    assert final.features.shape[1] < stages.features.shape[1]
    assert len(list((tmp_path / "c").glob("*.pt"))) == 2


def test_cli_flag_reaches_the_model_config_yaml_and_card_and_a_bad_value_is_one_error(tmp_path, capsys):
    spec, _ = _timm_spec(tmp_path)
    data = _idx_files(tmp_path / "data")
    common = ["--data", str(data), "--model", spec, "--mode", "last-layer", "--labels", "0,1,2", "--epsilon", "8",
              "--delta", "1e-3", "--image-size", "16", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--quiet"]
    assert main(["train", *common, "--output", str(tmp_path / "bad"), "--image-features", "stage"]) == 2
    assert "Did you mean 'stages'" in _one_error(capsys)
    assert not (tmp_path / "bad").exists()
    run = tmp_path / "run"
    assert main(["train", *common, "--steps", "2", "--batch-size", "16", "--output", str(run), "--seed", "0",
                 "--image-features", "stages"]) == 0
    capsys.readouterr()
    assert json.loads((run / "model" / "config.json").read_text())["privtune_vision"]["features"] == "stages"
    assert "image_features: stages" in (run / "config.yaml").read_text()
    assert "image_features: stages" in (run / "model" / "README.md").read_text()
    assert load_classifier(run / "model").backbone.features == "stages"
    from privtune.models import vision
    from privtune.report import model_card

    assert model_card.VISION_CONFIG_KEY == vision.VISION_CONFIG_KEY  # the card reads what the model writes
