"""privtune.choices, the light declaration of every choice set, agrees with the code that implements each
choice; and what reads it (the CLI's help, the YAML schema) loads without torch, SciPy or the tuning stack."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from privtune import accounting, choices
from privtune.accounting import DPSGDEvent, compute_epsilon
from privtune.engine.private_gradient import clip_factors
from privtune.errors import InvalidParameterError
from privtune.hpo import common
from privtune.hpo.executors import make_executor
from privtune.hpo.recommend import recommend
from privtune.hpo.registry import REGISTRY, STRATEGIES, register
from privtune.hpo.tune import MODES as TUNE_MODES
from privtune.hpo.tune import tune
from privtune.ledger import Ledger
from privtune.models.classifier import POOLING_CHOICES
from privtune.optim import make_optimizer
from privtune.training import train


def test_the_causal_lm_names_are_the_models_known_by_name():
    from privtune.models.causal_lm import KNOWN_CAUSAL_LMS

    assert choices.CAUSAL_LM_NAMES == tuple(KNOWN_CAUSAL_LMS)


def test_the_registry_holds_exactly_the_declared_strategies_in_order():
    assert tuple(REGISTRY) == choices.STRATEGIES == STRATEGIES
    assert all(strategy.name == name for name, strategy in REGISTRY.items())


def test_the_registry_refuses_a_strategy_that_is_not_declared():
    undeclared = type(REGISTRY["hyperfree"])()
    undeclared.name = "no-such-strategy"
    with pytest.raises(ValueError, match="not declared in privtune.choices.STRATEGIES"):
        register(undeclared)
    assert "no-such-strategy" not in REGISTRY


def test_modes_and_selections_agree_with_tune():
    assert TUNE_MODES == choices.TUNE_MODES == ("auto", *common.TUNABLE_MODES)
    assert set(choices.TUNABLE_MODES) == set(choices.TRAIN_MODES) - {"two-phase"}
    assert tuple(common.SELECTION_SOURCE_OF) == choices.SELECTIONS == common.SELECTIONS
    for strategy in REGISTRY.values():
        assert set(strategy.modes) <= set(choices.TUNABLE_MODES)


@pytest.mark.parametrize("name", choices.OPTIMIZERS)
def test_every_optimizer_name_builds_an_optimizer(name):
    p = torch.nn.Parameter(torch.ones(2))
    opt = make_optimizer(name, [p], learning_rate=0.1)
    p.grad = torch.ones(2)
    opt.step()
    assert torch.all(p < 1)


@pytest.mark.parametrize("name", choices.ACCOUNTANTS)
def test_every_accountant_name_accounts(name):
    eps = compute_epsilon([DPSGDEvent(1.0, 0.01, 100)], 1e-5, accountant=name)
    assert 0 < eps < 10


@pytest.mark.parametrize("name", choices.SAMPLING_SCHEMES)
def test_every_sampling_name_is_an_event(name):
    q = 1.0 if name == "full_batch" else 0.1
    assert compute_epsilon([DPSGDEvent(1.0, q, 10, sampling=name)], 1e-5) > 0


def test_every_clipping_name_bounds_the_norm_and_the_two_differ():
    norms = torch.tensor([0.5, 4.0])
    factors = {name: clip_factors(norms, 1.0, name, 0.01) for name in choices.CLIPPINGS}
    assert all(torch.all(f * norms <= 1.0 + 1e-6) for f in factors.values())
    assert not torch.allclose(factors["flat"], factors["automatic"])


def test_executors_and_preferences_are_the_ones_the_code_takes():
    assert make_executor("local").name == "local"
    with pytest.raises(InvalidParameterError, match="executor"):
        make_executor("nowhere")
    for prefer in choices.PREFERENCES:
        assert recommend(1.0, 1e-5, 2000, 3, prefer=prefer).batch_size >= 1


def test_the_defaults_the_cli_shows_are_the_functions_own():
    tune_defaults = {k: p.default for k, p in inspect.signature(tune).parameters.items()}
    assert choices.TUNE_DEFAULTS == {k: tune_defaults[k] for k in choices.TUNE_DEFAULTS}
    train_defaults = {k: p.default for k, p in inspect.signature(train).parameters.items()}
    assert choices.TRAIN_DEFAULTS == {k: train_defaults[k] for k in choices.TRAIN_DEFAULTS}
    init = inspect.signature(Ledger.init_dataset).parameters["accountant"].default
    assert choices.BUDGET_DEFAULTS == {"accountant": init,
                                       "sampling": inspect.signature(DPSGDEvent).parameters["sampling"].default}
    assert choices.ACCOUNT_DEFAULTS == {
        "accountant": inspect.signature(accounting.account).parameters["accountant"].default,
        "sampling": inspect.signature(DPSGDEvent).parameters["sampling"].default}
    recommend_defaults = {k: p.default for k, p in inspect.signature(recommend).parameters.items()}
    assert choices.RECOMMEND_DEFAULTS == {k: recommend_defaults[k] for k in choices.RECOMMEND_DEFAULTS}


def test_the_pooling_choices_are_the_classifiers():
    assert POOLING_CHOICES is choices.POOLING_CHOICES


def test_tune_help_and_the_config_schema_load_without_torch_scipy_or_the_tuning_stack():
    """What `privtune tune --help` (`recommend`, `train`, `predict`, `audit`, `budget`, `account`) and `privtune
    config check` import (its speed is measured by bench/cli_startup.py; here only what it must not load)."""
    code = ("import sys, contextlib, io\n"
            "from privtune.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['tune', '--help']) == 0 and main(['recommend', '--help']) == 0\n"
            "    assert all(main([c, '--help']) == 0 for c in ('train', 'predict', 'audit', 'budget', 'account'))\n"
            "    assert main(['budget', 'spend', '--help']) == 0\n"
            "    assert main(['config', 'init', '--command', 'tune', '-']) == 0\n"
            "import privtune.cli.config_file\n"
            "heavy = ('torch', 'scipy', 'sqlalchemy', 'dp_accounting', 'transformers', 'privtune.hpo')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
