"""Merging LoRA adapters back into their base layers, for saving a plain Hugging Face model."""

from __future__ import annotations

import copy

from torch import nn


def merged_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every LoRA adapter merged into its base weights and replaced by the base
    layer (no peft wrapper left): what a classifier's or a generator's ``save_pretrained`` writes."""
    # Lazy: peft is needed only when a model has LoRA adapters.
    from peft.tuners.lora import LoraLayer

    out = copy.deepcopy(model)
    for name, mod in list(out.named_modules()):
        if isinstance(mod, LoraLayer):
            mod.merge()
            parent_name, _, child = name.rpartition(".")
            parent = out.get_submodule(parent_name) if parent_name else out
            setattr(parent, child, mod.get_base_layer())
    if hasattr(out, "peft_config"):
        del out.peft_config
    return out
