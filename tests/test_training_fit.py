"""privtune.training.fit: events, accumulation, fast head path, two-phase, callbacks, learning."""

from __future__ import annotations

import math

import pytest
import torch

from privtune.accounting import Certificate, compute_epsilon
from privtune.accounting.events import DPSGDEvent, NonPrivateEvent
from privtune.errors import InvalidParameterError
from privtune.finetune import apply_mode, cache_features
from privtune.models import load_classifier
from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset
from privtune.tasks import TextClassification
from privtune.training import FitResult, fit, fit_nonprivate
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_text_model(tmp_path_factory.mktemp("m") / "st", sentence_transformers=True)


@pytest.fixture(scope="module")
def data():
    return make_toy_text_dataset(48, seed=0), make_toy_text_dataset(32, seed=1)


def _params(m):  # on the CPU: fit moves the model to the default device (the GPU where there is one)
    return {n: p.detach().cpu().clone() for n, p in m.named_parameters()}


def test_fit_returns_events_of_steps_taken(model_path, data):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "bitfit")
    r = fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.3, sample_rate=0.25, steps=4),
            optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=0), eval_set=data[1])
    assert isinstance(r, FitResult) and r.private
    assert r.events == [DPSGDEvent(1.3, 0.25, 4, sampling="poisson", label="")]
    assert r.steps == 4 and len(r.history["train_loss"]) == 4
    assert "NOT PRIVATE" in r.history["train_loss_label"]
    assert 0.0 <= r.eval["accuracy"] <= 1.0 and r.history["eval"][-1]["step"] == 4


def test_accumulation_equals_one_batch(model_path, data):
    results = []
    for phys in (5, 64):
        m = load_classifier(model_path, seed=0)
        apply_mode(m, "bitfit")
        fit(m, data[0], noise=NoiseSpec(noise_multiplier=0.8, sample_rate=0.5, steps=3),
            optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=3, max_physical_batch_size=phys))
        results.append(_params(m))
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=2e-6, rtol=1e-5)


def test_full_batch_accumulation_keeps_each_row_with_its_label(model_path, data):
    """A full batch of texts larger than the micro-batch is reordered by length before it is split; every row
    must still be paired with its own label (the same step as one micro-batch holding every row)."""
    results = []
    for phys in (5, 64):
        m = load_classifier(model_path, seed=0)
        apply_mode(m, "bitfit")
        fit(m, data[0], noise=NoiseSpec(noise_multiplier=0.0, sample_rate=1.0, steps=2, sampling="full_batch"),
            optimizer=OptimizerSpec(name="sgd", learning_rate=1.0), options=LoopOptions(seed=3, max_physical_batch_size=phys))
        results.append(_params(m))
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=2e-6, rtol=1e-5)


def test_same_seed_same_result_different_seed_differs(model_path, data):
    outs = []
    for seed in (5, 5, 6):
        m = load_classifier(model_path, seed=0)
        apply_mode(m, "bitfit")
        fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.3, steps=2),
            optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=seed))
        outs.append(m.classification_head.weight.detach().clone())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_fast_head_path_equals_hooks_path(model_path, data):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, data[0])
    heads = []
    for fast in (True, False):
        h = torch.nn.Linear(fs.num_features, 2)
        torch.nn.init.zeros_(h.weight)
        torch.nn.init.zeros_(h.bias)
        fit(h, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=5),
            optimizer=OptimizerSpec(learning_rate=0.05, name="sgd"), options=LoopOptions(seed=1, fast_head=fast))
        heads.append(h.weight.detach().clone())
    torch.testing.assert_close(heads[0], heads[1], atol=1e-5, rtol=1e-4)


def test_single_full_batch_step_on_features(model_path, data):
    """Seed 002's recipe: zero head, one full-batch DP step on cached features."""
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs, fe = cache_features(m, data[0]), cache_features(m, data[1])
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=2.0, sample_rate=1.0, steps=1),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0), eval_set=fe)
    assert r.events == [DPSGDEvent(2.0, 1.0, 1, sampling="full_batch", label="")]
    assert m.classification_head.weight.abs().sum() > 0  # moved from zero


