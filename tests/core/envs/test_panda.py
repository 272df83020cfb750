"""panda-gym tasks: flattened dict observations with named fields, and the success rate."""

from __future__ import annotations

import numpy as np
import pytest

from core.envs import make_task
from core.envs.panda import PandaTask
from core.errors import UserError
from core.records import Episode

SIZES = {"panda_reach": 12, "panda_push": 24, "panda_pick_and_place": 25}


@pytest.mark.parametrize("name", list(SIZES))
def test_schema_against_real_states(name, schema_check):
    task = make_task({"name": name})
    assert isinstance(task, PandaTask) and task.obs_dim == SIZES[name]
    schema_check(task, num_envs=2, steps=3)


@pytest.mark.parametrize("name", list(SIZES))
def test_fields_are_the_dict_observation_in_order(name):
    task = make_task({"name": name})
    env = task.make_single()
    try:
        obs, _ = env.reset(seed=0)
        raw = env.unwrapped._get_obs()
        parts = {f.name: obs[f.start : f.stop] for f in task.state_fields}
        np.testing.assert_allclose(parts["ee_pos"], raw["observation"][:3], atol=1e-6)
        np.testing.assert_allclose(parts["achieved_goal"], raw["achieved_goal"], atol=1e-6)
        np.testing.assert_allclose(parts["desired_goal"], raw["desired_goal"], atol=1e-6)
        if "object_pos" in parts:
            np.testing.assert_allclose(parts["object_pos"], raw["achieved_goal"], atol=1e-6)
        else:
            np.testing.assert_allclose(parts["ee_pos"], parts["achieved_goal"], atol=1e-6)
    finally:
        env.close()


def test_reward_type_picks_the_env_and_success_is_recorded():
    dense, sparse = make_task({"name": "panda_reach"}), make_task({"name": "panda_reach", "reward_type": "sparse"})
    assert dense.env_id == "PandaReachDense-v3" and sparse.env_id == "PandaReach-v3"
    env = dense.make_single()
    try:
        obs, info = env.reset(seed=0)
        assert info["success"] is False
        fields = {f.name: f for f in dense.state_fields}
        # steer the end effector straight at the goal: it succeeds and the episode terminates
        for _ in range(50):
            ee = obs[fields["ee_pos"].start : fields["ee_pos"].stop]
            goal = obs[fields["desired_goal"].start : fields["desired_goal"].stop]
            obs, reward, terminated, truncated, info = env.step(np.clip((goal - ee) * 10, -1, 1))
            assert reward <= 0.0
            if terminated or truncated:
                break
        assert terminated and info["success"] is True
    finally:
        env.close()
    assert dense.fitness([Episode(-1.0, 5, True), Episode(-3.0, 50, False)]).value == 0.5
    with pytest.raises(UserError):
        make_task({"name": "panda_push", "reward_type": "shaped"})
