"""Every built-in task builds its env and steps through the training stack, or says
clearly (a ``UserError`` naming what to install) why it cannot run here."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from core.envs import BUILTIN_TASKS, make_task
from core.envs.task import Task
from core.errors import UserError
from core.train.envs import VecGymEnv

#: options a task needs to build at all (``gym`` takes any gymnasium id)
OPTIONS = {"gym": {"id": "Acrobot-v1"}}
#: tasks whose simulator this test run may lack: (module that must import, what the message names)
OPTIONAL = {"minedojo": ("minedojo", "minedojo")}


def _random_actions(env: VecGymEnv, rng: np.random.Generator) -> torch.Tensor:
    n = env.batch_size[0]
    if env.discrete:
        return torch.from_numpy(rng.integers(0, int(env.action_spec.space.n), size=n))
    spec = env.action_spec
    low, high = spec.space.low.numpy(), spec.space.high.numpy()
    return torch.from_numpy(rng.uniform(low, high).astype(np.float32))


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_task_steps_through_the_training_env_or_raises_a_clear_error(name: str) -> None:
    if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name][0]) is None:
        with pytest.raises(UserError) as err:
            make_task({"name": name, **OPTIONS.get(name, {})})
        assert "not installed" in str(err.value) and "pip install" in str(err.value)
        return
    task = make_task({"name": name, **OPTIONS.get(name, {})})
    env = VecGymEnv(task.make_env(2, seed=0), seed=0)
    rng = np.random.default_rng(0)
    try:
        td = env.reset()
        assert td["observation"].shape == (2, task.obs_dim)
        for _ in range(5):
            td.set("action", _random_actions(env, rng))
            step, td = env.step_and_maybe_reset(td)
            nxt = step["next"]
            assert nxt["observation"].shape == (2, task.obs_dim)
            assert torch.isfinite(nxt["observation"]).all() and torch.isfinite(nxt["reward"]).all()
    finally:
        env.close()
    obs = nxt["observation"][0].numpy()
    # what an LLM reads: schema, description and a rendering that name the fields
    schema = task.schema_text()
    text = task.render_state(obs)
    assert task.description.strip() and text.strip() and task.goal.strip()
    names = [f.name for f in task.state_fields]
    assert all(n in schema and n in task.description for n in names)
    mentioned = [n for n in names if n in text]
    if type(task).render_state is Task.render_state:  # the default rendering: every field
        assert mentioned == names
    else:  # a task's own summary (Crafter) names the fields that matter in the state
        assert len(mentioned) >= 4, mentioned