def test_last_layer_learns_without_noise(model_path):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, make_toy_text_dataset(128, seed=0))
    fe = cache_features(m, make_toy_text_dataset(64, seed=1))
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=0.0, sample_rate=0.25, steps=100),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0), eval_set=fe)
    assert not r.private and "NOT PRIVATE" in r.label
    assert r.eval["accuracy"] > 0.65
    # a step without noise is not free: its event composes to ε = ∞ (it used to be [], i.e. ε = 0)
    assert len(r.events) == 1 and isinstance(r.events[0], NonPrivateEvent)
    assert compute_epsilon(r.events, 1e-5) == math.inf
    cert = Certificate.from_events(r.events, 1e-5)
    assert cert.epsilon == math.inf and not cert.private


def test_fit_nonprivate_events_compose_to_infinity(model_path):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, make_toy_text_dataset(32, seed=0))
    r = fit_nonprivate(m, fs, epochs=1.0, batch_size=16, learning_rate=0.1, seed=0)
    assert not r.private and [type(e) for e in r.events] == [NonPrivateEvent]
    assert compute_epsilon(r.events, 1e-5, "rdp") == math.inf


def test_two_phase_switches_to_bitfit(model_path, data):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "two-phase")
    before = _params(m)
    r = fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.25, steps=4),
            optimizer=OptimizerSpec(learning_rate=1e-2),
            options=LoopOptions(seed=0, mode="two-phase", phase1_steps=1))
    assert [e.steps for e in r.events] == [1, 3]
    assert r.events[0].label.startswith("two-phase 1/2") and r.events[1].label.startswith("two-phase 2/2")
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert all(n.endswith("bias") or n.startswith("head.") for n in trainable)
    # a weight that only phase 1 trains has changed
    assert not torch.equal(before["backbone.encoder.layer.0.attention.self.query.weight"],
                           m.backbone.encoder.layer[0].attention.self.query.weight.detach().cpu())
    with pytest.raises(InvalidParameterError, match="phase1_steps"):
        fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.25, steps=4),
            optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(mode="two-phase"))


def test_callback_can_stop_and_is_charged_for_the_plan(model_path, data):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, data[0])
    seen = []
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=10),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0),
            callback=lambda info: seen.append(info.step) or info.step >= 3)
    # training stops after step 3, but the stopping time is chosen during the run: the 10 planned steps are charged
    assert seen == [1, 2, 3] and r.steps == 3 and r.events[0].steps == 10
    full = fit(m, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=10),
               optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0))
    assert r.events == full.events
    # a callback that never stops changes nothing
    quiet = fit(m, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=4),
                optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0), callback=lambda info: None)
    assert quiet.steps == 4 and quiet.events[0].steps == 4


def test_clipping_diagnostics_are_labelled(model_path, data):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, data[0])
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=2),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0))
    assert r.clipping_diagnostics is None  # off by default
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=2),
            optimizer=OptimizerSpec(learning_rate=0.1), clipping=ClippingSpec(clip=0.5),
            options=LoopOptions(seed=0, clipping_diagnostics=True))
    d = r.clipping_diagnostics
    assert d["label"] == "NOT PRIVATE" and 0 <= d["fraction_clipped"] <= 1
    assert len(d["retained_weight_per_class"]) == 2
    assert d["mse_optimal_clip"]["label"] == "NOT PRIVATE" and d["mse_optimal_clip"]["C"] > 0
    m2 = load_classifier(model_path, seed=0)
    apply_mode(m2, "bitfit")
    r2 = fit(m2, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
             optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0, clipping_diagnostics=True))
    assert r2.clipping_diagnostics["mse_optimal_clip"]["C"] > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"steps": 0}, "steps"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"clipping": "auto"}, "clipping"),
        ({"optimizer": "adagrad"}, "optimizer"),
        ({"sampling": "full_batch", "sample_rate": 0.5}, "full_batch"),
    ],
)
def test_fit_bad_arguments(model_path, data, kwargs, match):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    base = dict(noise_multiplier=1.0, sample_rate=0.5, steps=1, learning_rate=0.1)
    base.update(kwargs)
    noise = {k: base[k] for k in ("noise_multiplier", "sample_rate", "steps", "sampling") if k in base}
    with pytest.raises(InvalidParameterError, match=match):
        fit(m, data[0], noise=NoiseSpec(**noise),
            optimizer=OptimizerSpec(name=base.get("optimizer", "adam"), learning_rate=base["learning_rate"]),
            clipping=ClippingSpec(clipping=base.get("clipping", "flat")))


