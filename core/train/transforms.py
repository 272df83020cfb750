"""Per-step rewriting of rewards and observations, as TorchRL transforms.

Order in the env (``build_transforms``): reward transforms first, so that they see the
task's own observation in ``("next", "observation")``; then state transforms, which
append features to the observation. The root ``"observation"`` a reward transform sees
may already carry appended features, so it is cut back to the task's ``obs_dim``.

- :class:`ProgramReward`: ``r <- f(s, a, s')`` (mode ``replace``) or
  ``r <- r + w * f(s, a, s')`` (mode ``add``) with a candidate's reward program.
- :class:`HookReward`: ``r <- r + sum_i h_i(batch)`` over the ``compute_reward`` hooks.
- :class:`ProgramState`: ``o <- [o, g(split(o))]`` with a candidate's state program.
- :class:`HookState`: ``o <- [o, h_1(o), ...]`` over the ``represent_state`` hooks.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from core.context import StepBatch, TrainContext
from core.envs.task import Task

RewardFn = Callable[[dict, torch.Tensor, dict], Any]  # -> reward [B] or (reward, components)
StateFn = Callable[[dict], torch.Tensor]  # -> features [B, k]


class _Tally:
    """Component sums and the step count since the last read (a plain object: a module's setattr costs microseconds)."""

    __slots__ = ("sums", "steps")

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0


def _mean(value: Any) -> float:
    """The mean of a reward component (a float32 row from the sandbox is summed in Python: no tensor op)."""
    if type(value) is torch.Tensor and value.dim() == 1 and value.numel():
        return math.fsum(value.tolist()) / value.numel()
    return float(torch.as_tensor(value, dtype=torch.float32).mean())


class ProgramReward(Transform):
    """Reward from a candidate's reward program, evaluated on the batched step.

    The env's own reward stays in ``("next", "env_reward")`` (written by the env).
    Component means are summed per step and read with :meth:`pop_components`.
    """

    def __init__(self, fn: RewardFn, task: Task, mode: str = "replace", weight: float = 1.0) -> None:
        if mode not in ("replace", "add"):
            raise ValueError(f"reward program mode must be 'replace' or 'add', not {mode!r}")
        super().__init__(in_keys=["reward"], out_keys=["reward"])
        self.fn, self.task, self.mode, self.weight = fn, task, mode, float(weight)
        self._dim = task.obs_dim
        # a sandboxed program takes whole observations (the worker names the fields)
        self._from_obs = getattr(fn, "from_obs", None) if getattr(fn, "fields", None) is not None else None
        self._tally = _Tally()

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        # once per env step: tensordict's unvalidated accessors (the keys are plain strings, the values the env's)
        env_reward = next_tensordict._get_str("reward", None)
        reward = self._reward(
            tensordict._get_str("observation", None),
            tensordict._get_str("action", None),
            next_tensordict._get_str("observation", None),
            env_reward,
        )
        if reward.shape == env_reward.shape and reward.dtype == env_reward.dtype:
            next_tensordict._set_str("reward", reward, validated=True, inplace=False, non_blocking=False)
        else:  # let tensordict check (and refuse) it
            next_tensordict.set("reward", reward)
        return next_tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Rewrite the rewards of a whole collected batch (any batch shape) in one call.

        Used as the collector's ``postproc`` when no per-step hook needs the program's
        reward during collection: one program call per batch instead of one per step.
        The env's reward moves to ``("next", "env_reward")``.
        """
        env_reward = tensordict.get(("next", "reward"))
        shape = env_reward.shape
        dims = tensordict.batch_dims

        def flat(key: Any) -> torch.Tensor:  # only the entries the program reads (not the whole batch) are reshaped
            value = tensordict.get(key)
            return value.reshape(-1, *value.shape[dims:])

        reward = self._reward(
            flat("observation"), flat("action"), flat(("next", "observation")), env_reward.reshape(-1, 1)
        )
        tensordict.set(("next", "env_reward"), env_reward)
        tensordict.set(("next", "reward"), reward.reshape(shape))
        return tensordict

    def _reward(
        self, obs: torch.Tensor, action: torch.Tensor, next_obs: torch.Tensor, env_reward: torch.Tensor
    ) -> torch.Tensor:
        dim = self._dim
        if (
            obs.shape[-1] != dim or next_obs.shape[-1] != dim
        ):  # appended state features: cut back to the task's observation
            obs, next_obs = obs[..., :dim], next_obs[..., :dim]
        if self._from_obs is not None:  # a sandboxed program: the worker names the fields
            out = self._from_obs(obs, action, next_obs)
        else:
            out = self.fn(self.task.split_state(obs), action, self.task.split_state(next_obs))
        reward, components = out if isinstance(out, tuple) else (out, None)
        if type(reward) is not torch.Tensor or reward.dtype != torch.float32:
            reward = torch.as_tensor(reward, dtype=torch.float32)
        reward = reward.reshape(-1, 1)
        if self.mode == "add":
            reward = env_reward + self.weight * reward
        tally = self._tally
        if components:
            sums = tally.sums
            for name, value in components.items():
                sums[name] = sums.get(name, 0.0) + _mean(value)
        tally.steps += 1
        return reward

    def pop_components(self) -> dict[str, float]:
        """Mean of each reward component over the steps since the last call."""
        tally, self._tally = self._tally, _Tally()
        steps = max(1, tally.steps)
        return {name: total / steps for name, total in tally.sums.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, weight={self.weight})"


class HookReward(Transform):
    """Adds the ``compute_reward`` hooks' per-step terms to the reward."""

    def __init__(self, hook: Any, ctx: TrainContext, task: Task) -> None:
        super().__init__(in_keys=["reward"], out_keys=["reward"])
        self.hook, self.ctx, self.task = hook, ctx, task
        self._dim = task.obs_dim

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        reward = next_tensordict.get("reward")
        env_reward = next_tensordict.get("env_reward", reward)
        batch = StepBatch(
            obs=tensordict.get("observation")[..., : self._dim],
            action=tensordict.get("action"),
            next_obs=next_tensordict.get("observation")[..., : self._dim],
            env_reward=env_reward.squeeze(-1),
            reward=reward.squeeze(-1),
            done=next_tensordict.get("done").squeeze(-1),
            task=self.task,
        )
        for extra in self.hook.compute_reward(train=self.ctx, batch=batch):
            if extra is not None:
                reward = reward + torch.as_tensor(extra, dtype=torch.float32).reshape(-1, 1)
        next_tensordict.set("reward", reward)
        return next_tensordict


class _AppendFeatures(Transform):
    """Base of the state transforms: ``observation <- cat(observation, features)``."""

    def __init__(self, extra_dim: int) -> None:
        super().__init__(in_keys=["observation"], out_keys=["observation"])
        self.extra_dim = int(extra_dim)

    def features(self, obs: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def augment(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs [B, D]`` -> ``[B, D + extra_dim]``."""
        feats = torch.as_tensor(self.features(obs), dtype=torch.float32).reshape(obs.shape[0], self.extra_dim)
        return torch.cat([obs, feats], dim=-1)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        next_tensordict.set("observation", self.augment(next_tensordict.get("observation")))
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        tensordict_reset.set("observation", self.augment(tensordict_reset.get("observation")))
        return tensordict_reset

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        spec = observation_spec["observation"]
        shape = (*spec.shape[:-1], spec.shape[-1] + self.extra_dim)
        observation_spec["observation"] = Unbounded(shape=shape, dtype=torch.float32, device=spec.device)
        return observation_spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}(extra_dim={self.extra_dim})"


class ProgramState(_AppendFeatures):
    """Appends a candidate's state-program features (computed on the task's fields)."""

    def __init__(self, fn: StateFn, task: Task, extra_dim: int) -> None:
        super().__init__(extra_dim)
        self.fn, self.task = fn, task
        self._dim = task.obs_dim

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs[..., : self._dim]
        if getattr(self.fn, "fields", None) is not None:  # a sandboxed program: the worker names the fields
            return self.fn.from_obs(obs)  # type: ignore[attr-defined]
        return self.fn(self.task.split_state(obs))


class HookState(_AppendFeatures):
    """Appends the ``represent_state`` hooks' features (``extra_dim`` found by a probe)."""

    def __init__(self, hook: Any, ctx: TrainContext, extra_dim: int) -> None:
        super().__init__(extra_dim)
        self.hook, self.ctx = hook, ctx

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        parts = [p for p in self.hook.represent_state(train=self.ctx, obs=obs) if p is not None]
        if not parts:
            return obs.new_zeros(obs.shape[0], 0)
        return torch.cat([torch.as_tensor(p, dtype=torch.float32).reshape(obs.shape[0], -1) for p in parts], -1)

    @staticmethod
    def probe(hook: Any, ctx: TrainContext, obs: torch.Tensor) -> int:
        """How many features the hooks add to ``obs`` (0 when they all abstain)."""
        return int(HookState(hook, ctx, 0).features(obs).shape[-1])


def has_impls(hook: Any, name: str) -> bool:
    """Whether any registered plugin implements the hook ``name`` (no per-step cost if not)."""
    if hook is None:
        return False
    caller = getattr(hook, name, None)
    return caller is not None and bool(caller.get_hookimpls())


def build_transforms(
    task: Task,
    *,
    reward_fn: RewardFn | None = None,
    reward_mode: str = "replace",
    reward_weight: float = 1.0,
    state_fn: StateFn | None = None,
    state_dim: int = 0,
    hook: Any = None,
    ctx: TrainContext | None = None,
    probe_obs: torch.Tensor | None = None,
) -> tuple[list[Transform], list[Transform]]:
    """(reward transforms, state transforms) for one candidate, in env order.

    ``probe_obs`` (a reset observation ``[B, D]``) sizes the ``represent_state`` hooks.
    """
    rewards: list[Transform] = []
    states: list[Transform] = []
    if reward_fn is not None:
        rewards.append(ProgramReward(reward_fn, task, reward_mode, reward_weight))
    if ctx is not None and has_impls(hook, "compute_reward"):
        rewards.append(HookReward(hook, ctx, task))
    if state_fn is not None:
        states.append(ProgramState(state_fn, task, state_dim))
    if ctx is not None and has_impls(hook, "represent_state"):
        obs = probe_obs if probe_obs is not None else torch.zeros(1, task.obs_dim)
        for t in states:  # the hooks see the observation after the state program
            obs = t.augment(obs)
        dim = HookState.probe(hook, ctx, obs)
        if dim:
            states.append(HookState(hook, ctx, dim))
    return rewards, states
