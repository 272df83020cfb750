"""Learning claims: PPO beats a random policy on CartPole (through ``python -m core``),
on MountainCar with the potential-based ``shaped`` reward, and on Crafter (achievements
a random policy does not unlock). Slow: about a minute each on a busy 2-core machine."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from core.envs import make_task
from core.envs.task import Task
from core.records import Candidate
from core.testing.cli import run_cli
from core.train.evaluate import evaluate
from core.train.ppo import PPOConfig, train


def random_fitness(task: Task, episodes: int, seed: int = 123) -> tuple[float, dict[str, float]]:
    """Fitness of a uniformly random policy (the baseline every claim is measured against)."""
    env = task.make_env(1, 0)
    n = int(env.single_action_space.n)
    env.close()
    g = torch.Generator().manual_seed(seed)
    fit = task.fitness(evaluate(task, lambda obs: torch.randint(0, n, (obs.shape[0],), generator=g), episodes, seed))
    return fit.value, fit.details


@pytest.mark.slow
def test_cartpole_trains_through_the_cli(tmp_path: Path) -> None:
    random_value, _ = random_fitness(make_task({"name": "cartpole"}), 10)
    env = {**os.environ, "LLM4RL_CACHE_DIR": str(tmp_path / "cache")}
    out = run_cli(
        tmp_path,
        "env=cartpole",
        "trainer.frames=16384",
        "trainer.eval_every=0",
        "progress=false",
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    value = float(re.search(r"fitness \(return\): ([-\d.]+)", out.stdout).group(1))
    # 16k frames: 113-500 over 64 seeded runs (median ~190), so 150 failed a third of the seeds
    assert random_value < 40 and value > 100, (random_value, value)


@pytest.mark.slow
def test_mountaincar_learns_with_the_shaped_reward() -> None:
    # the shaping's discount equals the trainer's (0.99): potential-based, so policy-invariant
    task = make_task({"name": "mountaincar", "shaped": True, "shaping_gamma": 0.99})
    random_value, _ = random_fitness(task, 10)
    # a constant learning rate: annealing it to 0 over so short a budget stalls learning
    # (the velocity input is ~0.01, so the first layer's weights must grow a lot)
    cfg = PPOConfig(
        frames=24576,
        num_envs=8,
        rollout_steps=32,
        epochs=10,
        minibatch=64,
        lr=3e-3,
        anneal_lr=False,
        gamma=0.99,
        gae_lambda=0.95,
        eval_every=0,
        eval_episodes=10,
    )
    result = train(task, Candidate(id="mc", iteration=0), cfg, seed=0)
    assert result.ok, result.error
    assert random_value == 0.0 and result.fitness.value >= 0.5, (random_value, result.fitness)


@pytest.mark.slow
def test_crafter_unlocks_achievements_a_random_policy_does_not() -> None:
    task = make_task({"name": "minecraft", "max_episode_steps": 1000})
    random_value, random_details = random_fitness(task, 8)  # ~0.5-0.8: sapling, drink, wake_up
    cfg = PPOConfig(
        frames=CRAFTER_FRAMES,
        num_envs=8,
        rollout_steps=64,
        epochs=4,
        minibatch=256,
        lr=3e-4,
        gamma=0.95,
        gae_lambda=0.95,
        ent_coef=0.01,
        hidden=[128, 128],
        eval_every=0,
        eval_episodes=8,
        eval_deterministic=False,
    )  # Crafter scores the agent's sampled behaviour
    result = train(task, Candidate(id="crafter", iteration=0), cfg, seed=0)
    assert result.ok, result.error
    unlocked = {k for k, v in result.fitness.details.items() if k.startswith("success_") and v > 0}
    assert len(unlocked) >= 3, unlocked
    assert result.fitness.value > random_value, (random_value, random_details, result.fitness)


CRAFTER_FRAMES = 40_000  # measured: score 2.3 (7 achievements incl. wood, table) vs 0.5 random
