"""No circles among the modules of ``core/``.

Every ``import core...`` / ``from core... import`` of every module counts: at module
level, inside functions (a deferred import still ties the two modules' designs together)
and under ``if TYPE_CHECKING:`` (a type one module takes from another is a dependency
too). ``from package import name`` counts as an import of the submodule ``name`` when
there is one, else of the package. A package's own ``__init__`` is not implied by
importing one of its submodules (Python runs it, but it is the package's door, not a
dependency of the importer).
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module and package under ``core/``."""
    found = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``core`` that ``name`` (a module, or a name inside one) belongs to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``core`` modules the file at ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {m for m in (_resolve(n, modules) for n in names if n == "core" or n.startswith("core.")) if m}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through ``component``, for the failure message: a -> b -> ... -> a."""
    members, start = set(component), component[0]
    trail, seen = [start], {start}
    while True:
        nxt = sorted(graph[trail[-1]] & members)
        back = start if start in nxt else None
        if back or not nxt:
            return " -> ".join([*trail, start])
        step = next((n for n in nxt if n not in seen), nxt[0])
        if step in seen:
            return " -> ".join([*trail[trail.index(step) :], step])
        trail.append(step)
        seen.add(step)


def test_the_collector_sees_every_kind_of_import(tmp_path):
    modules = {"core": Path(), "core.a": Path(), "core.b": Path(), "core.pkg": Path(), "core.pkg.c": Path()}
    source = tmp_path / "m.py"
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import core.a\n"
        "if TYPE_CHECKING:\n    from core.b import Thing\n"
        "def f():\n    from core.pkg import c, helper\n"
        "import os\n"
    )
    assert imports_of(source, modules) == {"core.a", "core.b", "core.pkg.c", "core.pkg"}


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_core_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    found = cycles(graph)
    assert not found, "import circles in core/ (function-level and TYPE_CHECKING imports count): " + "; ".join(
        _path(graph, c) for c in found
    )
