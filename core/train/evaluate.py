"""Evaluation of a trained policy on the task's original env, under its own reward."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from core.context import TrainContext
from core.envs.task import Task
from core.records import CurvePoint, Episode, TrainResult


def _env_info(info: dict[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s entries of a gymnasium vector info dict (``_key`` arrays are masks)."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if key.startswith("_"):
            continue
        mask = info.get("_" + key)
        if mask is not None and not bool(np.asarray(mask)[i]):
            continue
        item = value[i] if hasattr(value, "__getitem__") and not isinstance(value, (str, dict)) else value
        out[key] = _env_info(item, i) if isinstance(value, dict) else item
    return out


def _env_steps(info: dict[str, Any], n: int) -> np.ndarray:
    """Env steps each vector step took: ``info["env_steps"]`` where a wrapper set it, else 1.

    An env that ended its episode reports it in ``final_info`` (its ``info`` is the reset's).
    """
    steps = np.ones(n, dtype=np.int64)
    for source in (info, info.get("final_info", {})):
        if "env_steps" in source:
            mask = np.asarray(source.get("_env_steps", np.ones(n, dtype=bool)), dtype=bool)
            steps = np.where(mask, np.asarray(source["env_steps"], dtype=np.int64), steps)
    return steps


@torch.no_grad()
def evaluate(
    task: Task,
    act: Callable[[torch.Tensor], torch.Tensor],
    episodes: int,
    seed: int,
    max_steps: int | None = None,
    wrap_env: Callable[[Any], Any] | None = None,
) -> list[Episode]:
    """Run ``episodes`` episodes, one per env of a vector env of the original task.

    :param act: maps an observation batch ``[B, D]`` (the task's own observation) to
        actions; deterministic policies give the usual evaluation.
    :param max_steps: safety cap on steps (default ``4 * task.max_episode_steps``).
    :param wrap_env: applied to the vector env first (e.g. the candidate's macros); a
        wrapper whose steps span several env steps reports them as ``info["env_steps"]``,
        which episode lengths then count.
    :return: one :class:`Episode` per env, with the task's ``episode_info``.
    """
    if episodes <= 0:
        return []
    env = task.make_env(episodes, seed, None)
    if wrap_env is not None:
        env = wrap_env(env)
    try:
        obs, _ = env.reset(seed=seed)
        returns = np.zeros(episodes)
        lengths = np.zeros(episodes, dtype=np.int64)
        finished: dict[int, Episode] = {}
        limit = max_steps or 4 * max(1, task.max_episode_steps)
        for _ in range(limit):
            action = act(torch.as_tensor(np.asarray(obs), dtype=torch.float32))
            obs, reward, term, trunc, info = env.step(action.numpy())
            running = np.array([i not in finished for i in range(episodes)])
            returns += np.where(running, reward, 0.0)
            lengths += running * _env_steps(info, episodes)
            for i in np.flatnonzero(np.logical_or(term, trunc) & running):
                final = _env_info(info.get("final_info", {}), int(i))
                success, extra = task.episode_info(final)
                finished[int(i)] = Episode(float(returns[i]), int(lengths[i]), success, extra)
            if len(finished) == episodes:
                break
        for k in range(episodes):  # cut off by the cap: count what was reached
            if k not in finished:
                finished[k] = Episode(float(returns[k]), int(lengths[k]), None, {"cut_off": True})
        return [finished[k] for k in range(episodes)]
    finally:
        env.close()


def evaluate_and_record(
    task: Task,
    act: Callable[[torch.Tensor], torch.Tensor],
    episodes: int,
    *,
    seed: int,
    frames: int,
    result: TrainResult,
    ctx: TrainContext | None = None,
    hook: Any = None,
    wrap_env: Callable[[Any], Any] | None = None,
) -> list[Episode]:
    """One periodic evaluation of a trainer: episodes, a curve point and the hook.

    The curve point carries the latest mean of each reward component of ``result``.
    """
    if episodes <= 0:
        return []
    found = evaluate(task, act, episodes, seed=seed, wrap_env=wrap_env)
    fitness = task.fitness(found)
    components = {k: v[-1][1] for k, v in result.components.items() if v}
    # the tracker logs the curve as ``fitness`` and ``eval/return``: no second series here
    result.curve.append(CurvePoint(frames, fitness.value, float(np.mean([e.ret for e in found])), components))
    if hook is not None:
        hook.on_evaluation(train=ctx, frames=frames, fitness=fitness.value, episodes=found)
    return found
