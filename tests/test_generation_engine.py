"""Per-example gradients of causal LMs (summed response loss) through PrivateGradient, against a per-example
autograd loop (float64): GPT-2 (HF Conv1D, biases, tied wte/lm_head), LLaMA (RMSNorm, no biases, tied or
untied embeddings, as in SmolLM2), and LoRA adapters on q/v projections."""

from __future__ import annotations

import warnings

import pytest
import torch

from privtune.data.generation import GenerationDataset, tokenize_generation
from privtune.engine import PrivateGradient
from privtune.errors import UnsupportedModuleError
from privtune.models.causal_lm import sequence_losses
from privtune.models.testing_causal_lm import make_tiny_causal_lm

pytest.importorskip("transformers")

PAIRS = [
    ("hello how are you ?", "i am fine thanks ."),
    ("what do you like to eat ?", "italian food !"),
    ("name : the eagle | eatType : pub", "the eagle is a pub in the city centre ."),
    ("are you good ?", "yes"),
    ("hello", "hello how are you ? i am good ."),
]


def _batch(tok):
    ds = GenerationDataset(prompts=[p for p, _ in PAIRS], responses=[r for _, r in PAIRS])
    return tokenize_generation(ds, tok, max_length=16).collate()


def _model(arch, tie=True):
    model, tok = make_tiny_causal_lm(arch=arch, tie_word_embeddings=tie)
    return model.double(), tok


def _losses(model, batch, rows=slice(None)):
    out = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows])
    return sequence_losses(out.logits, batch["labels"][rows])


def _reference(model, batch, params, C):
    """Per-example loop: autograd of loss_i alone (a batch of one), flat clipping, sum."""
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        gs = torch.autograd.grad(_losses(model, batch, slice(i, i + 1)).sum(), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    G = torch.stack(rows)
    norms = G.norm(dim=1)
    return norms, ((C / norms).clamp(max=1.0)[:, None] * G).sum(0)


def _engine(model, batch, C):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    assert not [w for w in caught if "fallback" in str(w.message)], [str(w.message) for w in caught]
    norms = pg.backward(_losses(model, batch))
    pg.release()
    kinds = pg.describe()
    pg.close()
    return norms, kinds


def _check(model, tok):
    batch = _batch(tok)
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    ref_norms, _ = _reference(model, batch, params, 1.0)
    C = float(ref_norms.median())  # about half the examples are clipped
    ref_norms, ref_sum = _reference(model, batch, params, C)
    norms, kinds = _engine(model, batch, C)
    got = torch.cat([p.grad.reshape(-1) for p in params])
    assert torch.allclose(norms, ref_norms, rtol=1e-9, atol=0)
    assert (got - ref_sum).norm() <= 1e-9 * ref_sum.norm()
    return kinds


def test_gpt2_tied_conv1d_biases_match_per_example_loop():
    model, tok = _model("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    kinds = _check(model, tok)
    assert kinds["transformer.wte"] == "embedding" and kinds["transformer.h.0.attn.c_attn"] == "linear"
    assert "fallback" not in kinds.values()


@pytest.mark.parametrize("tie", [True, False])
def test_llama_rmsnorm_no_bias_matches_per_example_loop(tie):
    model, tok = _model("llama", tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    kinds = _check(model, tok)
    assert kinds["model.norm"] == "rmsnorm" and kinds["model.layers.0.input_layernorm"] == "rmsnorm"
    assert kinds["model.embed_tokens"] == "embedding"


def test_tied_weight_norm_includes_cross_term():
    """‖E_i + L_i‖ differs from √(‖E_i‖² + ‖L_i‖²): the engine must give the former (the loop's)."""
    model, tok = _model("llama", tie=True)
    model.requires_grad_(False)
    W = model.model.embed_tokens.weight
    W.requires_grad_(True)
    batch = _batch(tok)
    ref_norms, _ = _reference(model, batch, [W], 1.0)
    norms, kinds = _engine(model, batch, 1e6)
    assert set(kinds) == {"model.embed_tokens", "lm_head"}  # one parameter, both of its uses handled
    assert torch.allclose(norms, ref_norms, rtol=1e-9, atol=0)
    # the same weights untied: per-example gradients of the two uses separately
    import copy
    untied = copy.deepcopy(model)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    parts = [untied.model.embed_tokens.weight, untied.lm_head.weight]
    no_cross = []
    for i in range(len(PAIRS)):
        E, L = torch.autograd.grad(_losses(untied, batch, slice(i, i + 1)).sum(), parts)
        assert torch.allclose((E + L).norm(), ref_norms[i], rtol=1e-9)  # one gradient: the sum of both uses
        no_cross.append(torch.sqrt(E.norm() ** 2 + L.norm() ** 2))
    assert ((torch.stack(no_cross) - ref_norms).abs() > 1e-3 * ref_norms).any()  # the cross term matters here


def test_tied_weight_refused_with_per_layer_clipping():
    model, _ = _model("gpt2")
    with pytest.raises(UnsupportedModuleError, match="tied"):
        PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0, per_layer=True)


def test_lora_q_v_matches_per_example_loop():
    peft = pytest.importorskip("peft")
    model, tok = _model("llama", tie=True)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], bias="none")
    lm = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)
    for n, p in lm.named_parameters():  # LoRA B starts at 0: give it values so both factors get gradients
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    kinds = _check(lm, tok)
    assert kinds and all(k == "linear" for k in kinds.values())


def test_tied_weight_with_only_the_head_called():
    """inputs_embeds instead of input_ids: the embedding module never runs, the head's use is still counted
    (and not mistaken for an unattributable functional use of the weight)."""
    model, tok = _model("llama", tie=True)
    batch = _batch(tok)
    with torch.no_grad():
        embeds = model.model.embed_tokens(batch["input_ids"])

    def losses(rows=slice(None)):
        out = model(inputs_embeds=embeds[rows], attention_mask=batch["attention_mask"][rows])
        return sequence_losses(out.logits, batch["labels"][rows])

    W = model.lm_head.weight
    ref = torch.stack([torch.autograd.grad(losses(slice(i, i + 1)).sum(), W)[0].norm() for i in range(len(PAIRS))])
    pg = PrivateGradient(model, max_grad_norm=1e6, noise_multiplier=0.0, expected_batch_size=1.0)
    norms = pg.backward(losses())
    pg.close()
    params = [p for p in model.parameters() if p.requires_grad and p is not W]
    rest = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses(slice(i, i + 1)).sum(), params)])
                        .norm() for i in range(len(PAIRS))])
    assert torch.allclose(norms, torch.sqrt(ref ** 2 + rest ** 2), rtol=1e-9, atol=0)


def test_weight_tied_to_a_third_module_is_refused():
    model, _ = _model("gpt2")
    model.extra_head = torch.nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False).double()
    model.extra_head.weight = model.lm_head.weight
    with pytest.raises(UnsupportedModuleError, match="tied weights"):
        PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
