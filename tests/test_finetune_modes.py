"""Fine-tuning modes (what is trainable), feature caching and the closed-form head step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privtune.errors import InvalidParameterError, ModelError
from privtune.finetune import (
    FeatureSet,
    LinearHeadGradient,
    apply_mode,
    cache_features,
    default_lora_target_modules,
)
from privtune.models import load_classifier
from privtune.models.testing import make_tiny_image_model, make_tiny_text_model, make_toy_text_dataset


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "bert": make_tiny_text_model(root / "bert", sentence_transformers=True),
        "roberta": make_tiny_text_model(root / "roberta", arch="roberta"),
        "gpt2": make_tiny_text_model(root / "gpt2", arch="gpt2"),
    }


def trainable(m):
    return {n for n, p in m.named_parameters() if p.requires_grad}


def test_full(paths):
    m = load_classifier(paths["bert"])
    info = apply_mode(m, "full")
    assert trainable(m) == {n for n, _ in m.named_parameters()}
    assert info.num_trainable == info.num_total


@pytest.mark.parametrize("arch", ["bert", "roberta", "gpt2"])
def test_bitfit_selects_biases_by_module_type_plus_head(paths, arch):
    m = load_classifier(paths[arch])
    info = apply_mode(m, "bitfit")
    head = {f"{n}" for n, p in m.named_parameters() if any(p is q for q in m.classification_head.parameters())}
    tr = trainable(m)
    assert head <= tr
    others = tr - head
    assert others and all(n.endswith(".bias") for n in others)
    # every Linear / LayerNorm / Conv1D bias in the backbone is included
    from privtune.finetune import BIAS_MODULE_TYPES

    expected = {f"{mn}.bias" for mn, mod in m.named_modules()
                if isinstance(mod, BIAS_MODULE_TYPES) and getattr(mod, "bias", None) is not None}
    assert expected <= tr
    assert info.fraction < 0.2


def test_bitfit_without_head(paths):
    m = load_classifier(paths["bert"])
    apply_mode(m, "bitfit", train_head=False)
    assert not any(p.requires_grad for p in m.classification_head.parameters())


def test_bitfit_on_a_model_without_biases_is_an_error(paths):
    m = load_classifier(paths["bert"])
    for mod in m.backbone.modules():
        if getattr(mod, "bias", None) is not None and isinstance(mod.bias, nn.Parameter):
            mod.bias = None
    with pytest.raises(ModelError, match="no biases"):
        apply_mode(m, "bitfit")


def test_last_layer_zero_initialised_head(paths):
    m = load_classifier(paths["bert"], seed=0)
    assert m.classification_head.weight.abs().sum() > 0
    info = apply_mode(m, "last-layer")
    assert trainable(m) == {"head.weight", "head.bias"}
    assert m.classification_head.weight.abs().sum() == 0 and m.classification_head.bias.abs().sum() == 0
    assert any("zero" in n for n in info.notes)


@pytest.mark.parametrize("arch, targets", [("bert", ["query", "value"]), ("roberta", ["query", "value"]),
                                           ("gpt2", ["c_attn"])])
def test_lora_default_targets(paths, arch, targets):
    pytest.importorskip("peft")
    m = load_classifier(paths[arch])
    assert default_lora_target_modules(m) == targets
    info = apply_mode(m, "lora", lora_rank=2)
    tr = trainable(m)
    lora = {n for n in tr if "lora_" in n}
    assert lora and all(any(t in n for t in targets) for n in lora)
    head = {n for n, p in m.named_parameters() if any(p is q for q in m.classification_head.parameters())}
    assert tr == lora | head
    assert info.lora_target_modules == targets


def test_lora_vit_default_and_bad_targets(tmp_path, paths):
    pytest.importorskip("peft")
    m = load_classifier(make_tiny_image_model(tmp_path / "vit"))
    targets = default_lora_target_modules(m)
    names = {n.rsplit(".", 1)[-1] for n, _ in m.backbone.named_modules()}
    assert len(targets) == 2 and set(targets) <= names  # query/value projections, whatever they are called
    apply_mode(m, "lora", lora_rank=2)
    assert any("lora_" in n for n, p in m.named_parameters() if p.requires_grad)
    m2 = load_classifier(paths["bert"])
    with pytest.raises(ModelError, match="target modules"):
        apply_mode(m2, "lora", lora_target_modules=["no_such_module"])


def test_two_phase_starts_with_everything(paths):
    m = load_classifier(paths["bert"])
    info = apply_mode(m, "two-phase")
    assert trainable(m) == {n for n, _ in m.named_parameters()}
    assert "phase 2" in info.notes[0]


def test_mode_errors(paths):
    m = load_classifier(paths["bert"])
    with pytest.raises(InvalidParameterError, match="'bitfit'"):
        apply_mode(m, "bitfitt")
    with pytest.raises(InvalidParameterError, match="Classifier"):
        apply_mode(nn.Linear(2, 2), "full")


def test_cache_features_matches_model_features_and_disk_cache(tmp_path, paths):
    m = load_classifier(paths["bert"])
    ds = make_toy_text_dataset(20)
    fs = cache_features(m, ds, batch_size=7, cache_dir=tmp_path / "cache")
    assert isinstance(fs, FeatureSet) and fs.features.shape == (20, m.num_features)
    with torch.no_grad():
        direct = m.features(**m.encode(ds, [3]))
    torch.testing.assert_close(fs.features[3:4], direct, atol=1e-5, rtol=1e-5)
    assert fs.labels.tolist() == ds.labels
    files = list((tmp_path / "cache").glob("*.pt"))
    assert len(files) == 1
    again = cache_features(m, ds, cache_dir=tmp_path / "cache")
    torch.testing.assert_close(again.features, fs.features)


def _manual_clipped_sum(head, X, y, C, clipping):
    rows_w, rows_b = [], []
    for i in range(X.shape[0]):
        head.zero_grad()
        nn.functional.cross_entropy(head(X[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        g = torch.cat([head.weight.grad.flatten(), head.bias.grad.flatten()])
        c = min(1.0, C / g.norm().item()) if clipping == "flat" else C / (g.norm().item() + 0.01)
        rows_w.append(c * head.weight.grad.clone())
        rows_b.append(c * head.bias.grad.clone())
    return torch.stack(rows_w).sum(0), torch.stack(rows_b).sum(0)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_linear_head_gradient_equals_naive_loop(clipping):
    torch.manual_seed(0)
    X = torch.randn(16, 5, dtype=torch.float64) * 2
    y = torch.randint(0, 3, (16,))
    head = nn.Linear(5, 3).double()
    step = LinearHeadGradient(head, max_grad_norm=0.7, noise_multiplier=0.0, expected_batch_size=8.0,
                              clipping=clipping)
    step.accumulate(X[:9], y[:9])
    step.accumulate(X[9:], y[9:])  # accumulation over micro-batches
    step.release()
    gw, gb = head.weight.grad.clone(), head.bias.grad.clone()
    sw, sb = _manual_clipped_sum(head, X, y, 0.7, clipping)
    torch.testing.assert_close(gw, sw / 8.0, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gb, sb / 8.0, atol=1e-10, rtol=1e-10)


def test_linear_head_gradient_matches_private_gradient_noise_stream():
    from privtune.engine import PrivateGradient

    torch.manual_seed(1)
    X = torch.randn(40, 6)
    y = torch.randint(0, 2, (40,))
    h1, h2 = nn.Linear(6, 2), nn.Linear(6, 2)
    h2.load_state_dict(h1.state_dict())
    a = LinearHeadGradient(h1, max_grad_norm=1.0, noise_multiplier=2.0, expected_batch_size=20.0, seed=7)
    b = PrivateGradient(h2, max_grad_norm=1.0, noise_multiplier=2.0, expected_batch_size=20.0, seed=7)
    a.accumulate(X, y)
    a.release()
    b.backward(nn.functional.cross_entropy(h2(X), y, reduction="none"))
    b.release()
    torch.testing.assert_close(h1.weight.grad, h2.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.bias.grad, h2.bias.grad, atol=1e-5, rtol=1e-5)
    b.close()


def test_linear_head_noise_std():
    head = nn.Linear(50, 4)
    step = LinearHeadGradient(head, max_grad_norm=0.5, noise_multiplier=3.0, expected_batch_size=10.0, seed=0)
    draws = []
    for _ in range(100):
        step.release()  # empty logical batch: noise only
        draws.append(head.weight.grad.flatten().clone())
    std = torch.cat(draws).std().item()
    assert abs(std - 3.0 * 0.5 / 10.0) / (0.15) < 0.02
