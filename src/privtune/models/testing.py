"""Tiny randomly initialised checkpoints for tests and examples (no download, seconds to build).

* :func:`make_tiny_text_model` writes a 2-layer BERT/RoBERTa/GPT-2 (hidden size 32) with a word-level
  tokenizer over a small vocabulary, optionally with a sentence-transformers mean-pooling config.
* :func:`make_tiny_image_model` writes a 2-layer ViT (8×8 images) with its image processor.
* :func:`make_toy_text_dataset` returns a linearly separable two-class :class:`TextDataset`.

They are meant for correctness tests (per-example gradients, modes, resume); their accuracy means
nothing about pretrained models.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from privtune.data import TextDataset

POSITIVE_WORDS = ["good", "great", "fine", "nice", "love", "superb", "fun", "best"]
NEGATIVE_WORDS = ["bad", "awful", "poor", "boring", "hate", "worst", "dull", "sad"]
NEUTRAL_WORDS = ["the", "a", "movie", "film", "plot", "actors", "was", "is", "very", "quite", "story", "and"]


def _vocab() -> list[str]:
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    return special + POSITIVE_WORDS + NEGATIVE_WORDS + NEUTRAL_WORDS


def make_tiny_text_model(path: str | os.PathLike, *, arch: str = "bert", sentence_transformers: bool = False,
                         hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny random text backbone with tokenizer to ``path``; returns the path.

    ``arch``: ``"bert"``, ``"roberta"`` or ``"gpt2"``.  ``sentence_transformers=True`` adds
    ``modules.json`` and ``1_Pooling/config.json`` (mean pooling + Normalize), like all-MiniLM-L6-v2.
    """
    # Lazy: transformers only when a test model is written.
    from transformers import BertConfig, BertModel, BertTokenizer, GPT2Config, GPT2Model, RobertaConfig, RobertaModel

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab = _vocab()
    tok = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    common = dict(vocab_size=len(vocab), hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=2, intermediate_size=2 * hidden_size, max_position_embeddings=64)
    if arch == "bert":
        model = BertModel(BertConfig(**common, pad_token_id=0))
    elif arch == "roberta":
        model = RobertaModel(RobertaConfig(**common, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                                           type_vocab_size=1))
        common["max_position_embeddings"] = 64
    elif arch == "gpt2":
        model = GPT2Model(GPT2Config(vocab_size=len(vocab), n_embd=hidden_size, n_layer=num_layers, n_head=2,
                                     n_positions=64, pad_token_id=0, bos_token_id=2, eos_token_id=3))
    else:
        raise ValueError(f"arch must be 'bert', 'roberta' or 'gpt2'; got {arch!r}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if arch == "gpt2":  # GPT-2 configs name no tokenizer class; ours is a word-level BERT tokenizer
        cfg = json.loads((out / "config.json").read_text())
        cfg["tokenizer_class"] = "BertTokenizer"
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if sentence_transformers:
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}))
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]))
    return out


def make_tiny_image_model(path: str | os.PathLike, *, image_size: int = 8, seed: int = 0) -> Path:
    """Write a tiny random ViT (patch 4, hidden 32) with a ViTImageProcessor to ``path``."""
    # Lazy: transformers only when a test model is written.
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=image_size, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64)
    ViTModel(cfg).save_pretrained(out)
    ViTImageProcessor(size={"height": image_size, "width": image_size}, do_resize=True).save_pretrained(out)
    return out


def make_toy_text_dataset(n: int = 64, *, seed: int = 0, min_words: int = 3, max_words: int = 8):
    """A two-class TextDataset: positive words ⇒ label 1, negative words ⇒ label 0 (plus filler)."""
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        y = i % 2
        words = [rng.choice(NEUTRAL_WORDS) for _ in range(rng.randint(min_words, max_words))]
        for _ in range(rng.randint(1, 2)):
            words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE_WORDS if y else NEGATIVE_WORDS))
        texts.append(" ".join(words))
        labels.append(y)
    return TextDataset(texts=texts, labels=labels, num_labels=2)


def write_toy_tsv(path: str | os.PathLike, dataset) -> str:
    """Write a text dataset (``.texts``, ``.labels``) as a ``label<TAB>sentence`` TSV; returns the path as str."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("label\tsentence\n")
        for text, label in zip(dataset.texts, dataset.labels):
            f.write(f"{label}\t{text}\n")
    return str(path)


def make_toy_text_files(root: str | os.PathLike, splits: dict) -> dict:
    """A tiny sentence-transformers model and toy TSV splits under ``root``, for tests and docs.

    ``splits`` maps a key to ``(file name, rows, seed)``; returns ``{"model": path, "root": root,
    key: path of that split, ...}``.
    """
    root = Path(root)
    out = {"model": make_tiny_text_model(root / "st", sentence_transformers=True), "root": root}
    for key, (name, rows, seed) in splits.items():
        out[key] = write_toy_tsv(root / name, make_toy_text_dataset(rows, seed=seed))
    return out
