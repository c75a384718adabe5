"""PrivateGradient: noise, accumulation, resume, samplers, bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privtune.engine import (
    PoissonSampler,
    PrivateGradient,
    ShuffleSampler,
    clipping_diagnostics,
    optimal_clip_mse,
    clip_mse,
    per_example_gradients,
    retained_weight,
)
from privtune.errors import InvalidParameterError, PrivtuneError, UnsupportedModuleError


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).double()


def _data(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_accumulation_equals_one_batch():
    x, y = _data(12)
    out = []
    for splits in ([12], [5, 0, 4, 3]):
        model = _mlp()
        pg = PrivateGradient(model, max_grad_norm=0.3, noise_multiplier=1.3, expected_batch_size=10.0, seed=7)
        start = 0
        for s in splits:
            if s:
                pg.backward(F.cross_entropy(model(x[start:start + s]), y[start:start + s], reduction="none"))
            start += s
        info = pg.release()
        assert info.batch_size == 12 and info.step == 1
        out.append(_grads(model))
    assert torch.allclose(out[0], out[1], rtol=1e-12, atol=1e-14)


def test_divides_by_expected_not_realised_batch_size():
    x, y = _data(5)
    model = _mlp()
    pg = PrivateGradient(model, max_grad_norm=1e6, noise_multiplier=0.0, expected_batch_size=20.0)
    pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    pg.release()
    got = _grads(model)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    assert torch.allclose(got, _grads(model) / 20.0, rtol=1e-10)


def test_noise_std_and_noise_added_once_per_logical_batch():
    model = nn.Linear(50, 40, bias=True).double()
    C, sigma, ebs = 0.5, 2.0, 4.0
    pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=ebs, seed=3)
    x = torch.zeros(3, 50, dtype=torch.float64)  # zero input and zero loss: data gradient exactly 0
    draws = []
    for _ in range(20):
        for _ in range(3):  # three micro-batches, one logical batch: noise must be added once
            pg.backward((model(x) * 0).sum(1))
        info = pg.release()
        draws.append(torch.cat([model.weight.grad.reshape(-1), model.bias.grad]))
    z = torch.stack(draws) * ebs  # std of the noise on the sum
    assert info.microbatches == 3
    assert abs(z.std().item() / (sigma * C) - 1) < 0.02
    assert abs(z.mean().item()) < 0.05 * sigma * C
    assert info.noise_std == pytest.approx(sigma * C / ebs)


def test_empty_batch_release_is_noise_only():
    model = _mlp()
    pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, seed=0)
    info = pg.release()
    assert info.batch_size == 0 and info.clipped_fraction == 0.0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_resume_reproduces_noise_bit_for_bit():
    x, y = _data(12)

    def run(interrupt):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=6, seed=11)
        sampler = PoissonSampler(12, 0.5, seed=5, steps=6)
        it = iter(sampler)
        for step in range(6):
            if interrupt and step == 3:  # checkpoint, rebuild everything, restore
                ck = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
                      "pg": pg.state_dict(), "sampler": sampler.state_dict()}
                pg.close()
                model = _mlp(seed=99)
                model.load_state_dict(ck["model"])
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                opt.load_state_dict(ck["opt"])
                pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=6)
                pg.load_state_dict(ck["pg"])
                sampler = PoissonSampler(12, 0.5, steps=3)
                sampler.load_state_dict(ck["sampler"])
                it = iter(sampler)
            idx = next(it)
            if len(idx):
                pg.backward(F.cross_entropy(model(x[idx]), y[idx], reduction="none"))
            pg.release()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), pg.seed

    a, seed_a = run(False)
    b, seed_b = run(True)
    assert torch.equal(a, b)
    assert seed_a == seed_b == 11


def test_seed_none_is_random_and_not_exposed():
    model = _mlp()
    a = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    a.release()
    ga = _grads(model)
    a.close()
    b = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    b.release()
    assert a.seed is None and b.seed is None
    assert not torch.equal(ga, _grads(model))


def test_poisson_batch_sizes_match_q():
    n, q, steps = 400, 0.05, 400
    s = PoissonSampler(n, q, seed=0, steps=steps)
    sizes = torch.tensor([len(b) for b in s], dtype=torch.float64)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean().item() - mean) < 4 * (var / steps) ** 0.5
    assert abs(sizes.var().item() / var - 1) < 0.25
    assert s.expected_batch_size == pytest.approx(20.0)
    small = PoissonSampler(10, 0.01, seed=1, steps=200)
    assert any(len(b) == 0 for b in small)  # empty batches occur and are yielded
    full = list(PoissonSampler(7, 1.0, steps=2))
    assert all(torch.equal(b, torch.arange(7)) for b in full)


def test_shuffle_sampler_covers_each_example_once_per_epoch():
    s = ShuffleSampler(10, 4, seed=0)
    batches = list(s)
    assert [len(b) for b in batches] == [4, 4, 2] and len(s) == 3
    assert torch.equal(torch.cat(batches).sort().values, torch.arange(10))
    assert s.sampling == "shuffle" and "without amplification" in s.accounting_note


def test_bad_inputs():
    model = _mlp()
    with pytest.raises(InvalidParameterError, match="max_grad_norm"):
        PrivateGradient(model, max_grad_norm=0, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        PrivateGradient(model, max_grad_norm=1, noise_multiplier=-1.0, expected_batch_size=4)
    with pytest.raises(InvalidParameterError, match="expected_batch_size"):
        PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=0)
    with pytest.raises(InvalidParameterError, match="clipping"):
        PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4, clipping="flatt")
    with pytest.raises(InvalidParameterError, match="model"):
        PrivateGradient("bert", max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    frozen = _mlp().requires_grad_(False)
    with pytest.raises(InvalidParameterError, match="requires_grad"):
        PrivateGradient(frozen, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    x, y = _data(4)
    with pytest.raises(InvalidParameterError, match="reduction='none'"):
        pg.backward(F.cross_entropy(model(x), y))
    with pytest.raises(InvalidParameterError, match="one entry per example"):
        pg.backward(F.cross_entropy(model(x), y, reduction="none")[:3])
    # NaN losses do not stop the step (a stop after the reservation would reveal a sampled row): dropped
    pg.backward(F.cross_entropy(model(x), y, reduction="none") * float("nan"))
    with pytest.raises(InvalidParameterError, match="losses"):
        pg.backward([1.0, 2.0])
    pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    with pytest.raises(InvalidParameterError, match="release"):
        pg.state_dict()
    info = pg.release()
    assert info.nonfinite_examples == 4 and info.batch_size == 8
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    other = PrivateGradient(model, max_grad_norm=2, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(InvalidParameterError, match="max_grad_norm"):
        other.load_state_dict(pg.state_dict())
    with pytest.raises(PrivtuneError):
        PoissonSampler(0, 0.1)
    with pytest.raises(InvalidParameterError, match="sample_rate"):
        PoissonSampler(10, 1.5)
    with pytest.raises(InvalidParameterError, match="batch_size"):
        ShuffleSampler(10, 11)


def test_batchnorm_in_train_mode_is_refused_with_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    with pytest.raises(UnsupportedModuleError, match="GroupNorm"):
        PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    model.eval()
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    model.train()
    with pytest.raises(UnsupportedModuleError, match="eval"):
        model(torch.randn(3, 4, dtype=torch.float64))
    pg.close()


def test_functional_use_of_trainable_weight_is_not_dropped():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 2)

        def forward(self, x):
            return self.b(F.linear(x, self.a.weight))  # self.a is never called

    model = Tied().double()
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(UnsupportedModuleError, match="a.weight"):
        pg.backward(model(x).sum(1))


def test_fallback_with_active_dropout_is_refused():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x * self.w)

    model = nn.Sequential(Drop(), nn.Linear(3, 1)).double()
    with pytest.warns(UserWarning, match="fallback"):
        pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(UnsupportedModuleError, match="dropout"):
        pg.backward(model(torch.randn(4, 3, dtype=torch.float64)).sum(1))


def test_hf_bert_plain_call_in_train_mode_runs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).train()
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=8, seed=0)
    ids = torch.randint(0, 30, (5, 7))
    norms = pg.backward(F.cross_entropy(model(ids, torch.ones_like(ids)).logits, torch.zeros(5, dtype=torch.long),
                                        reduction="none"))
    assert norms.shape == (5,) and torch.isfinite(norms).all()
    info = pg.release()
    assert info.batch_size == 5
    assert model.bert.embeddings.position_embeddings.weight.grad is not None


def test_diagnostics_are_labelled_and_correct():
    norms = torch.tensor([0.5, 2.0, 4.0, 1.0])
    d = clipping_diagnostics(norms, 1.0, labels=[0, 1, 1, 0], num_classes=3)
    assert d["label"] == "NOT PRIVATE"
    assert d["fraction_clipped"] == pytest.approx(0.5)
    assert d["retained_weight_per_class"][:2] == pytest.approx([1.0, (0.5 + 0.25) / 2])
    assert torch.isnan(retained_weight(norms, [0, 1, 1, 0], 1.0, 3)[2])
    torch.manual_seed(0)
    G = torch.randn(20, 5, dtype=torch.float64) * torch.rand(20, 1, dtype=torch.float64) * 3
    best = optimal_clip_mse(G, 0.7)
    grid = torch.linspace(0.01, float(G.norm(dim=1).max()), 4001)
    assert best["mse"] <= min(clip_mse(G, float(c), 0.7) for c in grid) + 1e-9
    assert best["label"] == "NOT PRIVATE"
    assert optimal_clip_mse(G, 0.0)["C"] == pytest.approx(float(G.norm(dim=1).max()))
    model = _mlp()
    x, y = _data(3)
    pe = per_example_gradients(F.cross_entropy(model(x), y, reduction="none"), list(model.parameters()))
    pg = PrivateGradient(model, max_grad_norm=1e9, noise_multiplier=0.0, expected_batch_size=1)
    norms = pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert torch.allclose(norms, pe.norm(dim=1), rtol=1e-10)


def test_bias_only_layers_keep_no_activations():
    """DP-BiTFiT: bias-only layers store no input and reduce the output gradient to (B, p) at once."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).eval()
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=8)
    ids = torch.randint(0, 30, (3, 9))
    logits = model(ids).logits
    recorded = [h for h in pg.handlers if h.records]
    assert recorded and all(r.act is None for h in recorded for r in h.records)
    seen = []
    for h in recorded:  # after backward, every stored gradient is already reduced to (B, p)
        orig = h.finish

        def spy(h=h, orig=orig):
            seen.extend(r.grads[0].shape for r in h.records)
            return orig()
        h.finish = spy
    pg.backward(F.cross_entropy(logits, torch.zeros(3, dtype=torch.long), reduction="none"))
    assert seen and all(len(s) == 2 and s[0] == 3 for s in seen)


