"""Micro-benchmark of the DP step (PrivateGradient backward + release) on a BERT-like block stack.

    python bench/engine_norm_micro.py [T] [--reference]   # T = sequence length, default 64

``--reference`` also times the same step with :func:`uncertified_float32_sq` in place of the certified
float64 linear-layer norms (steps interleaved), which is what the certificate costs.

Embedding + 2 blocks (Q, K, V, O 384×384, FFN 384↔1536, LayerNorm) + head, B = 32, one CPU thread,
median CPU time of 9 steps, next to a non-private step of the same model.  Used to measure the cost of
the certified float64 per-example norms (docs/engine.md): run it with PYTHONPATH pointing at two
checkouts, interleaved, on a quiet machine."""
import statistics
import sys
import time

import torch
from torch import nn

from privtune.engine import PrivateGradient

BATCH, WIDTH, VOCAB, REPEATS = 32, 384, 1000, 9


def uncertified_float32_sq(a, g, cache=None, U=None, cache_key=None):
    """A reference for timing only, NOT a DP guarantee: the linear-layer ghost norm in float32, without the
    float64 Gram products and the rounding bound (a cancelling example can get norm 0: docs/engine.md)."""
    a, g = a.float(), g.float()
    if a.shape[1] == 1:
        return (a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))).double()
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2)).double()


class Block(nn.Module):
    """One post-LayerNorm transformer block without heads' split: what the per-example norms walk through."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.ln = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / WIDTH ** 0.5, -1) @ self.v(x)
        x = self.ln(x + self.o(att))
        return x + self.down(torch.relu(self.up(x)))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(VOCAB, WIDTH), Block(), Block(), nn.Linear(WIDTH, 2))

    def forward(self, ids):
        return self.body(ids).mean(1)


def main(seq_len: int, reference: bool = False) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Classifier()
    ids, labels = torch.randint(0, VOCAB, (BATCH, seq_len)), torch.randint(0, 2, (BATCH,))
    private = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=BATCH, seed=0)

    def dp_step():
        private.backward(nn.functional.cross_entropy(model(ids), labels, reduction="none"))
        private.release()

    def nonprivate_step():
        with private.paused():
            model.zero_grad()
            nn.functional.cross_entropy(model(ids), labels).backward()

    import privtune.engine._layers as layers

    certified = layers._linear_weight_sq

    def reference_step():
        layers._linear_weight_sq = uncertified_float32_sq
        try:
            dp_step()
        finally:
            layers._linear_weight_sq = certified

    steps = {"dp": dp_step, "nondp": nonprivate_step}
    if reference:
        steps["reference"] = reference_step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(REPEATS):  # interleaved, so machine noise spreads over the variants
        for name, step in steps.items():
            t0 = time.process_time()
            step()
            times[name].append(time.process_time() - t0)
    dp, nondp = statistics.median(times["dp"]), statistics.median(times["nondp"])
    out = f"T={seq_len} dp step {dp * 1e3:.1f} ms, non-DP {nondp * 1e3:.1f} ms, ratio {dp / nondp:.2f}"
    if reference:
        ref = statistics.median(times["reference"])
        out += f"; uncertified float32 norms {ref * 1e3:.1f} ms: the certificate costs {100 * (dp / ref - 1):+.0f} %"
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--reference"]
    print(main(int(args[0]) if args else 64, reference="--reference" in sys.argv[1:]))
