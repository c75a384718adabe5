"""Decoding and scores for causal language models.

* :func:`generate`: greedy or beam-search continuations of prompts (Hugging Face ``generate``, no sampling,
  at most ``max_new_tokens`` new tokens each), in the prompt format used for training
  (:func:`privtune.data.generation.encode_prompt`).
* :func:`generation_scores`: corpus BLEU and chrF (``sacrebleu``, its default 13a tokenisation) and mean
  ROUGE-L F1 (``rouge-score``, with the Porter stemmer; the best reference per example), all in [0, 100];
  one or several references per example.
* :func:`perplexity`: ``exp`` of the mean negative log-likelihood per response token on a tokenised split.

``sacrebleu`` and ``rouge-score`` come with ``pip install privtune[generation]``.  Scores computed on private
data are NOT PRIVATE unless released through a charged mechanism; on a public split they are public.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Sequence

from privtune.data.generation import DEFAULT_TEMPLATE, TokenizedGeneration, encode_prompt
from privtune.errors import DataError, InvalidParameterError, ModelError

__all__ = ["generate", "generation_scores", "perplexity"]


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelError(
            f"Generation scores need the package `{package}`, which is not installed. Install it with "
            f"`pip install {package}` (or `pip install privtune[generation]`)."
        ) from None


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(f"`{name}` must be an integer ≥ 1. Got {value!r}.")
    return value


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = 32, num_beams: int = 1,
             batch_size: int = 8, template: str = DEFAULT_TEMPLATE, max_prompt_tokens: int | None = None) -> list[str]:
    """Deterministic continuations of ``prompts``: greedy (``num_beams=1``) or beam search, each at most
    ``max_new_tokens`` tokens, stopping at the tokenizer's eos; returned as decoded text without special tokens.

    Prompts are left-padded into batches of ``batch_size`` (the model sees no padding between prompt and
    continuation); with ``max_prompt_tokens`` a longer prompt keeps its last tokens (the end of a context
    matters most, as in training).  The model's mode is left as it was."""
    import torch

    max_new_tokens = _check_positive_int(max_new_tokens, "max_new_tokens")
    num_beams = _check_positive_int(num_beams, "num_beams")
    batch_size = _check_positive_int(batch_size, "batch_size")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, p, template) for p in prompts[start:start + batch_size]]
            if max_prompt_tokens is not None:
                encoded = [e[len(e) - max_prompt_tokens:] if len(e) > max_prompt_tokens else e for e in encoded]
            T = max(len(e) for e in encoded)
            ids = torch.full((len(encoded), T), pad, dtype=torch.long)
            mask = torch.zeros((len(encoded), T), dtype=torch.long)
            for i, e in enumerate(encoded):
                ids[i, T - len(e):] = torch.tensor(e, dtype=torch.long)
                mask[i, T - len(e):] = 1
            with torch.no_grad():
                gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                     num_beams=num_beams, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                     eos_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)
            out += [tokenizer.decode(g[T:], skip_special_tokens=True).strip() for g in gen]
    finally:
        model.train(was_training)
    return out


def _reference_lists(references: Sequence[Any], n: int) -> list[list[str]]:
    if len(references) != n:
        raise DataError(f"generation_scores: {n} hypotheses but {len(references)} references; pass one entry each.")
    refs = [[r] if isinstance(r, str) else list(r) for r in references]
    if any(not r or not all(isinstance(x, str) for x in r) for r in refs):
        raise DataError("generation_scores: each reference must be a string or a non-empty list of strings.")
    return refs


def generation_scores(hypotheses: Sequence[str], references: Sequence[str | Sequence[str]]) -> dict[str, float]:
    """``{"bleu", "chrf", "rouge_l"}`` in [0, 100] for generated texts against one or more references each.

    BLEU and chrF are corpus-level (sacrebleu ``corpus_bleu``/``corpus_chrf``; examples with fewer references
    than others are padded as sacrebleu expects); ROUGE-L is the mean over examples of the F1 against the best
    reference (``RougeScorer.score_multi``).  A hypothesis equal to its reference scores 100 on all three (BLEU
    needs at least one 4-gram in the corpus); an empty one contributes 0."""
    sacrebleu = _require("sacrebleu", "sacrebleu")
    rouge_scorer = _require("rouge_score.rouge_scorer", "rouge-score")
    hyps = [h if isinstance(h, str) else str(h) for h in hypotheses]
    if not hyps:
        raise DataError("generation_scores: no hypotheses; pass at least one generated text.")
    refs = _reference_lists(references, len(hyps))
    k = max(len(r) for r in refs)
    streams = [[r[j] if j < len(r) else None for r in refs] for j in range(k)]
    bleu = sacrebleu.corpus_bleu(hyps, streams).score
    chrf = sacrebleu.corpus_chrf(hyps, streams).score
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rouge = sum(scorer.score_multi(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)) / len(hyps)
    return {"bleu": float(bleu), "chrf": float(chrf), "rouge_l": 100.0 * float(rouge)}


def perplexity(model: Any, tokenized: TokenizedGeneration, *, batch_size: int = 8) -> float:
    """``exp(Σ NLL / number of response tokens)`` over the split (natural log inside, so the unit is
    "per token"); the loss counts response tokens only, as in training."""
    import torch

    from privtune.models.causal_lm import sequence_losses

    batch_size = _check_positive_int(batch_size, "batch_size")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for start in range(0, len(tokenized), batch_size):
            b = tokenized.collate(range(start, min(start + batch_size, len(tokenized))))
            with torch.no_grad():
                logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
            total += float(sequence_losses(logits, b["labels"].to(device)).sum())
            tokens += int((b["labels"][:, 1:] != -100).sum())
    finally:
        model.train(was_training)
    if tokens == 0:
        raise DataError("perplexity: the split has no response tokens.")
    return math.exp(total / tokens)
