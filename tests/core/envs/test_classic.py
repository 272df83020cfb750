"""Classic-control, Box2D and generic gymnasium tasks against real envs."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from core.envs import make_task
from core.envs.classic import GymTask, SuccessInfo
from core.records import Episode

CLASSIC = ["cartpole", "mountaincar", "mountaincar_continuous", "pendulum", "acrobot", "lunarlander"]


@pytest.mark.parametrize("name", CLASSIC)
def test_schema_matches_real_observations(name, schema_check):
    task = make_task({"name": name})
    schema_check(task)


@pytest.mark.parametrize("name", CLASSIC)
def test_fields_are_the_unwrapped_env_state(name):
    """The named fields hold what the gymnasium env documents (compare with its state)."""
    task = make_task({"name": name})
    env = task._make_single()
    obs, _ = env.reset(seed=3)
    inner = env.unwrapped
    parts = {f.name: obs[f.start : f.stop] for f in task.state_fields}
    if name == "cartpole":
        np.testing.assert_allclose(obs, np.asarray(inner.state, np.float32))
        assert parts["pole_angle"][0] == np.float32(inner.state[2])
    elif name.startswith("mountaincar"):
        np.testing.assert_allclose(
            [parts["car_position"][0], parts["car_velocity"][0]], np.asarray(inner.state, np.float32)
        )
    elif name == "pendulum":
        theta, omega = inner.state
        np.testing.assert_allclose(
            [parts["cos_theta"][0], parts["sin_theta"][0], parts["angular_velocity"][0]],
            [np.cos(theta), np.sin(theta), omega],
            rtol=1e-5,
        )
    elif name == "acrobot":
        t1, t2, w1, w2 = inner.state
        np.testing.assert_allclose(obs, np.float32([np.cos(t1), np.sin(t1), np.cos(t2), np.sin(t2), w1, w2]), rtol=1e-5)
    elif name == "lunarlander":
        assert parts["y"][0] > 1.0 and parts["left_leg_contact"][0] == 0.0  # starts high, legs up


def test_gym_task_names_obs_fields_and_shows_the_env_docs(schema_check):
    task = make_task({"name": "gym", "id": "Acrobot-v1"})
    assert [f.name for f in task.state_fields] == [f"obs_{i}" for i in range(6)]
    assert task.max_episode_steps == 500
    assert "Observation Space" in task.description  # the env class's own documentation
    schema_check(task)


def test_show_source_includes_the_observation_code():
    task = make_task({"name": "cartpole", "show_source": True})
    assert "def step" in task.description and "self.state" in task.description


def test_mountaincar_success_is_reaching_the_flag():
    task = make_task({"name": "mountaincar"})
    assert task.fitness_name == "success_rate"
    env = task.make_env(1, seed=0)
    env.reset(seed=0)
    env.envs[0].unwrapped.state = np.array([0.49, 0.07])  # one push right reaches the flag
    _, _, terminated, _, info = env.step(np.array([2]))
    assert terminated[0] and info["_final_info"][0] and bool(info["final_info"]["success"][0])
    success, _ = task.episode_info({"success": True})
    assert success is True
    fit = task.fitness(
        [Episode(-50, 50, True), Episode(-200, 200, False), Episode(-200, 200, False), Episode(-90, 90, True)]
    )
    assert fit.value == 0.5 and fit.details["mean_return"] == pytest.approx(-135.0)


def test_success_info_stays_set_until_the_episode_ends():
    calls = iter([True, False])
    env = SuccessInfo(gym.make("CartPole-v1"), lambda terminated, info: next(calls))
    env.reset(seed=0)
    assert env.step(0)[4]["success"] and env.step(0)[4]["success"]
    assert env.reset()[1]["success"] is False


def test_time_limit_follows_the_config():
    task = make_task({"name": "pendulum", "max_episode_steps": 7})
    env = task.make_env(1, seed=0)
    env.reset(seed=0)
    truncated = [env.step(env.action_space.sample())[3][0] for _ in range(7)]
    assert truncated == [False] * 6 + [True]


def test_params_are_rejected_for_tasks_without_params():
    from core.errors import UserError

    with pytest.raises(UserError, match="no controllable params"):
        make_task({"name": "cartpole"}).make_env(1, 0, params={"gravity": 3})
    assert isinstance(make_task({"name": "cartpole"}), GymTask)


def test_cartpole_describes_a_segment_in_words():
    task = make_task({"name": "cartpole"})
    obs = np.zeros((5, 4), np.float32)
    obs[-1] = [-0.5, 0.0, np.radians(4.0), 0.0]
    running = task.describe_segment(obs, ended=False)
    assert "all 5 steps" in running and "4 degrees to the right" in running and "0.5 m left" in running
    assert "pole fell past 12 degrees" in task.describe_segment(obs, ended=True)
    obs[-1, 0] = 2.5
    assert "cart left the track" in task.describe_segment(obs, ended=True)
    assert make_task({"name": "mountaincar"}).describe_segment(obs[:, :2], ended=False) == ""


def test_task_steps_give_the_true_last_observation_of_an_ended_episode():
    from core.envs.task import task_steps

    steps = list(task_steps(make_task({"name": "cartpole"}), 2, 120, seed=0))  # random CartPole ends within ~30 steps
    assert len(steps) == 120 and steps[0].obs.shape == (2, 4) and steps[0].next_obs.shape == (2, 4)
    ends = [(t, i) for t, s in enumerate(steps[:-1]) for i in np.flatnonzero(s.done)]
    assert ends
    for t, i in ends:
        assert np.array_equal(steps[t].next_obs[i], steps[t].info["final_obs"][i])  # not the reset's observation
        assert not np.array_equal(steps[t].next_obs[i], steps[t + 1].obs[i])  # the next step starts from the reset
        assert steps[t].final_info(i) is not None
    again = list(task_steps(make_task({"name": "cartpole"}), 2, 120, seed=0))
    assert all(np.array_equal(a.action, b.action) for a, b in zip(steps, again))  # random actions seeded
