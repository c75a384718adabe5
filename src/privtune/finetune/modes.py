"""What is trainable in each fine-tuning mode."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from privtune._validation import check_choice, check_int, check_real
from privtune.choices import TRAIN_MODES
from privtune.errors import InvalidParameterError, ModelError

#: what can be trained (declared in privtune.choices, which the CLI and the config schema read)
MODES = TRAIN_MODES
#: train()'s learning rate for each mode when none is given (the head's rate where the mode has an α below)
DEFAULT_LEARNING_RATES = {"full": 1e-2, "bitfit": 5e-3, "lora": 2e-3, "last-layer": 5e-2, "two-phase": 5e-3}
#: α, the learning-rate multiplier of every trainable parameter outside the head (Mehta et al.'s pre-trained-layer
#: multiplier), for each mode when none is given; 1 (one rate) where not listed.  Full fine-tuning: under DP
#: noise Adam moves every weight by about η per step, so one rate is either too slow for the zero head or a
#: random walk for the 22.7 M pre-trained weights.  Measured (one epoch of DP full fine-tuning of MiniLM on
#: 60,957 SST-2 phrases, expected batch 1,024, dev accuracy, bench/sst2_full.py): head 1e-2 and α = 0.1
#: reached 81.4 % at ε = 1 (α = 0.03: 80.0 %, α = 0.3: 79.8 %) and 82.5 % at ε = 8, against 77.4 % (ε = 1,
#: one rate 5e-4) and at most 81.0 % (ε = 8, one rate 5e-4 / 2e-3 / 5e-3 / 1e-2: 78.7 / 81.0 / 78.9 / 50.9 %)
DEFAULT_BACKBONE_LR_SCALES: dict[str, float] = {"full": 0.1}


def default_backbone_lr_scale(mode: str) -> float:
    """α of ``mode`` when none is given (:data:`DEFAULT_BACKBONE_LR_SCALES`, else 1)."""
    return DEFAULT_BACKBONE_LR_SCALES.get(mode, 1.0)


def _bias_module_types() -> tuple[type, ...]:
    types: list[type] = [
        nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
        nn.ConvTranspose3d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
        # BatchNorm's shift β (privtune trains BatchNorm in eval mode only: a per-example affine map)
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    ]
    try:
        # Lazy: transformers only when a model is adapted: keeps import light.
        from transformers.pytorch_utils import Conv1D

        types.append(Conv1D)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


BIAS_MODULE_TYPES = _bias_module_types()
"""Module types whose ``bias`` is added by broadcasting, so its per-example gradient is the summed
output gradient (Bu et al., DP-BiTFiT).  Biases of other modules (``nn.MultiheadAttention.in_proj_bias``,
relative-position "bias" tables, ...) are not selected by BiTFiT and are reported in ``ModeInfo.notes``."""

_LORA_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"],
    "mpnet": ["q", "v"],
    "distilbert": ["q_lin", "v_lin"],
    "albert": ["query", "value"],
    "deberta": ["in_proj"],
    "deberta-v2": ["query_proj", "value_proj"],
    "gpt2": ["c_attn"],
    "gpt_neo": ["q_proj", "v_proj"],
    "gptj": ["q_proj", "v_proj"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "opt": ["q_proj", "v_proj"],
    "vit": ["query", "value"],
    "deit": ["query", "value"],
    "beit": ["query", "value"],
    "dinov2": ["query", "value"],
    "swin": ["query", "value"],
}


@dataclass
class ModeInfo:
    """Result of :func:`apply_mode`: the mode, trainable parameter names and counts, notes."""

    mode: str
    trainable: list[str]
    num_trainable: int
    num_total: int
    notes: list[str] = field(default_factory=list)
    lora_target_modules: list[str] | None = None

    @property
    def fraction(self) -> float:
        """Share of parameters that are trainable (0..1)."""
        return self.num_trainable / max(1, self.num_total)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "num_trainable": self.num_trainable, "num_total": self.num_total,
            "fraction_trainable": self.fraction, "notes": list(self.notes),
            "lora_target_modules": self.lora_target_modules,
        }


_LORA_PATTERNS = (
    ["query", "value"], ["q_proj", "v_proj"], ["q_lin", "v_lin"], ["query_proj", "value_proj"], ["c_attn"],
    ["q", "v"], ["qkv"], ["Wqkv"], ["in_proj"],
)


def default_lora_target_modules(model: nn.Module) -> list[str]:
    """Default LoRA target modules (attention query/value projections) for a classifier's backbone.

    The per-architecture preference (``config.model_type``: e.g. BERT/RoBERTa ``query``/``value``,
    GPT-2 ``c_attn``, DistilBERT ``q_lin``/``v_lin``) is used when those modules exist; otherwise the
    first common naming pattern present in the model (``q_proj``/``v_proj``, ...), so renamed modules
    across transformers versions (ViT in transformers 5 uses ``q_proj``/``v_proj``) are found.
    """
    bb = getattr(model, "backbone", model)
    model_type = getattr(getattr(bb, "config", None), "model_type", None)
    leaf = {name.rsplit(".", 1)[-1] for name, mod in bb.named_modules()
            if isinstance(mod, (nn.Linear, nn.Conv1d)) or type(mod).__name__ == "Conv1D"}
    preferred: list[list[str]] = []
    if model_type in _LORA_TARGETS:
        preferred.append(list(_LORA_TARGETS[model_type]))
    try:
        # Lazy: peft only for LoRA.
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

        if model_type in mapping:
            preferred.append(list(mapping[model_type]))
    except ImportError:  # pragma: no cover
        pass
    for cand in [*preferred, *map(list, _LORA_PATTERNS)]:
        if all(c in leaf for c in cand):
            return cand
    raise ModelError(
        f"No default LoRA target modules for model_type={model_type!r} (no query/value projection found). "
        "Pass lora_target_modules=[...] (names of the attention projection nn.Linear modules)."
    )


def _lora_capable_names(backbone: nn.Module) -> list[str]:
    """Distinct last name parts of the backbone's modules LoRA can adapt (Linear, Conv1D, Conv, Embedding)."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)
    return sorted({n.rsplit(".", 1)[-1] for n, m in backbone.named_modules()
                   if n and (isinstance(m, kinds) or type(m).__name__ == "Conv1D")})


