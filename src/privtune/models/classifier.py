"""The :class:`Classifier` (backbone + pooling + linear head) and :func:`load_classifier`."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from privtune import __version__
from privtune._validation import check_choice, check_int
from privtune.choices import POOLING_CHOICES
from privtune.data.labels import check_label_set, describe_label_set
from privtune.errors import InvalidParameterError, ModelError
from privtune.models._lora import merged_copy
from privtune.models.backbones import (  # noqa: F401 (default_model_path: re-exported)
    default_model_path,
    public_backbone_name,
    resolve_backbone,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CLASSIFIER_CONFIG = "privtune_classifier.json"
HEAD_FILE = "privtune_head.safetensors"
#: the centre subtracted from the pooled features before they are re-normalised (:attr:`Classifier.feature_center`)
FEATURE_CENTER_FILE = "privtune_feature_center.safetensors"
FORMAT_VERSION = 1
DEFAULT_MAX_LENGTH = 128


#: the Hugging Face name of the bundled backbone (what a saved model names as its base model)
BUNDLED_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def public_model_name(source: str | os.PathLike | None) -> str | None:
    """How a saved model names its base model: a name, never a path of the machine that trained it.

    The bundled backbone is named by its Hugging Face name; a privtune model fine-tuned again keeps
    the base model its own ``privtune_classifier.json`` names; any other local directory is named by
    its last component; a name that is not a path is kept."""
    if source is None:
        return None
    text = os.fspath(source)
    if not os.path.isabs(text) and not os.path.exists(text):
        return text  # already a name (e.g. a Hugging Face id)
    path = Path(text).expanduser()
    try:
        if path.resolve() == default_model_path().resolve():
            return BUNDLED_MODEL_NAME
    except ModelError:  # the bundled package is not installed: this is not it
        pass
    cached = public_backbone_name(path)  # a backbone assembled into privtune's cache (all-mpnet-base-v2)
    if cached is not None:
        return cached
    try:
        base = json.loads((path / CLASSIFIER_CONFIG).read_text(encoding="utf-8")).get("base_model")
        if isinstance(base, str) and base and not os.path.isabs(base):
            return base
    except (OSError, ValueError, AttributeError):
        pass
    return path.resolve().name or text


def resolve_device(device: Any = None) -> torch.device:
    """The torch device to train or predict on.

    ``None`` (the default everywhere in privtune) means ``"cuda"`` when ``torch.cuda.is_available()``
    and ``"cpu"`` otherwise.  Otherwise ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a
    ``torch.device``; a device this machine does not have is an :class:`InvalidParameterError` that
    says so (never a failure deep inside torch at the first batch).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allowed = "'cpu', 'cuda', 'cuda:N' (N = GPU index), 'mps', or None (CUDA when available, else CPU)"
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str) and device.strip():
        try:
            dev = torch.device(device.strip().lower())
        except (RuntimeError, ValueError):
            raise InvalidParameterError(f"`device` must be {allowed}. Got {device!r}.") from None
    else:
        raise InvalidParameterError(f"`device` must be {allowed}. Got {device!r} ({type(device).__name__}).")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidParameterError(
                f"`device` {str(device)!r} was requested but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False: no NVIDIA GPU, no driver, or a CPU-only torch build). "
                "Pass device='cpu' (CLI: --device cpu), or omit it to use CUDA only when present."
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise InvalidParameterError(
                f"`device` {str(device)!r} names GPU {dev.index}, but this machine has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}). Pass one of those, or 'cuda'."
            )
        return dev
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise InvalidParameterError(
                f"`device` {str(device)!r} was requested but Apple MPS is not available on this machine. "
                "Pass device='cpu', or omit it."
            )
        return dev
    raise InvalidParameterError(f"`device` must be {allowed}. Got {device!r} (device type {dev.type!r} is not supported).")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off while a model loads (restored afterwards)."""
    # Lazy: transformers only when a model is built: keeps import privtune light.
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)
        if bars:
            hf_logging.enable_progress_bar()


def _sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling, normalize) from a sentence-transformers checkpoint, or None if it is not one."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    pooling_dir = None
    normalize = False
    for m in modules if isinstance(modules, list) else []:
        t = str(m.get("type", ""))
        if t.endswith(".Pooling"):
            pooling_dir = path / str(m.get("path", "1_Pooling"))
        if t.endswith(".Normalize"):
            normalize = True
    if pooling_dir is None:
        return None
    cfg_file = pooling_dir / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return ("mean", normalize)
    if cfg.get("pooling_mode_mean_tokens"):
        return ("mean", normalize)
    if cfg.get("pooling_mode_cls_token"):
        return ("cls", normalize)
    return ("mean", normalize)  # max / sqrt-len pooling: fall back to mean (documented)


def _find_native_head(model: nn.Module, num_labels: int) -> tuple[str, nn.Linear]:
    """The final nn.Linear producing ``num_labels`` outputs inside an AutoModelFor*Classification."""
    found = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.out_features == num_labels:
            found = (name, mod)
    if found is None:
        raise ModelError(
            f"Cannot find the classification head (an nn.Linear with {num_labels} outputs) of "
            f"{type(model).__name__}. Use pooling='mean' or 'cls' to put a privtune head on the backbone."
        )
    return found


class Classifier(nn.Module):
    """A sequence or image classifier: ``logits = head(pool(backbone(inputs)))``.

    Two structures, chosen by :func:`load_classifier`:

    * **pooled** (``pooling`` in ``{"mean", "cls"}``): ``backbone`` is the base model (``AutoModel``),
      features are the masked mean (or the first token) of the last hidden states, optionally
      L2-normalised (``normalize``; sentence-transformers checkpoints with a Normalize module), and
      ``head`` is a new ``nn.Linear(hidden_size, num_labels)``;
    * **model** (``pooling="model"``): ``backbone`` is ``AutoModelFor{Sequence,Image}Classification``
      and ``head`` is its own final linear layer; features are that layer's input.

    ``forward(**inputs)`` takes what :meth:`encode` returns and gives logits of shape (B, K).
    Training is done by :mod:`privtune.training`; the model itself is an ordinary ``nn.Module``.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Linear | None,
        *,
        kind: str,
        pooling: str,
        normalize: bool = False,
        num_labels: int,
        label_names: Sequence[str] | None = None,
        tokenizer: Any = None,
        processor: Any = None,
        max_length: int = DEFAULT_MAX_LENGTH,
        source: str | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.kind = kind
        self.pooling = pooling
        self.normalize = normalize
        #: what the checkpoint declares (a sentence-transformers Normalize module, or a saved privtune model's
        #: setting); ``normalize`` is what the forward pass applies, set per mode by ``finetune.apply_mode``
        self.declared_normalize = normalize
        self.num_labels = num_labels
        self.label_names = list(label_names) if label_names is not None else None
        self.tokenizer = tokenizer
        self.processor = processor
        self.max_length = max_length
        self.source = source
        self.lora_config: dict | None = None
        #: (num_features,) or None.  When set, the pooled features become ``normalize(pooled − feature_center)``:
        #: a head trained on centred, re-normalised features (``privtune tune`` on image features: the mean of
        #: the public split, or a charged private mean); a buffer, so it moves with the model, saved in its own file
        self.register_buffer("feature_center", None, persistent=False)
        if pooling == "model":
            self._head_name, native = _find_native_head(backbone, num_labels)
            self._native_head = [native]  # not registered twice
        else:
            assert head is not None
            self.head = head

    # ------------------------------------------------------------------ structure
    @property
    def classification_head(self) -> nn.Linear:
        """The final linear layer (new head for pooled models, the model's own head otherwise)."""
        return self._native_head[0] if self.pooling == "model" else self.head

    @property
    def num_features(self) -> int:
        return self.classification_head.in_features

    def backbone_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Named parameters that are not part of the classification head."""
        head_ids = {id(p) for p in self.classification_head.parameters()}
        for n, p in self.named_parameters():
            if id(p) not in head_ids:
                yield n, p

    # ------------------------------------------------------------------ inputs
    def encode(self, dataset: Any, indices: Sequence[int] | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Model inputs for rows ``indices`` of a TextDataset/ImageDataset (all rows if None)."""
        if indices is None:
            idx = list(range(len(dataset)))
        elif isinstance(indices, torch.Tensor):
            idx = indices.tolist()
        else:
            idx = [int(i) for i in indices]
        if self.kind == "text":
            if getattr(dataset, "kind", None) != "text":
                raise ModelError(f"This classifier takes text, but the data is {getattr(dataset, 'kind', type(dataset))!r}.")
            return self.encode_texts([dataset.texts[i] for i in idx])
        if getattr(dataset, "kind", None) != "image":
            raise ModelError(f"This classifier takes images, but the data is {getattr(dataset, 'kind', type(dataset))!r}.")
        return self._encode_image_rows(dataset, idx)

    def _encode_image_rows(self, dataset: Any, idx: list[int]) -> dict[str, torch.Tensor]:
        """Rows ``idx`` of an ImageDataset as ``{"pixel_values"}``: each image read (and, by privtune's
        :class:`~privtune.models.vision.ImagePreprocessor`, resized), then converted in one call.  Images of at
        least :data:`~privtune.data.host_threads.MIN_PIXELS_FOR_THREADS` pixels (the first row's decides) are
        read on the host's threads; the tensor is the one thread's, row for row."""
        from privtune.data.host_threads import MIN_PIXELS_FOR_THREADS, map_rows

        grey = bool(getattr(self.processor, "accepts_greyscale", False))
        resized = getattr(self.processor, "resized", None)
        if not idx:
            return self.encode_images([])
        first = dataset.load_image(idx[0], keep_greyscale=grey)

        def prepared(image: Any) -> Any:
            return image if resized is None else resized(image)

        def read(i: int) -> Any:
            return prepared(dataset.load_image(i, keep_greyscale=grey))

        if first.width * first.height >= MIN_PIXELS_FOR_THREADS:
            rows = [prepared(first), *map_rows(read, idx[1:])]
        else:  # small images: each one's work is mostly Python, which threads only take turns at (measured)
            rows = [prepared(first), *(read(i) for i in idx[1:])]
        if resized is None:  # another library's processor converts the images
            return self.encode_images(rows)
        return {"pixel_values": self.processor.pixels(rows)["pixel_values"].to(torch.float32)}

    def encode_texts(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def encode_images(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        enc = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": enc["pixel_values"].to(torch.float32)}

    # ------------------------------------------------------------------ forward
    @property
    def device(self) -> torch.device:
        """Device of the model's parameters (where :meth:`forward` moves its inputs)."""
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _on_device(self, inputs: dict[str, Any]) -> dict[str, Any]:
        dev = self.device
        return {k: v.to(dev) if isinstance(v, torch.Tensor) and v.device != dev else v for k, v in inputs.items()}

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            if attention_mask is None:
                pooled = hidden.mean(dim=1)
            else:
                m = attention_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-9)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        if self.feature_center is not None:
            pooled = torch.nn.functional.normalize(pooled - self.feature_center.to(pooled.dtype), p=2, dim=-1)
        return pooled

    def features(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The head's input features, shape (B, num_features), on the model's device."""
        inputs = self._on_device(inputs)
        if self.pooling == "model":
            captured: list[torch.Tensor] = []

            def hook(_mod, args):
                captured.append(args[0])

            h = self.classification_head.register_forward_pre_hook(hook)
            try:
                self.backbone(**inputs)
            finally:
                h.remove()
            feats = captured[-1]
            if feats.dim() != 2:
                raise ModelError(
                    f"The own head of {type(self.backbone).__name__} acts on {feats.dim()}-D inputs (it pools "
                    "after the head), so its features cannot be cached. Load with pooling='mean'."
                )
            return feats
        out = self.backbone(**inputs)
        return self._pool(out.last_hidden_state, inputs.get("attention_mask"))

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Logits (B, K) on the model's device; tensor inputs on another device are moved there."""
        inputs = self._on_device(inputs)
        if self.pooling == "model":
            return self.backbone(**inputs).logits
        return self.head(self.features(**inputs))

    @torch.no_grad()
    def predict_logits(self, dataset: Any, *, batch_size: int = 64) -> torch.Tensor:
        """Logits (N, K) for every row of ``dataset`` (eval mode, no gradients), on the CPU.

        The forward passes run on the model's device (move the model with ``.to(device)`` first)."""
        was_training = self.training
        self.eval()
        try:
            order = length_order(dataset)
            out = torch.empty(len(dataset), self.num_labels)
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                out[idx] = self(**self.encode(dataset, idx)).float().cpu()
            return out
        finally:
            self.train(was_training)

    # ------------------------------------------------------------------ save / load
    def _export_backbone(self) -> nn.Module:
        """The backbone with LoRA adapters merged into the base weights (a plain HF model)."""
        if self.lora_config is None:
            return self.backbone
        return merged_copy(self.backbone)

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write the classifier to a directory (HF convention; LoRA adapters are merged).

        Files: the backbone's ``config.json`` + ``model.safetensors``, the tokenizer or image
        processor, ``privtune_classifier.json`` (pooling, classes, format version) and, for pooled
        models, ``privtune_head.safetensors``.  Load with :meth:`from_pretrained`.
        """
        # Lazy: safetensors only when saving.
        from safetensors.torch import save_file

        out = Path(save_directory)
        if out.exists() and not out.is_dir():
            raise ModelError(f"`save_directory` {str(out)!r} is a file; pass a directory.")
        out.mkdir(parents=True, exist_ok=True)
        before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        bb = self._export_backbone()
        with quiet_transformers():
            bb.save_pretrained(out)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out)
            if self.processor is not None:
                self.processor.save_pretrained(out)
        head_file = center_file = None
        if self.pooling != "model":
            save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                      str(out / HEAD_FILE))
            head_file = HEAD_FILE
            if self.feature_center is not None:
                save_file({"feature_center": self.feature_center.detach().float().cpu().contiguous()},
                          str(out / FEATURE_CENTER_FILE))
                center_file = FEATURE_CENTER_FILE
        meta = {
            "format_version": FORMAT_VERSION,
            "privtune_version": __version__,
            "kind": self.kind,
            "pooling": self.pooling,
            "normalize": self.normalize,
            "num_labels": self.num_labels,
            "label_names": self.label_names,
            "max_length": self.max_length,
            "head_file": head_file,
            "feature_center_file": center_file,
            "lora_merged": self.lora_config,
            "base_model": public_model_name(self.source),
        }
        if self.kind == "image":  # no tokenizer: a text length means nothing here
            del meta["max_length"]
            if hasattr(self.backbone, "vision_config"):  # a timm/torchvision network pools by its own global mean
                del meta["pooling"]
        (out / CLASSIFIER_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        from privtune._release import public_modes  # lazy: the release helpers only when saving

        for p in out.iterdir():  # one mode for every file written: the weights are not more private than the rest
            if p.is_file() and before.get(p.name) != p.stat().st_mtime_ns:
                public_modes(p)
        return out

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "Classifier":
        """Load a classifier written by :meth:`save_pretrained`."""
        d = Path(directory).expanduser()
        if not (d / CLASSIFIER_CONFIG).is_file():
            raise ModelError(
                f"{str(d)!r} is not a privtune classifier (no {CLASSIFIER_CONFIG}). Pass RUN_DIR/model, or use "
                "load_classifier(path) for a Hugging Face backbone."
            )
        return load_classifier(d)


def length_order(dataset: Any) -> list[int]:
    """Row order that groups texts of similar length (less padding); identity for images."""
    if getattr(dataset, "kind", None) == "text":
        return sorted(range(len(dataset)), key=lambda i: len(dataset.texts[i]))
    return list(range(len(dataset)))


def _model_words(path: Any) -> str:
    """How an error names a model: the bundled one, or its directory's name (never a full local path)."""
    return "the bundled all-MiniLM-L6-v2" if path is None else repr(Path(str(path)).name or str(path))


def _is_image_config(config: Any) -> bool:
    return hasattr(config, "num_channels") and hasattr(config, "image_size") and not hasattr(config, "vocab_size")


def saved_label_set(model: Any) -> tuple[int, list[str] | None] | None:
    """The label set a model declares itself, or None: ``(num_labels, label_names)``.

    ``model`` is a loaded :class:`Classifier` (its head and names), a privtune model directory or RUN_DIR
    (``privtune_classifier.json``), a Hugging Face directory whose ``config.json`` ``id2label`` names real
    classes (``LABEL_0``/``LABEL_1`` defaults name none), or None (the bundled backbone).  Integer names
    ``0..K-1`` give ``label_names=None`` (integer classes).  An unreadable directory gives None:
    :func:`load_classifier` reports it."""
    if isinstance(model, nn.Module):
        k = getattr(model, "num_labels", None)
        if not isinstance(k, int):
            return None
        names = getattr(model, "label_names", None)
        return k, list(names) if names is not None else None
    try:
        d = resolve_backbone(model)
        if (d / "model" / CLASSIFIER_CONFIG).is_file() and not (d / CLASSIFIER_CONFIG).is_file():
            d = d / "model"
        if (d / CLASSIFIER_CONFIG).is_file():
            meta = json.loads((d / CLASSIFIER_CONFIG).read_text(encoding="utf-8"))
            names = meta.get("label_names")
            return int(meta["num_labels"]), list(names) if names is not None else None
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
        id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(id2label) < 2 or sorted(id2label) != list(range(len(id2label))):
        return None
    names = [id2label[i] for i in range(len(id2label))]
    if all(n == f"LABEL_{i}" for i, n in enumerate(names)):
        return None  # transformers' placeholder names: the config declares no classes
    return check_label_set(names, f"the id2label names in {str(d / 'config.json')!r}")


def check_model_label_set(model: nn.Module, num_labels: int, label_names: Sequence[str] | None,
                          source: str = "declared labels") -> None:
    """Refuse a model whose classes differ from the run's declared label set; a model without class
    names (integer classes) of the right size takes the declared names."""
    k = getattr(model, "num_labels", None)
    names = getattr(model, "label_names", None)
    if k is None:
        return
    if k != num_labels or (names is not None and list(names) != list(label_names or [])):
        raise ModelError(
            f"`model` has the classes {describe_label_set(k, names)} but the run's label set ({source}) is "
            f"{describe_label_set(num_labels, label_names)}. Declare the model's labels (e.g. --labels), or start "
            "from a backbone without a trained head."
        )
    if names is None and label_names is not None and hasattr(model, "label_names"):
        model.label_names = list(label_names)


#: Model families other than Hugging Face directories, as (matches(path) -> bool, load(path, num_labels, pooling,
#: label_names=, seed=) -> Classifier) pairs.  Each family's module registers itself when ``privtune.models`` is
#: imported (privtune.models.vision: efficientnet-lite0, timm:…, torchvision:…), so this module never imports them.
MODEL_FAMILIES: list[tuple[Any, Any]] = []


def register_model_family(matches, load) -> None:
    """Let :func:`load_classifier` hand the model names ``matches`` accepts to ``load``."""
    MODEL_FAMILIES.append((matches, load))


def load_classifier(
    path: str | os.PathLike | None = None,
    num_labels: int = 2,
    pooling: str = "auto",
    *,
    normalize: bool | None = None,
    label_names: Sequence[str] | None = None,
    max_length: int | None = None,
    seed: int | None = None,
    image_size: int | None = None,
    batchnorm: str | None = None,
    image_features: str | None = None,
) -> Classifier:
    """Load a classifier from a local Hugging Face checkpoint (offline).

    Parameters
    ----------
    path : path, optional
        A local model directory (``config.json`` + weights + tokenizer or image processor), or a
        directory written by :meth:`Classifier.save_pretrained`.  ``None``: the bundled
        all-MiniLM-L6-v2.  A vision backbone name (``"efficientnet-lite0"``, ``"timm:ARCH@WEIGHTS"``,
        ``"torchvision:ARCH@WEIGHTS"``) is loaded by :func:`privtune.models.vision.load_vision_classifier`
        with its defaults (64-pixel inputs, BatchNorm kept in eval mode).
    num_labels : int, default 2
        Number of classes of the new head (ignored for a saved privtune classifier).
    pooling : {"auto", "mean", "cls", "model"}, default "auto"
        ``"auto"``: mean (or CLS) pooling as declared by a sentence-transformers pooling config,
        the model's own classification head otherwise.  ``"model"`` forces the own head.
    normalize : bool, optional
        L2-normalise pooled features (default: as the sentence-transformers config says).
    label_names : list of str, optional
        Class names recorded with the model.
    max_length : int, optional
        Token truncation length for text (default 128).
    seed : int, optional
        Seed for the random initialisation of a new head.
    image_size : int, optional
        A vision backbone's input resolution in pixels (default 64, or the size a network requires).
    batchnorm : {"eval", "group"}, optional
        A vision backbone's BatchNorm policy (default "eval"; "train" is refused: see
        :mod:`privtune.models.vision`).
    image_features : {"final", "stages"}, optional
        What a vision backbone's head reads (default "final"; "stages" adds each stage's pooled output: see
        :mod:`privtune.models.vision`).  ``image_size``, ``batchnorm`` and ``image_features`` apply to the vision
        backbone names only (a Hugging Face image model resizes as its image processor says): given for another
        model, an error.

    Raises
    ------
    ModelError
        Missing path, a directory that is not a model, a hub id (downloads are disabled), an
        architecture without a classification/base model class.
    """
    check_choice(pooling, "pooling", POOLING_CHOICES)
    vision = {k: v for k, v in (("image_size", image_size), ("batchnorm", batchnorm),
                                ("image_features", image_features)) if v is not None}
    for matches, load in MODEL_FAMILIES:
        if matches(path):
            return load(path, num_labels, pooling, label_names=label_names, seed=seed, **vision)
    if vision:
        key = next(iter(vision))
        raise InvalidParameterError(
            f"`{key}` applies to the vision backbones (efficientnet-lite0, timm:ARCH@WEIGHTS, "
            f"torchvision:ARCH@WEIGHTS) only; {_model_words(path)} is not one of them (a Hugging Face image model "
            f"resizes as its image processor says). Drop `{key}` (CLI: --{key.replace('_', '-')}).")
    num_labels = check_int(num_labels, "num_labels", low=2, fix="A classifier needs at least two classes.")
    d, config, max_length = _checked_model_config(path, max_length)
    meta = _read_classifier_meta(d)
    if meta is not None:
        pooling = meta["pooling"]
        normalize = bool(meta.get("normalize", False))
        num_labels = int(meta["num_labels"])
        label_names = meta.get("label_names")
        max_length = max_length or meta.get("max_length")
    kind = "image" if _is_image_config(config) else "text"
    if pooling == "auto":
        st = _sentence_transformers_pooling(d)
        if st is not None:
            pooling, st_norm = st
            normalize = st_norm if normalize is None else normalize
        else:
            pooling = "model"
    normalize = bool(normalize) if normalize is not None else False
    with quiet_transformers():
        tokenizer, processor = _load_preprocessor(d, kind)
        if seed is not None:
            torch.manual_seed(seed)
        backbone = _load_backbone(d, config, kind, pooling, num_labels, new_head=meta is None, tokenizer=tokenizer)
    backbone.float()
    head = None if pooling == "model" else _pooled_head(backbone, num_labels, d, meta)
    if kind == "text" and max_length is None:
        # the default truncation, never beyond what the model's position embeddings hold
        max_length = min(DEFAULT_MAX_LENGTH, max_text_positions(config) or DEFAULT_MAX_LENGTH)
    model = Classifier(
        backbone, head, kind=kind, pooling=pooling, normalize=normalize, num_labels=num_labels,
        label_names=label_names, tokenizer=tokenizer, processor=processor,
        max_length=int(max_length or DEFAULT_MAX_LENGTH), source=str(d.resolve()),
    )
    load_feature_center(model, d, meta)
    model.eval()
    return model


def load_feature_center(model: Classifier, d: Path, meta: dict | None) -> None:
    """Restore :attr:`Classifier.feature_center` of a saved privtune classifier whose metadata names its file."""
    name = (meta or {}).get("feature_center_file")
    if not name:
        return
    # Lazy: safetensors only when loading.
    from safetensors.torch import load_file

    try:
        center = load_file(str(d / name))["feature_center"]
    except Exception as exc:  # missing, truncated or not a safetensors file
        raise ModelError(f"The feature centre {str(d / name)!r} of the model in {str(d)!r} is missing or unreadable "
                         f"({type(exc).__name__}). Copy the whole RUN_DIR/model directory again.") from None
    if center.shape != (model.num_features,):
        raise ModelError(f"The feature centre in {str(d)!r} has shape {tuple(center.shape)}, but the model's features "
                         f"have {model.num_features} dimensions. Copy the whole RUN_DIR/model directory again.")
    model.feature_center = center.float()


# architectures whose position ids start after the padding index (padding_idx + 1): RoBERTa and its
# descendants; they hold max_position_embeddings − (pad_token_id + 1) tokens
_POSITION_OFFSET_MODEL_TYPES = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "mpnet",
                                "data2vec-text", "ibert", "roberta-prelayernorm", "xmod")


def max_text_positions(config: Any) -> int | None:
    """How many tokens (including special tokens) a text model's position embeddings hold, from its
    transformers ``config``; None when the config names no limit (e.g. rotary or relative positions)."""
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        n = getattr(config, "n_positions", None)
    if not isinstance(n, int) or n <= 0:
        return None
    if getattr(config, "model_type", None) in _POSITION_OFFSET_MODEL_TYPES:
        pad = getattr(config, "pad_token_id", None)
        n -= (pad if isinstance(pad, int) else 1) + 1
    return n


def check_model(path: str | os.PathLike | None, *, max_length: int | None = None) -> None:
    """Refuse a model that :func:`load_classifier` would refuse for its path or ``max_length`` (tokens),
    reading only the model's config (no weights): what a run checks before its ledger reservation."""
    _checked_model_config(path, max_length)


def _checked_model_config(path: str | os.PathLike | None, max_length: int | None) -> tuple[Path, Any, int | None]:
    """The model directory, its transformers config and ``max_length`` checked against the positions the
    model has (a longer input would fail inside the backbone, after the data was read)."""
    if max_length is not None:
        max_length = check_int(max_length, "max_length", low=2)
    d = _model_directory(path)
    # Lazy: transformers only when a model is built: keeps import privtune light.
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(d))
    except Exception as exc:
        raise ModelError(f"Cannot read the model config in {str(d)!r}: {exc}") from None
    limit = max_text_positions(config) if not _is_image_config(config) else None
    if max_length is not None and limit is not None and max_length > limit:
        raise InvalidParameterError(
            f"`max_length` = {max_length} tokens is more than the model in {str(d)!r} can read: its position "
            f"embeddings hold {limit} tokens. Pass --max-length {limit} or less (longer texts are truncated)."
        )
    return d, config, max_length


def _model_directory(path: str | os.PathLike | None) -> Path:
    """The Hugging Face model directory ``path`` names (``None``: the bundled backbone; a RUN_DIR: its
    ``model/``); refuses a missing path, a hub id and a directory without ``config.json``."""
    d = resolve_backbone(path)
    if not d.exists():
        from privtune.choices import CAUSAL_LM_NAMES

        hub_like = isinstance(path, str) and "/" in path and not str(path).startswith((".", "/", "~"))
        if str(path).strip().lower() in CAUSAL_LM_NAMES:  # a generator's name where a classifier is built
            raise ModelError(
                f"`model` {str(path).strip()!r} is a text generator: it trains on prompt → response pairs "
                "(docs/generation.md), not on labelled data. For a classifier name a backbone: all-MiniLM-L6-v2 "
                "(bundled) or all-mpnet-base-v2.")
        hint = (
            " It looks like a Hugging Face Hub id; downloads are disabled here (HF_HUB_OFFLINE=1): download "
            "the model to a folder elsewhere and pass that folder." if hub_like else
            " Check the path, or name a backbone: all-MiniLM-L6-v2 (bundled) or all-mpnet-base-v2."
        )
        raise ModelError(f"`model` path {str(d)!r} does not exist.{hint}")
    if d.is_dir() and not (d / "config.json").is_file() and (d / "model" / CLASSIFIER_CONFIG).is_file():
        d = d / "model"  # a privtune RUN_DIR
    if not d.is_dir() or not (d / "config.json").is_file():
        raise ModelError(
            f"`model` {str(d)!r} is not a Hugging Face model directory (no config.json). Pass a folder "
            "saved with save_pretrained, a privtune RUN_DIR/model, or omit it for the bundled MiniLM."
        )
    return d


def _read_classifier_meta(d: Path) -> dict | None:
    """The privtune classifier metadata saved in ``d`` (pooling, classes, head file), or None for a plain
    Hugging Face checkpoint; refuses invalid JSON and a format written by a newer privtune."""
    if not (d / CLASSIFIER_CONFIG).is_file():
        return None
    try:
        meta = json.loads((d / CLASSIFIER_CONFIG).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelError(f"{str(d / CLASSIFIER_CONFIG)!r} is not valid JSON: {exc}.") from None
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise ModelError(f"{str(d)!r} was written by a newer privtune; upgrade with `pip install -U privtune`.")
    return meta


def _load_preprocessor(d: Path, kind: str) -> tuple[Any, Any]:
    """``(tokenizer, None)`` for a text model (pad token set, falling back to eos), ``(None, image processor)``
    for an image model, both read from ``d``."""
    tokenizer = processor = None
    try:
        if kind == "text":
            # Lazy: transformers only when a model is built.
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(d))
            if tokenizer.pad_token is None:
                if tokenizer.eos_token is None:
                    raise ModelError(f"The tokenizer in {str(d)!r} has neither a pad nor an eos token.")
                tokenizer.pad_token = tokenizer.eos_token
        else:
            # Lazy: transformers only when a model is built.
            from transformers import AutoImageProcessor

            processor = AutoImageProcessor.from_pretrained(str(d))
    except ModelError:
        raise
    except Exception as exc:
        what = "tokenizer" if kind == "text" else "image processor"
        raise ModelError(f"Cannot load the {what} from {str(d)!r}: {exc}. Save it next to the model.") from None
    return tokenizer, processor


def _load_backbone(d: Path, config: Any, kind: str, pooling: str, num_labels: int, *, new_head: bool,
                   tokenizer: Any) -> nn.Module:
    """The transformers model in ``d``: with its own classification head of ``num_labels`` classes for
    ``pooling="model"`` (a ``new_head`` may replace a checkpoint head of another size), the base model otherwise."""
    try:
        if pooling == "model":
            # Lazy: transformers only when a model is built.
            from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

            auto = AutoModelForSequenceClassification if kind == "text" else AutoModelForImageClassification
            kwargs: dict[str, Any] = {"num_labels": num_labels}
            if new_head:
                kwargs["ignore_mismatched_sizes"] = True
            backbone = auto.from_pretrained(str(d), **kwargs)
            if kind == "text" and getattr(backbone.config, "pad_token_id", None) is None:
                backbone.config.pad_token_id = tokenizer.pad_token_id
        else:
            # Lazy: transformers only when a model is built.
            from transformers import AutoModel

            backbone = AutoModel.from_pretrained(str(d))
    except Exception as exc:
        raise ModelError(
            f"{str(d)!r} (model_type={getattr(config, 'model_type', '?')!r}) cannot be loaded as a "
            f"{kind} classifier backbone: {str(exc).splitlines()[0]}"
        ) from None
    return backbone


def _pooled_head(backbone: nn.Module, num_labels: int, d: Path, meta: dict | None) -> nn.Linear:
    """The linear head (hidden size → ``num_labels``) over mean/CLS-pooled features: the saved one when the
    metadata names a head file, else newly initialised.  Drops the backbone's unused pooler."""
    if getattr(backbone, "pooler", None) is not None:
        backbone.pooler = None  # unused by mean/CLS pooling; would be a trainable parameter without gradient
    hidden = getattr(backbone.config, "hidden_size", None)
    if hidden is None:
        hs = getattr(backbone.config, "hidden_sizes", None)
        hidden = hs[-1] if hs else None
    if hidden is None:
        raise ModelError(f"Cannot tell the hidden size of {type(backbone).__name__}; use pooling='model'.")
    head = nn.Linear(int(hidden), num_labels)
    if meta is not None and meta.get("head_file"):
        # Lazy: safetensors only when loading.
        from safetensors.torch import load_file

        head_path = d / meta["head_file"]
        try:
            head.load_state_dict(load_file(str(head_path)))
        except Exception as exc:  # missing, truncated or not a safetensors file, wrong shapes
            raise ModelError(
                f"The classification head {str(head_path)!r} of the model in {str(d)!r} is missing or "
                f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no details'}). "
                "Copy the whole RUN_DIR/model directory again, or retrain."
            ) from None
    return head
