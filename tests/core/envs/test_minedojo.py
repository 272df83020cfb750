"""MineDojo: what is missing is found before any reset; the adapter over a fake minedojo."""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest

from core.envs import make_task, minedojo as md
from core.errors import UserError


@pytest.fixture
def fake_minedojo(monkeypatch):
    """A stand-in ``minedojo`` module: importable, with a ``make`` that records its calls."""
    made = []

    class FakeEnv:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.actions = []

        def _obs(self, t):
            return {
                "life_stats": {
                    "life": np.array([20.0]),
                    "oxygen": np.array([300.0]),
                    "armor": np.array([0.0]),
                    "food": np.array([20.0]),
                    "saturation": np.array([5.0]),
                },
                "location_stats": {
                    "pos": np.array([1.0, 64.0, float(t)]),
                    "yaw": np.array([90.0]),
                    "pitch": np.array([0.0]),
                },
                "inventory": {"quantity": np.arange(36, dtype=np.float32)},
                "rgb": np.zeros((3, 8, 8), np.uint8),
            }

        def reset(self):
            return self._obs(0)

        def step(self, action):
            self.actions.append(np.asarray(action))
            return self._obs(len(self.actions)), 1.0, len(self.actions) >= 3, {"success": len(self.actions) >= 3}

        def close(self):
            pass

    module = types.ModuleType("minedojo")
    module.make = lambda **kwargs: FakeEnv(**kwargs)
    monkeypatch.setitem(sys.modules, "minedojo", module)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "minedojo" else real_find_spec(name, *a)
    )
    return made


def test_missing_package_is_reported_with_the_recipe(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "minedojo" else real_find_spec(name, *a)
    )
    with pytest.raises(UserError) as err:
        make_task({"name": "minedojo"})
    message = str(err.value)
    assert "'minedojo' package, which is not installed" in message
    assert (
        "gym==0.21.0" in message
        and "--no-build-isolation" in message
        and "JDK 8" in message
        and "env=minecraft" in message
    )


def test_missing_java_is_reported(fake_minedojo, monkeypatch):
    monkeypatch.setattr(md.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="'java' was not found on PATH.*openjdk-8"):
        make_task({"name": "minedojo"})
    assert fake_minedojo == []  # detected before any env was made


@pytest.mark.parametrize("output", ['openjdk version "17.0.9" 2023-10-17', 'java version "11.0.2"'])
def test_wrong_java_version_is_reported(fake_minedojo, monkeypatch, output):
    monkeypatch.setattr(md.shutil, "which", lambda name: "/usr/bin/java")
    monkeypatch.setattr(
        md.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="", stderr=output + "\nOpenJDK Runtime")
    )
    with pytest.raises(UserError, match="needs JDK 8, but 'java -version' reports 1[17]"):
        make_task({"name": "minedojo"})
    assert fake_minedojo == []


def test_adapter_runs_over_minedojo_when_everything_is_there(fake_minedojo, monkeypatch, schema_check):
    monkeypatch.setattr(md.shutil, "which", lambda name: "/usr/bin/java")
    monkeypatch.setattr(
        md.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="", stderr='openjdk version "1.8.0_392"')
    )
    assert md.java_version() == "1.8.0_392"
    task = make_task({"name": "minedojo", "task_id": "harvest_milk", "image_size": [64, 96]})
    schema_check(task, num_envs=1, steps=2)
    assert fake_minedojo[0]["task_id"] == "harvest_milk" and fake_minedojo[0]["image_size"] == (64, 96)
    env = md.MineDojoEnv("harvest_milk", (64, 96), max_episode_steps=10)
    obs, _ = env.reset()
    fields = {f.name: obs[f.start : f.stop] for f in task.state_fields}
    assert fields["life"][0] == 20.0 and list(fields["position"]) == [1.0, 64.0, 0.0]
    assert fields["inventory_quantity"][5] == 5.0
    assert md.ACTIONS[11][0] == "attack"
    env.step(11)
    assert list(env._env.actions[-1]) == list(md.ACTIONS[11][1])
    env.step(0)
    *_, terminated, truncated, info = env.step(0)
    assert terminated and not truncated and info["success"] is True


@pytest.mark.parametrize("installed", [False, True])
def test_cli_prints_the_clear_message_not_a_traceback(tmp_path, installed):
    """``python -m core env=minedojo``: without MineDojo, and with a (stand-in) MineDojo but
    only a JDK 17 on PATH, the run stops with the recipe, exit code 2, no traceback."""
    import os

    from core.testing.cli import run_cli

    env = {**os.environ, "LLM4RL_CACHE_DIR": str(tmp_path / "cache")}
    if installed:
        (tmp_path / "pkgs" / "minedojo").mkdir(parents=True)
        (tmp_path / "pkgs" / "minedojo" / "__init__.py").write_text(
            "def make(**kwargs):\n    raise RuntimeError('launched')\n"
        )
        (tmp_path / "bin").mkdir()
        java = tmp_path / "bin" / "java"
        java.write_text("#!/bin/sh\necho 'openjdk version \"17.0.15\" 2025-04-15' >&2\n")
        java.chmod(0o755)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "pkgs"), env.get("PYTHONPATH", "")])
        env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), env["PATH"]])
    out = run_cli(tmp_path, "env=minedojo", "progress=false", env=env, timeout=300)
    text = out.said
    assert out.returncode == 2, text[-2000:]
    assert "Traceback" not in text and "launched" not in text
    expected = (
        "needs JDK 8, but 'java -version' reports 17" if installed else "'minedojo' package, which is not installed"
    )
    assert expected in text and "llm4rl[minedojo]" in text
