"""Shared pieces of the trainer tests: the CartPole task and a tiny PPO config."""

from __future__ import annotations

import pytest

from core.envs.classic import CartPole
from core.envs.task import Task
from core.train.ppo import PPOConfig


@pytest.fixture
def task() -> Task:
    return CartPole()


@pytest.fixture
def tiny_cfg() -> PPOConfig:
    """A few batches, two small evaluations: seconds, not minutes."""
    return PPOConfig(frames=512, num_envs=4, rollout_steps=32, epochs=2, minibatch=64,
                     hidden=[16], eval_every=256, eval_episodes=2)
