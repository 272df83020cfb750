"""VecGymEnv: the fast ``step_and_maybe_reset`` matches TorchRL's generic one, final
observations and episode returns are right, and a Collector batch has the same keys."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.collectors import Collector
from torchrl.envs import EnvBase

from core.envs.classic import CartPole, Pendulum
from core.train.envs import VecGymEnv


def _actions(env: VecGymEnv, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = env.batch_size[0]
    if env.discrete:
        return [torch.randint(0, 2, (n,), generator=g) for _ in range(steps)]
    return [torch.rand(n, 1, generator=g) * 4 - 2 for _ in range(steps)]


def _rollout(env: VecGymEnv, actions: list[torch.Tensor], fast: bool) -> list[tuple]:
    td = env.reset()
    out = []
    for a in actions:
        td.set("action", a)
        td.set("sample_log_prob", torch.zeros(a.shape[0]))  # a policy output the root must carry over
        if fast:
            step, td = env.step_and_maybe_reset(td)
        else:
            step, td = EnvBase._step_and_maybe_reset(env, td)
        out.append((step.clone(), td.clone()))
    return out


@pytest.mark.parametrize("task_cls,keep", [(CartPole, False), (CartPole, True), (Pendulum, False)])
def test_fast_step_matches_torchrl_generic_path(task_cls: type, keep: bool) -> None:
    task = task_cls(max_episode_steps=20) if task_cls is Pendulum else task_cls()
    fast_env = VecGymEnv(task.make_env(4, 0), seed=0, keep_env_reward=keep)
    slow_env = VecGymEnv(task.make_env(4, 0), seed=0, keep_env_reward=keep)
    actions = _actions(fast_env, 60)
    fast, slow = _rollout(fast_env, actions, True), _rollout(slow_env, actions, False)
    assert any(bool(s["next", "done"].any()) for s, _ in slow), "the rollout must cross episode ends"
    for (fs, fr), (ss, sr) in zip(fast, slow):
        assert set(fs.keys(True, True)) == set(ss.keys(True, True))
        assert set(fr.keys(True, True)) == set(sr.keys(True, True))
        for key in ss.keys(True, True):
            torch.testing.assert_close(fs.get(key), ss.get(key), msg=f"step key {key}")
        for key in sr.keys(True, True):
            if key in ("action", "sample_log_prob"):
                # carried-over policy outputs: the generic reset zeroes them for reset envs,
                # the fast path keeps them; the policy overwrites both before they are read
                continue
            torch.testing.assert_close(fr.get(key), sr.get(key), msg=f"root key {key}")
    assert fast_env.pop_finished() == slow_env.pop_finished()


def test_final_observation_and_episode_returns() -> None:
    env = VecGymEnv(CartPole().make_env(3, 0), seed=0)
    td = env.reset()
    lengths = np.zeros(3, dtype=int)
    seen = []
    for _ in range(80):  # always push right: episodes end in ~10 steps
        td.set("action", torch.ones(3, dtype=torch.int64))
        step, td = env.step_and_maybe_reset(td)
        lengths += 1
        done = step["next", "done"].squeeze(-1).numpy()
        for i in np.flatnonzero(done):
            # the final observation has the pole past its limit or the cart off the track
            final = step["next", "observation"][i]
            assert abs(float(final[2])) > 0.2095 or abs(float(final[0])) > 2.4
            # the next root observation is a fresh episode's (near zero)
            assert float(td["observation"][i].abs().max()) <= 0.05
            seen.append(int(lengths[i]))
            lengths[i] = 0
        assert not bool(td["done"].any())
    finished = env.pop_finished()
    assert [n for _, n in finished] == seen and len(seen) >= 6
    assert all(r == float(n) for r, n in finished)  # CartPole: +1 per step
    assert env.pop_finished() == []


def test_collector_batch_over_the_fast_path() -> None:
    env = VecGymEnv(CartPole().make_env(4, 0), seed=0)

    def policy(td):
        td.set("action", torch.randint(0, 2, (4,)))
        return td

    collector = Collector(
        env,
        policy,
        frames_per_batch=4 * 50,
        total_frames=4 * 100,
        trust_policy=True,
        track_traj_ids=False,
        auto_register_policy_transforms=False,
    )
    batches = list(collector)
    collector.shutdown()
    assert len(batches) == 2
    b = batches[1]
    assert b.shape == torch.Size([4, 50])
    obs, nxt, done = b["observation"], b["next", "observation"], b["next", "done"].squeeze(-1)
    # where no episode ended, the next step starts from this step's next observation
    cont = ~done[:, :-1]
    torch.testing.assert_close(obs[:, 1:][cont], nxt[:, :-1][cont])
    assert bool(done.any())


def test_buffer_reusing_vector_env_is_copied() -> None:
    vec = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(2)],
        copy=False,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    env = VecGymEnv(vec, seed=0)
    td = env.reset()
    steps = []
    for _ in range(5):
        td.set("action", torch.zeros(2, dtype=torch.int64))
        step, td = env.step_and_maybe_reset(td)
        steps.append(step["next", "observation"])
    assert not torch.equal(steps[0], steps[-1])