def _lora_names_hint(backbone: nn.Module) -> str:
    names = _lora_capable_names(backbone)
    more = f" ... ({len(names)} in all)" if len(names) > 25 else ""
    return f"Layers LoRA can adapt in this backbone (last part of the module name): {names[:25]}{more}."


def check_lora_targets(backbone: nn.Module, targets: Sequence[str]) -> None:
    """Raise ModelError unless every name in ``targets`` matches a module of ``backbone``.

    A target matches a module whose full name equals it or ends with ``"." + target`` (peft's rule
    for a list of names).  peft itself ignores a target that matches nothing as long as another one
    matches; here a misspelt target is an error, so what is trained is exactly what was asked for.
    """
    names = [n for n, _ in backbone.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ModelError(
            f"LoRA target modules {missing} match no module of the backbone {type(backbone).__name__}. "
            f"{_lora_names_hint(backbone)} Pass lora_target_modules=[...] (CLI: --lora-target-modules a,b)."
        )


def _set_all(model: nn.Module, flag: bool) -> None:
    for p in model.parameters():
        p.requires_grad_(flag)


def select_biases(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of biases of BIAS_MODULE_TYPES modules, names of other bias-like parameters)."""
    chosen: list[str] = []
    chosen_ids = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, BIAS_MODULE_TYPES) and getattr(mod, "bias", None) is not None \
                and isinstance(mod.bias, nn.Parameter):
            if id(mod.bias) in chosen_ids:
                continue
            chosen_ids.add(id(mod.bias))
            chosen.append(f"{mname}.bias" if mname else "bias")
    others = [n for n, p in model.named_parameters() if "bias" in n.split(".")[-1] and id(p) not in chosen_ids]
    return chosen, others


def _zero_head(head: nn.Linear) -> None:
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()


def _train_biases(model: nn.Module, head: nn.Module, *, train_head: bool) -> list[str]:
    """DP-BiTFiT: make the backbone's biases (and the head, with ``train_head``) trainable, freeze the rest;
    returns the notes for :class:`ModeInfo` (bias-like parameters left frozen, also warned about)."""
    _set_all(model, False)
    head_ids = {id(p) for p in head.parameters()}
    chosen, others = select_biases(model.backbone)
    if not chosen:
        raise ModelError(
            f"mode='bitfit' needs bias terms, but the backbone {type(model.backbone).__name__} has no biases in "
            "Linear/Conv/LayerNorm/GroupNorm/BatchNorm/Conv1D modules. Use mode='lora', 'full' or 'two-phase'."
        )
    params = dict(model.backbone.named_parameters())
    for n in chosen:
        params[n].requires_grad_(True)
    others = [o for o in others if id(params.get(o)) not in head_ids]
    notes = []
    if others:
        msg = (f"bitfit: {len(others)} bias-like parameter(s) of unsupported module types stay frozen: "
               f"{others[:5]}{' ...' if len(others) > 5 else ''}")
        notes.append(msg)
        warnings.warn(msg, stacklevel=3)  # point at apply_mode's caller
    if train_head:
        for p in head.parameters():
            p.requires_grad_(True)
    return notes


def _add_lora_adapters(model: nn.Module, head: nn.Module, *, train_head: bool, targets: Sequence[str] | None,
                       rank: int, alpha: float) -> list[str]:
    """Inject LoRA adapters of rank r = ``rank`` and scale α = ``alpha`` into the backbone's ``targets`` (default
    per architecture); make them (and the head, with ``train_head``) trainable, freeze the rest.  Records
    ``model.lora_config`` and returns the target module names."""
    rank = check_int(rank, "lora_rank", low=1)
    alpha = check_real(alpha, "lora_alpha", low=0.0)
    lora_targets = list(targets) if targets else default_lora_target_modules(model)
    if getattr(model, "lora_config", None) is not None:
        raise ModelError("LoRA adapters were already added to this model; load a fresh model.")
    check_lora_targets(model.backbone, lora_targets)
    # Lazy: peft only for LoRA.
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=lora_targets, bias="none")
    _set_all(model, False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fan_in_fan_out notice for GPT-2 Conv1D
            inject_adapter_in_model(cfg, model.backbone)
    except ValueError as exc:
        raise ModelError(
            f"LoRA target modules {lora_targets} cannot be adapted in the backbone {type(model.backbone).__name__}: "
            f"{str(exc).splitlines()[0]} {_lora_names_hint(model.backbone)} Pass lora_target_modules=[...] "
            "(CLI: --lora-target-modules a,b)."
        ) from None
    n_lora = 0
    for n, p in model.backbone.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)
            n_lora += 1
    if n_lora == 0:
        raise ModelError(f"LoRA injected no adapters for target modules {lora_targets}; pass others.")
    model.lora_config = {"r": rank, "alpha": alpha, "target_modules": lora_targets}
    if train_head:
        for p in head.parameters():
            p.requires_grad_(True)
    return lora_targets


def head_input_normalization(model: nn.Module, mode: str) -> bool:
    """Whether the head of ``model`` reads L2-normalised pooled features in ``mode``.

    A frozen text backbone ("last-layer") keeps what the checkpoint declares: its features are the embedding it
    was trained to produce.  A frozen image backbone's pooled features are L2-normalised per example (a public
    map of each example alone, so it costs no privacy): an image network's pooled features have no common scale
    (EfficientNet-Lite0's have norm ≈ 60), while the head's defaults (hyperfree's η0, random search's ranges,
    the clipped private feature centre) are set for unit-norm inputs.  Measured (Fashion-MNIST, 10,000
    private images, EfficientNet-Lite0 at 64 px, ``privtune tune --mode last-layer``, ε = 1, seeds 0 and 1):
    77.7 % / 77.8 % test normalised, 74.3 % / 74.5 % not.  A network whose own head is kept
    (``pooling="model"``) is not changed.  When the backbone is trained the features are not normalised: a unit-norm
    input caps the logits of a zero-initialised head at its weight norm, so DP-Adam, whose per-coordinate
    step is about η, needs about ‖x‖ times more steps to reach confident logits (all-MiniLM-L6-v2's mean-pooled
    features have norm ≈ 4).  Measured (``bench/sst2_full.py --quick`` split, 20,000 SST-2 phrases, ε = 1,
    DP-BiTFiT, Adam 1e-2, expected batch 1,024, 59 steps, one seed): 77.5 % dev normalised, 80.3 % not.
    """
    if mode != "last-layer":
        return False
    if getattr(model, "kind", None) == "image" and getattr(model, "pooling", None) != "model":
        return True
    return bool(getattr(model, "declared_normalize", False))


def apply_mode(
    model: nn.Module,
    mode: str,
    *,
    train_head: bool = True,
    zero_init_head: bool | None = None,
    lora_target_modules: Sequence[str] | None = None,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    normalize_features: bool | None = None,
) -> ModeInfo:
    """Make the parameters of ``mode`` trainable (``requires_grad=True``) and freeze the rest.

    Parameters
    ----------
    model : Classifier
        From :func:`privtune.models.load_classifier`; modified in place.
    mode : {"full", "bitfit", "last-layer", "lora", "two-phase"}
    train_head : bool, default True
        Train the classification head together with the biases (bitfit) or adapters (lora).
    zero_init_head : bool, optional
        Zero the head's weight and bias; default True for "last-layer" (Mehta et al.), False otherwise.
    lora_target_modules : list of str, optional
        Module names for LoRA; default per architecture (:func:`default_lora_target_modules`).
    lora_rank, lora_alpha : LoRA rank r and scaling α (update = α/r · B A).
    normalize_features : bool, optional
        L2-normalise the pooled features the head reads.  Default for ``"last-layer"``: on for an image
        backbone, as the checkpoint declares for a text one (the frozen embedding it was trained to produce);
        off when the backbone is trained (see :func:`head_input_normalization`).

    Raises
    ------
    ModelError
        ``"bitfit"`` on a backbone without biases; LoRA without matching target modules.
    """
    mode = check_choice(mode, "mode", MODES)
    head = getattr(model, "classification_head", None)
    if head is None:
        raise InvalidParameterError(
            "`model` must be a privtune Classifier (from privtune.models.load_classifier); got "
            f"{type(model).__name__}."
        )
    notes: list[str] = []
    lora_targets = None
    if zero_init_head is None:
        zero_init_head = mode == "last-layer"
    if mode in ("full", "two-phase"):
        _set_all(model, True)
        if mode == "two-phase":
            if not select_biases(model.backbone)[0]:
                raise ModelError(
                    "mode='two-phase' ends with DP-BiTFiT, but the backbone "
                    f"{type(model.backbone).__name__} has no biases. Use mode='full' or 'lora'."
                )
            notes.append("phase 1: all parameters (DP full); phase 2: biases + head (DP-BiTFiT)")
    elif mode == "bitfit":
        notes.extend(_train_biases(model, head, train_head=train_head))
    elif mode == "last-layer":
        _set_all(model, False)
        for p in head.parameters():
            p.requires_grad_(True)
    elif mode == "lora":
        lora_targets = _add_lora_adapters(model, head, train_head=train_head, targets=lora_target_modules,
                                          rank=lora_rank, alpha=lora_alpha)
    if zero_init_head:
        _zero_head(head)
        notes.append("classification head zero-initialised")
    if hasattr(model, "normalize"):
        model.normalize = head_input_normalization(model, mode) if normalize_features is None else bool(
            normalize_features)
        if getattr(model, "declared_normalize", False) and not model.normalize:
            notes.append("pooled features not L2-normalised (the checkpoint's Normalize is for similarity search)")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ModelError(f"mode={mode!r} with train_head={train_head} leaves nothing to train.")
    n_tr = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    return ModeInfo(mode=mode, trainable=trainable, num_trainable=n_tr, num_total=n_all, notes=notes,
                    lora_target_modules=lora_targets)
