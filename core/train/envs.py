"""A thin TorchRL env over a gymnasium vector env (autoreset SAME_STEP).

TorchRL's ``GymWrapper`` handles vectorised gymnasium envs through an info reader and a
``VecGymEnvTransform`` that rebuild the final observation step by step; that costs
~0.7 ms per step here against ~0.1 ms for the env itself. This wrapper does the same
job with preallocated arrays: on a step that ends an episode, ``("next", "observation")``
is the episode's final observation (for bootstrapping and reward programs) and the
following ``reset`` hands out the first observation of the next episode, which the
vector env already produced in the same step.

It also keeps the env's own reward under ``("next", "env_reward")`` when asked (reward
transforms then rewrite ``"reward"``), and the returns of finished episodes.

Speed: the collector calls :meth:`VecGymEnv.step_and_maybe_reset` once per vector step.
TorchRL's generic version runs spec/done completion, ``step_mdp`` and, whenever an env
finished, a partial ``reset`` that merges old and new data with ``where``; here the
vector env has already reset those envs, so one override builds the step's ``"next"``
and the next root tensordict directly (same keys and values as the generic path,
checked in ``tests/core/train/test_envs.py``). Per step it costs one vector-env step,
a few ``torch.from_numpy`` views and two unvalidated ``TensorDict`` constructions.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase


class _StepState:
    """First observations, returns and lengths of the running episodes."""

    __slots__ = ("obs", "running", "lengths")

    def __init__(self, obs: np.ndarray, running: np.ndarray, lengths: np.ndarray) -> None:
        self.obs, self.running, self.lengths = obs, running, lengths


class VecGymEnv(EnvBase):
    """TorchRL view of a ``gymnasium.vector.VectorEnv`` with SAME_STEP autoreset.

    :param env: the vector env (flat Box observation; Discrete or Box actions).
    :param seed: seed of the first reset.
    :param keep_env_reward: also write the env's reward to ``("next", "env_reward")``.
    """

    def __init__(self, env: gym.vector.VectorEnv, seed: int, keep_env_reward: bool = False) -> None:
        n = env.num_envs
        # no device: the collector then skips its per-step device casts
        super().__init__(batch_size=torch.Size([n]), device=None, allow_done_after_reset=True)
        self.env = env
        self._seed: int | None = seed
        self.keep_env_reward = keep_env_reward
        obs_space, act_space = env.single_observation_space, env.single_action_space
        assert obs_space.shape is not None
        obs_dim = int(np.prod(obs_space.shape))
        obs_spec = {"observation": Unbounded(shape=(n, obs_dim), dtype=torch.float32)}
        if keep_env_reward:
            obs_spec["env_reward"] = Unbounded(shape=(n, 1), dtype=torch.float32)
        self.observation_spec = Composite(obs_spec, shape=(n,))
        if isinstance(act_space, gym.spaces.Discrete):
            self.discrete = True
            self.action_spec = Categorical(int(act_space.n), shape=(n,), dtype=torch.int64)
        elif isinstance(act_space, gym.spaces.Box):
            self.discrete = False
            self._low, self._high = act_space.low, act_space.high
            low = torch.as_tensor(act_space.low, dtype=torch.float32).expand(n, *act_space.shape)
            high = torch.as_tensor(act_space.high, dtype=torch.float32).expand(n, *act_space.shape)
            self.action_spec = Bounded(low=low, high=high, shape=(n, *act_space.shape), dtype=torch.float32)
        else:
            raise TypeError(f"unsupported action space {act_space!r}")
        self.reward_spec = Unbounded(shape=(n, 1), dtype=torch.float32)
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,))
        # per-step state lives in a plain object: EnvBase.__setattr__ costs ~10 us a call
        self._state = _StepState(
            obs=np.zeros((n, obs_dim), dtype=np.float32),
            running=np.zeros(n, dtype=np.float64),
            lengths=np.zeros(n, dtype=np.int64),
        )
        self.finished: list[tuple[float, int]] = []  # (return, length) of finished episodes
        self._zero_reward = torch.zeros(n, 1)
        self._false = torch.zeros(n, 1, dtype=torch.bool)
        self._reuses_buffers = getattr(env, "copy", True) is False  # gymnasium vector envs' copy=False

    # -- EnvBase ----------------------------------------------------------------------
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        if tensordict is None or "_reset" not in tensordict.keys():
            obs, _ = self.env.reset(seed=self._seed)
            self._seed = None  # later full resets continue the RNG stream
            st = self._state
            st.obs = np.asarray(obs, dtype=np.float32).reshape(st.obs.shape)
            st.running[:] = 0.0
            st.lengths[:] = 0
        # partial reset: the vector env already reset those envs in the last step
        out = {"observation": torch.from_numpy(self._state.obs.copy())}
        if self.keep_env_reward:
            out["env_reward"] = self._zero_reward
        n = self.batch_size[0]
        false = torch.zeros(n, 1, dtype=torch.bool)
        out.update(done=false, terminated=false, truncated=false)
        return TensorDict(out, batch_size=self.batch_size)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._vector_step(tensordict.get("action"))

    def _vector_step(self, action_t: torch.Tensor) -> TensorDictBase:
        """Step the vector env; the ``"next"`` tensordict (final observations where done)."""
        action = action_t.numpy()
        if not self.discrete:  # Gaussian policies sample outside the bounds
            action = np.clip(action, self._low, self._high)
        obs, reward, term, trunc, info = self.env.step(action)
        st = self._state
        if self._reuses_buffers:  # the collector keeps views of each step's arrays until it stacks
            obs = np.array(obs, dtype=np.float32)
        obs = np.asarray(obs, dtype=np.float32).reshape(st.obs.shape)
        term = np.asarray(term, dtype=bool)
        trunc = np.asarray(trunc, dtype=bool)
        done = term | trunc
        st.running += reward
        st.lengths += 1
        next_obs = obs
        if done.any():
            # the vector env already holds the next episodes' first observations:
            # swap in the final ones for the finished envs (vectorised, no per-env loop)
            idx = np.flatnonzero(done)
            next_obs = obs.copy()
            final = info["final_obs"]
            next_obs[idx] = np.stack([final[i] for i in idx]).reshape(len(idx), -1)
            self.finished.extend(zip(st.running[idx].tolist(), st.lengths[idx].tolist()))
            st.running[idx] = 0.0
            st.lengths[idx] = 0
        st.obs = obs
        reward_np = np.asarray(reward, dtype=np.float32)[:, None]
        # numpy views with the trailing 1 are cheaper than torch unsqueeze; each step gets
        # fresh arrays, so the collector may keep these tensors until it stacks the batch
        reward_t = torch.from_numpy(reward_np)
        out = {
            "observation": torch.from_numpy(next_obs),
            "reward": reward_t,
            "done": torch.from_numpy(done[:, None]),
            "terminated": torch.from_numpy(term[:, None]),
            "truncated": torch.from_numpy(trunc[:, None]),
        }
        if self.keep_env_reward:
            out["env_reward"] = reward_t
        # the values are built here with the specs' shapes and dtypes: skip validation
        return TensorDict._new_unsafe(out, batch_size=self.batch_size)

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """One vector step: ``(tensordict with "next", root tensordict of the next step)``.

        Same result as ``EnvBase.step_and_maybe_reset`` (the root of the next step keeps
        the input's keys, takes the new observations and all-false done flags, since
        finished envs are already reset), without its generic done/reset machinery. One
        difference nobody reads: the generic reset zeroes carried-over policy outputs
        (``action``, log-probs) of reset envs, this keeps them; the policy overwrites them.
        """
        nxt = self._vector_step(tensordict.get("action"))
        tensordict._set_str("next", nxt, validated=True, inplace=False, non_blocking=False)
        if type(tensordict) is TensorDict:  # the collector's carrier: copy its entries directly
            entries = {k: v for k, v in tensordict._tensordict.items() if k != "next"}
            root = TensorDict._new_unsafe(entries, batch_size=tensordict.batch_size)
        else:
            root = tensordict.exclude("next")
        root._set_str(
            "observation", torch.from_numpy(self._state.obs), validated=True, inplace=False, non_blocking=False
        )
        false = self._false  # never written in place: the collector copies it when stacking
        for key in ("done", "terminated", "truncated"):
            root._set_str(key, false, validated=True, inplace=False, non_blocking=False)
        if self.keep_env_reward:  # a reset env's first observation has no env reward yet
            fresh = nxt._get_str("env_reward", None).masked_fill(nxt._get_str("done", None), 0.0)
            root._set_str("env_reward", fresh, validated=True, inplace=False, non_blocking=False)
        return tensordict, root

    def _set_seed(self, seed: int | None) -> None:
        self._seed = seed

    def close(self, *, raise_if_closed: bool = True) -> None:
        self.env.close()
        super().close(raise_if_closed=raise_if_closed)

    def pop_finished(self) -> list[tuple[float, int]]:
        """The (return, length) of the episodes finished since the last call."""
        done, self.finished = self.finished, []
        return done
