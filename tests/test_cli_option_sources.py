"""One source of truth for options: each choice set is declared once, in the module that owns it, and the
config schema, the CLI's click choices, its help text and its defaults are read from there."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace
from pathlib import Path

import click
import pytest

import privtune
from privtune.accounting.accountant import ACCOUNTANTS
from privtune.accounting.events import SAMPLING_SCHEMES, DPSGDEvent
from privtune.cli import budget as cli_budget
from privtune.cli import config as cli_config
from privtune.cli import main
from privtune.cli import train as cli_train
from privtune.cli import tune as cli_tune
from privtune.cli.config_file import COMMANDS, SCHEMAS
from privtune.engine.private_gradient import CLIPPINGS
from privtune.finetune.modes import DEFAULT_LEARNING_RATES
from privtune.finetune.modes import MODES as TRAIN_MODES
from privtune.hpo.common import SELECTION_SOURCE_OF, SELECTIONS
from privtune.hpo.executors import EXECUTORS
from privtune.hpo.recommend import PREFERENCES, recommend
from privtune.hpo.tune import MODES as TUNE_MODES
from privtune.hpo.tune import STRATEGIES, tune
from privtune.ledger import Ledger
from privtune.choices import IMAGE_FEATURES
from privtune.models.classifier import POOLING_CHOICES
from privtune.models.vision import BATCHNORM_CHOICES
from privtune.optim import OPTIMIZERS
from privtune.report.html import STRATEGY_TEXT
from privtune.training import train

SRC = Path(privtune.__file__).parent

#: each choice set -> the one source file allowed to spell it out (privtune/choices.py imports nothing, so the
#: CLI and the config schema read it without torch; tests/test_choices.py checks each implementation against it)
OWNERS = {
    "optimizers": (OPTIMIZERS, "choices.py"),
    "accountants": (ACCOUNTANTS, "choices.py"),
    "sampling": (SAMPLING_SCHEMES, "choices.py"),
    "clippings": (CLIPPINGS, "choices.py"),
    "train modes": (TRAIN_MODES, "choices.py"),
    "tune modes": (TUNE_MODES, "choices.py"),
    "strategies": (STRATEGIES, "choices.py"),
    "selections": (SELECTIONS, "choices.py"),
    "executors": (EXECUTORS, "choices.py"),
    "pooling": (POOLING_CHOICES, "choices.py"),
    "batchnorm policies": (BATCHNORM_CHOICES, "choices.py"),
    "image features": (IMAGE_FEATURES, "choices.py"),
    "recommend preferences": (PREFERENCES, "choices.py"),
    "config commands": (COMMANDS, "cli/config_file.py"),
}
#: tables with one entry per choice, kept outside the owning module (each must cover every choice, no other)
PER_CHOICE_TABLES = {
    "strategies": {"report/html.py": STRATEGY_TEXT},
    "selections": {"hpo/common.py": SELECTION_SOURCE_OF},
    "train modes": {"finetune/modes.py": DEFAULT_LEARNING_RATES},
}


def _string_collections(tree: ast.AST):
    """Every tuple/list/set literal, and the keys and the values of every dict literal, made of two or more
    string constants: the shapes a choice set is spelt in."""
    for node in ast.walk(tree):
        groups = []
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            groups.append(node.elts)
        elif isinstance(node, ast.Dict):
            groups += [[k for k in node.keys if k is not None], node.values]
        for elts in groups:
            if len(elts) >= 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
                yield node.lineno, frozenset(e.value for e in elts)


def _spellings() -> dict[frozenset, list[str]]:
    found: dict[frozenset, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for lineno, values in _string_collections(ast.parse(path.read_text(encoding="utf-8"))):
            found.setdefault(values, []).append(f"{rel}:{lineno}")
    return found


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_each_choice_set_is_spelt_out_in_its_owning_module_only(name):
    choices, owner = OWNERS[name]
    tables = PER_CHOICE_TABLES.get(name, {})
    for table in tables.values():
        assert sorted(table) == sorted(choices)
    places = _spellings().get(frozenset(choices), [])
    elsewhere = [p for p in places if p.split(":")[0] not in (owner, *tables)]
    assert not elsewhere, (f"the {name} {choices} are re-declared at {elsewhere}; import them from "
                           f"privtune/{owner} instead")


def _choice_params(command: click.Command) -> dict[str, tuple]:
    return {p.name: tuple(p.type.choices) for p in command.params if isinstance(p.type, click.Choice)}


@pytest.mark.parametrize("command, expected", [
    (cli_train.train, {"mode": TRAIN_MODES, "optimizer": OPTIMIZERS, "clipping": CLIPPINGS,
                       "sampling": SAMPLING_SCHEMES, "accountant": ACCOUNTANTS, "pooling": POOLING_CHOICES}),
    (cli_tune.tune, {"mode": TUNE_MODES, "strategy": STRATEGIES, "selection": SELECTIONS, "executor": EXECUTORS}),
    (cli_tune.recommend, {"prefer": PREFERENCES}),
    (cli_budget.budget.commands["init"], {"accountant": ACCOUNTANTS}),
    (cli_budget.budget.commands["spend"], {"sampling": SAMPLING_SCHEMES}),
    (cli_config.config.commands["init"], {"command": COMMANDS}),
    (cli_config.config.commands["check"], {"command": COMMANDS}),
], ids=["train", "tune", "recommend", "budget-init", "budget-spend", "config-init", "config-check"])
def test_click_choices_are_the_owning_tuples(command, expected):
    assert _choice_params(command) == expected


def test_config_choices_are_the_owning_tuples_and_their_help_names_every_choice():
    expected = {
        "train": {"mode": TRAIN_MODES, "optimizer": OPTIMIZERS, "clipping": CLIPPINGS, "sampling": SAMPLING_SCHEMES,
                  "accountant": ACCOUNTANTS, "batchnorm": BATCHNORM_CHOICES, "image_features": IMAGE_FEATURES},
        "tune": {"mode": TUNE_MODES, "strategy": STRATEGIES, "selection": SELECTIONS, "optimizer": OPTIMIZERS,
                 "clipping": CLIPPINGS, "accountant": ACCOUNTANTS, "executor": EXECUTORS,
                 "batchnorm": BATCHNORM_CHOICES, "image_features": IMAGE_FEATURES},
    }
    for command, schema in SCHEMAS.items():
        choices = {key: tuple(o.choices) for key, o in schema.items() if o.kind == "choice"}
        assert choices == expected[command], command
        for key, values in choices.items():
            missing = [v for v in values if v not in schema[key].help]
            assert not missing, f"the {command} template's help of `{key}` does not name {missing}"


def _signature_defaults(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def test_tune_cli_leaves_the_defaults_to_tune(monkeypatch, tmp_path):
    """The CLI passes only what the user set (flags or file); tune()'s signature supplies every default."""
    calls = []

    class Stop(Exception):
        pass

    def fake_tune(data=None, **kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setattr(cli_tune, "run_tune", fake_tune, raising=False)
    with pytest.raises(Stop):
        main(["tune", "--data", str(tmp_path / "train.tsv"), "--trials", "4"])
    assert calls == [{"trials": 4}]


def test_cli_help_shows_the_signature_defaults(capsys):
    tune_defaults, train_defaults = _signature_defaults(tune), _signature_defaults(train)
    assert main(["tune", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for key in ("mode", "strategy", "epsilon"):
        assert f"[default: {tune_defaults[key]}]" in text, key
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for key in ("optimizer", "clipping", "sampling", "accountant", "clip", "max_physical_batch_size"):
        assert f"(default {train_defaults[key]})" in text, key
    budget_init = {p.name: p.default for p in cli_budget.budget.commands["init"].params}
    assert budget_init["accountant"] == _signature_defaults(Ledger.init_dataset)["accountant"]
    budget_spend = {p.name: p.default for p in cli_budget.budget.commands["spend"].params}
    assert budget_spend["sampling"] == _signature_defaults(DPSGDEvent)["sampling"]
    assert main(["account", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{' | '.join(SAMPLING_SCHEMES)} " in text and f"{' or '.join(ACCOUNTANTS)} " in text
    assert f"[default: {_signature_defaults(DPSGDEvent)['sampling']}]" in text
    recommend_defaults = _signature_defaults(recommend)
    assert {p.name: p.default for p in cli_tune.recommend.params if p.name in ("min_steps", "plateau_tol", "prefer")} \
        == {k: recommend_defaults[k] for k in ("min_steps", "plateau_tol", "prefer")}


def test_tune_cli_states_the_union_bound_guarantee_of_a_mode_auto_run(monkeypatch, tmp_path, capsys):
    """After --mode auto's pilots chose one of k plans (each made at δ/k), the CLI prints the guarantee of the union
    bound, (total ε, δ), below the certificate's ε; other runs print no such line."""
    def fake_tune(data=None, **kwargs):
        metrics = {"epsilon": 7.5372, "delta": 1e-5, "total_epsilon": 8.0, "strategy": "hyperfree",
                   "mode": "last-layer", "selection": "public_validation", "trials": 3, "hyperparameters": {}, **extra}
        return SimpleNamespace(run_dir=tmp_path / "run", metrics=metrics, certificate=None)

    monkeypatch.setattr(cli_tune, "run_tune", fake_tune, raising=False)
    for extra, expected in (({"mode_plans": 3}, True), ({}, False)):
        assert main(["tune", "--data", str(tmp_path / "train.tsv")]) == 0
        out = capsys.readouterr().out
        assert "certificate: ε = 7.5372, δ = 1e-05" in out
        assert ("guarantee: ε = 8, δ = 1e-05 (the mode pilots chose one of 3 plans, each made at δ/3" in out) == expected
