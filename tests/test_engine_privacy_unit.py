"""User-level DP (privacy unit): Poisson sampling over units, ≤ k rows per unit, one vector of norm ≤ C per unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privtune.engine import PrivateGradient
from privtune.engine.sampling import make_generator, poisson_mask
from privtune.engine.units import UnitIndex, UnitSampler, check_unit_delta, unit_index
from privtune.errors import DataError, InvalidParameterError
from privtune.finetune import apply_mode
from privtune.finetune.last_layer import LinearHeadGradient
from privtune.models import load_classifier
from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset
from privtune.training import fit
from privtune.specs import LoopOptions, NoiseSpec, OptimizerSpec


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_text_model(tmp_path_factory.mktemp("m") / "st", sentence_transformers=True)


def _params(m):
    return {n: p.detach().cpu().clone() for n, p in m.named_parameters()}


# ------------------------------------------------------------------------------------------ one row per unit


def test_one_row_per_unit_equals_example_level_exactly(model_path):
    data = make_toy_text_dataset(40, seed=0)
    out = []
    for unit in (None, [f"user{i}" for i in range(len(data))]):
        m = load_classifier(model_path, seed=0)
        apply_mode(m, "bitfit")
        r = fit(m, data, noise=NoiseSpec(noise_multiplier=1.1, sample_rate=0.3, steps=3, privacy_unit=unit),
                optimizer=OptimizerSpec(learning_rate=1e-2),
                options=LoopOptions(seed=7, max_physical_batch_size=8), device="cpu")
        out.append((_params(m), r.events))
    (p0, e0), (p1, e1) = out
    assert e0 == e1
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k


def test_one_row_per_unit_sampler_draws_the_example_level_batches():
    n, q = 500, 0.1
    sampler = UnitSampler(UnitIndex(list(range(n))), q, seed=3)
    g = make_generator(3)
    for _ in range(5):
        assert torch.equal(sampler.sample(), poisson_mask(n, q, g).nonzero().squeeze(1))


# ------------------------------------------------------------------------------------------ sensitivity C per unit


def _adversarial_rows(k: int, d: int = 6):
    """k rows whose gradients point the same way and are far above C (at a zero head: uniform softmax): the worst
    case for a per-row clip."""
    x = torch.ones(k, d) * 100.0
    y = torch.zeros(k, dtype=torch.long)
    return x, y


def _zero_head(d: int = 6) -> nn.Linear:
    head = nn.Linear(d, 3)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_a_unit_of_k_adversarial_rows_moves_the_clipped_sum_by_at_most_C(clipping):
    k, C = 8, 0.5
    x, y = _adversarial_rows(k)
    units = UnitIndex(["alice"] * k)
    head = _zero_head(x.shape[1])
    pg = PrivateGradient(head, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0, clipping=clipping)
    losses = nn.functional.cross_entropy(head(x), y, reduction="none")
    pg.backward(losses, row_weights=units.row_weights(torch.arange(k)))
    pg.release()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in head.parameters()))
    assert 0.9 * C < float(norm) <= C * (1 + 1e-6)
    # the broken build (one clip per row, no unit weight) moves it by k·C
    losses = nn.functional.cross_entropy(head(x), y, reduction="none")
    pg.backward(losses)
    pg.release()
    assert float(torch.sqrt(sum((p.grad ** 2).sum() for p in head.parameters()))) > (k - 1) * C


def test_linear_head_step_weights_rows_like_the_engine():
    k, C = 5, 1.0
    x, y = _adversarial_rows(k)
    head = _zero_head(x.shape[1])
    weights = UnitIndex(["u"] * k).row_weights(torch.arange(k))
    fast = LinearHeadGradient(head, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    fast.accumulate(x, y, row_weights=weights)
    fast.release()
    fast_grads = [p.grad.clone() for p in head.parameters()]
    pg = PrivateGradient(head, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    pg.backward(nn.functional.cross_entropy(head(x), y, reduction="none"), row_weights=weights)
    pg.release()
    for a, p in zip(fast_grads, head.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)
    assert float(torch.sqrt(sum((g ** 2).sum() for g in fast_grads))) <= C * (1 + 1e-6)


def test_row_weights_are_one_over_rows_used_per_unit():
    units = UnitIndex(["a", "b", "a", "c", "a", "b"])
    w = units.row_weights(torch.tensor([0, 1, 2, 3, 5]))
    assert w.tolist() == [0.5, 0.5, 0.5, 1.0, 0.5]


# ------------------------------------------------------------------------------------------ sampling over units


def _skewed_units(num_units: int = 60, seed: int = 0) -> list[int]:
    """Unit u owns 1 + (u mod 17) rows, rows interleaved across units."""
    keys = [u for u in range(num_units) for _ in range(1 + u % 17)]
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    return [keys[i] for i in perm]


def test_poisson_inclusion_is_per_unit_whatever_its_row_count():
    keys = _skewed_units()
    units = UnitIndex(keys)
    q, steps = 0.2, 3000
    sampler = UnitSampler(units, q, max_rows_per_unit=4, seed=11)
    hits = torch.zeros(units.num_units)
    for _ in range(steps):
        rows = sampler.sample()
        hits[torch.unique(units.unit_of_row[rows])] += 1
    freq = hits / steps
    # each unit is in a batch w.p. q, independently of how many rows it has (a per-row Poisson sample would give a
    # unit of 17 rows 1 − 0.8¹⁷ ≈ 0.98); 5 binomial standard deviations of tolerance
    tol = 5 * (q * (1 - q) / steps) ** 0.5
    assert float((freq - q).abs().max()) < tol
    big = torch.tensor([1 + u % 17 for u in range(units.num_units)]) >= 10
    assert abs(float(freq[big].mean()) - q) < tol


def test_rows_beyond_the_cap_are_never_used_and_each_row_is_chosen_in_turn():
    k = 3
    keys = _skewed_units()
    units = UnitIndex(keys)
    sampler = UnitSampler(units, 1.0, max_rows_per_unit=k, seed=5)
    counts = torch.bincount(units.unit_of_row)
    seen = torch.zeros(units.num_rows, dtype=torch.bool)
    for _ in range(200):
        rows = sampler.sample()
        used = torch.bincount(units.unit_of_row[rows], minlength=units.num_units)
        assert torch.equal(used, counts.clamp(max=k))  # ≤ k per unit, and all rows of a small unit
        assert rows.unique().numel() == rows.numel()
        seen[rows] = True
    assert bool(seen.all())  # the k rows are a fresh random subset each step


def test_unit_sampler_resumes_exactly():
    units = UnitIndex(_skewed_units())
    a = UnitSampler(units, 0.3, max_rows_per_unit=2, seed=1)
    a.sample()
    state = a.state_dict()
    expected = [a.sample() for _ in range(3)]
    b = UnitSampler(units, 0.3, max_rows_per_unit=2, seed=99)
    b.load_state_dict(state)
    for e in expected:
        assert torch.equal(b.sample(), e)


def test_fit_with_units_uses_at_most_k_rows_per_unit(model_path):
    data = make_toy_text_dataset(36, seed=2)
    keys = [i % 4 for i in range(len(data))]  # 4 units of 9 rows
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "bitfit")
    sizes = []
    r = fit(m, data,
            noise=NoiseSpec(noise_multiplier=1.0, sample_rate=1.0, steps=2, privacy_unit=keys, max_rows_per_unit=2),
            optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=0), device="cpu",
            callback=lambda info: sizes.append(info.batch_size))
    assert sizes == [8, 8]
    assert r.events[0].sample_rate == 1.0


# ------------------------------------------------------------------------------------------ refusals


def test_refusals(model_path):
    data = make_toy_text_dataset(12, seed=0)
    m = load_classifier(model_path, seed=0)
    apply_mode(m, "bitfit")
    common = dict(noise_multiplier=1.0, sample_rate=0.5, steps=1)

    def fit_units(**noise):
        fit(m, data, noise=NoiseSpec(**common, **noise), optimizer=OptimizerSpec(learning_rate=1e-2), device="cpu")

    with pytest.raises(InvalidParameterError, match="sampling='shuffle' is not supported"):
        fit_units(privacy_unit=[0] * 12, sampling="shuffle")
    with pytest.raises(InvalidParameterError, match="max_rows_per_unit"):
        fit_units(privacy_unit=[0] * 12, max_rows_per_unit=0)
    with pytest.raises(InvalidParameterError, match="one unit per training row"):
        fit_units(privacy_unit=[0] * 5)
    with pytest.raises(InvalidParameterError, match="column name"):
        fit_units(privacy_unit="user_id")
    with pytest.raises(DataError, match="no privacy unit"):
        unit_index(["a", "", "b"], 3)
    for missing in (None, float("nan"), " ", "NaN", "null", "None"):
        with pytest.raises(DataError, match="Row 2 has no privacy unit"):
            unit_index(["a", missing, "b"], 3)
    assert unit_index(["u1", " u1", "u1 "], 3).num_units == 1
    assert unit_index(lambda i: i // 3, 12).num_units == 4


def test_delta_must_be_below_one_over_the_number_of_units():
    check_unit_delta(1e-3, 999, "user_id")
    with pytest.raises(InvalidParameterError, match="1/N_u"):
        check_unit_delta(1e-3, 1000, "user_id")


def test_the_default_cap_is_one_constant():
    import inspect

    from privtune.engine.units import DEFAULT_MAX_ROWS_PER_UNIT
    from privtune.training import train

    assert inspect.signature(train).parameters["max_rows_per_unit"].default == DEFAULT_MAX_ROWS_PER_UNIT
    assert NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1).max_rows_per_unit == DEFAULT_MAX_ROWS_PER_UNIT


# ------------------------------------------------------------------------------------------ the statement


def test_certificate_states_the_unit_and_round_trips(tmp_path):
    from privtune.accounting import Certificate, verify_certificate
    from privtune.accounting.certificate import neighbouring_relation, privacy_statement
    from privtune.accounting.events import DPSGDEvent
    from privtune.errors import CertificateError

    cert = Certificate.from_events([DPSGDEvent(1.0, 0.05, 100)], 1e-6,
                                   neighbouring=neighbouring_relation("patient_id"))
    assert cert.neighbouring == "add/remove all rows of one patient_id"
    back = verify_certificate(cert.save(tmp_path / "c.json"))
    assert back.neighbouring == cert.neighbouring and back.epsilon == pytest.approx(cert.epsilon)
    assert privacy_statement(back.neighbouring) == (
        "(ε, δ)-DP with respect to adding or removing all rows of one patient_id")
    assert privacy_statement(neighbouring_relation()) == (
        "(ε, δ)-DP with respect to adding or removing one training example")
    with pytest.raises(CertificateError, match="neighbouring"):
        Certificate.from_events([DPSGDEvent(1.0, 0.05, 100)], 1e-6, neighbouring="replace one example")
    data = cert.to_dict()
    data["neighbouring"] = "replace one row"
    with pytest.raises(CertificateError, match="not supported"):
        Certificate.from_dict(data)


def test_a_data_parallel_run_is_refused_before_anything_runs(monkeypatch):
    from privtune.engine.units import checked_units

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(InvalidParameterError, match="one process"):
        checked_units([0, 0, 1], 3, 8, "poisson")
    assert checked_units(None, 3, 8, "poisson") is None


def test_units_on_cached_features_match_example_level_and_cap_rows():
    from privtune.finetune import FeatureSet

    g = torch.Generator().manual_seed(0)
    feats = FeatureSet(features=torch.randn(60, 5, generator=g), labels=torch.randint(0, 3, (60,), generator=g), num_labels=3)
    out = []
    for unit in (None, list(range(60))):
        head = _zero_head(5)
        fit(head, feats, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.2, steps=4, privacy_unit=unit),
            optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=3), device="cpu")
        out.append([p.detach().clone() for p in head.parameters()])
    for a, b in zip(*out):
        assert torch.equal(a, b)
    sizes = []
    fit(_zero_head(5), feats,
        noise=NoiseSpec(noise_multiplier=1.0, sample_rate=1.0, steps=2, privacy_unit=[i % 6 for i in range(60)], max_rows_per_unit=3),
        optimizer=OptimizerSpec(learning_rate=0.1), options=LoopOptions(seed=3), device="cpu",
        callback=lambda info: sizes.append(info.batch_size))
    assert sizes == [18, 18]


def test_per_layer_clipping_keeps_a_unit_within_C():
    k, C = 6, 0.7
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(1, 4).repeat(k, 1) * 50.0  # k identical rows: their clipped gradients add up in one direction
    y = torch.zeros(k, dtype=torch.long)
    pg = PrivateGradient(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0, per_layer=True)
    pg.backward(nn.functional.cross_entropy(model(x), y, reduction="none"),
                row_weights=UnitIndex(["bob"] * k).row_weights(torch.arange(k)))
    pg.release()
    norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))
    assert 0.5 * C < norm <= C * (1 + 1e-6)


def test_a_unit_column_needs_a_table(tmp_path):
    from privtune.engine.units import load_units

    folder = tmp_path / "images"
    folder.mkdir()
    with pytest.raises(DataError, match="has no columns"):
        load_units(str(folder), "user_id", 3)
    table = tmp_path / "rows.jsonl"
    table.write_text('{"text": "a", "label": 0, "user": 7}\n{"text": "b", "label": 1, "user": 7}\n')
    with pytest.raises(DataError, match="Did you mean 'user'"):
        load_units(str(table), "users", 2)
    units = load_units(str(table), "user", 2)
    assert units.num_units == 1 and units.name == "user" and units.column == "user"
    with pytest.raises(InvalidParameterError, match="without columns"):
        load_units(object(), "user", 2)
