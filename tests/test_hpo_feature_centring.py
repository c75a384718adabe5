"""A head on frozen image features reads them centred (by the public mean, or a charged private mean) and
re-normalised to norm 1; the released classifier applies the same map to its pooled features, keeps it through
save and load, and a model that keeps its own head or a text model keeps centring alone (folded into the bias)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from privtune.data import ImageDataset
from privtune.finetune import apply_mode, cache_features
from privtune.hpo import _heads
from privtune.hpo.backends import (FeatureBackend, centred_features, head_into_classifier,
                                   renormalizes_centred_features)
from privtune.models import load_classifier
from privtune.models.vision import build_vision_classifier

from test_engine_vision_layers import require
from test_models_vision import tiny_bn_net


def _images(n: int, seed: int = 0) -> ImageDataset:
    rng = np.random.default_rng(seed)
    return ImageDataset(images=[Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)) for _ in range(n)],
                        labels=[i % 3 for i in range(n)])


def test_centred_rows_are_renormalised_and_a_row_at_the_centre_stays_zero():
    X = torch.tensor([[4.0, 5.0], [1.0, 1.0], [2.0, 0.5]])
    c = torch.tensor([1.0, 1.0])
    out = centred_features(X, c, renormalize=True)
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8])) and torch.equal(out[1], torch.zeros(2))
    assert torch.allclose(out.norm(dim=1), torch.tensor([1.0, 0.0, 1.0]))
    assert torch.equal(centred_features(X, c, renormalize=False), X - c)
    assert centred_features(X, None, renormalize=True) is X


def test_which_models_renormalise():
    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16)
    apply_mode(clf, "last-layer")
    assert renormalizes_centred_features(clf, "image")
    assert not renormalizes_centred_features(clf, "text")      # measured on images only
    clf.normalize = False
    assert not renormalizes_centred_features(clf, "image")     # raw features: centring alone, in the bias
    clf.normalize, clf.pooling = True, "model"
    assert not renormalizes_centred_features(clf, "image")     # an own head: no place for the map


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_released_classifier_computes_what_the_backend_scored(renormalize):
    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16)
    apply_mode(clf, "last-layer")
    ds = _images(8)
    X = cache_features(clf, ds).features
    center = X[:4].mean(0)
    g = torch.Generator().manual_seed(0)
    head = _heads.LinearHead(torch.randn(3, X.shape[1], generator=g), torch.randn(3, generator=g))
    backend = FeatureBackend(X, torch.tensor(ds.labels), 3, center=center, renormalize=renormalize)
    expected = backend.logits(head, X)
    head_into_classifier(clf, head, center, renormalize)
    assert (clf.feature_center is not None) == renormalize
    with torch.no_grad():
        got = clf(**clf.encode(ds))
    assert torch.allclose(got, expected, atol=1e-5)
    head_into_classifier(clf, head, None)  # a later head without centring clears the model's own
    assert clf.feature_center is None


def test_the_feature_centre_survives_save_and_load(tmp_path):
    timm = require("timm")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    weights = tmp_path / "w.safetensors"
    save_file(timm.create_model("test_efficientnet", num_classes=1000).state_dict(), str(weights))
    clf = load_classifier(f"timm:test_efficientnet@{weights}", num_labels=3, seed=0)
    apply_mode(clf, "last-layer")
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        center = clf.features(pixel_values=x).mean(0)
    head = _heads.LinearHead(torch.randn(3, clf.num_features), torch.zeros(3))
    head_into_classifier(clf, head, center, renormalize=True)
    clf.save_pretrained(tmp_path / "saved")
    again = load_classifier(tmp_path / "saved")
    assert torch.equal(again.feature_center, clf.feature_center)
    with torch.no_grad():
        assert torch.allclose(again(pixel_values=x), clf(pixel_values=x), atol=1e-6)
    (tmp_path / "saved" / "privtune_feature_center.safetensors").write_bytes(b"junk")
    from privtune.errors import ModelError

    with pytest.raises(ModelError, match="feature centre .* is missing or unreadable"):
        load_classifier(tmp_path / "saved")
