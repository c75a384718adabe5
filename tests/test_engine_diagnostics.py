"""Clipping diagnostics follow the clipping actually used (flat, AUTO-S, per-layer) and stay NOT PRIVATE."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privtune.engine import PrivateGradient, clipping_diagnostics, retained_weight
from privtune.errors import InvalidParameterError
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec


def test_flat_whole_gradient_is_seed_003():
    n = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    d = clipping_diagnostics(n, 1.0, labels=[0, 0, 1, 1], num_classes=2)
    assert d["label"] == "NOT PRIVATE" and d["clipping"] == "flat" and d["per_layer"] is False
    assert d["threshold"] == 1.0 and d["fraction_clipped"] == 0.5
    assert d["mean_retained_factor"] == pytest.approx((1 + 1 + 0.5 + 0.25) / 4)
    assert d["retained_weight_per_class"] == pytest.approx([1.0, 0.375])


def test_automatic_clipping_uses_its_own_factor_and_no_fraction_clipped():
    n = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    d = clipping_diagnostics(n, 1.0, labels=[0, 0, 1, 1], num_classes=2, clipping="automatic", gamma=0.01)
    f = 1.0 / (n + 0.01)
    assert d["label"] == "NOT PRIVATE" and d["clipping"] == "automatic"
    assert d["fraction_clipped"] is None and "not defined" in d["fraction_clipped_note"]
    assert d["fraction_scaled_down"] == pytest.approx(float((f < 1).double().mean()))  # 1.0, 2.0, 4.0
    assert d["mean_retained_factor"] == pytest.approx(float(f.mean()))
    assert d["mean_retained_factor"] > 0.75 + 0.1  # AUTO-S scales the small gradient up: not min(1, C/n)
    assert d["retained_weight_per_class"] == pytest.approx([float(f[:2].mean()), float(f[2:].mean())])


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_per_layer_statistics_use_the_layer_threshold(clipping):
    # two layers: the whole norm is below C but one layer exceeds C/sqrt(2)
    L = torch.tensor([[0.9, 0.1], [0.3, 0.3], [3.0, 4.0]], dtype=torch.float64)
    n = L.norm(dim=1)
    C = 1.0
    d = clipping_diagnostics(n, C, labels=[0, 1, 1], num_classes=2, clipping=clipping, layer_norms=L)
    thr = C / math.sqrt(2)
    assert d["per_layer"] is True and d["num_layers"] == 2 and d["threshold"] == pytest.approx(thr)
    if clipping == "flat":
        fl = (thr / L).clamp(max=1.0)
        # example 0 has ||g|| < C, yet a layer is clipped: the global comparison would say 1/3
        assert d["fraction_clipped"] == pytest.approx(2 / 3)
        assert float((n > C).double().mean()) == pytest.approx(1 / 3)
        assert d["fraction_layers_clipped"] == pytest.approx(3 / 6)
    else:
        fl = thr / (L + 0.01)
        assert d["fraction_clipped"] is None
    kept = ((fl * L) ** 2).sum(1).sqrt() / n
    assert d["mean_retained_factor"] == pytest.approx(float(kept.mean()))
    assert d["retained_weight_per_class"] == pytest.approx([float(kept[0]), float(kept[1:].mean())])
    assert "C/sqrt(K)" in d["norm_quantiles_note"]


def test_per_layer_factors_match_what_private_gradient_applies():
    """The retained factor from the diagnostics equals ||clipped sum contribution|| / ||g|| of the DP step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(1, 5, dtype=torch.float64), torch.tensor([2])
    pg = PrivateGradient(model, max_grad_norm=0.2, noise_multiplier=0.0, expected_batch_size=1.0, per_layer=True)
    norms = pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    layer = pg.last_layer_norms
    pg.release()
    clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    pg.close()
    assert layer.shape == (1, 2)
    assert torch.allclose(layer.norm(dim=1), norms)
    d = clipping_diagnostics(norms, 0.2, layer_norms=layer)
    assert d["mean_retained_factor"] == pytest.approx(float(clipped / norms[0]), rel=1e-9)
    flat = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
    assert flat.last_layer_norms is None
    flat.close()


def test_bad_layer_norms_and_clipping():
    with pytest.raises(InvalidParameterError, match="layer_norms"):
        clipping_diagnostics([1.0, 2.0], 1.0, layer_norms=[[1.0], [2.0], [3.0]])
    with pytest.raises(InvalidParameterError, match="clipping"):
        clipping_diagnostics([1.0], 1.0, clipping="auto")
    with pytest.raises(InvalidParameterError, match="clipping"):
        retained_weight([1.0], [0], 1.0, 1, clipping="nope")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from privtune.models.testing import make_tiny_text_model

    return make_tiny_text_model(tmp_path_factory.mktemp("diag") / "st", sentence_transformers=True)


@pytest.mark.parametrize("clipping, per_layer", [("flat", False), ("flat", True), ("automatic", False)])
def test_fit_diagnostics_follow_the_run(model_path, clipping, per_layer):
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.models.testing import make_toy_text_dataset
    from privtune.training import fit

    m = load_classifier(model_path, seed=0)
    apply_mode(m, "bitfit")
    r = fit(m, make_toy_text_dataset(24, seed=0), noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=2),
            optimizer=OptimizerSpec(learning_rate=1e-2),
            clipping=ClippingSpec(clip=0.05, clipping=clipping, per_layer=per_layer),
            options=LoopOptions(seed=0, clipping_diagnostics=True), device="cpu")
    d = r.clipping_diagnostics
    assert d["label"] == "NOT PRIVATE" and d["mse_optimal_clip"]["label"] == "NOT PRIVATE"
    assert d["clipping"] == clipping and d["per_layer"] is per_layer
    if per_layer:
        K = d["num_layers"]
        assert K > 2 and d["threshold"] == pytest.approx(0.05 / math.sqrt(K))
        assert 0.0 <= d["fraction_layers_clipped"] <= 1.0
    if clipping == "flat" and not per_layer:
        assert d["mse_optimal_clip"]["C"] > 0 and 0.0 <= d["fraction_clipped"] <= 1.0
    else:  # Thm 5.2 is about flat clipping of the whole gradient: say so instead of a misleading C
        assert d["mse_optimal_clip"]["C"] is None
        assert ("per-layer" if per_layer else "automatic") in d["mse_optimal_clip"]["note"]
    if clipping == "automatic":
        assert d["fraction_clipped"] is None and 0.0 <= d["fraction_scaled_down"] <= 1.0