def test_bundled_minilm_last_layer_on_32_examples():
    from privtune.data import embedded_sst2

    train, _, test = embedded_sst2()
    m = load_classifier()
    apply_mode(m, "last-layer")
    fs = cache_features(m, train.subset(range(32)))
    fe = cache_features(m, test.subset(range(32)))
    assert fs.features.shape == (32, 384)
    torch.testing.assert_close(fs.features.norm(dim=1), torch.ones(32), atol=1e-4, rtol=0)  # normalised
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=0.5, sample_rate=1.0, steps=1),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0), eval_set=fe)
    assert isinstance(r.eval["accuracy"], float)


@pytest.mark.parametrize("mode", ["full", "bitfit", "last-layer", "lora"])
def test_only_trainable_parameters_change(model_path, data, mode):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, mode, lora_rank=2)
    before = _params(m)
    fit(m, data[0], noise=NoiseSpec(noise_multiplier=0.5, sample_rate=0.5, steps=2),
        optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=0))
    after = _params(m)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    for n in before:
        if n not in trainable:  # frozen weights are bit-identical after DP steps
            assert torch.equal(before[n], after[n]), n
    assert any(not torch.equal(before[n], after[n]) for n in trainable)


def test_shuffled_run_accounts_the_batch_size_it_uses(model_path):
    # n = 11, q = 0.25: the sampler cuts batches of round(2.75) = 3 (11 mod 3 = 2, so the shuffle accounting
    # applies), so 44 steps make 12 passes; accounting the requested q would count ⌈44·0.25⌉ = 11 epochs
    # and under-charge.
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, make_toy_text_dataset(11, seed=2))
    r = fit(m, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.25, steps=44, sampling="shuffle"),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=0))
    (event,) = r.events
    assert event.sampling == "shuffle" and event.sample_rate == pytest.approx(3 / 11)
    assert event.epochs == 12


# ------------------------------------------------------------------ the pre-trained-layer multiplier α (seed 002)
def _largest_moves(m, before):
    moved = {n: (p.detach().cpu() - before[n]).abs().max().item() for n, p in m.named_parameters() if p.requires_grad}
    head = max(v for n, v in moved.items() if n.startswith("head."))
    rest = max(v for n, v in moved.items() if not n.startswith("head."))
    return head, rest


def test_backbone_lr_scale_scales_every_step_outside_the_head(model_path, data):
    # Adam's first step moves each coordinate by about η whatever its gradient (here: the noise), so with the
    # same seed the largest move of the backbone is α times that of α = 1 while the head's is unchanged
    moves = {}
    for alpha in (1.0, 0.1):
        m = load_classifier(model_path, seed=0)
        apply_mode(m, "full", zero_init_head=True)
        before = _params(m)
        fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
            optimizer=OptimizerSpec(learning_rate=1e-2, backbone_lr_scale=alpha), options=LoopOptions(seed=0))
        moves[alpha] = _largest_moves(m, before)
    assert moves[0.1][0] == pytest.approx(moves[1.0][0], rel=1e-4)
    assert moves[0.1][1] == pytest.approx(0.1 * moves[1.0][1], rel=1e-3)


