"""A causal language model as privtune trains it: :class:`Generator`.

A :class:`Generator` holds a Hugging Face causal LM (``backbone``), its tokenizer, the prompt template and the
public ``max_length`` (tokens per prompt + response).  It is what the one DP loop trains on prompt → response
pairs (:class:`privtune.data.generation.GenerationDataset`), through the generation task
(:class:`privtune.tasks.generation.Generation`): ``tokenized`` gives each row's token ids and labels (response
tokens only, ``-100`` elsewhere), and the task's per-example loss is each example's summed response loss, the
quantity DP-SGD clips.

* :func:`load_generator`: a known model name (``smollm2-135m``), a Hugging Face causal-LM directory, or a
  directory a privtune run released (``privtune_generator.json`` keeps its template and ``max_length``);
* :func:`apply_generation_mode`: what is trainable: ``lora`` (adapters on the attention projections),
  ``full``, or ``bitfit`` where the model has biases (GPT-2; LLaMA and SmolLM2 have none: one clear error).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from privtune.data.generation import DEFAULT_TEMPLATE, GenerationDataset, tokenize_generation
from privtune.errors import InvalidParameterError, ModelError
from privtune.models._lora import merged_copy

#: the saved generator's own description (template, max_length, base model), beside config.json
GENERATOR_CONFIG = "privtune_generator.json"
#: what a generator can train (``--mode``); LoRA is the default
GENERATION_MODES = ("lora", "full", "bitfit")
DEFAULT_GENERATION_MODE = "lora"
#: tokens per prompt + response when none is given (a public choice)
DEFAULT_MAX_LENGTH = 128
#: the learning rate of each mode when none is given (Adam).  LoRA's is the middle of tune's sweep (× 1/3, 1, 3):
#: with 2e-3 at the middle, all six tuned SmolLM2 LoRA runs of the generation and user-level benches (chitchat and
#: BBC headlines, ε = 3 and 8, pair and sender level) selected the top of the sweep, 6e-3, by public perplexity
GENERATION_LEARNING_RATES = {"lora": 6e-3, "full": 1e-4, "bitfit": 1e-3}


class Generator(nn.Module):
    """A causal LM with its tokenizer, prompt template and ``max_length`` (see the module doc)."""

    kind = "generation"

    def __init__(self, backbone: nn.Module, tokenizer: Any, *, max_length: int = DEFAULT_MAX_LENGTH,
                 template: str = DEFAULT_TEMPLATE, source: str | None = None):
        super().__init__()
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.template = template
        self.source = source
        self.lora_config: dict | None = None
        self._tokenized: dict[int, tuple[Any, Any]] = {}  # id(dataset) -> (dataset, TokenizedGeneration)

    # ------------------------------------------------------------------ data
    def tokenized(self, data: GenerationDataset):
        """The dataset's token ids and labels (computed once per dataset object)."""
        hit = self._tokenized.get(id(data))
        if hit is None or hit[0] is not data:
            hit = (data, tokenize_generation(data, self.tokenizer, max_length=self.max_length, template=self.template))
            self._tokenized[id(data)] = hit
        return hit[1]

    def sequence_lengths(self, data: GenerationDataset) -> torch.Tensor:
        """(N,) token counts (micro-batches of similar length pad less)."""
        return torch.tensor([len(s) for s in self.tokenized(data).input_ids])

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def encode(self, data: GenerationDataset, idx: Any) -> dict:
        """The model inputs of rows ``idx``: right-padded ``input_ids`` and ``attention_mask`` on the model's device."""
        b = self.tokenized(data).collate(torch.as_tensor(idx).tolist())
        dev = self._device()
        return {"input_ids": b["input_ids"].to(dev), "attention_mask": b["attention_mask"].to(dev)}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, V) next-token logits."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask).logits

    # ------------------------------------------------------------------ decoding
    def generate(self, prompts: Sequence[str], *, max_new_tokens: int = 32, num_beams: int = 1,
                 batch_size: int = 8) -> list[str]:
        """Greedy (``num_beams=1``) or beam-search continuations of ``prompts`` (:func:`privtune.eval.generation.generate`)."""
        from privtune.eval.generation import generate

        # prompt + continuation fit the model's positions: a longer prompt keeps its last tokens
        positions = self.positions()
        room = None if positions is None else max(1, positions - int(max_new_tokens))
        return generate(self.backbone, self.tokenizer, list(prompts), max_new_tokens=max_new_tokens,
                        num_beams=num_beams, batch_size=batch_size, template=self.template,
                        max_prompt_tokens=None if room is None else min(room, self.max_length))

    def positions(self) -> int | None:
        """How many positions the model has (None: no fixed limit stated in its config)."""
        cfg = getattr(self.backbone, "config", None)
        n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        return int(n) if n else None

    # ------------------------------------------------------------------ saving
    def merged_state_dict(self) -> dict:
        """The causal LM's weights with its LoRA adapters merged in: a plain Hugging Face state dict, the weights
        :meth:`save_pretrained` writes (e.g. for a fresh model of the same base to start from)."""
        return self._export_backbone().state_dict()

    def _export_backbone(self) -> nn.Module:
        """The causal LM with LoRA adapters merged into the base weights (a plain Hugging Face model)."""
        if self.lora_config is None:
            return self.backbone
        return merged_copy(self.backbone)

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write a Hugging Face causal-LM directory (LoRA merged) with the tokenizer and ``privtune_generator.json``;
        any Hugging Face tool loads it with ``AutoModelForCausalLM``, privtune with :func:`load_generator`."""
        from privtune import __version__
        from privtune.models.classifier import public_model_name, quiet_transformers

        out = Path(save_directory)
        if out.exists() and not out.is_dir():
            raise ModelError(f"`save_directory` {str(out)!r} is a file; pass a directory.")
        out.mkdir(parents=True, exist_ok=True)
        with quiet_transformers():
            self._export_backbone().save_pretrained(out)
            self.tokenizer.save_pretrained(out)
        meta = {"kind": "generation", "privtune_version": __version__, "template": self.template,
                "max_length": self.max_length, "lora_merged": self.lora_config,
                "base_model": public_model_name(self.source)}
        (out / GENERATOR_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return out


def is_generator_dir(path: Any) -> bool:
    """True for a directory a privtune generation run released (it holds ``privtune_generator.json``)."""
    return isinstance(path, (str, os.PathLike)) and (Path(path).expanduser() / GENERATOR_CONFIG).is_file()


def load_generator(model: Any, *, max_length: int | None = None) -> Generator:
    """A :class:`Generator` from a model name, a Hugging Face causal-LM directory or a released generator
    directory (its template and ``max_length`` are kept unless ``max_length`` is given); a Generator is
    returned as it is."""
    from privtune.models.causal_lm import load_causal_lm

    if isinstance(model, Generator):
        return model
    if model is None:
        from privtune.models.causal_lm import KNOWN_CAUSAL_LMS

        raise InvalidParameterError(
            "`model` is required for prompt → response data: pass a causal language model, e.g. --model "
            f"smollm2-135m (install it with `{KNOWN_CAUSAL_LMS['smollm2-135m'][3]}`) or the path of a Hugging Face "
            "causal-LM directory.")
    if isinstance(model, nn.Module):
        raise InvalidParameterError(
            f"`model` for prompt → response data must be a name, a directory or a privtune Generator; got "
            f"{type(model).__name__}.")
    if isinstance(max_length, bool) or (max_length is not None and (not isinstance(max_length, int) or max_length < 8)):
        raise InvalidParameterError(f"`max_length` must be an integer ≥ 8 (tokens). Got {max_length!r}.")
    template, length, source = DEFAULT_TEMPLATE, DEFAULT_MAX_LENGTH, str(model)
    if is_generator_dir(model):
        meta = json.loads((Path(model).expanduser() / GENERATOR_CONFIG).read_text(encoding="utf-8"))
        template = meta.get("template") or template
        length = int(meta.get("max_length") or length)
        source = meta.get("base_model") or source
    lm, tok = load_causal_lm(model)
    positions = getattr(lm.config, "max_position_embeddings", None) or getattr(lm.config, "n_positions", None)
    length = max_length or length
    if positions is not None:
        length = min(length, int(positions))
    return Generator(lm, tok, max_length=length, template=template, source=source)


def has_biases(model: Generator) -> bool:
    """Whether the causal LM has bias terms BiTFiT can train (GPT-2 does; LLaMA and SmolLM2 do not)."""
    from privtune.finetune.modes import select_biases

    return bool(select_biases(model.backbone)[0])


def generation_modes(model: Generator) -> list[str]:
    """The modes that apply to ``model``: LoRA and full always, BiTFiT where it has biases."""
    return [m for m in GENERATION_MODES if m != "bitfit" or has_biases(model)]


def apply_generation_mode(model: Generator, mode: str, *, lora_rank: int = 8, lora_alpha: float = 16.0,
                          lora_target_modules: Sequence[str] | None = None):
    """Make the parameters of ``mode`` trainable and freeze the rest; returns a
    :class:`privtune.finetune.modes.ModeInfo`.  ``bitfit`` on a model without biases is one clear error."""
    from privtune._validation import check_int, check_real
    from privtune.finetune.modes import ModeInfo, check_lora_targets, default_lora_target_modules, select_biases

    if mode not in GENERATION_MODES:
        raise InvalidParameterError(
            f"`mode` {mode!r} does not apply to a causal language model. Choose one of {', '.join(GENERATION_MODES)} "
            "(or auto with tune).")
    bb = model.backbone
    for p in model.parameters():
        p.requires_grad_(mode == "full")
    targets = None
    if mode == "bitfit":
        chosen, _ = select_biases(bb)
        if not chosen:
            raise ModelError(
                f"mode='bitfit' trains bias terms, but {type(bb).__name__} has none (LLaMA-family models such as "
                "SmolLM2 have no biases). Use --mode lora (the default) or --mode full.")
        params = dict(bb.named_parameters())
        for n in chosen:
            params[n].requires_grad_(True)
    elif mode == "lora":
        rank = check_int(lora_rank, "lora_rank", low=1)
        alpha = check_real(lora_alpha, "lora_alpha", low=0.0)
        if model.lora_config is not None:
            raise ModelError("LoRA adapters were already added to this model; load a fresh model.")
        targets = list(lora_target_modules) if lora_target_modules else default_lora_target_modules(model)
        check_lora_targets(bb, targets)
        from peft import LoraConfig, inject_adapter_in_model

        cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fan_in_fan_out notice for GPT-2 Conv1D
            inject_adapter_in_model(cfg, bb)
        for n, p in bb.named_parameters():
            p.requires_grad_("lora_" in n)
        model.lora_config = {"r": rank, "alpha": alpha, "target_modules": targets}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    n_tr = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    return ModeInfo(mode=mode, trainable=trainable, num_trainable=n_tr, num_total=n_all, notes=[],
                    lora_target_modules=targets)


__all__ = ["DEFAULT_GENERATION_MODE", "GENERATION_MODES", "Generator", "apply_generation_mode", "generation_modes",
           "has_biases", "is_generator_dir", "load_generator"]
