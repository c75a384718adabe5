"""Tiny randomly initialised causal language models and a synthetic E2E-format table, for tests.

* :func:`make_tiny_causal_lm` writes a 2-layer GPT-2 (HF ``Conv1D``, biases, tied ``wte``/``lm_head``) or
  LLaMA (RMSNorm, no biases, tied or untied embeddings) with a word-level tokenizer, in a second.
* :func:`make_synthetic_e2e_rows` returns **synthetic** E2E-style (``mr``, ``ref``) rows made from templates:
  a format fixture, not the E2E data set and not meant to measure anything.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
WORDS = [
    "the", "a", "is", "in", "near", "an", "it", "serves", "food", "coffee", "shop", "restaurant", "pub",
    "cheap", "expensive", "moderate", "high", "low", "rating", "customer", "family", "friendly", "not",
    "italian", "french", "chinese", "english", "city", "centre", "riverside", "eagle", "mill", "phoenix",
    "name", "eatType", "priceRange", "area", "|", ":", ".", ",", "hello", "how", "are", "you", "i", "am",
    "fine", "good", "thanks", "what", "do", "like", "to", "eat", "?", "!", "yes", "no",
    # the memorisation audit's canaries: "my secret code is 3 9 1 4 7 2"
    "my", "secret", "code", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
]


def tiny_vocab() -> list[str]:
    return SPECIAL_TOKENS + WORDS


def make_tiny_tokenizer():
    """A word-level fast tokenizer over :func:`tiny_vocab` (whitespace and punctuation split, lower case)."""
    # Lazy: tokenizers/transformers only when a test model is written.
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers import decoders
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(tiny_vocab())}
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins with spaces, tidies " ." → "."
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def make_tiny_causal_lm(path: str | os.PathLike | None = None, *, arch: str = "llama", tie_word_embeddings: bool = True,
                        hidden_size: int = 16, num_layers: int = 2, seed: int = 0):
    """A tiny random causal LM with its tokenizer; saved to ``path`` (returned) or returned as ``(model, tok)``.

    ``arch``: ``"gpt2"`` (Conv1D, biases, LayerNorm, learned positions, tied ``wte``/``lm_head``) or ``"llama"``
    (RMSNorm, rotary positions, no biases; ``tie_word_embeddings`` as in SmolLM2).  Dropout is 0."""
    # Lazy: transformers only when a test model is written.
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tok = make_tiny_tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    V = len(tok)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_embd=hidden_size, n_layer=num_layers, n_head=2, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, **ids)
        model = GPT2LMHeadModel(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                          num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings, **ids)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"arch must be 'gpt2' or 'llama'; got {arch!r}")
    model.eval()
    if path is None:
        return model, tok
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


_E2E_NAMES = ["The Eagle", "The Mill", "The Phoenix"]
_E2E_TYPES = ["coffee shop", "restaurant", "pub"]
_E2E_FOOD = ["Italian", "French", "Chinese", "English"]
_E2E_AREA = ["city centre", "riverside"]


def make_synthetic_e2e_rows(n: int = 12, *, seed: int = 0, refs_per_mr: int = 2) -> list[dict[str, str]]:
    """**Synthetic** rows in the E2E NLG format: ``{"mr": "name[..], eatType[..], ...", "ref": sentence}``, with
    ``refs_per_mr`` template-made references per meaning representation (n rows in all)."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        name, typ, food, area = (rng.choice(_E2E_NAMES), rng.choice(_E2E_TYPES), rng.choice(_E2E_FOOD),
                                 rng.choice(_E2E_AREA))
        mr = f"name[{name}], eatType[{typ}], food[{food}], area[{area}]"
        refs = [f"{name} is a {typ} in the {area} . it serves {food} food .",
                f"in the {area} , {name} serves {food} food ."]
        for k in range(min(refs_per_mr, n - len(rows))):
            rows.append({"mr": mr, "ref": refs[k % len(refs)]})
    return rows
