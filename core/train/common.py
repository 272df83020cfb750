"""Pieces every trainer shares: the candidate's env, its programs, failures, saving.

A trainer (:mod:`core.train.ppo`, :mod:`core.train.sac`) builds its env with
:class:`CandidateEnv` (the task's vector env, the candidate's macros, reward and state
transforms), wraps its loop in :func:`train_safely` (failures of LLM-written code become
``TrainResult(ok=False)``), evaluates with :func:`core.train.evaluate.evaluate` and saves
its policy with :func:`save_policy`. :class:`RewardNormalizer` scales the reward the learner
sees (``trainer.normalize_reward``).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import traceback
from dataclasses import fields, replace
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torchrl.envs import Compose, EnvBase, TransformedEnv

from core.context import TrainContext
from core.envs.task import Task
from core.records import Candidate, EnvConfig, TrainResult
from core.train.envs import VecGymEnv
from core.train.transforms import ProgramReward, build_transforms, has_impls


def sandbox_settings(ctx: TrainContext | None) -> tuple[Any, tuple[str, ...]]:
    """``(Limits, allowed_imports)`` from the run's typed ``sandbox:`` settings (defaults without a context)."""
    from core.config import SandboxConfig

    sandbox = ctx.sandbox if ctx is not None else SandboxConfig()
    return sandbox.limits(), sandbox.imports


def prepare_programs(
    task: Task, candidate: Candidate, ctx: TrainContext | None, worker: Any = None
) -> tuple[Any, Any, int]:
    """``(reward_fn, state_fn, state_dim)``: the candidate's programs, loaded and probed in the sandbox.

    ``worker`` is the candidate's :class:`core.sandbox.ProgramWorker` (each program
    starts its own without one). The programs never run in this process.

    :raises core.sandbox.SandboxError: when a program fails its checks or its probe.
    """
    reward_fn = state_fn = None
    state_dim = 0
    if candidate.reward is None and candidate.state is None:
        return reward_fn, state_fn, state_dim
    from core import sandbox

    limits, imports = sandbox_settings(ctx)
    shared = {"worker": worker} if worker is not None else {}
    if candidate.reward is not None:
        reward_fn = sandbox.prepare_reward(candidate.reward, task, limits=limits, allowed_imports=imports, **shared)
    if candidate.state is not None:
        state_fn = sandbox.prepare_state(candidate.state, task, limits=limits, allowed_imports=imports, **shared)
        state_dim = int(getattr(state_fn, "extra_dim", candidate.state.extra_dim))
    return reward_fn, state_fn, state_dim


def split_env_params(envs: list[EnvConfig], num_envs: int) -> list[dict[str, Any]] | None:
    """Per-env params: ``num_envs`` shared among the configs by weight (None: defaults)."""
    if not envs:
        return None
    weights = np.array([max(0.0, float(e.weight)) for e in envs])
    if weights.sum() <= 0:
        weights = np.ones(len(envs))
    exact = weights / weights.sum() * num_envs
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: num_envs - counts.sum()]:
        counts[i] += 1  # largest remainders get the leftover envs
    return [dict(e.params) for e, c in zip(envs, counts) for _ in range(c)]


