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


def _replay_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("replay_check", BENCHMARKS[0].parent / "replay_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(fitness: float, winner: str, **metrics: float):
    from core.report.data import StudyRun

    figures = {"candidates": 8.0, "candidates_rejected": 2.0, "candidates_trained": 6.0, "llm_programs_trained": 6.0}
    tags = {"best_candidate": winner, "study.machine": "cpu"}
    return StudyRun(
        "id",
        "eureka-cartpole-s0",
        "cartpole",
        "eureka",
        0,
        "ok",
        fitness,
        metrics={**figures, "fitness": fitness, "final/fresh_mean": fitness, **metrics},
        tags=tags,
    )


def test_the_replay_check_tells_programs_winner_and_scores_apart() -> None:
    compare = _replay_check().compare
    same = compare(_run(500.0, "it0-c2"), _run(500.0, "it0-c2", **{"llm/requests": 0.0}))
    assert same["same_programs"] and same["same_winner"] and same["same_scores"]
    tie = compare(_run(500.0, "it0-c2"), _run(120.6, "it0-c1"))  # another CPU: a tie broken the other way
    assert tie["same_programs"] and not tie["same_winner"] and not tie["same_scores"]
    asked = compare(_run(500.0, "it0-c2"), _run(500.0, "it0-c2", **{"llm/requests": 3.0}))
    assert not asked["same_programs"]  # a reply that came from the LLM is not the recorded one
    fewer = _run(500.0, "it0-c2", candidates_rejected=3.0)
    assert not compare(_run(500.0, "it0-c2"), fewer)["same_programs"]
