"""Shared pieces of the trainer tests: the CartPole task, a tiny PPO config, a clean temp folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from core.envs.classic import CartPole
from core.envs.task import Task
from core.train.ppo import PPOConfig


@pytest.fixture(autouse=True)
def temp_folder_left_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Trainer tests write temporary files (saved policies) to a folder of their own and remove them.

    The system temp folder is never touched, and a test that leaves a saved policy
    behind fails: outside a run nobody uploads and deletes it.
    """
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    left = sorted(p.name for p in folder.glob("policy-*.pt"))
    assert not left, f"the test left saved policies behind: {left}"


@pytest.fixture
def task() -> Task:
    return CartPole()


@pytest.fixture
def tiny_cfg() -> PPOConfig:
    """A few batches, two small evaluations: seconds, not minutes."""
    return PPOConfig(
        frames=512, num_envs=4, rollout_steps=32, epochs=2, minibatch=64, hidden=[16], eval_every=256, eval_episodes=2
    )
