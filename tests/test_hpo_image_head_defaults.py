"""The full-batch η box depends on what the features were computed from: a head on image features searches
IMAGE_HEAD_LR_BOUNDS, a text head DEFAULT_LR_BOUNDS, in every strategy that searches it, unless the user gives one."""

from __future__ import annotations

import math

import pytest
import torch

from privtune.errors import InvalidParameterError
from privtune.hpo import grid_oracle as go
from privtune.hpo import linear_scaling as ls
from privtune.hpo import random_search as rs
from privtune.hpo.backends import FeatureBackend
from privtune.hpo.common import Selector


def _blobs(n: int, seed: int = 0, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    X = torch.randn(n, d, generator=g) + 2.0 * (2 * y[:, None] - 1) * torch.ones(d) / math.sqrt(d)
    return X / X.norm(dim=1, keepdim=True), y


def test_default_box_by_data_kind():
    assert ls.default_lr_bounds("image") == ls.IMAGE_HEAD_LR_BOUNDS
    assert ls.default_lr_bounds("text") == ls.DEFAULT_LR_BOUNDS == ls.default_lr_bounds(None)
    assert ls.IMAGE_HEAD_LR_BOUNDS[1] > ls.DEFAULT_LR_BOUNDS[1]
    for cfg in (ls.LinearScalingConfig(), rs.RandomSearchConfig()):
        assert (cfg.space("image").lr_min, cfg.space("image").lr_max) == ls.IMAGE_HEAD_LR_BOUNDS
        assert (cfg.space("text").lr_min, cfg.space("text").lr_max) == ls.DEFAULT_LR_BOUNDS
    grid = go.GridOracleConfig().grid("image")
    assert grid[0][0] == pytest.approx(ls.IMAGE_HEAD_LR_BOUNDS[0])
    assert grid[-1][0] == pytest.approx(ls.IMAGE_HEAD_LR_BOUNDS[1])
    assert len(grid) == len(go.GridOracleConfig().grid("text"))  # the same number of runs, shifted


def test_a_given_box_wins_over_the_data_default():
    for cfg in (ls.LinearScalingConfig(lr_bounds=(0.5, 2.0)), rs.RandomSearchConfig(lr_bounds=[0.5, 2.0])):
        space = cfg.space("image")
        assert (space.lr_min, space.lr_max) == (0.5, 2.0)
    assert {lr for lr, _ in go.GridOracleConfig(lr_bounds=(0.5, 2.0)).grid("image")} >= {0.5, 2.0}
    with pytest.raises(InvalidParameterError, match="lr_bounds"):
        rs.RandomSearchConfig(lr_bounds="fast").space("image")
    with pytest.raises(InvalidParameterError, match="steps_grid"):
        go.GridOracleConfig(steps_grid=5).grid()


@pytest.mark.parametrize("kind, box", [("image", ls.IMAGE_HEAD_LR_BOUNDS), (None, ls.DEFAULT_LR_BOUNDS)])
def test_random_search_draws_from_the_box_of_its_features(kind, box):
    X, y = _blobs(400)
    be = FeatureBackend(X, y, 2, data_kind=kind)
    cfg = rs.RandomSearchConfig(trials=6, accounting="composition", steps_grid=(5, 10))
    p = rs.plan(cfg, 8.0, 1e-5)
    out = rs.run(be, Selector("public_validation", X, y, name="public"), cfg, p, seed=0)
    lrs = [t.hyperparameters["learning_rate"] for t in out.trials]
    assert len(lrs) == 6 and all(box[0] <= lr <= box[1] for lr in lrs)
    assert out.strategy_data["search_space"]["lr_bounds"] == list(box)


def _hyperfree_steps(kind, *, epochs=None, request_epochs=None, mode="last-layer") -> int:
    from privtune.hpo import hyperfree as hf
    from privtune.hpo.common import PlanRequest

    request = PlanRequest(total_epsilon=3.0, delta=1e-5, n_train=20_000, batch_size=1_000, epochs=request_epochs,
                          data_kind=kind)
    plan = hf.Hyperfree().plan(hf.HyperfreeConfig(epochs=epochs), mode, request)
    return plan.steps


def test_hyperfree_runs_more_epochs_on_image_features_only():
    from privtune.hpo import hyperfree as hf

    per_epoch = 20  # 20,000 rows at an expected batch of 1,000
    assert _hyperfree_steps("text") == hf.DEFAULT_EPOCHS * per_epoch == _hyperfree_steps(None)
    assert _hyperfree_steps("image") == hf.IMAGE_HEAD_EPOCHS * per_epoch
    assert _hyperfree_steps("image", mode="bitfit") == hf.DEFAULT_EPOCHS * per_epoch  # the backbone trains
    assert _hyperfree_steps("image", epochs=2) == 2 * per_epoch  # the strategy option
    assert _hyperfree_steps("image", request_epochs=4) == 4 * per_epoch  # tune(epochs=...)
