"""MPNet (all-mpnet-base-v2's architecture) through PrivateGradient, against a per-example loop (float64).

MPNet adds a relative-position bias to every attention layer from one nn.Embedding table that the encoder
looks up with (T, T) bucket ids, without the batch dimension; the engine batches that lookup while it is
attached.  B == T is the case where a per-example rule applied to the unbatched lookup would not even fail.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privtune.engine import PrivateGradient
from privtune.errors import UnsupportedModuleError
from privtune.finetune.modes import select_biases

transformers = pytest.importorskip("transformers")


def _tiny_mpnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.MPNetConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=48, max_position_embeddings=24, num_labels=3, pad_token_id=1)
    model = transformers.MPNetForSequenceClassification(cfg).double().eval()
    with torch.no_grad():  # a random, not zero-like, bias table so that its gradient path matters
        model.mpnet.encoder.relative_attention_bias.weight.normal_(0, 0.5)
    return model


def _set_mode(model: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return model
    chosen, _ = select_biases(model.mpnet)  # DP-BiTFiT's selection (privtune.finetune.apply_mode)
    chosen = {f"mpnet.{n}" for n in chosen}
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen or n.startswith("classifier."))
    return model


def _inputs(B: int, T: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, T - 2:] = 0
    ids[0, T - 2:] = 1  # MPNet's pad id
    return ids, mask, torch.randint(0, 3, (B,), generator=g)


def _loop_reference(model, ids, mask, y, params, C):
    rows = []
    for i in range(ids.shape[0]):
        loss = F.cross_entropy(model(ids[i:i + 1], attention_mask=mask[i:i + 1]).logits, y[i:i + 1])
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    G = torch.stack(rows)
    norms = G.norm(dim=1)
    return norms, ((C / norms).clamp(max=1.0)[:, None] * G).sum(0)


@pytest.mark.parametrize("B,T", [(4, 6), (6, 6)])
@pytest.mark.parametrize("mode", ["full", "bitfit"])
def test_mpnet_matches_per_example_loop(mode, B, T):
    model = _set_mode(_tiny_mpnet(), mode)
    ids, mask, y = _inputs(B, T)
    params = [p for p in model.parameters() if p.requires_grad]
    table = model.mpnet.encoder.relative_attention_bias.weight
    assert (table.requires_grad) == (mode == "full")
    ref_norms, _ = _loop_reference(model, ids, mask, y, params, 1.0)
    C = float(ref_norms.median())  # clipping active for about half the examples
    ref_norms, ref_sum = _loop_reference(model, ids, mask, y, params, C)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no per-example fallback: every MPNet layer has a fast rule
        pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    norms = pg.backward(F.cross_entropy(model(ids, attention_mask=mask).logits, y, reduction="none"))
    pg.release()
    got = torch.cat([p.grad.reshape(-1) for p in params])
    pg.close()
    assert torch.allclose(norms, ref_norms, rtol=1e-6, atol=0)
    assert (got - ref_sum).norm() <= 1e-6 * ref_sum.norm()
    if mode == "full":  # the table's own part of the clipped sum, which is small next to the rest
        k = sum(p.numel() for p in params[:[id(p) for p in params].index(id(table))])
        part, ref_part = got[k:k + table.numel()], ref_sum[k:k + table.numel()]
        assert ref_part.norm() > 0 and (part - ref_part).norm() <= 1e-6 * ref_part.norm()


def test_batched_bias_lookup_gives_the_same_logits_and_is_removed_on_close():
    model = _tiny_mpnet()
    ids, mask, _ = _inputs(3, 5)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
    assert "compute_position_bias" in vars(model.mpnet.encoder)
    with pg.paused(), torch.no_grad():
        during = model(ids, attention_mask=mask).logits
    assert pg.describe()["mpnet.encoder.relative_attention_bias"] == "embedding (per-example table)"
    twin = copy.deepcopy(model)  # a copy made while attached looks its own table up, not the original's
    with torch.no_grad():
        twin.mpnet.encoder.relative_attention_bias.weight.zero_()
        assert not torch.equal(twin(ids, attention_mask=mask).logits, before)
        assert torch.equal(model(ids, attention_mask=mask).logits, before)
    pg.close()
    assert "compute_position_bias" not in vars(model.mpnet.encoder)
    assert torch.equal(before, during)


class _UnbatchedBias(nn.Module):
    """A T5-style relative bias: one (T, T) lookup broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(8, 1)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        T = x.shape[1]
        rel = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-4, 3) + 4
        bias = self.relative_attention_bias(rel).squeeze(-1)  # (T, T)
        return self.out(x + torch.einsum("qk,bkd->bqd", bias, x))  # x: (B, T, 4)


def test_other_unbatched_relative_bias_tables_are_refused():
    with pytest.raises(UnsupportedModuleError, match="relative-position bias table"):
        PrivateGradient(_UnbatchedBias(), max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0)
