"""The micro-batches of a logical batch: on an accelerator their sizes come from a fixed set (a GPU pays per input
shape), and the trained model does not depend on how the rows are cut."""

from __future__ import annotations

import pytest
import torch

import privtune.training as training
from privtune.models.testing import make_toy_text_files
from privtune.specs import LoopOptions, NoiseSpec, OptimizerSpec
from privtune.training import micro_batch_bounds


@pytest.mark.parametrize("size", [1, 4, 7, 32, 256])
def test_bounds_cover_the_batch_in_order_with_few_shapes(size):
    shapes = set()
    for n in range(0, 3 * size + 40):
        for fixed in (False, True):
            b = micro_batch_bounds(n, size, fixed)
            assert [s for s, _ in b] == ([0] + [e for _, e in b][:-1] if b else []) and (b[-1][1] if b else 0) == n
            assert all(0 < e - s <= size for s, e in b)
            if fixed:
                shapes |= {e - s for s, e in b}
                assert len(b) <= n // size + max(1, size.bit_length())
            else:
                assert len(b) == -(-n // size)
    allowed = {size} | {1 << k for k in range(size.bit_length()) if 1 << k < size}
    assert shapes <= allowed


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("mb"), {"train": ("train.tsv", 40, 0)})


def _train(files, monkeypatch, fixed: bool, seen: list):
    from privtune.data import load_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    real = micro_batch_bounds  # the function itself (a second call would find the first call's patch)

    def cut(n, size, fixed_shapes=False):
        seen.append((fixed_shapes, n, size, real(n, size, fixed)))
        return seen[-1][-1]

    monkeypatch.setattr(training, "micro_batch_bounds", cut)
    model = load_classifier(files["model"], seed=0)
    apply_mode(model, "bitfit")
    training.fit(model, load_dataset(files["train"]), noise=NoiseSpec(noise_multiplier=0.0, sample_rate=0.7, steps=3),
                 optimizer=OptimizerSpec(learning_rate=0.5, name="sgd"),
                 options=LoopOptions(mode="bitfit", seed=0, max_physical_batch_size=16), device="cpu")
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_trained_model_does_not_depend_on_the_cut(files, monkeypatch):
    seen: list = []
    plain = _train(files, monkeypatch, False, seen)
    assert seen and not any(asked for asked, *_ in seen)  # on the CPU the loop asks for the plain cut
    cuts: list = []
    fixed = _train(files, monkeypatch, True, cuts)
    assert any(len(b) > -(-n // size) for _, n, size, b in cuts), cuts  # some rest was cut into pieces
    for name, p in plain.items():
        torch.testing.assert_close(fixed[name], p, rtol=1e-5, atol=1e-6)


def test_a_hooks_per_example_losses_keep_no_graph(files):
    """A hook's losses at the current parameters are computed without gradient: a graph kept per micro-batch
    held the activations of the whole logical batch at once (an out-of-memory kill on 4,096 images)."""
    from privtune.data import load_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    seen = []

    class Probe(training.LoopHook):
        def after_step(self, loop, batch):
            losses = loop.per_example_losses(batch)
            seen.append((losses.shape[0] == batch.numel(), losses.requires_grad, losses.grad_fn))

    model = load_classifier(files["model"], seed=0)
    apply_mode(model, "bitfit")
    training.fit(model, load_dataset(files["train"]), noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=2),
                 optimizer=OptimizerSpec(learning_rate=0.1, name="sgd"), hooks=[Probe()],
                 options=LoopOptions(mode="bitfit", seed=0, max_physical_batch_size=8), device="cpu")
    assert seen == [(True, False, None)] * 2
