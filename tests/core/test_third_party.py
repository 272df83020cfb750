"""A third-party plugin installed with pip is discovered, listed, enabled and run."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llm4rl_hello"


@pytest.fixture(scope="module")
def hello_installed():
    if not any(ep.name == "hello" for ep in entry_points(group="llm4rl.plugins")):
        # a local, dependency-free install: no network needed
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(FIXTURE)],
            check=True,
            timeout=300,
        )
    yield


def test_registry_lists_the_third_party_plugin(hello_installed):
    out = subprocess.run([sys.executable, "-m", "core.registry"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hello" in out.stdout
    assert "llm4rl_hello" in out.stdout
    assert "llm4rl-hello" in out.stdout  # the distribution that provides it


@pytest.mark.slow
def test_enabled_third_party_plugin_hooks_run(hello_installed, tmp_path):
    marker = tmp_path / "marker.txt"
    cmd = [
        sys.executable, "-m", "core", "+plugins=[hello]", f"plugins.hello.marker={marker}",
        "trainer.frames=2048", "trainer.eval_episodes=2", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_location={tmp_path}/art", f"cache_dir={tmp_path}/cache", "progress=false",
        f"hydra.run.dir={tmp_path}/out",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = marker.read_text().splitlines()
    assert lines[0] == "on_run_start"
    assert lines[1].startswith("on_train_end ")
    assert int(lines[1].split()[1]) >= 2048
