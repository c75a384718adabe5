"""PrivateGradient per-example norms and clipped sums against a naive per-example loop (float64)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privtune.engine import PrivateGradient

transformers = pytest.importorskip("transformers")

B, T = 4, 6


def _oracle(forward_one, n, params, C, clipping="flat", gamma=0.01):
    """Per-example loop: grads of loss_i alone (batch of one), then clip and sum."""
    rows = []
    for i in range(n):
        loss = forward_one(i)
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    G = torch.stack(rows)
    norms = G.norm(dim=1)
    c = (C / norms).clamp(max=1.0) if clipping == "flat" else C / (norms + gamma)
    return norms, (c[:, None] * G).sum(0)


def _check(model, forward_batch, forward_one, n, C=None, clipping="flat", expect_fallback=False):
    params = [p for p in model.parameters() if p.requires_grad]
    ref_norms, ref_sum = _oracle(forward_one, n, params, C if C else 1.0, clipping)
    if C is None:  # make clipping active for about half the examples
        C = float(ref_norms.median())
        ref_norms, ref_sum = _oracle(forward_one, n, params, C, clipping)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0, clipping=clipping)
    assert any("fallback" in str(x.message) for x in w) == expect_fallback
    norms = pg.backward(forward_batch())
    pg.release()
    got = torch.cat([p.grad.reshape(-1) for p in params])
    pg.close()
    assert torch.allclose(norms, ref_norms, rtol=1e-6, atol=0)
    assert (got - ref_sum).norm() <= 1e-6 * ref_sum.norm()
    return norms


def _text_inputs(vocab, pad_last=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad_last:
        mask[0, T - 2:] = 0
        ids[0, T - 2:] = 1  # pad token id 1
    y = torch.randint(0, 3, (B,), generator=g)
    return ids, mask, y


def _set_mode(model, mode, head_names=("classifier", "score")):
    if mode == "full":
        return model
    for n, p in model.named_parameters():
        is_head = any(n.startswith(h) or f".{h}." in n for h in head_names)
        if mode == "bitfit":
            p.requires_grad_(n.endswith("bias") or is_head)
        elif mode == "last-layer":
            p.requires_grad_(is_head)
    return model


TEXT_MODELS = {
    "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, num_labels=3, pad_token_id=1)),
    "roberta": lambda: transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=20, num_labels=3, pad_token_id=1)),
    "gpt2": lambda: transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16, num_labels=3, pad_token_id=1)),
}


@pytest.mark.parametrize("arch", sorted(TEXT_MODELS))
@pytest.mark.parametrize("mode", ["full", "bitfit", "last-layer"])
def test_text_models_match_naive_loop(arch, mode):
    torch.manual_seed(0)
    model = _set_mode(TEXT_MODELS[arch]().double().eval(), mode)
    ids, mask, y = _text_inputs(40)

    def batch():
        return F.cross_entropy(model(ids, attention_mask=mask).logits, y, reduction="none")

    def one(i):
        return F.cross_entropy(model(ids[i:i + 1], attention_mask=mask[i:i + 1]).logits, y[i:i + 1])

    _check(model, batch, one, B)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_bert_clipping_styles(clipping):
    torch.manual_seed(0)
    model = TEXT_MODELS["bert"]().double().eval()
    ids, mask, y = _text_inputs(40)
    _check(model, lambda: F.cross_entropy(model(ids, attention_mask=mask).logits, y, reduction="none"),
           lambda i: F.cross_entropy(model(ids[i:i + 1], attention_mask=mask[i:i + 1]).logits, y[i:i + 1]),
           B, C=0.05, clipping=clipping)


def test_lora_peft_matches_naive_loop():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = TEXT_MODELS["bert"]().double().eval()
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], lora_dropout=0.0,
                          modules_to_save=["classifier"], task_type="SEQ_CLS")
    model = peft.get_peft_model(base, cfg).double().eval()
    for n, p in model.named_parameters():  # LoRA B starts at zero: perturb so its gradient path is exercised
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0, 0.5)
    ids, mask, y = _text_inputs(40)
    _check(model, lambda: F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y, reduction="none"),
           lambda i: F.cross_entropy(model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]).logits, y[i:i + 1]),
           B)


@pytest.mark.parametrize("mode", ["full", "bitfit"])
def test_vit_matches_naive_loop(mode):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=24, num_labels=3)
    model = _set_mode(transformers.ViTForImageClassification(cfg).double().eval(), mode)
    x = torch.randn(B, 3, 8, 8, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    # ViTEmbeddings owns cls_token / position_embeddings directly: handled by the torch.func fallback
    _check(model, lambda: F.cross_entropy(model(pixel_values=x).logits, y, reduction="none"),
           lambda i: F.cross_entropy(model(pixel_values=x[i:i + 1]).logits, y[i:i + 1]), B,
           expect_fallback=(mode == "full"))


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.c2 = nn.Conv2d(6, 8, 3, stride=2, padding="valid", groups=2)
        self.c3 = nn.Conv1d(8, 4, 2, dilation=2, padding=1)
        self.ln = nn.LayerNorm(4)
        self.emb = nn.Embedding(5, 4, padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, x, tok):
        h = torch.relu(self.gn(self.c1(x)))
        h = torch.relu(self.c2(h)).flatten(2)           # (B, 8, L)
        h = self.c3(h).transpose(1, 2)                   # (B, L', 4)
        h = self.ln(h).mean(1) + self.emb(tok).sum(1)
        return self.head(self.head.weight.new_ones(1) * h) + 0 * self.head(h).detach()


@pytest.mark.parametrize("mode", ["full", "bias"])
def test_conv_groupnorm_net_matches_naive_loop(mode):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    if mode == "bias":
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith("bias"))
    x = torch.randn(B, 3, 7, 7, dtype=torch.float64)
    tok = torch.tensor([[1, 0, 2], [3, 3, 0], [4, 1, 1], [0, 0, 2]])
    y = torch.tensor([0, 1, 2, 1])
    _check(model, lambda: F.cross_entropy(model(x, tok), y, reduction="none"),
           lambda i: F.cross_entropy(model(x[i:i + 1], tok[i:i + 1]), y[i:i + 1]), B)


class Reused(nn.Module):
    """A Linear called twice, plus a module type with no fast rule (fallback)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.scale = Scale(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.scale(torch.tanh(self.lin(torch.tanh(self.lin(x))))))


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.w


