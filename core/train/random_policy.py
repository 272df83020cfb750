"""The uniformly random policy as a trainer (``trainer=random``): what an agent scores without learning.

Studies normalise scores between this and the designers' reward ((x - random) / (human -
random)), and score a search that found no policy at it, so it must be the task's own
random policy, not an untrained network: every action is drawn uniformly from the task's
action space (seeded by the run's seed), no frame is trained, and the fitness comes from
``eval_episodes`` episodes of the original task, as any trainer's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from core.context import TrainContext
from core.envs.task import Task
from core.records import Candidate, CurvePoint, TrainResult
from core.train.common import config_from, train_safely
from core.train.evaluate import evaluate


@dataclass
class RandomConfig:
    """Settings of the random policy; mirrors ``conf/trainer/random.yaml``."""

    frames: int  # the budget of the arms it is compared with (recorded; nothing is trained)
    eval_every: int = 0  # unused: the random policy does not change (kept so studies can set it for every arm)
    eval_episodes: int = 100  # episodes its score is the mean of
    threads: int = 1  # torch threads (the worker sets them for every trainer)

    def validate(self) -> None:
        if self.eval_episodes < 1:
            raise ValueError("trainer.eval_episodes must be >= 1 for the random policy (its score is their mean)")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RandomConfig:
        """Build from the Hydra ``trainer`` node; unknown keys raise ``ValueError``."""
        return config_from(cls, cfg, "the random policy")


def uniform_actions(task: Task, seed: int) -> Any:
    """``act(obs) -> actions``: one uniform draw from the task's action space per row, seeded."""
    env = task.make_env(1, seed, None)
    space = env.single_action_space
    env.close()
    space.seed(seed)

    def act(obs: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(np.stack([space.sample() for _ in range(obs.shape[0])]))

    return act


def train(
    task: Task,
    candidate: Candidate,
    cfg: RandomConfig,
    *,
    seed: int,
    hook: Any = None,
    ctx: TrainContext | None = None,
    progress: Any = None,
) -> TrainResult:
    """Score the uniformly random policy on ``task`` (0 frames trained); never raises for the task's errors."""

    def body(result: TrainResult) -> None:
        episodes = evaluate(task, uniform_actions(task, seed), cfg.eval_episodes, seed=seed)
        result.episodes = episodes
        result.fitness = task.fitness(episodes)
        mean_return = float(np.mean([e.ret for e in episodes]))
        result.curve.append(CurvePoint(0, result.fitness.value, mean_return, {}))
        result.metrics["charts/episodic_return"] = mean_return
        result.frames = 0

    return train_safely(body, candidate, hook, ctx)
