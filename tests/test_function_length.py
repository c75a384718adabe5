"""No function in privtune is longer than MAX_LINES lines (about 120).  A function's length runs from its ``def`` line to its last line, docstring and nested functions
included; methods and nested functions are checked too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import privtune

SRC = Path(privtune.__file__).resolve().parent
MAX_LINES = 120

# The flat keyword entry points: train() and tune().  They are what the command line and the docs call, so they
# keep one keyword per option and document every keyword (with units) in their docstrings, which alone run to
# ~40-70 lines; their BODIES (without the docstring) stay within 60 lines: they build the typed run request at once
# and hand it to the spec-based stages (tests/test_specs.py checks their bodies through its own measure).  They are
# the only functions allowed more than MAX_PARAMETERS parameters: every other function takes spec objects instead
# (audit() takes an AuditSpec, which `privtune audit` builds from its options with AuditSpec.create).
FLAT_API_ENTRY_POINTS = {"privtune.hpo.tune.tune": 60, "privtune.training.train": 60}
MAX_PARAMETERS = 15


def _functions(root: Path = SRC):
    """(qualified name ``privtune.pkg.module.Class.method``, its FunctionDef) for every function under root,
    methods and nested functions included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{prefix}.{child.name}", child))
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), ".".join(parts))
    return found


def function_lengths(root: Path = SRC, docstrings: bool = True) -> dict[str, int]:
    """Qualified name -> number of lines, for every function under root (from the ``def`` line, or with
    ``docstrings=False`` from the first statement after the docstring)."""
    lengths: dict[str, int] = {}
    for name, fn in _functions(root):
        body = fn.body
        if not docstrings and len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]
        start = fn.lineno if docstrings else body[0].lineno
        lengths[name] = fn.end_lineno - start + 1
    return lengths


def test_no_function_is_longer_than_the_limit():
    too_long = {name: n for name, n in function_lengths().items()
                if n > MAX_LINES and name not in FLAT_API_ENTRY_POINTS}
    assert not too_long, (f"functions longer than {MAX_LINES} lines (split them into named helpers): "
                          + ", ".join(f"{name} ({n})" for name, n in sorted(too_long.items())))


def test_the_flat_entry_points_have_short_bodies():
    lengths = function_lengths(docstrings=False)
    too_long = {name: lengths.get(name) for name, limit in FLAT_API_ENTRY_POINTS.items()
                if lengths.get(name) is None or lengths[name] > limit}
    assert not too_long, f"train()/tune() bodies must stay within 60 lines (None: function gone): {too_long}"


def parameter_counts(root: Path = SRC) -> dict[str, int]:
    """Qualified name -> number of parameters (``self``/``cls`` not counted; ``*args``/``**kwargs`` not counted)."""
    return {name: len([x for x in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
                       if x.arg not in ("self", "cls")])
            for name, fn in _functions(root)}


def too_many_parameters(root: Path = SRC, allowed=FLAT_API_ENTRY_POINTS) -> dict[str, int]:
    """Qualified name -> parameter count of every function under root above MAX_PARAMETERS, except ``allowed``."""
    return {name: n for name, n in parameter_counts(root).items() if n > MAX_PARAMETERS and name not in allowed}


def test_no_function_takes_more_than_15_parameters():
    too_many = too_many_parameters()
    assert not too_many, (f"functions with more than {MAX_PARAMETERS} parameters (pass a spec object instead): "
                          + ", ".join(f"{name} ({n})" for name, n in sorted(too_many.items())))


def test_the_parameter_check_flags_a_function_with_16_parameters(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    params15 = ", ".join(f"a{i}" for i in range(15))
    (pkg / "mod.py").write_text(
        f"def ok({params15}):\n    pass\n\n"
        f"def entry(*, {params15}, extra):\n    pass\n\n"
        f"class C:\n    def method(self, {params15}, extra=None):\n        pass\n")
    assert too_many_parameters(pkg, allowed={}) == {"pkg.mod.entry": 16, "pkg.mod.C.method": 16}
    assert too_many_parameters(pkg, allowed={"pkg.mod.entry": 60}) == {"pkg.mod.C.method": 16}


def test_the_parameter_measure(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("def f(a, b, *args, c, **kw):\n    pass\n\nclass C:\n    def m(self, x):\n        pass\n")
    assert parameter_counts(pkg) == {"pkg.mod.f": 3, "pkg.mod.C.m": 1}


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
    assert function_lengths(pkg, docstrings=False) == {"pkg.mod.f": 3, "pkg.mod.f.inner": 1, "pkg.mod.C.m": 1}
