"""MuJoCo locomotion tasks: field names are the model's joints, values its qpos/qvel."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest

from core.envs import make_task
from core.records import Episode

SKIP = {"halfcheetah": 1, "hopper": 1, "ant": 2, "humanoid": 2}
KIND = {0: "free", 2: "slide", 3: "hinge"}


@pytest.mark.parametrize("name", list(SKIP))
def test_schema_matches_real_observations(name, schema_check):
    schema_check(make_task({"name": name}), steps=2)


@pytest.mark.parametrize("name", list(SKIP))
def test_joint_fields_are_the_models_qpos_and_qvel(name):
    task = make_task({"name": name})
    env = task._make_single()
    obs, _ = env.reset(seed=1)
    obs, *_ = env.step(env.action_space.sample())
    model, data = env.unwrapped.model, env.unwrapped.data
    joints = [
        (mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, j), KIND[int(model.jnt_type[j])])
        for j in range(model.njnt)
    ]
    assert joints == type(task).joints
    parts = {f.name: obs[f.start : f.stop] for f in task.state_fields}
    n_pos = model.nq - SKIP[name]
    qpos_fields = task.state_fields[:n_pos]
    qvel_fields = task.state_fields[n_pos : n_pos + model.nv]
    np.testing.assert_allclose([parts[f.name][0] for f in qpos_fields], data.qpos[SKIP[name] :], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([parts[f.name][0] for f in qvel_fields], data.qvel, rtol=1e-5, atol=1e-5)
    for joint, kind in joints[1:]:
        assert f"{joint}_pos" in parts and f"{joint}_vel" in parts


def test_forward_velocity_is_logged_with_the_return():
    task = make_task({"name": "halfcheetah", "max_episode_steps": 5})
    env = task.make_env(1, seed=0)
    env.reset(seed=0)
    for _ in range(5):
        _, _, _, truncated, info = env.step(env.action_space.sample())
    assert truncated[0]
    final = {k: v[0] for k, v in info["final_info"].items() if not k.startswith("_")}
    success, extra = task.episode_info(final)
    assert success is None and "mean_forward_velocity" in extra
    fit = task.fitness(
        [Episode(10.0, 5, info={"mean_forward_velocity": 1.0}), Episode(20.0, 5, info={"mean_forward_velocity": 3.0})]
    )
    assert fit.name == "return" and fit.value == 15.0 and fit.details["mean_forward_velocity"] == 2.0
