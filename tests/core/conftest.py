"""Fixtures of the core tests: plugins written to a temporary folder, tiny run budgets."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest

import core.registry
from core.registry import PluginInfo

#: a CartPole run that trains in about a second, in this process
TINY_RUN = [
    "env=cartpole",
    "trainer.frames=512",
    "trainer.num_envs=4",
    "trainer.rollout_steps=32",
    "trainer.epochs=1",
    "trainer.minibatch=64",
    "trainer.hidden=[16]",
    "trainer.eval_every=0",
    "trainer.eval_episodes=2",
    "executor=inprocess",
    "tracking.log_plots=false",
]


@pytest.fixture
def tiny_run(make_config):
    """``tiny_run(*overrides)``: a composed run config of :data:`TINY_RUN` size, stored under tmp_path."""
    return lambda *overrides: make_config([*TINY_RUN, *overrides])


@pytest.fixture
def local_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], Path]:
    """``add(name, source)``: a plugin module written to ``tmp_path`` and known to the catalogue.

    The module ``llm4rl_test_<name>`` is importable for this test only (as an installed
    third-party plugin would be through its entry point); writing it again and calling
    ``add`` again replaces the code a later import sees. Returns the module's file.
    """
    folder = tmp_path / "plugin_src"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit within the same second is seen
    infos: dict[str, PluginInfo] = {}
    monkeypatch.setattr(core.registry, "entry_point_plugins", lambda: list(infos.values()))

    def add(name: str, source: str) -> Path:
        module = f"llm4rl_test_{name}"
        path = folder / f"{module}.py"
        path.write_text(textwrap.dedent(source))
        sys.modules.pop(module, None)
        infos[name] = PluginInfo(name=name, module=module, roles=["test"], source="tests")
        return path

    yield add
    for info in infos.values():
        sys.modules.pop(info.module, None)
