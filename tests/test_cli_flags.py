"""A flag that an error names exists on the command that raised it, and every command that reads a data file
takes the same data flags (--text-column, --label-column; --labels where the label set is declared)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

import privtune
from privtune.cli import _COMMANDS, cli, main
from privtune.models import load_classifier
from privtune.models.testing import make_tiny_text_model

SRC = Path(privtune.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: `privtune budget raise --dataset D ...` inside a message: flags of THAT command
OTHER_COMMAND = re.compile(r"`privtune ([a-z]+)(?: ([a-z]+))?([^`]*)`")
#: a quoted command of another program (`ray start --head`, `pip install ...`): its flags are not privtune's
FOREIGN_COMMAND = re.compile(r"`(?!privtune |--)[a-z][^`]*`")
#: commands that read a data file, and whether they take the label set (predict takes the model's)
DATA_COMMANDS = {"train": True, "tune": True, "audit": True, "predict": False}


def _command(*path: str) -> click.Command:
    ctx = click.Context(cli)
    command: click.Command = cli
    for name in path:
        command = command.get_command(ctx, name)  # type: ignore[attr-defined]
    return command


def _flags(command: click.Command) -> set[str]:
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


def _all_commands():
    for name in _COMMANDS:
        command = _command(name)
        if isinstance(command, click.Group):
            for sub in command.commands:
                yield (name, sub), command.commands[sub]
        else:
            yield (name,), command


def _flags_named(message: str, raised_by: tuple[str, ...]) -> dict[tuple[str, ...], set[str]]:
    """Each command a message names flags of -> those flags; flags outside a quoted `privtune X ...` command
    belong to the command that raised the message."""
    named: dict[tuple[str, ...], set[str]] = {}
    for m in OTHER_COMMAND.finditer(message):
        path = (m.group(1),) + ((m.group(2),) if m.group(2) and isinstance(_command(m.group(1)), click.Group) else ())
        named.setdefault(path, set()).update(FLAG.findall(m.group(0)))
    rest = OTHER_COMMAND.sub("", FOREIGN_COMMAND.sub("", message))
    named.setdefault(raised_by, set()).update(f for f in FLAG.findall(rest) if f != "--help")
    return named


@pytest.mark.parametrize("name", sorted(DATA_COMMANDS))
def test_every_data_command_takes_the_same_data_flags(name):
    expected = {"--data", "--text-column", "--label-column"} | ({"--labels"} if DATA_COMMANDS[name] else set())
    assert expected <= _flags(_command(name))
    helps = {p.opts[0]: p.help for p in _command(name).params if p.opts[0] in ("--text-column",)}
    assert helps == {"--text-column": "Text column name (auto-detected)."}  # the one shared declaration


def _error_texts():
    """(file:line, text) of every string constant inside a `raise` of src/privtune (f-string parts included)."""
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for sub in ast.walk(node.exc):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        yield f"{path.relative_to(SRC)}:{sub.lineno}", sub.value


def test_every_flag_an_error_spells_is_a_flag_of_some_command():
    """A `--flag` in any error of src/privtune names a real option (the behavioural test below checks, for the
    data errors, that it is an option of the very command that raises them)."""
    known = set().union(*(_flags(c) for _, c in _all_commands())) | {"--help"}
    unknown = {flag: where for where, text in _error_texts() for flag in FLAG.findall(FOREIGN_COMMAND.sub("", text))
               if flag not in known}
    assert not unknown, f"errors name flags that no privtune command has: {unknown}"
    assert sum(1 for _, text in _error_texts() if "--text-column" in text) >= 1  # the walk sees the errors


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    """A CSV whose columns auto-detection cannot name, and a privtune model to predict with."""
    root = tmp_path_factory.mktemp("odd")
    rows = [("1", "a good film", "positive"), ("2", "a bad film", "negative"), ("3", "great acting", "positive"),
            ("4", "dull plot", "negative"), ("5", "lovely", "positive"), ("6", "boring", "negative")]
    data = root / "odd.csv"
    data.write_text("id,body,polarity\n" + "".join(",".join(r) + "\n" for r in rows), encoding="utf-8")
    backbone = make_tiny_text_model(root / "backbone", sentence_transformers=True)
    model = load_classifier(backbone, num_labels=2, label_names=["negative", "positive"]).save_pretrained(
        root / "model")
    return {"data": str(data), "backbone": str(backbone), "model": str(model), "root": root}


def _refusal(argv: list[str], capsys) -> str:
    assert main(argv) == 2, argv
    return capsys.readouterr().err


def _check_named_flags_exist(err: str, command: tuple[str, ...]) -> None:
    for path, flags in _flags_named(err, command).items():
        missing = flags - _flags(_command(*path))
        assert not missing, f"`privtune {' '.join(command)}` says to use {missing} of `privtune {' '.join(path)}`, " \
                            f"which has no such option: {err}"


def _argv(name: str, files: dict, tmp_path) -> list[str]:
    if name == "predict":
        return ["predict", "--model", files["model"], "--data", files["data"]]
    argv = [name, "--data", files["data"], "--model", files["backbone"], "--epsilon", "1", "--delta", "1e-3",
            "--ledger", f"sqlite:///{tmp_path / 'l.db'}"]
    if name == "train":
        argv += ["--mode", "last-layer", "--output", str(tmp_path / "run"), "--steps", "1"]
    if name == "tune":
        argv += ["--mode", "last-layer", "--strategy", "single-step", "--output", str(tmp_path / "run")]
    if name == "audit":
        argv += ["--no-whitebox", "--mode", "last-layer", "--steps", "1", "--canaries", "10"]
    return argv


@pytest.mark.parametrize("name", sorted(DATA_COMMANDS))
def test_the_flags_a_data_error_names_exist_and_get_past_it(name, odd_files, tmp_path, capsys):
    """Follow the errors a user meets on a CSV with unusual columns: each names flags of its own command, and
    passing them gets past it (so `tune`, whose error named --text-column, takes it)."""
    argv = _argv(name, odd_files, tmp_path)
    steps = [("--labels", "negative,positive"), ("--text-column", "body"), ("--label-column", "polarity")]
    if not DATA_COMMANDS[name]:  # predict: the model's labels; a file without a label column is predicted
        steps = steps[1:2]
    for flag, value in steps:
        err = _refusal(argv, capsys)
        assert flag in err, err
        _check_named_flags_exist(err, (name,))
        argv += [flag, value]
    capsys.readouterr()
    if name == "predict":
        assert main(argv) == 0 and "accuracy:" not in capsys.readouterr().out
        assert main(argv + ["--label-column", "polarity"]) == 0
        assert "accuracy:" in capsys.readouterr().out
    else:  # the data are read; the run goes on (or is refused for another reason, never for the data flags)
        rc = main(argv)
        err = capsys.readouterr().err
        assert "column" not in err and "label set is not declared" not in err, err
        _check_named_flags_exist(err, (name,))
        assert rc in (0, 1, 2)


def test_the_message_parser_attributes_flags_to_the_command_they_follow():
    msg = ("The planned run does not fit (...). Use more noise, or raise the total with "
           "`privtune budget raise --dataset D --epsilon NEW --reason WHY`; or pass --epsilon 0.5.")
    assert _flags_named(msg, ("train",)) == {("budget", "raise"): {"--dataset", "--epsilon", "--reason"},
                                             ("train",): {"--epsilon"}}
    with pytest.raises(AssertionError, match="--text-column"):
        _check_named_flags_exist("error: Pass text_column=... (CLI: --text-column).", ("account",))
