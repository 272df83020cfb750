"""The testing kit, :mod:`core.testing`: shipped with the package, light to load, pytest kept inside it.

That a third-party package runs the contract through it from outside the repository is
tested in ``tests/core/test_third_party.py`` (the guide's package and test file).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tomllib

import core.testing

ROOT = Path(__file__).resolve().parents[2]


def python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, outside the repository (the installed package only)."""
    return subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)


def test_every_public_name_resolves():
    missing = [name for name in core.testing.__all__ if not hasattr(core.testing, name)]
    assert not missing, missing
    assert core.testing.PluginContract.__module__ == "core.testing.contract"
    assert core.testing.ScriptedLLM.__module__ == "core.testing.fakes"


def test_the_framework_imports_pytest_only_in_the_kit():
    """pytest is a test dependency (``llm4rl[test]``): a run must not need it."""
    found = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        if (ROOT / "core" / "testing") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] in ("pytest", "_pytest") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_without_pytest_the_kit_says_what_to_install():
    out = python(
        "import sys; sys.modules['pytest'] = None\n"
        "try:\n    import core.testing\nexcept ImportError as err:\n    print(err)"
    )
    assert out.returncode == 0, out.stderr
    assert "core.testing needs pytest" in out.stdout and "pip install 'llm4rl[test]'" in out.stdout, out.stdout


def test_the_pytest_plugin_loads_without_the_framework():
    """A suite's conftest loads it before any test: no torch, Hydra or litellm until a test asks."""
    out = python(
        "import sys, core.testing.pytest_plugin as p; assert callable(p.make_config)\n"
        "print(sorted(m for m in ('torch', 'hydra', 'litellm', 'core.testing.contract') if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_kit_is_in_the_wheel_and_rewrites_only_its_own_asserts():
    """Every package of ``core`` and ``plugins`` ships (``core.testing`` included); no
    ``pytest11`` entry point, which would make pytest rewrite the asserts of all of them."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(meta["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("core", "plugins")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk <= packages, f"packages missing from pyproject.toml: {sorted(on_disk - packages)}"
    assert "pytest11" not in meta["project"].get("entry-points", {})
    import core.plugin
    import core.testing.contract

    assert "@pytest_ar" in vars(core.testing.contract), "the contract's asserts explain themselves"
    assert "@pytest_ar" not in vars(core.plugin)


def test_make_config_comes_from_the_kit(request, make_config):
    """The repository's own tests get ``make_config`` from the kit's plugin, like a third party's suite."""
    assert request.config.pluginmanager.has_plugin("core.testing.pytest_plugin")
    cfg = make_config(["env=cartpole"])
    assert str(cfg.tracking.uri).endswith("mlflow.db") and cfg.progress is False


def test_run_cli_keeps_the_records_in_the_folder_but_those_the_caller_places(tmp_path, monkeypatch):
    import core.testing.cli as cli

    seen: list[list[str]] = []

    def fake_run(command, **kwargs):
        seen.append(command)
        return subprocess.CompletedProcess(command, 0, "out", "err")

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    result = cli.run_cli(tmp_path, "env=cartpole", f"+cache_dir={tmp_path}/mine")
    assert (result.returncode, result.output) == (0, "outerr")
    assert seen[0] == [
        sys.executable,
        "-m",
        "core",
        "env=cartpole",
        f"+cache_dir={tmp_path}/mine",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_location={tmp_path}/art",
        f"hydra.run.dir={tmp_path}/out",
    ]
    cli.run_cli(tmp_path, "--experiment", "x", module="core.report")
    assert seen[1] == [sys.executable, "-m", "core.report", "--experiment", "x"]  # overrides only for core


def test_a_third_party_config_key_without_a_word_is_found(tmp_path, monkeypatch):
    """The contract's docs check for plugins outside the repository: a comment or the docstring explains a key."""
    from core.testing.contract import undocumented_keys

    (tmp_path / "undocumented_plugin.py").write_text(
        "from dataclasses import dataclass\n"
        "from core.plugin import PluginConfig\n\n\n"
        "@dataclass\n"
        "class Config(PluginConfig):\n"
        '    """``plugins.x``: ``gamma`` discounts the bonus."""\n\n'
        "    beta: float = 0.1  # bonus scale\n"
        "    gamma: float = 0.9\n"
        "    delta: int = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import undocumented_plugin

    assert undocumented_keys(undocumented_plugin) == ["delta"]
