"""MetaWorld tasks: the 39 named values and the any-step success rate."""

from __future__ import annotations

import numpy as np
import pytest

from core.envs import make_task
from core.envs.metaworld import MetaWorldTask
from core.records import Episode

NAMES = ["reach", "push", "pick-place", "door-open", "drawer-open", "button-press"]


def test_reach_schema_and_fields_match_the_sawyer_state(schema_check):
    task = make_task({"name": "reach"})
    schema_check(task, num_envs=1, steps=2)
    env = task._make_single(seed=0)
    obs, _ = env.reset(seed=0)
    inner = env.unwrapped
    parts = {f.name: obs[f.start : f.stop] for f in task.state_fields}
    np.testing.assert_allclose(parts["hand_pos"], inner.get_endeff_pos(), atol=1e-5)
    np.testing.assert_allclose(parts["goal_pos"], inner._target_pos, atol=1e-5)
    np.testing.assert_allclose(parts["obj_pos"], inner._get_pos_objects()[:3], atol=1e-5)
    assert 0.0 <= parts["gripper_distance"][0] <= 1.0
    assert task.obs_dim == 39 and task.state_fields[-1].name == "goal_pos"


@pytest.mark.parametrize("name", NAMES)
def test_every_task_makes_its_metaworld_env(name):
    task = make_task({"name": name})
    assert isinstance(task, MetaWorldTask) and task.fitness_name == "success_rate"
    env = task._make_single(seed=0)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (39,) and obs.dtype == np.float32
    assert env.unwrapped.__class__.__name__.lower().replace("sawyer", "").startswith(name.replace("-", "")[:4])
    for f in ("hand_pos", "obj_pos", "goal_pos"):
        assert f in task.description


def test_success_at_any_step_counts():
    task = make_task({"name": "reach", "max_episode_steps": 3})
    env = task._make_single(seed=0)
    env.reset(seed=0)
    inner = env.unwrapped
    # a success flag on the first step survives two failing steps
    original = inner.evaluate_state
    flags = iter([1.0, 0.0, 0.0])

    def evaluate(obs, action):
        reward, info = original(obs, action)
        return reward, info | {"success": next(flags)}

    inner.evaluate_state = evaluate
    infos = [env.step(np.zeros(4, np.float32))[4] for _ in range(3)]
    assert [i["success"] for i in infos] == [True, True, True]
    fit = task.fitness([Episode(1.0, 3, True), Episode(1.0, 3, False)])
    assert fit.value == 0.5