def test_backbone_lr_scale_keeps_its_ratio_when_a_hook_sets_the_rate(model_path, data):
    from privtune.training import _checked_loop_options, _Loop

    m = load_classifier(model_path, seed=0)
    apply_mode(m, "bitfit")
    plan = _checked_loop_options(data[0], NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
                                 OptimizerSpec(learning_rate=1e-2, backbone_lr_scale=0.25), ClippingSpec(),
                                 LoopOptions(seed=0, max_physical_batch_size=16), None)
    loop = _Loop(m, data[0], plan)
    assert loop.learning_rate == pytest.approx(1e-2)
    loop.set_learning_rate(4e-2)
    assert loop.learning_rate == pytest.approx(4e-2)
    assert sorted(g["lr"] for g in loop.opt.param_groups) == pytest.approx([1e-2, 4e-2])


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5, float("nan"), "0.1", True])
def test_backbone_lr_scale_outside_0_1_is_one_clear_error(model_path, data, alpha):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "full")
    with pytest.raises(InvalidParameterError, match=r"backbone_lr_scale.*\(0, 1\]"):
        fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
            optimizer=OptimizerSpec(learning_rate=1e-2, backbone_lr_scale=alpha))


class _ScaledLoss(TextClassification):
    """Classification whose per-example loss is ``factor`` × cross-entropy; counts its calls."""

    def __init__(self, factor: float):
        self.factor, self.calls = factor, 0

    def per_example_loss(self, model, batch):
        self.calls += 1
        return self.factor * super().per_example_loss(model, batch)


def _norms_and_losses(model_path, data, task):
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "bitfit")
    r = fit(m, data[0], noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
            optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=4, clipping_diagnostics=True),
            task=task)
    return r.clipping_diagnostics["norm_quantiles"], r.history["train_loss"][0]


def test_the_loop_clips_the_tasks_per_example_loss(model_path, data):
    """The DP step clips the gradient of the task's loss: 2 × cross-entropy doubles every per-example norm and the
    (NOT PRIVATE) batch loss; the default task (None) and an explicit classification task agree exactly."""
    norms, loss = _norms_and_losses(model_path, data, None)
    same_norms, same_loss = _norms_and_losses(model_path, data, TextClassification())
    assert same_norms == norms and same_loss == loss
    doubled = _ScaledLoss(2.0)
    norms2, loss2 = _norms_and_losses(model_path, data, doubled)
    assert doubled.calls >= 1
    for q in norms:
        assert norms2[q] == pytest.approx(2 * norms[q], rel=1e-6)
    assert loss2 == pytest.approx(2 * loss, rel=1e-6)


def test_a_task_loss_on_cached_features_goes_through_the_hooks(model_path, data):
    """On cached features the closed-form head step computes cross-entropy itself; a task with another loss
    is trained through the hooks, with that loss."""
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "last-layer")
    fs = cache_features(m, data[0])
    heads = {}
    for name, task in (("ce", None), ("half", _ScaledLoss(0.5))):
        h = torch.nn.Linear(fs.num_features, 2)
        torch.nn.init.zeros_(h.weight)
        torch.nn.init.zeros_(h.bias)
        fit(h, fs, noise=NoiseSpec(noise_multiplier=0.0, sample_rate=1.0, steps=1),
            optimizer=OptimizerSpec(learning_rate=0.1, name="sgd"), clipping=ClippingSpec(clip=100.0),
            options=LoopOptions(seed=1), task=task)
        heads[name] = h.weight.detach().clone()
        if task is not None:
            assert task.calls >= 1
    # no clipping at C = 100 and no noise: one SGD step on 0.5 × the loss moves the head half as far
    torch.testing.assert_close(heads["half"], 0.5 * heads["ce"], atol=1e-6, rtol=1e-5)
