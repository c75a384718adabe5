"""Positions whose output gradient is exactly zero (padding behind an attention mask, masked targets) are
dropped before the per-example norms and the clipped sum, and the ghost norms run over groups of examples
of similar length: the results are those of the full tensors (float64, against a naive loop), and the
work really shrinks (the stored tensors have the largest kept length, not T)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privtune.engine._layers as layers
from privtune.engine import PrivateGradient

LENGTHS = [2, 7, 3, 12, 6, 5, 4, 9]  # kept positions per example; T = 16 (a length-1 example has zero Q, K gradients)
T, WIDTH = 16, 24


class Attention(nn.Module):
    """Q, K, V read one input (they share its packed copy); masked keys; masked mean over positions."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / WIDTH ** 0.5
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        h = x + torch.softmax(scores, -1) @ self.v(x)
        h = h + self.down(torch.tanh(self.up(h)))
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(LENGTHS), T, WIDTH, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    y = torch.randint(0, 3, (len(LENGTHS),), generator=g)
    return x, mask, y


def test_padded_batch_matches_naive_loop_with_positions_dropped(monkeypatch):
    torch.manual_seed(0)
    model = Attention().double()
    x, mask, y = _batch()
    params = list(model.parameters())
    rows = []
    for i in range(len(y)):
        gs = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1], mask[i:i + 1]), y[i:i + 1]), params)
        rows.append(torch.cat([gr.reshape(-1) for gr in gs]))
    G = torch.stack(rows)
    ref_norms = G.norm(dim=1)
    C = float(ref_norms.median())
    ref_sum = ((C / ref_norms).clamp(max=1.0)[:, None] * G).sum(0)

    stored, packs, groups = [], [], []
    real_drop, real_pack, real_groups = layers.drop_zero_rows, layers._pack_rows, layers.length_groups

    def drop_spy(act, g, cache=None):
        out = real_drop(act, g, cache)
        stored.append((tuple(g.shape), tuple(out[1].shape)))
        return out

    def pack_spy(x_, keep, counts, width):
        packs.append(tuple(x_.shape))
        return real_pack(x_, keep, counts, width)

    def groups_spy(counts):
        out = real_groups(counts)
        groups.append(out)
        return out

    monkeypatch.setattr(layers, "drop_zero_rows", drop_spy)
    monkeypatch.setattr(layers, "_pack_rows", pack_spy)
    monkeypatch.setattr(layers, "length_groups", groups_spy)
    pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    norms = pg.backward(F.cross_entropy(model(x, mask), y, reduction="none"))
    pg.release()
    pg.close()
    got = torch.cat([p.grad.reshape(-1) for p in params])

    assert torch.allclose(norms, ref_norms, rtol=1e-9, atol=0)
    assert float((got - ref_sum).norm()) <= 1e-9 * float(ref_sum.norm())
    # the five sequence layers stored (B, 12, ·) instead of (B, 16, ·): 12 = the longest example
    assert sorted(after for _, after in stored) == sorted(
        [(len(y), max(LENGTHS), WIDTH)] * 4 + [(len(y), max(LENGTHS), 2 * WIDTH)])
    # Q, K and V share one packed input: 5 outputs + 3 distinct inputs (x, h for up, tanh(up) for down)
    assert len(packs) == 5 + 3
    # and the ghost norms ran over groups narrower than the longest example for the short ones
    assert groups and all(min(w for _, w in grp) < max(LENGTHS) for grp in groups)


def test_length_groups_cover_every_example_once_with_enough_width():
    counts = torch.tensor([3, 40, 5, 5, 12, 0, 7, 21, 9, 2, 30, 4])
    groups = layers.length_groups(counts)
    seen = torch.cat([idx for idx, _ in groups])
    assert sorted(seen.tolist()) == list(range(len(counts)))
    for idx, width in groups:
        assert int(counts[idx].max()) <= width and width >= 1
    assert [w for _, w in groups] == sorted({w for _, w in groups})  # increasing, equal neighbours merged
    assert len(layers.length_groups(torch.full((8,), 6))) == 1


def test_zero_row_detection_keeps_tiny_and_non_finite_rows():
    # a row is dropped only if it is exactly zero: 1e-30 (whose square underflows in float32) and NaN stay
    g = torch.zeros(2, 5, 4)
    g[0, 1, 2] = 1e-30
    g[0, 3, 0] = float("nan")
    g[1, 4, 1] = -2.0
    a = torch.randn(2, 5, 3)
    pa, pg_, slots = layers.drop_zero_rows(a, g)
    assert pg_.shape == (2, 2, 4) and slots.tolist() == [[True, True], [True, False]]
    assert float(pg_[0, 0, 2]) == float(g[0, 1, 2]) > 0 and bool(torch.isnan(pg_[0, 1, 0]))
    assert torch.equal(pa[0], a[0, [1, 3]]) and torch.equal(pa[1, 0], a[1, 4]) and not bool(pa[1, 1].any())
    # nothing to drop: the tensors themselves come back
    full = torch.ones(2, 5, 4)
    assert layers.drop_zero_rows(a, full)[1] is full


@pytest.mark.parametrize("pad", [3, 20])
def test_cancelling_example_among_padding_is_still_clipped(pad):
    """The crafted cancelling example (tests/test_engine_norm_cancellation.py) with padding positions after
    it and a longer ordinary example beside it: its positions are packed and its ghost norm runs in a group
    of its own width; the certified bound still holds, so its released contribution is at most C."""
    s, d, width = 1e4, 1e-4, 4
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(width, dtype=torch.float64, generator=gen)
    u = torch.randn(width, dtype=torch.float64, generator=gen)
    a, u = a / a.norm() * s, u / u.norm() * s
    T_ = 2 + pad
    x = torch.zeros(2, T_, width)
    g = torch.zeros(2, T_, width)
    x[0, 0], x[0, 1] = a.float(), a.float()
    g[0, 0], g[0, 1] = u.float(), (-(1 + d) * u).float()
    x[1] = torch.randn(T_, width, generator=gen)
    g[1, : T_ - 1] = torch.randn(T_ - 1, width, generator=gen) * 1e-3  # ordinary, small: not clipped
    exact = float((g[0].double().t() @ x[0].double()).norm())
    lin = nn.Linear(width, width, bias=False)
    pg = PrivateGradient(lin, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
    norms = pg.backward((lin(x) * g).sum((1, 2)))
    pg.release()
    pg.close()
    assert float(norms[0]) >= exact * (1 - 1e-6)  # the reported norm never understates the true one
    ordinary = g[1].double().t() @ x[1].double()
    assert float(ordinary.norm()) < 1.0  # example 1 goes in unclipped, so example 0's part is the rest
    released = float((lin.weight.grad.double() - ordinary).norm())
    assert 0.999 <= released <= 1.0 + 1e-6