class CandidateEnv:
    """The training env of one candidate: task env, macros, reward and state transforms.

    Attributes a trainer reads: ``env`` (the TorchRL env to collect from), ``base``
    (the :class:`VecGymEnv`, for finished-episode returns), ``postproc`` (a batch-wise
    reward rewrite for the collector, or None), ``program_reward`` (for component
    means), ``rewrites_reward``, ``program_metrics`` (1.0 per program that runs per
    row, for the result's metrics), ``macros`` (a :class:`core.train.macros.MacroSet` or
    None) and :meth:`augment` (the policy's input for a task observation).

    A population method (LaRes) that rewrites a candidate's reward during training passes
    ``reward_fn``, a prepared ``(state, action, next_state) -> (reward, components)``
    used in place of the candidate's program (whose ``mode`` and ``weight`` still apply),
    and ``wrap_env``, applied to the task's vector env after the macros (e.g. to record
    how episodes end).
    """

    def __init__(
        self,
        task: Task,
        candidate: Candidate,
        num_envs: int,
        seed: int,
        hook: Any,
        ctx: TrainContext | None,
        *,
        reward_fn: Any = None,
        wrap_env: Callable[[Any], Any] | None = None,
    ) -> None:
        own = replace(candidate, reward=None) if reward_fn is not None else candidate
        self.worker = None  # the candidate's sandbox worker: every program of the candidate runs there
        self._worker_scoped = True  # ended by train_safely's scope (after evaluation), else by close()
        if own.reward is not None or own.state is not None or own.macros:
            from core.sandbox import ProgramWorker, in_candidate_scope

            self._worker_scoped = in_candidate_scope()
            self.worker = ProgramWorker(*sandbox_settings(ctx))
        prepared, state_fn, state_dim = prepare_programs(task, own, ctx, self.worker)
        reward_fn = reward_fn if reward_fn is not None else prepared
        self.program_metrics = {
            f"sandbox/{role}_per_row": 1.0
            for role, fn in (("reward", reward_fn), ("state", state_fn))
            if getattr(fn, "per_row", False)
        }
        self.macros = None
        if candidate.macros:
            from core.train.macros import MacroSet

            limits, imports = sandbox_settings(ctx)
            self.macros = MacroSet.prepare(
                candidate.macros, task, limits=limits, allowed_imports=imports, worker=self.worker
            )
        params = split_env_params(candidate.envs, num_envs)
        wants_hooks = hook is not None and ctx is not None
        vec = task.make_env(num_envs, seed, params)
        if self.macros is not None:
            vec = self.macros.wrap(vec)
        if wrap_env is not None:
            vec = wrap_env(vec)
        base = VecGymEnv(vec, seed, keep_env_reward=wants_hooks and has_impls(hook, "compute_reward"))
        probe = None
        if wants_hooks:
            probe = torch.as_tensor(np.asarray(base.env.observation_space.sample()), dtype=torch.float32)
        program = candidate.reward
        rewards, states = build_transforms(
            task,
            reward_fn=reward_fn,
            reward_mode=program.mode if program else "replace",
            reward_weight=program.weight if program else 1.0,
            state_fn=state_fn,
            state_dim=state_dim,
            hook=hook,
            ctx=ctx,
            probe_obs=probe,
        )
        self.base = base
        self.program_reward = next((t for t in rewards if isinstance(t, ProgramReward)), None)
        self.rewrites_reward = bool(rewards)
        self.state_transforms = states
        self.postproc = None
        if rewards == [self.program_reward]:
            # no per-step hook needs the program's reward during collection: rewrite the
            # whole batch in one program call instead of one call per step
            self.postproc = rewards.pop()
        self.env: EnvBase = TransformedEnv(base, Compose(*rewards, *states)) if rewards or states else base

    @property
    def obs_dim(self) -> int:
        return int(self.env.observation_spec["observation"].shape[-1])

    def augment(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy's input for a task observation (the state transforms applied)."""
        for t in self.state_transforms:
            obs = t.augment(obs)
        return obs

    def close(self) -> None:
        """Close the env. Under :func:`train_safely` the worker stays for evaluation and ends with the
        candidate; elsewhere (a population method's own loop) it ends here."""
        self.env.close(raise_if_closed=False)
        if self.worker is not None:
            self.program_metrics.update(self.worker.metrics())
            if not self._worker_scoped:
                self.worker.close()

    def macro_metrics(self) -> dict[str, float]:
        """``macros/<name>_calls`` (and primitive steps) when the candidate has macros."""
        return self.macros.metrics() if self.macros is not None else {}


def error_of(exc: BaseException) -> tuple[str, str]:
    """(feedback text, kind) of an exception; sandbox errors carry their own report."""
    report = getattr(exc, "report", None)
    if report is not None and getattr(report, "kind", None):
        message = getattr(report, "message", "") or str(exc)
        return str(message), str(report.kind)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text, type(exc).__name__


def train_safely(
    body: Callable[[TrainResult], None], candidate: Candidate, hook: Any, ctx: TrainContext | None
) -> TrainResult:
    """Run ``body(result)``; exceptions become a failed result; then ``on_train_end``.

    Every sandbox worker started meanwhile (the candidate's, and any a plugin started
    for it) ends when this returns.
    """
    from core.sandbox import candidate_scope

    start = time.perf_counter()
    result = TrainResult(candidate_id=candidate.id, ok=False)
    with candidate_scope():
        try:
            body(result)
            result.ok = True
        except Exception as exc:  # failures of candidate code are data
            result.error, result.error_kind = error_of(exc)
        result.seconds = time.perf_counter() - start
        if hook is not None:
            try:
                hook.on_train_end(train=ctx, result=result)
            except Exception as exc:
                result.ok = False
                result.error, result.error_kind = error_of(exc)
    return result


def wants_saved_policy(ctx: TrainContext | None) -> bool:
    """Policies are saved in runs (``save_policy``, default true), not in bare calls."""
    return ctx is not None and ctx.settings.run.save_policy


def save_policy(state: dict[str, Any], candidate_id: str) -> str:
    """``torch.save`` ``state`` to a new temporary file; returns its path (the tracker uploads it)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in candidate_id)[:60]
    fd, path = tempfile.mkstemp(prefix=f"policy-{safe}-", suffix=".pt")
    os.close(fd)
    torch.save(state, path)
    return path


class RewardNormalizer:
    """The learner's reward divided by the running standard deviation of a discounted return.

    The method of SB3's ``VecNormalize(norm_reward=True)``, Gymnasium's ``NormalizeReward``
    and rl_games: per env a return ``G <- gamma * G + r`` (reset to 0 after an episode's
    last step, truncated or terminated), the running variance of ``G`` over every step seen
    (Chan's parallel update, a prior of mean 0, variance 1 and weight 1e-4, as SB3's
    ``RunningMeanStd``), and the learner's reward ``clip(r / sqrt(var + 1e-8), -clip, clip)``.
    Only the trainer's advantages and targets see it: episode returns, logged rewards and
    the fitness stay in the task's units.

    The state is a few numbers computed from the collected rewards alone, so a training
    is deterministic under its seed; :meth:`state_dict` / :meth:`load_state_dict` carry
    the statistics across a continued policy (the per-env returns start again with the new
    envs).
    """

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0, eps: float = 1e-8) -> None:
        self.gamma, self.clip, self.eps = float(gamma), float(clip), float(eps)
        self.returns = torch.zeros(int(num_envs), dtype=torch.float64)
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0

    @property
    def scale(self) -> float:
        """What rewards are divided by (``train/reward_scale``)."""
        return math.sqrt(self.var + self.eps)

    def update(self, reward: torch.Tensor, done: torch.Tensor) -> None:
        """Accumulate a collected batch ``[envs, steps(, 1)]`` (the env's reward and done flags, in step order)."""
        envs = self.returns.shape[0]
        reward = reward.detach().reshape(envs, -1).to(torch.float64)
        done = done.reshape(envs, -1).bool()
        seen = torch.empty_like(reward)
        ret = self.returns
        for t in range(reward.shape[1]):
            ret = ret * self.gamma + reward[:, t]
            seen[:, t] = ret
            ret = ret.masked_fill(done[:, t], 0.0)
        self.returns = ret
        n = seen.numel()
        mean, var = float(seen.mean()), float(seen.var(unbiased=False))
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.var = (self.var * self.count + var * n + delta * delta * self.count * n / total) / total
        self.count = total

    def normalize(self, reward: torch.Tensor) -> torch.Tensor:
        """``reward`` (any shape, its dtype kept) divided by :attr:`scale`, clipped to ``+-clip`` (0: no clip)."""
        out = reward / self.scale
        return out.clamp(-self.clip, self.clip) if self.clip > 0 else out

    def reset_returns(self) -> None:
        """New envs (a training's next stage): their returns start from 0, the statistics stay."""
        self.returns.zero_()

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.var = (float(state[k]) for k in ("count", "mean", "var"))


def reward_normalizer(cfg: Any) -> RewardNormalizer | None:
    """The trainer config's :class:`RewardNormalizer` (``normalize_reward``, ``reward_clip``), or None when off."""
    if not cfg.normalize_reward:
        return None
    return RewardNormalizer(cfg.num_envs, cfg.gamma, cfg.reward_clip)


def pearson(s: np.ndarray) -> float:
    """Pearson correlation from (n, sx, sy, sxx, syy, sxy); NaN (undefined) when one side is constant."""
    n, sx, sy, sxx, syy, sxy = s
    cov = sxy / n - sx * sy / n**2
    vx, vy = sxx / n - (sx / n) ** 2, syy / n - (sy / n) ** 2
    if vx <= 1e-12 or vy <= 1e-12:
        return math.nan
    return float(cov / math.sqrt(vx * vy))


def corr_sums(batch: Any) -> np.ndarray:
    """(n, sx, sy, sxx, syy, sxy) of the batch's reward against the env's own reward."""
    x = batch.get(("next", "reward")).reshape(-1).double()
    y = batch.get(("next", "env_reward")).reshape(-1).double()
    return np.array([x.numel(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()], dtype=float)


def config_from(cls: type, cfg: Mapping[str, Any], algorithm: str) -> Any:
    """A trainer config dataclass from the Hydra ``trainer`` node (or a dict).

    ``name`` and ``_target_`` are ignored; unknown keys and a missing ``frames`` raise
    ``ValueError``; ``hidden`` becomes a list of ints; ``validate()`` runs if defined. An
    ``eval_every`` not below ``frames`` becomes ``frames // 4`` (with a warning), so even a
    small budget gives a learning curve of several points.
    """
    if hasattr(cfg, "items") and not isinstance(cfg, dict):
        from omegaconf import OmegaConf  # a DictConfig

        cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    values = {k: v for k, v in dict(cfg).items() if k not in ("name", "_target_")}
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown trainer setting(s) {unknown}; {algorithm} knows {sorted(known)}")
    if "frames" not in values:
        raise ValueError("trainer.frames (the training budget) is required")
    config = cls(**values)
    every = getattr(config, "eval_every", 0)
    if every and every >= config.frames:  # one evaluation, at the end: a curve of one dot
        config.eval_every = max(1, config.frames // 4)
        logging.getLogger(__name__).warning(
            "trainer.eval_every=%d is not below trainer.frames=%d: evaluating every %d frames instead",
            every,
            config.frames,
            config.eval_every,
        )
    if hasattr(config, "hidden"):
        config.hidden = [int(h) for h in config.hidden]
    if hasattr(config, "validate"):
        config.validate()
    return config
