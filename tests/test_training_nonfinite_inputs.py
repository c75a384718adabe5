"""Non-finite inputs: refused before anything is reserved when they can be seen up front (cached features),
and otherwise dropped by the DP step (clip factor 0) so that one NaN/inf row neither makes the release NaN
nor stops a run whose budget is reserved; both outcomes would reveal that the row was sampled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import privtune
from privtune.engine import PrivateGradient
from privtune.errors import DataError
from privtune.finetune import FeatureSet, LinearHeadGradient
from privtune.ledger import Ledger
from privtune.training import fit
from privtune.specs import LoopOptions, NoiseSpec, OptimizerSpec


def _features(n: int = 40, d: int = 6, bad_row: int | None = 7, seed: int = 0) -> FeatureSet:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    if bad_row is not None:
        X[bad_row, 2] = float("inf")
    return FeatureSet(X, y, 2)


# ------------------------------------------------------------------ the closed-form head step


@pytest.mark.parametrize("train_weight", [True, False])
def test_head_step_drops_an_inf_row_exactly(train_weight):
    fs = _features()
    keep = torch.arange(len(fs)) != 7
    released = []
    for X, y in ((fs.features, fs.labels), (fs.features[keep], fs.labels[keep])):
        torch.manual_seed(1)
        head = nn.Linear(6, 2)
        head.weight.requires_grad_(train_weight)  # without it only the bias trains: the inf shows in the loss
        step = LinearHeadGradient(head, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=40.0, seed=3)
        step.accumulate(X, y)
        info = step.release()
        w = head.weight.grad.clone() if train_weight else torch.zeros(1)
        released.append((w, head.bias.grad.clone(), info.nonfinite_examples))
    (w_bad, b_bad, dropped), (w_ok, b_ok, none) = released
    assert torch.isfinite(w_bad).all() and torch.isfinite(b_bad).all()
    assert (dropped, none) == (1, 0)
    torch.testing.assert_close(w_bad, w_ok, rtol=1e-6, atol=1e-6)  # the inf row added exactly nothing
    torch.testing.assert_close(b_bad, b_ok, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fast_head", [True, False])
def test_review_experiment_inf_row_sampled_gives_a_finite_head(fast_head):
    """The privacy review's experiment, small: the inf row is sampled at every step (q = 1) and at random
    (q = 0.5); the released head is finite and the run does not stop."""
    for q in (1.0, 0.5):
        head = nn.Linear(6, 2)
        res = fit(head, _features(), noise=NoiseSpec(noise_multiplier=1.0, sample_rate=q, steps=6),
                  optimizer=OptimizerSpec(learning_rate=0.1, name="sgd"),
                  options=LoopOptions(seed=5, fast_head=fast_head, nonfinite_features="drop"))
        assert res.steps == 6
        assert torch.isfinite(head.weight).all() and torch.isfinite(head.bias).all()
        assert res.nonfinite_examples >= (6 if q == 1.0 else 1)


def test_fit_refuses_nonfinite_features_before_training():
    head = nn.Linear(6, 2)
    before = head.weight.detach().clone()
    fs = _features()
    fs.features[11, 0] = float("nan")
    with pytest.raises(DataError, match=r"`train_set` has 2 feature row\(s\) with NaN or infinite") as err:
        fit(head, fs, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=3),
            optimizer=OptimizerSpec(learning_rate=0.1))
    assert "inf," not in str(err.value) and "tensor" not in str(err.value)  # a count, never row values
    assert torch.equal(head.weight.detach(), before)


def test_tune_refuses_nonfinite_features_before_the_reservation(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with pytest.raises(DataError, match=r"`data` has 1 feature row\(s\)"):
        privtune.tune(_features(), mode="last-layer", strategy="single-step", epsilon=1.0, delta=1e-3,
                      labels=[0, 1], ledger=url, output_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "l.db").exists() or not Ledger(url).datasets()  # nothing registered, nothing reserved
    assert not (tmp_path / "run" / "certificate.json").exists()


# ------------------------------------------------------------------ the general engine


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc1 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, ids):
        h = torch.cat([x, self.emb(ids)], dim=1)
        return self.fc2(self.norm(torch.tanh(self.fc1(h))))


def _engine_release(x, ids, y, loss_scale=None, per_layer=False):
    torch.manual_seed(0)
    net = _Net()
    pg = PrivateGradient(net, max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=8.0, seed=11,
                         per_layer=per_layer)
    losses = nn.functional.cross_entropy(net(x, ids), y, reduction="none")
    if loss_scale is not None:
        losses = losses * loss_scale
    pg.backward(losses)
    info = pg.release()
    grads = [p.grad.clone() for p in net.parameters()]
    pg.close()
    return grads, info


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("how", ["inf input", "nan input", "inf loss"])
def test_private_gradient_drops_a_nonfinite_row_instead_of_stopping(how, per_layer):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=g)
    ids = torch.randint(0, 10, (6,), generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    scale = None
    if how == "inf input":
        x[3, 1] = float("inf")
    elif how == "nan input":
        x[3, 0] = float("nan")
    else:
        scale = torch.ones(6)
        scale[3] = float("inf")
    grads, info = _engine_release(x, ids, y, scale, per_layer)  # no error: the run goes on
    keep = torch.arange(6) != 3
    ref, ref_info = _engine_release(x[keep], ids[keep], y[keep], None, per_layer)
    assert info.nonfinite_examples == 1 and ref_info.nonfinite_examples == 0
    assert "nonfinite_examples" in info.to_dict()["not_private"]
    for a, b in zip(grads, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same update as without the row


def test_train_keeps_the_count_of_dropped_rows_out_of_the_release():
    from privtune.report.release import NON_PRIVATE_METRICS, split_release

    assert "nonfinite_examples_dropped" in NON_PRIVATE_METRICS
    pub, _, private = split_release({"epsilon": 1.0, "nonfinite_examples_dropped": 3}, {})
    assert "nonfinite_examples_dropped" not in pub and private["metrics"]["nonfinite_examples_dropped"] == 3
