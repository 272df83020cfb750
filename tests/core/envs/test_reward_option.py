"""``env.reward``: ``human`` (the env designers' reward) or ``sparse``; the fitness never changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.envs import make_task
from core.errors import UserError
from core.records import Episode
from core.train.evaluate import evaluate

CLASSIC = ["cartpole", "mountaincar", "mountaincar_continuous", "pendulum", "acrobot", "lunarlander"]
OTHERS = ["hopper", "reach", "minecraft"]  # one MuJoCo, one MetaWorld task, Crafter


def _task(name: str, reward: str):
    cfg = {"name": name, "reward": reward}
    if name == "minecraft":
        cfg["max_episode_steps"] = 200  # short episodes: the evaluation below ends them
    return make_task(cfg)


def _fixed_policy(task):
    """A deterministic policy that needs no training: cycle the discrete actions, or push +0.5."""
    env = task.make_env(1, 0)
    space = env.single_action_space
    env.close()
    if hasattr(space, "n"):
        return lambda obs: torch.as_tensor(np.arange(obs.shape[0]) % space.n)
    return lambda obs: torch.full((obs.shape[0], *space.shape), 0.5)


def _rewards(task, steps: int = 150) -> np.ndarray:
    env = task.make_env(2, 0)
    env.action_space.seed(0)
    out = []
    for _ in range(steps):
        _, reward, *_ = env.step(env.action_space.sample())
        out.append(np.asarray(reward, dtype=float))
    env.close()
    return np.stack(out)


@pytest.mark.parametrize("name", CLASSIC + OTHERS)
def test_sparse_changes_the_reward_not_the_fitness(name):
    human, sparse = _task(name, "human"), _task(name, "sparse")
    assert not np.allclose(_rewards(human), _rewards(sparse))  # the same actions are paid differently
    policy = _fixed_policy(human)
    on_human = evaluate(human, policy, episodes=3, seed=5)
    on_sparse = evaluate(sparse, policy, episodes=3, seed=5)
    assert human.fitness(on_human).value == pytest.approx(sparse.fitness(on_sparse).value)
    assert [e.length for e in on_human] == [e.length for e in on_sparse]  # the same episodes
    if name not in ("mountaincar", "mountaincar_continuous", "reach", "minecraft"):  # return-based fitness
        assert sparse.fitness(on_sparse).value == pytest.approx(np.mean([e.ret for e in on_human]))


@pytest.mark.parametrize("name", CLASSIC + OTHERS)
def test_the_sparse_reward_is_stated_in_the_description(name):
    human, sparse = _task(name, "human"), _task(name, "sparse")
    assert "env.reward=sparse" not in human.description
    assert sparse.sparse_text and sparse.sparse_text in sparse.description


def test_cartpole_pays_only_a_whole_balanced_episode():
    task = _task("cartpole", "sparse")
    rule = task.sparse_reward
    assert rule(None, 1.0, False, False, {}, {}) == 0.0  # a step alive
    assert rule(None, 1.0, True, False, {}, {}) == 0.0  # the pole fell
    assert rule(None, 1.0, False, True, {}, {}) == 1.0  # reached the time limit upright


def test_goal_tasks_pay_only_the_success_step():
    for name in ("mountaincar", "acrobot"):
        rule = _task(name, "sparse").sparse_reward
        assert rule(None, -1.0, False, False, {}, {}) == 0.0
        assert rule(None, -1.0, False, True, {}, {}) == 0.0  # time out
        assert rule(None, 0.0, True, False, {}, {}) == 1.0  # reached the goal


def test_pendulum_pays_only_near_upright():
    rule = _task("pendulum", "sparse").sparse_reward
    at = lambda theta: np.array([np.cos(theta), np.sin(theta), 0.0])  # noqa: E731
    assert rule(at(0.0), -0.0, False, False, {}, {}) == 1.0
    assert rule(at(0.19), -0.1, False, False, {}, {}) == 1.0
    assert rule(at(-0.3), -0.1, False, False, {}, {}) == 0.0
    assert rule(at(np.pi), -9.9, False, False, {}, {}) == 0.0


def test_lunarlander_pays_only_the_outcome():
    rule = _task("lunarlander", "sparse").sparse_reward
    assert rule(None, 2.5, False, False, {}, {}) == 0.0  # shaping on the way down
    assert rule(None, -100.0, True, False, {}, {}) == -100.0  # crash
    assert rule(None, 100.0, True, False, {}, {}) == 100.0  # at rest


def test_mujoco_pays_each_new_metre_once():
    rule = _task("hopper", "sparse").sparse_reward
    episode: dict = {}
    paid = [rule(None, 1.0, False, False, {"x_position": x}, episode) for x in (0.2, 0.9, 1.1, 0.8, 1.5, 3.2)]
    assert paid == [0.0, 0.0, 1.0, 0.0, 0.0, 2.0]


def test_metaworld_pays_success_steps():
    rule = _task("reach", "sparse").sparse_reward
    assert rule(None, 5.0, False, False, {"success": 0.0}, {}) == 0.0
    assert rule(None, 9.0, False, False, {"success": 1.0}, {}) == 1.0


def test_the_human_return_is_the_fitness_of_return_tasks():
    task = _task("cartpole", "sparse")
    episodes = [Episode(0.0, 40, None, {"human_return": 40.0}), Episode(1.0, 500, None, {"human_return": 500.0})]
    assert task.fitness(episodes).value == pytest.approx(270.0)


def test_a_task_without_a_sparse_reward_refuses_it():
    with pytest.raises(UserError, match="no sparse reward"):
        make_task({"name": "gym", "id": "Acrobot-v1", "reward": "sparse"})


def test_an_unknown_reward_is_refused():
    with pytest.raises(UserError, match="env.reward must be one of human, sparse"):
        make_task({"name": "cartpole", "reward": "dense"})