def test_reused_module_and_fallback():
    torch.manual_seed(0)
    model = Reused().double()
    x = torch.randn(B, 3, 5, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    _check(model, lambda: F.cross_entropy(model(x).mean(1), y, reduction="none"),
           lambda i: F.cross_entropy(model(x[i:i + 1]).mean(1), y[i:i + 1]), B, expect_fallback=True)


def test_linear_ghost_and_per_example_forms_agree():
    """Long sequences pick the per-example form, short ones the ghost form; both exact."""
    from privtune.engine._layers import _linear_weight_sq

    torch.manual_seed(0)
    for T_, d, p in [(3, 8, 8), (40, 4, 3)]:
        a = torch.randn(2, T_, d, dtype=torch.float64)
        g = torch.randn(2, T_, p, dtype=torch.float64)
        ref = torch.stack([(g[i].t() @ a[i]).pow(2).sum() for i in range(2)])
        assert torch.allclose(_linear_weight_sq(a, g), ref, rtol=1e-12)


class WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))


def test_multihead_attention_uses_fallback_for_all_its_parameters():
    torch.manual_seed(0)
    model = WithMHA().double().eval()
    x = torch.randn(B, 5, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    _check(model, lambda: F.cross_entropy(model(x), y, reduction="none"),
           lambda i: F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), B, expect_fallback=True)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_per_layer_clipping_matches_naive_loop(clipping):
    """per_layer=True: each module's part of g_i is clipped to C/√K separately (K modules)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 3)).double()
    x, y = torch.randn(B * 2, 5, dtype=torch.float64), torch.randint(0, 3, (B * 2,))
    modules = [m for m in model if any(p.requires_grad for p in m.parameters(recurse=False))]
    C = 0.3
    C_layer = C / len(modules) ** 0.5
    expected, total_sq = [], torch.zeros(len(x), dtype=torch.float64)
    for m in modules:
        ps = list(m.parameters())
        rows = []
        for i in range(len(x)):
            gs = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), ps)
            rows.append(torch.cat([g.reshape(-1) for g in gs]))
        G = torch.stack(rows)
        n = G.norm(dim=1)
        total_sq += n ** 2
        c = (C_layer / n).clamp(max=1.0) if clipping == "flat" else C_layer / (n + 0.01)
        expected.append((c[:, None] * G).sum(0))
    pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0, clipping=clipping,
                         per_layer=True)
    norms = pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    pg.release()
    got = torch.cat([torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in modules])
    want = torch.cat(expected)
    assert torch.allclose(norms, total_sq.sqrt(), rtol=1e-9)
    assert (got - want).norm() <= 1e-9 * want.norm()
    # every clipped per-example term still has norm <= C: the sensitivity (and so the noise) is unchanged
    assert float(want.norm()) <= len(x) * C + 1e-12
    with pytest.raises(Exception, match="per_layer"):
        PrivateGradient(model, max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=1.0, per_layer="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU-only run)")
def test_cuda_step_matches_cpu():
    """The DP step on a CUDA model clips and sums what the same step on the CPU does, and its noise is drawn on
    the GPU with the claimed scale, reproducibly for one seed."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).double()
    gpu = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).double().cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 3, (10,))

    def step(model, dev, sigma, seed=3):
        pg = PrivateGradient(model, max_grad_norm=0.5, noise_multiplier=sigma, expected_batch_size=10.0, seed=seed)
        pg.backward(F.cross_entropy(model(x.to(dev)), y.to(dev), reduction="none"))
        pg.release()
        out = torch.cat([p.grad.reshape(-1).cpu() for p in model.parameters()])
        pg.close()
        model.zero_grad(set_to_none=True)
        return out

    assert torch.allclose(step(cpu, "cpu", 0.0), step(gpu, "cuda", 0.0), rtol=1e-9, atol=1e-12)
    clean = step(gpu, "cuda", 0.0)
    noisy, again, other = step(gpu, "cuda", 1.0), step(gpu, "cuda", 1.0), step(gpu, "cuda", 1.0, seed=4)
    assert torch.equal(noisy, again) and not torch.equal(noisy, other)
    # noise std σ·C / expected batch size = 0.05 per coordinate (only 107 coordinates: a loose check)
    assert float((noisy - clean).std()) == pytest.approx(0.05, rel=0.3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU-only run)")
