"""Evaluation of a trained policy on the task's original env, under its own reward."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from core.envs.task import Task
from core.records import Episode


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


@torch.no_grad()
def evaluate(
    task: Task,
    act: Callable[[torch.Tensor], torch.Tensor],
    episodes: int,
    seed: int,
    max_steps: int | None = None,
) -> list[Episode]:
    """Run ``episodes`` episodes, one per env of a vector env of the original task.

    :param act: maps an observation batch ``[B, D]`` (the task's own observation) to
        actions; deterministic policies give the usual evaluation.
    :param max_steps: safety cap on steps (default ``4 * task.max_episode_steps``).
    :return: one :class:`Episode` per env, with the task's ``episode_info``.
    """
    if episodes <= 0:
        return []
    env = task.make_env(episodes, seed, None)
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
            lengths += running
            for i in np.flatnonzero(np.logical_or(term, trunc) & running):
                final = _env_info(info.get("final_info", {}), int(i))
                success, extra = task.episode_info(final)
                finished[int(i)] = Episode(float(returns[i]), int(lengths[i]), success, extra)
            if len(finished) == episodes:
                break
        for i in range(episodes):  # cut off by the cap: count what was reached
            if i not in finished:
                finished[i] = Episode(float(returns[i]), int(lengths[i]), None, {"cut_off": True})
        return [finished[i] for i in range(episodes)]
    finally:
        env.close()
