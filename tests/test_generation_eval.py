"""Decoding and generation scores on a fixed tiny causal LM (random weights, seed 0)."""

from __future__ import annotations

import math

import pytest
import torch

from privtune.data.generation import GenerationDataset, encode_prompt, tokenize_generation
from privtune.errors import DataError, InvalidParameterError
from privtune.eval.generation import generate, generation_scores, perplexity
from privtune.models.causal_lm import sequence_losses
from privtune.models.testing_causal_lm import make_tiny_causal_lm

pytest.importorskip("sacrebleu")
pytest.importorskip("rouge_score")

PROMPTS = ["hello how are you ?", "what do you like to eat ?", "name : the eagle | area : riverside"]
SENTENCES = ["the eagle is a coffee shop in the city centre .", "the mill serves cheap italian food near the river ."]


def test_perfect_prediction_scores_100_and_empty_scores_0():
    perfect = generation_scores(SENTENCES, SENTENCES)
    assert perfect == pytest.approx({"bleu": 100.0, "chrf": 100.0, "rouge_l": 100.0})
    empty = generation_scores(["", ""], SENTENCES)
    assert empty == {"bleu": 0.0, "chrf": 0.0, "rouge_l": 0.0}


def test_multiple_references_score_against_the_best_one():
    refs = [["a completely different sentence about nothing at all", SENTENCES[0]], [SENTENCES[1]]]
    assert generation_scores(SENTENCES, refs) == pytest.approx({"bleu": 100.0, "chrf": 100.0, "rouge_l": 100.0})
    assert generation_scores(SENTENCES, [[r[0]] for r in refs])["bleu"] < 100.0


def test_rouge_l_is_the_lcs_f1():
    # LCS("cat dog bird fish", "cat dog tree fish") = 3 words: P = R = 3/4, F1 = 0.75
    assert generation_scores(["cat dog bird fish"], ["cat dog tree fish"])["rouge_l"] == pytest.approx(75.0)


def test_score_errors():
    with pytest.raises(DataError, match="2 hypotheses but 1 references"):
        generation_scores(SENTENCES, SENTENCES[:1])
    with pytest.raises(DataError, match="no hypotheses"):
        generation_scores([], [])


def _greedy_reference(model, tok, prompt, max_new_tokens):
    ids = torch.tensor([encode_prompt(tok, prompt)])
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return tok.decode(new, skip_special_tokens=True).strip()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_decoding_matches_an_argmax_loop_and_ignores_batching(arch):
    model, tok = make_tiny_causal_lm(arch=arch)
    expected = [_greedy_reference(model, tok, p, 6) for p in PROMPTS]
    assert generate(model, tok, PROMPTS, max_new_tokens=6, batch_size=1) == expected
    assert generate(model, tok, PROMPTS, max_new_tokens=6, batch_size=3) == expected  # left padding is invisible
    assert generate(model, tok, PROMPTS, max_new_tokens=6, num_beams=1) == expected


def test_beam_search_respects_max_new_tokens():
    model, tok = make_tiny_causal_lm(arch="llama")
    out = generate(model, tok, PROMPTS, max_new_tokens=4, num_beams=3)
    assert len(out) == len(PROMPTS)
    assert all(len(tok(o, add_special_tokens=False)["input_ids"]) <= 4 for o in out)
    with pytest.raises(InvalidParameterError, match="max_new_tokens"):
        generate(model, tok, PROMPTS, max_new_tokens=0)


def test_perplexity_is_exp_of_mean_response_token_nll():
    model, tok = make_tiny_causal_lm(arch="gpt2")
    ds = GenerationDataset(prompts=PROMPTS[:2], responses=SENTENCES)
    tg = tokenize_generation(ds, tok, max_length=32)
    b = tg.collate()
    with torch.no_grad():
        nll = sequence_losses(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    n_tokens = sum(len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in SENTENCES)  # + eos each
    assert perplexity(model, tg, batch_size=1) == pytest.approx(math.exp(float(nll.sum()) / n_tokens), rel=1e-5)
    # a random model is close to uniform over the vocabulary
    assert 0.3 * len(tok) < perplexity(model, tg) < 3 * len(tok)
