"""Import hygiene of the privtune source tree.

* No private name (``_x``) and no private module (``pkg._mod``) is imported from another privtune package.
  The top-level private modules ``privtune._validation`` and ``privtune._release`` are the library's shared
  internals, so importing their public names from any package is allowed; their private names are not.
* The imports between privtune modules have no cycle: neither the module-level ones nor all of them together
  (function-level ones included).  There is no allow-list; the checker is itself tested on a synthetic
  package with a cycle behind a function-level import.
* ``import privtune`` stays light: it imports none of the heavy dependencies the package docstring promises
  to load lazily (torch, transformers).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import privtune

SRC = Path(privtune.__file__).resolve().parent


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(src: Path) -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package at ``src``: dotted name -> (path, syntax tree)."""
    return {_module_name(p, src): (p, ast.parse(p.read_text(), str(p))) for p in sorted(src.rglob("*.py"))}


MODULES = _modules(SRC)


def _package_of(modules: dict, module: str) -> str:
    path = modules[module][0]
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _absolute(modules: dict, module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(modules, module).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owner(dotted: str) -> str:
    """The package that owns ``dotted``: the part before its first private component."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            return ".".join(parts[:i])
    return ".".join(parts)


def _imported(modules: dict, module: str, tree: ast.Module, *, module_level_only: bool):
    """Yield (node, target) for each name or module of the same top-level package that ``module`` imports.

    A target is ``pkg.mod.name`` for ``from pkg.mod import name`` and ``pkg.mod`` for ``import pkg.mod``.
    """
    root = module.split(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # imports under a top-level `if`/`try` still run at import time
        nodes = [n for top in tree.body for n in (ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top])]
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = _absolute(modules, module, node)
            if base.split(".")[0] == root:
                for alias in node.names:
                    yield node, f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root:
                    yield node, alias.name


def _private_cross_package_imports(modules: dict) -> set[tuple[str, str]]:
    found = set()
    for module, (_, tree) in modules.items():
        importer = _package_of(modules, module)
        root = module.split(".")[0]
        for _, target in _imported(modules, module, tree, module_level_only=False):
            if not any(_is_private(p) for p in target.split(".")):
                continue
            owner = _owner(target)
            shared_internal = owner == root and (target in modules or not _is_private(target.rsplit(".", 1)[1]))
            if owner != importer and not shared_internal:
                found.add((module, target))
    return found


def test_no_private_name_is_imported_across_packages():
    found = sorted(_private_cross_package_imports(MODULES))
    assert not found, "private names imported from another package (give them a public name): " + repr(found)


def _import_graph(modules: dict, *, module_level_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (_, tree) in modules.items():
        for _, target in _imported(modules, module, tree, module_level_only=module_level_only):
            # `from pkg import name` imports module pkg.name when it is one, else pkg itself.
            dep = target if target in modules else target.rsplit(".", 1)[0]
            while dep not in modules and "." in dep:
                dep = dep.rsplit(".", 1)[0]
            # Importing a submodule runs its package's __init__ first, which is not a dependency on
            # the importer's own package (that is already being imported).
            if dep != module and dep in modules:
                graph[module].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop edges from a submodule to its own ancestor packages' ``__init__``.

    ``from privtune.ledger import _backend`` inside ``privtune.ledger.ledger`` reads the package only
    as a namespace; Python has already started importing that package, so it is no cycle to untangle.
    """
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def _all_cycles(modules: dict, *, module_level_only: bool) -> list[list[str]]:
    return _cycles(_without_package_inits(_import_graph(modules, module_level_only=module_level_only)))


def test_module_level_imports_have_no_cycle():
    cycles = _all_cycles(MODULES, module_level_only=True)
    assert not cycles, f"import cycles among module-level imports: {cycles}"


def test_all_imports_have_no_cycle():
    cycles = _all_cycles(MODULES, module_level_only=False)
    assert not cycles, (f"import cycles (function-level imports included): {cycles}. Move the shared definition "
                        "to a module both can import.")


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_checker_finds_a_cycle_closed_by_a_function_level_import(tmp_path):
    src = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/schema.py": "from pkg.run import write\n",
        "pkg/run/__init__.py": "",
        "pkg/run/write.py": "def write():\n    from pkg.schema import KEYS  # lazy: hides the cycle at import time\n",
        "pkg/alone.py": "import pkg.schema\n",
    })
    modules = _modules(src)
    assert _all_cycles(modules, module_level_only=True) == []
    assert _all_cycles(modules, module_level_only=False) == [["pkg.run.write", "pkg.schema"]]


def test_the_checker_finds_a_module_level_cycle_and_a_private_import(tmp_path):
    src = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "from . import a\n",
        "pkg/sub/__init__.py": "from pkg.sub import _impl\n",  # its own package's private module: allowed
        "pkg/sub/_impl.py": "",
        "pkg/c.py": "from pkg.sub._impl import thing\n",  # another package's private module: refused
    })
    modules = _modules(src)
    assert _all_cycles(modules, module_level_only=True) == [["pkg.a", "pkg.b"]]
    assert _private_cross_package_imports(modules) == {("pkg.c", "pkg.sub._impl.thing")}


def test_import_privtune_does_not_import_torch_or_transformers():
    # privtune/__init__.py: "``import privtune`` ... do[es] not pay for importing torch and transformers."
    code = "import sys, privtune; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
