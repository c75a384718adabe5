"""The DP-step interface: PrivateGradient and LinearHeadGradient both implement ``engine.step.DPStep``, give the
same released gradient for a linear head on features, and the training loop never asks which one it has."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn.functional as F

import privtune
from privtune.engine import PrivateGradient
from privtune.engine.step import DPStep, MicroBatch
from privtune.finetune import LinearHeadGradient


def _head_and_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    head = torch.nn.Linear(5, 3).double()
    batch = MicroBatch(losses=lambda: F.cross_entropy(head(X), y, reduction="none"), labels=y,
                       features=lambda: (X, X.pow(2).sum(1)))
    return head, batch


def _steps(head):
    kw = dict(max_grad_norm=0.5, noise_multiplier=0.7, expected_batch_size=10.0, seed=3)
    return PrivateGradient(head, **kw), LinearHeadGradient(head, **kw)


def test_both_steps_implement_the_protocol():
    head, _ = _head_and_batch()
    pg, lh = _steps(head)
    assert isinstance(pg, DPStep) and isinstance(lh, DPStep)
    pg.close()


def test_same_batch_same_release_through_the_protocol():
    head, batch = _head_and_batch()
    pg, lh = _steps(head)
    released = []
    for step in (pg, lh):
        losses, norms = step.accumulate_batch(batch)
        assert losses.shape == norms.shape == (12,)
        torch.testing.assert_close(losses, F.cross_entropy(head(batch.features()[0]), batch.labels,
                                                           reduction="none"))
        info = step.release()
        assert info.batch_size == 12
        released.append([p.grad.clone() for p in head.parameters()])
        for p in head.parameters():
            p.grad = None
    pg.close()
    for a, b in zip(*released):
        torch.testing.assert_close(a, b)


def test_example_gradients_agree_and_accumulate_nothing():
    head, batch = _head_and_batch(1)
    pg, lh = _steps(head)
    G_pg, G_lh = pg.example_gradients(batch), lh.example_gradients(batch)
    assert G_pg.shape == (12, 3 * 5 + 3)
    torch.testing.assert_close(G_pg, G_lh)
    assert lh.pending_examples == 0
    info = pg.release()
    assert info.batch_size == 0  # the paused forward reached nothing
    pg.close()


def test_linear_head_layer_norms_are_its_norms():
    head, batch = _head_and_batch(2)
    _, lh = _steps(head)
    _, norms = lh.accumulate_batch(batch)
    torch.testing.assert_close(lh.last_layer_norms, norms[:, None])


def test_training_loop_does_not_pick_its_step_by_attribute():
    tree = ast.parse((Path(privtune.__file__).parent / "training.py").read_text())
    probes = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("hasattr", "getattr") and n.args and "pg" in ast.unparse(n.args[0])]
    assert not probes, [ast.unparse(p) for p in probes]
