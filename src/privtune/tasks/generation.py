"""Text generation: a causal language model fine-tuned on prompt → response pairs.

* splits: JSONL/CSV/TSV files with a prompt and a response column (detected by name:
  :data:`privtune.data.generation.PROMPT_COLUMN_CANDIDATES` / ``RESPONSE_COLUMN_CANDIDATES``; ``text_column``
  names the prompt column and ``label_column`` the response column when given), or ``embedded:chitchat``;
* model: :class:`privtune.models.generator.Generator` (a name such as ``smollm2-135m`` or a Hugging Face
  causal-LM directory);
* per-example loss: the summed negative log-likelihood of the example's response tokens (the prompt and the
  padding carry no loss);
* evaluation: perplexity per response token, and BLEU, chrF and ROUGE-L of greedy generations against the
  responses (:mod:`privtune.eval.generation`);
* predict: greedy or beam-search generations.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from privtune.errors import DataError, InvalidParameterError

#: ``--data`` value of the generation demo: the chitchat slice shipped with privtune
EMBEDDED_CHITCHAT = "embedded:chitchat"
#: how many reported rows are decoded for BLEU/chrF/ROUGE-L by default (perplexity uses every row)
DEFAULT_SCORED_ROWS = 200
#: new tokens per generation when scoring
SCORE_MAX_NEW_TOKENS = 32
#: prompts decoded together when scoring: each greedy step reads every weight once for the whole batch, so 32
#: prompts decode about twice as fast per prompt as 8 on a 2-core CPU (SmolLM2-135M, chitchat prompts)
SCORE_DECODE_BATCH_SIZE = 32


class Generation:
    """Fine-tune a causal LM on prompt → response pairs (see the module doc)."""

    name = "text-generation"
    kind = "generation"

    def load_split(self, data: Any, what: str, *, text_column: str | None = None, label_column: str | None = None,
                   num_labels: int | None = None, label_names: Sequence[str] | None = None,
                   labelled: bool = True) -> Any:
        """A :class:`~privtune.data.generation.GenerationDataset`; with ``labelled`` every row needs a response."""
        from privtune.data.generation import GenerationDataset, load_generation_dataset

        if data is None:
            raise InvalidParameterError(f"`{what}` is required for a {self.name} split.")
        if getattr(data, "kind", self.kind) != self.kind:
            raise DataError(f"`{what}` holds {data.kind} inputs, but this is a {self.name} run on prompt → response "
                            "pairs.")
        if isinstance(data, str) and data.startswith("embedded:"):
            raise DataError(f"`{what}`: {data!r} names a whole demo; pass a file of prompt → response pairs.")
        split = load_generation_dataset(data, prompt_column=text_column, response_column=label_column,
                                        require_responses=labelled)
        if not isinstance(split, GenerationDataset) or len(split) == 0:
            raise DataError(f"`{what}` has no examples. Pass a file with prompt → response rows.")
        return split

    def build_model(self, model: Any, *, num_labels: int = 0, label_names: Sequence[str] | None = None,
                    pooling: str = "auto", max_length: int | None = None, seed: int | None = None) -> nn.Module:
        from privtune.models.generator import load_generator

        return load_generator(model, max_length=max_length)

    def batch(self, model: nn.Module, data: Any, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` (right-padded) and token ``labels`` (B, T): the response's ids,
        ``-100`` on the prompt and the padding (:meth:`privtune.models.generator.Generator.tokenized`)."""
        return model.tokenized(data).collate(torch.as_tensor(idx).tolist())

    def per_example_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The summed negative log-likelihood (nats) of each row's response tokens."""
        from privtune.models.causal_lm import sequence_losses

        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return sequence_losses(logits, batch["labels"])

    def evaluate(self, model: nn.Module, data: Any, *, batch_size: int = 8, scored_rows: int | None = None,
                 generate: bool = True) -> dict:
        """``{"perplexity", "loss", "n"}`` on every row, and with ``generate`` ``{"bleu", "chrf", "rouge_l",
        "scored_rows"}`` of greedy generations for the first ``scored_rows`` rows (default
        :data:`DEFAULT_SCORED_ROWS`, decoded :data:`SCORE_DECODE_BATCH_SIZE` at a time) against their responses.
        ``loss`` is the mean NLL per response token; ``batch_size`` rows at a time make the perplexity."""
        import math

        from privtune.eval.generation import generation_scores, perplexity

        if getattr(data, "responses", None) is None:
            raise DataError("The evaluation split has no responses; scores need prompt → response pairs.")
        ppl = perplexity(model.backbone, model.tokenized(data), batch_size=batch_size)
        out = {"perplexity": ppl, "loss": math.log(ppl), "n": len(data)}
        if generate:
            k = min(len(data), DEFAULT_SCORED_ROWS if scored_rows is None else int(scored_rows))
            hyps = model.generate(data.prompts[:k], max_new_tokens=SCORE_MAX_NEW_TOKENS,
                                  batch_size=SCORE_DECODE_BATCH_SIZE)
            out.update(generation_scores(hyps, data.responses[:k]))
            out["scored_rows"] = k
        return out

    def predict(self, model: nn.Module, data: Any, *, batch_size: int = 8, max_new_tokens: int = 32,
                num_beams: int = 1) -> list:
        """One generated response per prompt."""
        return model.generate(data.prompts, max_new_tokens=max_new_tokens, num_beams=num_beams, batch_size=batch_size)

    def samples(self, model: nn.Module, public: Any, k: int = 5, *, max_new_tokens: int = 32) -> list[dict]:
        """Up to ``k`` generations for prompts of a split declared PUBLIC (for the report): never call it with
        private rows, whose prompts would then sit in a shareable file."""
        if public is None or len(public) == 0:
            return []
        prompts = public.prompts[:k]
        outs = model.generate(prompts, max_new_tokens=max_new_tokens)
        refs = public.responses[:k] if public.responses is not None else [None] * len(prompts)
        return [{"prompt": p, "generated": g, "reference": r} for p, g, r in zip(prompts, outs, refs)]


def check_generation_disjoint(train: Any, other: Any, what: str) -> None:
    """Refuse a split that shares a (prompt, response) pair with the training data; the message gives a count,
    never a row."""
    if other is None:
        return
    shared = set(train.canonical_rows()) & set(other.canonical_rows())
    if shared:
        raise DataError(f"`{what}` overlaps the training data: {len(shared)} prompt → response pair(s) appear in "
                        "both. Scores must come from held-out pairs; remove the shared pairs from one of the files.")


__all__ = ["EMBEDDED_CHITCHAT", "Generation", "check_generation_disjoint"]
