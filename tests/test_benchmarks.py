"""The benchmark scripts measure the code of the checkout they are in.

A benchmark started as ``python benchmarks/x.py`` from a worktree at a fixed commit, with a
virtual environment that another checkout installed in editable mode, would otherwise import
that other checkout's ``core`` and record its commit: the figures would come from code the
worktree does not hold.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def _imports_project(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in ("core", "plugins") for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] in ("core", "plugins")
    return False


def _puts_checkout_first(node: ast.stmt) -> bool:
    source = ast.unparse(node)
    return "sys.path.insert(0" in source and "parents[1]" in source


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_imports_the_core_of_its_own_checkout(script: Path) -> None:
    tree = ast.parse(script.read_text())
    project_imports = [n for n in ast.walk(tree) if _imports_project(n)]
    if not project_imports:
        return  # a self-contained script (the single-file baselines) imports nothing of ours
    inserts = [n for n in tree.body if _puts_checkout_first(n)]
    assert inserts, f"{script.name} imports core or plugins without putting its own checkout first on sys.path"
    first_import = min(n.lineno for n in project_imports)
    assert inserts[0].lineno < first_import, f"{script.name} imports core before it puts its checkout first"
