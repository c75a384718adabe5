"""What users read names papers by their authors and method, never by the project's internal numbering ("seed
003", "digest 001"), and carries no account of the project's machines ("when one is lent") or issue numbers:
the help of every command, the configuration templates, `privtune recommend`, the report's texts, every error
message of src/privtune, and the reasons the test suite prints for skipped tests."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import click
import pytest

import privtune
from privtune.cli import _COMMANDS, cli, main
from privtune.cli.config_file import COMMANDS, template
from privtune.hpo.recommend import recommend

SRC = Path(privtune.__file__).parent
TESTS = Path(__file__).parent
INTERNAL = re.compile(r"\b(?:seeds? 00\d|digest (?:00\d|anchors)|issues? #?\d+|lent)\b", re.IGNORECASE)


def _help_texts():
    ctx = click.Context(cli)
    paths = []
    for name in _COMMANDS:
        command = cli.get_command(ctx, name)
        paths.append([name])
        if isinstance(command, click.Group):
            paths += [[name, sub] for sub in command.commands]
    for path in [[]] + paths:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*path, "--help"]) == 0
        yield "privtune " + " ".join(path + ["--help"]), out.getvalue()


def _docstrings(tree: ast.AST) -> set[int]:
    """The string statements of a tree: docstrings of modules, classes, functions and attributes (developers'
    text, read in the source)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _source_texts():
    """Every string of src/privtune but docstrings: errors, messages, log lines, what runs write and the report."""
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                yield f"{path.relative_to(SRC).as_posix()}:{node.lineno}", node.value


def _skip_reasons():
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in ("skip", "skipif", "importorskip", "xfail", "_unavailable"):
                continue
            texts = [k.value for k in node.keywords if k.arg in ("reason", "msg")]
            texts += node.args if name in ("skip", "_unavailable") else []
            for t in texts:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        yield f"tests/{path.name}:{sub.lineno}", sub.value


def _offenders(texts) -> list[str]:
    return [f"{where}: {m.group(0)!r}" for where, text in texts for m in INTERNAL.finditer(text)]


def test_help_of_every_command_names_papers_not_seed_numbers():
    texts = list(_help_texts())
    assert len(texts) > 10 and any("Rehn et al." in t for _, t in texts)
    assert not _offenders(texts)


def test_templates_and_recommend_output_name_papers():
    texts = [(f"config init --command {c}", template(c)) for c in COMMANDS]
    texts.append(("privtune recommend", recommend(1.0, 1e-5, 2000, 3).format()))
    assert "Rehn et al." in texts[-1][1]
    assert not _offenders(texts)


def test_errors_messages_and_report_texts_name_papers():
    texts = list(_source_texts())
    assert any("Liu & Bu" in t for _, t in texts)  # the walk reaches the report's strategy texts
    assert not _offenders(texts)


def test_skip_reasons_say_what_is_missing_not_which_machine_was_lent():
    reasons = list(_skip_reasons())
    assert any("CUDA" in r for _, r in reasons)
    assert not _offenders(reasons)


@pytest.mark.parametrize("text", ["(seed 003)", "digest 001 §3", "issue 15", "when one is lent", "Seeds 000"])
def test_the_pattern_catches_the_internal_words(text):
    assert INTERNAL.search(text)
