"""The per-step transforms, on the real CartPole env, with plain-Python programs."""

from __future__ import annotations

import pluggy
import pytest
import torch
from torchrl.envs import Compose, TransformedEnv

from core.hookspecs import PROJECT
from core.train.envs import VecGymEnv
from core.train.transforms import HookReward, HookState, ProgramReward, ProgramState, build_transforms, has_impls

hookimpl = pluggy.HookimplMarker(PROJECT)


def upright_reward(state, action, next_state):
    """Fake reward program: 1 - |angle|, with two components."""
    upright = 1.0 - next_state["pole_angle"].abs()
    moved = action.float()
    return upright, {"upright": upright, "moved": moved}


def make_env(task, *transforms, keep=True):
    base = VecGymEnv(task.make_env(4, 0), seed=0, keep_env_reward=keep)
    return TransformedEnv(base, Compose(*transforms)) if transforms else base


def test_vec_env_final_observation_and_reset(task):
    env = make_env(task, keep=False)
    data = env.rollout(60, break_when_any_done=False)
    done = data["next", "done"].squeeze(-1)
    assert done.any()
    env_i, t = [int(x) for x in done.nonzero()[0]]
    # the final observation of an episode is out of bounds; the next step starts afresh
    final = data["next", "observation"][env_i, t]
    assert final[2].abs() > 0.2 or final[0].abs() > 2.4
    start = data["observation"][env_i, t + 1]
    assert start.abs().max() <= 0.05
    assert len(env.pop_finished()) == int(done.sum())


def test_program_reward_replace_keeps_env_reward(task):
    env = make_env(task, ProgramReward(upright_reward, task, "replace"))
    data = env.rollout(10, break_when_any_done=False)
    expected = 1.0 - data["next", "observation"][..., 2].abs()
    torch.testing.assert_close(data["next", "reward"].squeeze(-1), expected)
    assert torch.all(data["next", "env_reward"] == 1.0)


def test_program_reward_add_with_weight(task):
    env = make_env(task, ProgramReward(upright_reward, task, "add", weight=0.5))
    data = env.rollout(10, break_when_any_done=False)
    expected = 1.0 + 0.5 * (1.0 - data["next", "observation"][..., 2].abs())
    torch.testing.assert_close(data["next", "reward"].squeeze(-1), expected)


def test_program_reward_components_are_step_means(task):
    transform = ProgramReward(upright_reward, task)
    env = make_env(task, transform)
    data = env.rollout(10, break_when_any_done=False)
    means = transform.pop_components()
    assert set(means) == {"upright", "moved"}
    assert means["moved"] == pytest.approx(data["action"].float().mean().item(), abs=1e-5)
    assert transform.pop_components() == {}


def test_program_reward_rejects_unknown_mode(task):
    with pytest.raises(ValueError, match="mode"):
        ProgramReward(upright_reward, task, "multiply")


def test_program_state_appends_features_and_updates_spec(task):
    def revise(state):
        return torch.stack([state["pole_angle"] * 2, state["cart_position"] ** 2], dim=-1)

    env = make_env(task, ProgramState(revise, task, 2), keep=False)
    assert env.observation_spec["observation"].shape == (4, 6)
    data = env.rollout(5, break_when_any_done=False)
    obs = data["next", "observation"]
    assert obs.shape == (4, 5, 6)
    torch.testing.assert_close(obs[..., 4], obs[..., 2] * 2)
    torch.testing.assert_close(data["observation"][..., 5], data["observation"][..., 0] ** 2)


def test_reward_program_sees_task_observation_after_state_program(task):
    seen = []

    def reward(state, action, next_state):
        seen.append(len(state))
        return torch.zeros(action.shape[0]), {}

    def revise(state):
        return state["pole_angle"].unsqueeze(-1)

    env = make_env(task, ProgramReward(reward, task), ProgramState(revise, task, 1))
    env.rollout(3, break_when_any_done=False)
    assert seen and all(n == 4 for n in seen)  # the four CartPole fields, no extra feature


class _Judge:
    """A plugin implementing the per-step hooks."""

    @hookimpl
    def compute_reward(self, train, batch):
        return 10.0 * batch.done.float() + batch.env_reward * 0

    @hookimpl
    def represent_state(self, train, obs):
        return obs[:, :1] * 3


def _hook(*plugins):
    from core import hookspecs

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for p in plugins:
        pm.register(p)
    return pm.hook


def test_has_impls_is_false_without_plugins():
    hook = _hook()
    assert not has_impls(hook, "compute_reward")
    assert not has_impls(None, "compute_reward")
    assert has_impls(_hook(_Judge()), "compute_reward")


def test_hook_transforms(task):
    from core.config import Settings
    from core.context import TrainContext
    from core.records import Candidate

    hook = _hook(_Judge())
    ctx = TrainContext(settings=Settings.of(), task=task, candidate=Candidate("c", 0), seed=0, total_frames=100)
    rewards, states = build_transforms(task, hook=hook, ctx=ctx)
    assert [type(t) for t in rewards] == [HookReward] and [type(t) for t in states] == [HookState]
    env = make_env(task, *rewards, *states)
    data = env.rollout(40, break_when_any_done=False)
    done = data["next", "done"].float()
    torch.testing.assert_close(data["next", "reward"], 1.0 + 10.0 * done)
    obs = data["next", "observation"]
    assert obs.shape[-1] == 5
    torch.testing.assert_close(obs[..., 4], obs[..., 0] * 3)


def test_no_transforms_without_programs_or_plugins(task):
    assert build_transforms(task, hook=_hook(), ctx=None) == ([], [])


def test_program_reward_on_a_collected_batch_matches_per_step(task):
    per_step = make_env(task, ProgramReward(upright_reward, task, "add", weight=2.0))
    stepped = per_step.rollout(12, break_when_any_done=False)
    batch = stepped.clone()
    batch.set(("next", "reward"), batch.get(("next", "env_reward")).clone())
    del batch["next", "env_reward"]
    ProgramReward(upright_reward, task, "add", weight=2.0)(batch)
    torch.testing.assert_close(batch["next", "reward"], stepped["next", "reward"])
    assert torch.all(batch["next", "env_reward"] == 1.0)
