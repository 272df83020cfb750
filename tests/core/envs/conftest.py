"""Checks every task's state schema must pass against real observations."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from core.envs.task import Task

# gymnasium's passive checker warns about MetaWorld's spaces; not what these tests check
warnings.filterwarnings("ignore", message=".*(within the observation space|maximum and minimum).*")


def check_schema(task: Task, num_envs: int = 2, steps: int = 3) -> np.ndarray:
    """Make the task's env and check its schema against real observations; return them.

    Fields must tile ``[0, obs_dim)`` exactly (no gap, no overlap), ``obs_dim`` must be
    the env's observation size, ``split_state`` must give ``[B]`` / ``[B, *shape]``,
    and the description must name every field.
    """
    spans = sorted((f.start, f.stop) for f in task.state_fields)
    assert spans[0][0] == 0
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        assert stop == start, f"gap or overlap at {stop}/{start}"
    for f in task.state_fields:
        assert f.size == int(np.prod(f.shape)) if f.shape else f.size == 1, f.name
        assert f.description, f.name
    assert len({f.name for f in task.state_fields}) == len(task.state_fields)

    env = task.make_env(num_envs, seed=0)
    obs, _ = env.reset(seed=0)
    for _ in range(steps):
        obs, *_ = env.step(env.action_space.sample())
    env.close()
    assert obs.shape == (num_envs, task.obs_dim) and obs.dtype == np.float32
    assert env.single_observation_space.shape == (task.obs_dim,)

    parts = task.split_state(torch.as_tensor(obs))
    assert list(parts) == task.field_names()  # derived fields included
    for f in task.program_fields:
        assert tuple(parts[f.name].shape) == (num_envs, *f.shape), f.name

    for f in task.state_fields:
        assert f.name in task.description, f"description does not mention {f.name}"
    assert task.goal and task.action_description
    text = task.render_state(obs[0])
    assert text.strip()
    assert task.schema_text().count("\n") == len(task.program_fields) - 1
    return obs


@pytest.fixture
def schema_check():
    return check_schema