def test_sensitivity_one_adversarial_example_moves_sum_by_at_most_C():
    x, y = _data(9)
    x_adv = x.clone()
    x_adv[-1] *= 1e4
    for clipping in ("flat", "automatic"):
        sums = []
        for xb in (x[:-1], x_adv):
            model = _mlp()
            pg = PrivateGradient(model, max_grad_norm=0.7, noise_multiplier=0.0, expected_batch_size=1.0,
                                 clipping=clipping)
            pg.backward(F.cross_entropy(model(xb), y[: len(xb)], reduction="none"))
            pg.release()
            sums.append(_grads(model))
        assert (sums[1] - sums[0]).norm() <= 0.7 * (1 + 1e-9)


def test_activation_checkpointing_is_refused():
    from torch.utils.checkpoint import checkpoint

    class Ck(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x):
            return self.b(checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False))

    model = Ck().double()
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(UnsupportedModuleError, match="checkpointing"):
        pg.backward(model(torch.randn(3, 4, dtype=torch.float64)).sum(1))


def test_losses_from_an_older_forward_pass_are_refused():
    model = _mlp()
    pg = PrivateGradient(model, max_grad_norm=1, noise_multiplier=1.0, expected_batch_size=4)
    x, y = _data(4)
    old = F.cross_entropy(model(x), y, reduction="none")
    model(x * 2)  # a second forward pass (e.g. evaluation with grad enabled) replaces the records
    with pytest.raises(InvalidParameterError, match="most recent forward"):
        pg.backward(old)
    with pg.paused():
        model(x * 2)
    pg.backward(F.cross_entropy(model(x), y, reduction="none"))
