"""No function in privtune is longer than MAX_LINES lines (issue 14: "no function in src/ longer than about 120
lines").  A function's length runs from its ``def`` line to its last line, docstring and nested functions
included; methods and nested functions are checked too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import privtune

SRC = Path(privtune.__file__).resolve().parent
MAX_LINES = 120

# Still long in main and being split by the run-pipeline work (engineer tunesplit): the integrator removes each
# entry when its split lands (the second test below then insists).
BEING_SPLIT = {
    "privtune.hpo.tune.tune",
    "privtune.hpo.tune._execute",
    "privtune.training.train",
}


def function_lengths(root: Path = SRC) -> dict[str, int]:
    """Qualified name (``privtune.pkg.module.Class.method``) -> number of lines, for every function under root."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), ".".join(parts))
    return lengths


def test_no_function_is_longer_than_the_limit():
    too_long = {name: n for name, n in function_lengths().items() if n > MAX_LINES and name not in BEING_SPLIT}
    assert not too_long, (f"functions longer than {MAX_LINES} lines (split them into named helpers): "
                          + ", ".join(f"{name} ({n})" for name, n in sorted(too_long.items())))


def test_the_allow_list_names_only_functions_that_are_still_too_long():
    lengths = function_lengths()
    fixed = sorted(name for name in BEING_SPLIT if lengths.get(name, 0) <= MAX_LINES)
    assert not fixed, f"short now (or gone): remove from BEING_SPLIT: {fixed}"


def test_the_measure_counts_docstrings_methods_and_nested_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(
        "def f():\n"
        '    """Doc\n\n    more doc.\n    """\n'
        "    def inner():\n"
        "        return 1\n"
        "    return inner()\n"
        "\n"
        "class C:\n"
        "    def m(self):\n"
        "        return 2\n"
    )
    assert function_lengths(pkg) == {"pkg.mod.f": 8, "pkg.mod.f.inner": 2, "pkg.mod.C.m": 2}
