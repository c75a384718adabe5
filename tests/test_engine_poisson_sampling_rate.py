"""Poisson masks never include an example with probability above q (issue 13, item 8).

float32 ``torch.rand(n) < q`` lies on a 2⁻²⁴ grid, so its real rate is ⌈q·2²⁴⌉/2²⁴ > q
(1.000005·q at q = 0.01, 6·q at q = 1e-8).  Every Poisson mask now goes through
``privtune.engine.sampling.poisson_mask``: include iff U < ⌊q·2⁶²⌋ for U uniform on [0, 2⁶²).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from privtune.engine import PoissonSampler
from privtune.engine import sampling
from privtune.engine.sampling import inclusion_probability, make_generator, poisson_indices, poisson_mask


@pytest.mark.parametrize("q", [0.01, 1e-7, 1e-8, 0.3, 1 / 3, 0.999999, 2**-70])
def test_exact_inclusion_probability_is_at_most_q(q):
    p = inclusion_probability(q)
    assert p <= Fraction(q)  # exact rational comparison with the float64 q the accountant is given
    assert Fraction(q) - p < Fraction(1, 2**62)  # and not needlessly below it


def test_full_batch_includes_everyone():
    assert inclusion_probability(1.0) == 1
    assert poisson_mask(1000, 1.0, make_generator(0)).all()


@pytest.mark.parametrize("q", [0.01, 0.3])
def test_mask_rate_matches_q(q):
    n = 400_000
    hits = int(poisson_mask(n, q, make_generator(1)).sum())
    sd = math.sqrt(n * q * (1 - q))
    assert abs(hits - n * q) < 5 * sd  # a 5-sd two-sided band: false-failure rate < 1e-6


def test_tiny_rate_is_not_inflated_by_a_float_grid():
    # q = 1e-8: the old float32 grid included each example with probability 2**-24 ≈ 6e-8 (6·q); over
    # 2e7 draws the old sampler expects ~1.2 hits, the exact one 0.2.  P(≥ 4 hits | rate ≤ 1e-8) < 1e-4.
    g = make_generator(2)
    hits = sum(int(poisson_mask(1_000_000, 1e-8, g).sum()) for _ in range(20))
    assert hits < 4


def test_every_poisson_sampler_uses_the_exact_mask(monkeypatch):
    # PoissonSampler and the hpo head trainers draw their batches through sampling.poisson_indices
    calls = []
    real = sampling.poisson_mask

    def spy(n, q, g):
        calls.append((n, q))
        return real(n, q, g)

    monkeypatch.setattr(sampling, "poisson_mask", spy)
    PoissonSampler(50, 0.1, seed=0).sample()
    assert calls == [(50, 0.1)]
    idx = poisson_indices(30, 0.5, make_generator(3))
    assert idx.dtype == torch.long and bool((idx[1:] > idx[:-1]).all())


def _compares_uniform_draws(source: str) -> bool:
    """Whether ``source`` compares a uniform float draw (``torch.rand(...)``, directly or through a name it was
    assigned to) with something: the float-grid Bernoulli mask that the exact integer mask replaced."""
    import ast

    tree = ast.parse(source)

    def is_rand(node):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rand"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")

    drawn = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_rand(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for side in (n.left, *n.comparators):
                if is_rand(side) or (isinstance(side, ast.Name) and side.id in drawn):
                    return True
    return False


def test_the_float_mask_detector_finds_a_float_mask():
    assert _compares_uniform_draws("import torch\nm = torch.rand(5) < 0.1\n")
    assert _compares_uniform_draws("import torch\nu = torch.rand(5)\nm = u < q\n")
    assert not _compares_uniform_draws("import torch\nkeys = torch.rand(5)\norder = keys.argsort()\n")


def test_no_float_comparison_masks_left_in_the_package():
    # the one sampler (engine/sampling.py's exact integer mask) is the only place that draws a Poisson mask;
    # uniform draws used otherwise (random sort keys for a uniform k-subset) are not masks
    import pathlib

    import privtune

    root = pathlib.Path(privtune.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "sampling.py" and _compares_uniform_draws(p.read_text(encoding="utf-8"))]
    assert offenders == []
