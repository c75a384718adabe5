"""The contract every registered tuning strategy keeps (the analogue of scikit-learn's ``check_estimator``).

Parametrised over :data:`privtune.hpo.registry.REGISTRY`, so a new strategy is checked as soon as it is
registered: its plan exists before any data is read or anything reserved, what it runs is covered by that
plan, the certificate stays within the total, unknown options are refused before anything is spent, and the
reported split never reaches a selector; the backend and selector a strategy gets implement the declared
protocols (:class:`privtune.hpo.backends.Backend`, :class:`privtune.hpo.common.Scorer`).  Tiny model
(:mod:`privtune.models.testing`), last-layer mode on cached features and every model mode a strategy offers
among BiTFiT and LoRA: seconds each.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import privtune
from privtune.accounting import compute_epsilon, event_from_dict
from privtune.errors import InvalidParameterError
from privtune.hpo import common
from privtune.hpo.registry import REGISTRY, STRATEGIES
from privtune.models.testing import make_toy_text_dataset, make_toy_text_files

TOTAL_EPSILON, DELTA = 2.0, 1e-3
#: keeps the runs small (a strategy's defaults are sized for real data); every other option is its default
FAST_OPTIONS = {"random-search": {"trials": 3}}
#: tune() overrides that keep a model-mode run small (one epoch of a few batches; two trials a sweep)
FAST_MODEL = {"epochs": 1, "batch_size": 40}
MODEL_MODES = ("bitfit", "lora")
CASES = [(name, "last-layer") for name in STRATEGIES] + [
    (name, mode) for name in STRATEGIES for mode in MODEL_MODES if mode in REGISTRY[name].modes]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("contract"), {
        "train": ("train.tsv", 120, 0), "public": ("public.tsv", 40, 1), "dev": ("dev.tsv", 30, 2)})


def _tune(files, tmp_path, name, mode="last-layer", **kw):
    args = dict(eval_data=files["dev"], public_eval_data=files["public"], model=files["model"], mode=mode,
                strategy=name, epsilon=TOTAL_EPSILON, delta=DELTA, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                output_dir=tmp_path / "run", seed=0, quiet=True, strategy_options=dict(FAST_OPTIONS.get(name, {})))
    if mode != "last-layer":
        args.update(FAST_MODEL)
        if "trials" in REGISTRY[name].overrides.get("model", ()):
            args["trials"] = 2
    args.update(kw)
    return privtune.tune(files["train"], **args)


def test_the_registry_is_the_one_list_of_strategies():
    assert STRATEGIES == tuple(REGISTRY) == privtune.hpo.STRATEGIES
    for name, strategy in REGISTRY.items():
        assert strategy.name == name and strategy.modes and set(strategy.modes) <= set(common.TUNABLE_MODES)
        assert set(strategy.overrides) <= {"features", "model"}
        assert all(set(v) <= set(common.OVERRIDE_NAMES) for v in strategy.overrides.values())


@pytest.mark.parametrize("name, mode", CASES)
def test_strategy_contract(files, tmp_path, monkeypatch, name, mode):
    import privtune.finetune as ft
    from privtune.hpo import backends
    from privtune.ledger import Ledger
    from privtune.models.classifier import Classifier

    strategy = REGISTRY[name]
    dev_texts = set(make_toy_text_dataset(30, seed=2).texts)
    log: list[tuple[str, bool]] = []  # (what happened, whether it touched the reported split's rows)
    plans, run_plans, outcomes = [], [], []

    def touches_dev(data) -> bool:
        return bool(set(getattr(data, "texts", None) or []) & dev_texts)

    orig_plan, orig_run = strategy.plan, strategy.run
    orig_cache, orig_pred, orig_fit = ft.cache_features, Classifier.predict_logits, backends.fit
    orig_sel_init, orig_score, orig_reserve = common.Selector.__init__, common.Selector.score, Ledger.reserve

    def plan(cfg, mode, request):
        log.append(("plan", False))
        plans.append(orig_plan(cfg, mode, request))
        return plans[-1]

    def run(backend, selector, p, **kw):
        log.append(("run", False))
        run_plans.append(p)
        assert isinstance(backend, backends.Backend), type(backend)
        assert selector is None or isinstance(selector, common.Scorer), type(selector)
        outcomes.append(orig_run(backend, selector, p, **kw))
        return outcomes[-1]

    def cache(model, ds, **kw):
        log.append(("read data", touches_dev(ds)))
        return orig_cache(model, ds, **kw)

    def fit(model, train_set, **kw):  # a model mode reads the private rows when it first trains
        log.append(("read data", touches_dev(train_set)))
        return orig_fit(model, train_set, **kw)

    def pred(self, ds, **kw):
        log.append(("predict", touches_dev(ds)))
        return orig_pred(self, ds, **kw)

    def sel_init(self, source, data, *a, **kw):
        log.append(("selector", touches_dev(data)))
        return orig_sel_init(self, source, data, *a, **kw)

    def score(self, outputs, label=""):
        log.append(("score", False))
        return orig_score(self, outputs, label)

    def reserve(self, *a, **kw):
        log.append(("reserve", False))
        return orig_reserve(self, *a, **kw)

    monkeypatch.setattr(strategy, "plan", plan)
    monkeypatch.setattr(strategy, "run", run)
    monkeypatch.setattr(ft, "cache_features", cache)
    monkeypatch.setattr(backends, "fit", fit)
    monkeypatch.setattr(Classifier, "predict_logits", pred)
    monkeypatch.setattr(common.Selector, "__init__", sel_init)
    monkeypatch.setattr(common.Selector, "score", score)
    monkeypatch.setattr(Ledger, "reserve", reserve)

    r = _tune(files, tmp_path, name, mode)
    assert r.metrics["mode"] == mode
    kinds = [k for k, _ in log]

    # 0. plans are immutable: a strategy's plan is its own frozen dataclass, without an untyped details dict
    for planned in plans:
        assert dataclasses.is_dataclass(planned) and not hasattr(planned, "details")
        with pytest.raises(dataclasses.FrozenInstanceError):
            planned.notes = []
        assert planned.config is not None  # the strategy config the run executes rides in the typed plan

    # 1. the plan exists before any data is read (features cached) and before anything is reserved
    assert "plan" in kinds and "read data" in kinds, log
    first_plan = kinds.index("plan")
    assert first_plan < kinds.index("read data") and first_plan < kinds.index("run")
    assert max(i for i, k in enumerate(kinds) if k == "plan") < kinds.index("read data")
    if not strategy.not_private:
        assert first_plan < kinds.index("reserve") < kinds.index("read data")

    # 5. the reported split never reaches a selector; its rows are read only to report accuracy, at the end
    dev_uses = [i for i, (k, dev) in enumerate(log) if dev]
    assert all(log[i][0] == "predict" for i in dev_uses), log
    selection = [i for i, k in enumerate(kinds) if k in ("selector", "score")]
    if dev_uses and selection:
        assert min(dev_uses) > max(selection), log
    assert r.certificate.metadata["reported_split_used_for_selection"] is False

    cert = json.loads((r.run_dir / "certificate.json").read_text())
    events = [event_from_dict(e) for e in cert["events"]]
    if strategy.not_private:
        # a NOT PRIVATE reference spends nothing against the budget: no model, no ledger, labelled as such
        assert r.model is None and not (r.run_dir / "model").exists()
        assert not (tmp_path / "l.db").exists()
        assert r.metrics["label"] == "NOT PRIVATE" and cert["metadata"]["label"] == "NOT PRIVATE"
        return

    # 2. what ran is covered by the plan that was reserved; pricing the candidate modes before the reservation (the
    # time estimate) plans them too, and planning is pure: every plan of the run is the reserved one
    p = plans[-1]
    assert plans and all(q == p for q in plans), plans
    (outcome,) = outcomes
    (armed,) = run_plans  # what runs is the reserved plan, a copy armed with the reservation's cover
    assert armed.events == p.events and armed.planned_epsilon() == p.planned_epsilon() and p.covered is None
    planned = p.planned_epsilon()
    assert compute_epsilon(events, DELTA, accountant=p.accountant) <= planned * (1 + 1e-9)
    ran = (list(outcome.certificate_events) if outcome.certificate_events is not None
           else [e for t in outcome.trials for e in t.events] + list(outcome.final_events))
    assert common.epsilon_of(ran, DELTA, p.accountant) <= planned * (1 + 1e-9)
    assert armed.covered is not None and armed.covered(events)

    # 3. certificate ε ≤ the total, and the ledger was charged exactly the certificate's events
    assert r.certificate.epsilon <= TOTAL_EPSILON * (1 + 1e-9) and cert["epsilon"] <= TOTAL_EPSILON * (1 + 1e-9)
    st = Ledger(f"sqlite:///{tmp_path / 'l.db'}").status(r.metrics["dataset_id"])
    assert st.spent_epsilon == pytest.approx(cert["epsilon"], rel=1e-3)


@pytest.mark.parametrize("name", STRATEGIES)
def test_unknown_and_unused_options_are_refused_before_anything_is_spent(files, tmp_path, name):
    strategy = REGISTRY[name]
    with pytest.raises(InvalidParameterError, match="no_such_option") as info:
        _tune(files, tmp_path, name, strategy_options={"no_such_option": 1})
    assert "Valid keys" in str(info.value)
    # an override of tune() the strategy does not use (in last-layer mode) is refused, never dropped
    values = {"trials": 4, "epochs": 2.0, "steps": 5, "batch_size": 16, "optimizer": "adam"}
    unused = [o for o in common.OVERRIDE_NAMES if o not in strategy.overrides.get("features", ())]
    for option in unused:
        with pytest.raises(InvalidParameterError, match=f"`{option}` does not apply to strategy={name!r}"):
            _tune(files, tmp_path, name, **{option: values[option]})
    # refused before the ledger was opened and before anything was written to the run directory
    assert not (tmp_path / "l.db").exists()
    assert not (tmp_path / "run" / "certificate.json").exists()


def test_noise_seeds_are_drawn_from_62_bits():
    """A trial's seed is its noise: from 2**31 values anyone holding a released output could search for it."""
    import re
    from pathlib import Path

    import numpy as np

    from privtune.hpo.common import noise_seed

    seeds = [noise_seed(np.random.default_rng(i)) for i in range(64)]
    assert all(0 <= s < 2**62 for s in seeds) and max(seeds) >= 2**40
    hpo = Path(__file__).resolve().parents[1] / "src" / "privtune" / "hpo"
    narrow = [p.name for p in hpo.glob("*.py") if re.search(r"integers\(\s*2\s*\*\*\s*(31|32)\b", p.read_text())]
    assert narrow == [], f"strategies drawing noise seeds from 32 bits or fewer: {narrow}"
