"""Classifier loading: pooling detection, masked mean pooling, save/load round trips, images, errors."""

from __future__ import annotations

import json

import pytest
import torch

from privtune.errors import ModelError
from privtune.models import Classifier, default_model_path, load_classifier
from privtune.models.testing import make_tiny_image_model, make_tiny_text_model, make_toy_text_dataset


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    return make_tiny_text_model(tmp_path_factory.mktemp("m") / "st", sentence_transformers=True)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return make_tiny_text_model(tmp_path_factory.mktemp("m") / "plain")


def test_sentence_transformers_checkpoint_gets_mean_pooling(st_model):
    m = load_classifier(st_model, num_labels=3)
    assert isinstance(m, Classifier)
    assert m.pooling == "mean" and m.normalize is True and m.kind == "text"
    assert m.classification_head.out_features == 3
    assert getattr(m.backbone, "pooler", None) is None  # unused pooler removed (no gradient-less parameters)


def test_plain_checkpoint_uses_its_own_head(plain_model):
    m = load_classifier(plain_model)
    assert m.pooling == "model"
    assert type(m.backbone).__name__ == "BertForSequenceClassification"
    assert m.classification_head is m.backbone.classifier


def test_pooling_override(st_model, plain_model):
    assert load_classifier(st_model, pooling="cls").pooling == "cls"
    assert load_classifier(st_model, pooling="model").pooling == "model"
    m = load_classifier(plain_model, pooling="mean")
    assert m.pooling == "mean" and m.normalize is False


def test_masked_mean_pooling_ignores_padding(st_model):
    m = load_classifier(st_model)
    short, long = "good", "the movie was very good and the plot was fun"
    with torch.no_grad():
        alone = m.features(**m.encode_texts([short]))
        padded = m.features(**m.encode_texts([short, long]))[:1]
        # reference: mean over real tokens of the last hidden state, then L2 normalisation
        enc = m.encode_texts([short])
        h = m.backbone(**enc).last_hidden_state[0]
        ref = torch.nn.functional.normalize(h.mean(0), dim=0)
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone[0], ref, atol=1e-6, rtol=1e-6)


def test_bundled_minilm_is_detected_as_mean_pooling():
    path = default_model_path()
    assert (path / "config.json").is_file()
    modules = json.loads((path / "modules.json").read_text())
    assert any(m["type"].endswith("Pooling") for m in modules)
    m = load_classifier()  # offline, bundled
    assert m.pooling == "mean" and m.normalize is True and m.num_features == 384


@pytest.mark.parametrize("which", ["st", "plain"])
def test_save_and_load_round_trip(tmp_path, st_model, plain_model, which):
    m = load_classifier(st_model if which == "st" else plain_model, seed=0, label_names=["neg", "pos"])
    with torch.no_grad():
        for p in m.classification_head.parameters():
            p.add_(0.5)
    ds = make_toy_text_dataset(6)
    before = m.predict_logits(ds)
    out = m.save_pretrained(tmp_path / "saved")
    assert (out / "privtune_classifier.json").is_file() and (out / "config.json").is_file()
    again = Classifier.from_pretrained(out)
    assert again.pooling == m.pooling and again.label_names == ["neg", "pos"]
    torch.testing.assert_close(again.predict_logits(ds), before, atol=1e-5, rtol=1e-5)


def test_lora_adapters_are_merged_on_save(tmp_path, st_model):
    pytest.importorskip("peft")
    from privtune.finetune import apply_mode

    m = load_classifier(st_model, seed=0)
    apply_mode(m, "lora", lora_rank=2)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ds = make_toy_text_dataset(5)
    before = m.predict_logits(ds)
    m.save_pretrained(tmp_path / "lora")
    again = Classifier.from_pretrained(tmp_path / "lora")
    assert not any("lora_" in n for n, _ in again.named_parameters())
    torch.testing.assert_close(again.predict_logits(ds), before, atol=1e-4, rtol=1e-4)


def test_image_classifier(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    from privtune.data import ImageDataset

    path = make_tiny_image_model(tmp_path / "vit")
    m = load_classifier(path, num_labels=3)
    assert m.kind == "image" and m.pooling == "model"
    imgs = [Image.new("RGB", (10, 10), (i * 40, 0, 0)) for i in range(4)]
    ds = ImageDataset(images=imgs, labels=[0, 1, 2, 0])
    logits = m.predict_logits(ds)
    assert logits.shape == (4, 3)
    m.save_pretrained(tmp_path / "vit_saved")
    torch.testing.assert_close(Classifier.from_pretrained(tmp_path / "vit_saved").predict_logits(ds), logits)


def test_path_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_classifier(tmp_path / "missing")
    with pytest.raises(ModelError, match="Hub id"):
        load_classifier("someorg/some-model")
    with pytest.raises(ModelError, match="'smollm2-135m' is a text generator: it trains on prompt → response"):
        load_classifier("smollm2-135m")  # a generator's name where a classifier is built
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="no config.json"):
        load_classifier(tmp_path / "notamodel")
    with pytest.raises(ModelError, match="not a privtune classifier"):
        Classifier.from_pretrained(tmp_path / "notamodel")
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelError):
        load_classifier(tmp_path / "weird")


def test_bad_arguments(st_model):
    from privtune.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="pooling"):
        load_classifier(st_model, pooling="max")
    with pytest.raises(InvalidParameterError, match="num_labels"):
        load_classifier(st_model, num_labels=1)


def test_head_reads_unnormalised_features_when_the_backbone_trains(tmp_path, st_model):
    """The checkpoint's Normalize stays for a frozen backbone (last-layer) and is off when the backbone
    trains (its unit-norm features slowed DP-BiTFiT: 77.5 % vs 80.3 % dev, finetune.head_input_normalization)."""
    from privtune.finetune import apply_mode

    m = load_classifier(st_model, seed=0)
    assert m.declared_normalize is True
    for mode in ("bitfit", "full", "two-phase"):
        info = apply_mode(m, mode)
        assert m.normalize is False, mode
        assert any("not L2-normalised" in n for n in info.notes)
        with torch.no_grad():
            feats = m.features(**m.encode_texts(["a good film", "bad"]))
        assert not torch.allclose(feats.norm(dim=1), torch.ones(2))  # raw mean pooling reaches the head
    apply_mode(m, "last-layer")
    assert m.normalize is True  # what the checkpoint declares, for the frozen embedding
    apply_mode(m, "bitfit", normalize_features=True)
    assert m.normalize is True  # an explicit choice wins
    apply_mode(m, "bitfit")
    out = m.save_pretrained(tmp_path / "saved")
    again = load_classifier(out)
    assert again.normalize is False and again.declared_normalize is False  # the trained model's own setting
