"""The package's shape: no import circle among serve_app's modules, no module over MAX_LINES.

The import graph is read from the source with ``ast`` (nothing is imported): a module-level
``import a.b`` or ``from a.b import c`` of a serve_app module is an edge to that module (to the
submodule ``a.b.c`` when ``c`` is one, else to ``a.b``), and to the packages above it whose
``__init__`` Python runs first, except the importer's own packages (already running when it
runs). Imports under ``if TYPE_CHECKING:`` and inside functions or classes are left out: they
are the intentional way to name a module without importing it at load time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "serve_app"
MAX_LINES = 400


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]):
    """Import statements run when the module loads (not under TYPE_CHECKING, not in a def)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse,
                          node.finalbody):
                yield from _module_level_imports(block)
        elif isinstance(node, ast.With):
            yield from _module_level_imports(node.body)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at load time (see the module docstring)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in _module_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            if node.level:  # relative: from .x import y
                base = own_package.split(".")[:len(own_package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets += [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                        for a in node.names]
        running = set(_parents(name))
        edges = set()
        for target in targets:
            if target in modules:
                edges.add(target)
                edges.update(p for p in _parents(target) if p in modules and p not in running)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_in_the_package():
    cycle = find_cycle(import_graph(ROOT, PACKAGE))
    assert cycle is None, (
        "import circle: " + " -> ".join(cycle) + ". Move what both sides need into the lower "
        "layer (governance/config below ingress, metrics below everything), or import inside the "
        "function that needs it if the circle is intended.")


def test_no_module_over_the_line_limit():
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / PACKAGE).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, (
        f"modules over {MAX_LINES} lines (split a cohesive piece into its own module, keeping "
        "the public names importable where they were): "
        + ", ".join(f"{p} ({n})" for p, n in long.items()))


def test_the_cycle_finder_sees_a_circle_through_a_package_init(tmp_path):
    """The checker itself: a circle closed by a package ``__init__`` re-export is found, one
    closed only under TYPE_CHECKING or inside a function is not."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from pkg.low.base import Thing\n")
    (pkg / "low" / "base.py").write_text("from pkg.high import helper\nThing = 1\n")
    (pkg / "high.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from pkg.low import Thing\n"
        "if TYPE_CHECKING:\n    from pkg import lazy\n"
        "def helper():\n    from pkg import lazy\n")
    (pkg / "lazy.py").write_text("import pkg.high\n")
    graph = import_graph(tmp_path, "pkg")
    assert find_cycle(graph) == ["pkg.high", "pkg.low", "pkg.low.base", "pkg.high"]
    assert "pkg.lazy" not in graph["pkg.high"]
    (pkg / "low" / "base.py").write_text("Thing = 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None
