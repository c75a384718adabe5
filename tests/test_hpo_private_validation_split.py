"""selection="private-validation": a dataset and its neighbour (one row added) must differ on exactly one side of
the split, and nothing released may depend on the realised split sizes (only on the file's public n)."""

from __future__ import annotations

import json

import pytest
import torch

import privtune
from privtune.data import TextDataset
from privtune.errors import InvalidParameterError
from privtune.hpo.common import Selector
from privtune.hpo.tune import _Inputs, _planned_split_sizes, _split_private_validation
from privtune.models.testing import make_toy_text_files
from privtune.training import public_size

NEIGHBOUR_SIZES = [170, 171, 999, 1000, 1004, 1005, 1006, 1014, 1015, 2501, 4095]


def _old_training_rows(n: int, frac: float = 0.1) -> int:
    """The rule this module replaces: a fixed-size split of k = max(1, round(f·n)) validation rows."""
    return n - max(1, int(round(frac * n)))


def test_old_fixed_size_split_trained_neighbours_on_the_same_number_of_rows():
    # n = 1,005 and 1,006 both trained on 905 rows: the neighbours' training sets differ by a replacement
    assert _old_training_rows(1005) == _old_training_rows(1006) == 905
    # k steps up once every 1/f = 10 sizes, so a size has such a neighbour (n − 1 or n + 1) one time in five
    hit = sum(_old_training_rows(n) in (_old_training_rows(n - 1), _old_training_rows(n + 1))
              for n in range(100, 5100))
    assert hit == 1000


def _inputs(texts: list[str], frac: float = 0.1, delta: float = 1e-5) -> _Inputs:
    n = len(texts)
    n_train, n_val = _planned_split_sizes(n, frac, delta)
    ds = TextDataset(texts, [i % 2 for i in range(n)], 2)
    return _Inputs(train=ds, eval_set=None, public_set=None, private_val=None, selection="private_validation_noisy",
                   privacy=None, num_labels=2, label_names=None, label_source=None, fingerprint="f", file_name=None,
                   embedded=False, train_source="test", reported_split=None, validation_fraction=frac,
                   n_train_public=n_train, n_val_public=n_val)


@pytest.mark.parametrize("n", NEIGHBOUR_SIZES)
def test_adding_a_row_changes_exactly_one_side_of_the_split(n):
    base = [f"row {i}" for i in range(n)]
    for run_seed in range(5):
        # the natural coupling: the same run seed, the added row last (each row's draw is its own)
        a = _split_private_validation(_inputs(base), run_seed)
        b = _split_private_validation(_inputs(base + ["added row"]), run_seed)
        tr_a, tr_b, va_a, va_b = (set(x.texts) for x in (a.train, b.train, a.private_val, b.private_val))
        assert tr_a <= tr_b and va_a <= va_b  # no row moved: never a replacement
        assert (tr_b - tr_a) | (va_b - va_a) == {"added row"}
        assert len(tr_b - tr_a) + len(va_b - va_a) == 1  # exactly one side holds the added row


def test_the_realised_sizes_vary_but_what_is_published_does_not():
    """Same n, different random splits (different realised sizes): the public sizes the plan, the divisors and
    the release use are identical; they are functions of n only."""
    base = [f"row {i}" for i in range(1006)]
    splits = [_split_private_validation(_inputs(base), s) for s in range(12)]
    assert len({len(s.private_val) for s in splits}) > 1  # the realised sizes do differ
    assert {(s.n_train, s.n_val_public, public_size(s.train)) for s in splits} == {(905, 101, 905)}
    assert all(len(s.train) + len(s.private_val) == 1006 for s in splits)


def test_too_small_an_expected_side_is_refused_from_public_sizes():
    with pytest.raises(InvalidParameterError, match="at least 11.5 expected rows"):
        _planned_split_sizes(60, 0.1, 1e-3)  # 6 expected validation rows: a side could be empty
    assert _planned_split_sizes(160, 0.1, 1e-3) == (144, 16)


def test_selector_normalises_a_private_score_by_the_public_size():
    labels = torch.tensor([0, 1] * 45)  # 90 rows realised, 100 planned
    sel = Selector("private_validation_noisy", None, labels, noise_std=0.0 + 1e-12, public_size=100)
    score, events = sel.score(labels.clone())
    assert score == pytest.approx(90 / 100) and len(events) == 1
    plain = Selector("private_validation_noisy", None, labels, noise_std=1e-12)
    assert plain.score(labels.clone())[0] == pytest.approx(1.0)
    assert sel.tie_margin(0.5) != plain.tie_margin(0.5)  # the margin uses the public size too


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("pv_split"), {"train": ("train.tsv", 160, 0),
                                                                     "dev": ("dev.tsv", 40, 2)})


def test_tune_release_does_not_depend_on_the_realised_split(files, tmp_path, monkeypatch):
    """Two runs with the same seed whose random splits differ in size (one more validation row in the second):
    the certificate's events, the published n_train and plan and every divisor of a released gradient are
    identical, and log.txt shows the file's n only."""
    import sys

    from privtune.finetune import last_layer

    tune_module = sys.modules["privtune.hpo.tune"]
    divisors: list[float] = []
    real_sum, real_mask = last_layer.privatise_sum, tune_module.poisson_mask

    def recording(sums, noise_multiplier, sensitivity, expected_batch_size, generator, group=None):
        divisors.append(float(expected_batch_size))
        return real_sum(sums, noise_multiplier, sensitivity, expected_batch_size, generator, group)

    def one_more_validation_row(n, rate, generator):
        mask = real_mask(n, rate, generator)
        mask[int((~mask).nonzero()[0])] = True
        realised.append(int(mask.sum()))
        return mask

    def recorded_mask(n, rate, generator):
        mask = real_mask(n, rate, generator)
        realised.append(int(mask.sum()))
        return mask

    monkeypatch.setattr(last_layer, "privatise_sum", recording)
    runs, realised = [], []
    for k, split in enumerate((recorded_mask, one_more_validation_row)):
        monkeypatch.setattr(tune_module, "poisson_mask", split)
        divisors.clear()
        r = privtune.tune(files["train"], eval_data=files["dev"], model=files["model"], mode="last-layer",
                          strategy="random-search", strategy_options={"trials": 3}, selection="private-validation",
                          epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{tmp_path / f'l{k}.db'}",
                          output_dir=tmp_path / f"run{k}", seed=3, quiet=True, labels=[0, 1])
        cert = json.loads((r.run_dir / "certificate.json").read_text())
        log = (r.run_dir / "log.txt").read_text()
        runs.append((cert["events"], r.metrics["n_train"], r.history["plan"], sorted(set(divisors)), log))
    assert realised[1] == realised[0] + 1  # the realised sizes differ
    (ev_a, n_a, plan_a, div_a, log_a), (ev_b, n_b, plan_b, div_b, log_b) = runs
    assert n_a == n_b == 144  # planned from n = 160, never 160 − |validation|
    assert ev_a == ev_b and plan_a == plan_b  # σ, q, T identical
    assert div_a == div_b and div_a  # the released gradients are divided by public sizes only
    for log, val in ((log_a, realised[0]), (log_b, realised[1])):  # progress lines show the file's n only
        assert "caching features (train) (160 examples)" in log
        assert f"({160 - val} examples)" not in log and f"({val} examples)" not in log