def test_privatise_sum_draws_cuda_noise_on_the_device():
    """A part on a GPU gets noise of the claimed scale drawn there; CPU parts keep the CPU stream."""
    from privtune.engine.mechanisms import privatise_sum

    parts = [torch.zeros(200_000, device="cuda"), torch.zeros(1000)]
    out = privatise_sum(parts, 2.0, 0.5, 4.0, torch.Generator().manual_seed(0)).value
    assert out[0].device.type == "cuda"
    assert float(out[0].std()) == pytest.approx(2.0 * 0.5 / 4.0, rel=0.02)
    assert float(out[0].mean()) == pytest.approx(0.0, abs=0.002)
    cpu_only = privatise_sum([torch.zeros(1000)], 2.0, 0.5, 4.0, torch.Generator().manual_seed(0)).value[0]
    assert not torch.equal(out[1], cpu_only)  # the device seed was drawn from the stream first


@pytest.mark.parametrize(
    "T_, p, d, form",
    [
        (4, 64, 64, "ghost"),          # short sequence, wide layer: 2T² = 32 < p·d = 4096
        (64, 4, 4, "per-example"),     # long sequence, narrow layer: 2T² = 8192 > p·d = 16
        (8, 13, 10, "ghost"),          # just below the boundary: 128 < 130
        (8, 16, 8, "per-example"),     # on the boundary 2T² = p·d = 128: the rule is strict
        (1, 5, 7, "rank-one"),
    ],
)
def test_linear_norm_form_is_chosen_by_cost(T_, p, d, form):
    """The cost rule 2T² vs p·d picks the form, and _linear_weight_sq really follows it: only the ghost
    form builds (and caches) the T×T Gram matrix of the layer input."""
    from privtune.engine._layers import _linear_weight_sq, linear_norm_form

    assert linear_norm_form(T_, p, d) == form
    torch.manual_seed(0)
    a = torch.randn(3, T_, d, dtype=torch.float64)
    g = torch.randn(3, T_, p, dtype=torch.float64)
    cache: dict = {}
    got = _linear_weight_sq(a, g, cache)
    assert len(cache) == (1 if form == "ghost" else 0)
    if form == "ghost":
        (_, gram), = cache.values()
        assert gram.shape == (3, T_, T_)
    ref = torch.stack([(g[i].t() @ a[i]).pow(2).sum() for i in range(3)])
    assert torch.allclose(got, ref, rtol=1e-12)


def test_private_gradient_uses_the_form_the_rule_picks(monkeypatch):
    """Through the DP step: a wide layer on a short sequence goes ghost, a narrow one on a long sequence
    goes per-example (recorded from the Gram cache each call leaves behind)."""
    import privtune.engine._layers as layers

    real = layers._linear_weight_sq
    seen = []

    def spy(a, g, cache=None, **kw):
        before = len(cache) if cache is not None else 0
        out = real(a, g, cache, **kw)
        seen.append(((a.shape[1], g.shape[-1], a.shape[-1]), (len(cache) if cache is not None else 0) > before))
        return out

    monkeypatch.setattr(layers, "_linear_weight_sq", spy)
    for T_, width, want_ghost in ((4, 48, True), (40, 3, False)):
        seen.clear()
        torch.manual_seed(0)
        lin = nn.Linear(width, width).double()
        x = torch.randn(B, T_, width, dtype=torch.float64)
        pg = PrivateGradient(lin, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
        pg.backward(lin(x).pow(2).mean((1, 2)))
        pg.release()
        pg.close()
        assert seen == [((T_, width, width), want_ghost)]
