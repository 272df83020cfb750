"""What training hooks see: the training context and one batched step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from core.envs.task import Task
from core.records import Candidate


@dataclass
class StepBatch:
    """One collected step of every env, batched over ``B`` envs.

    ``obs``/``next_obs`` are the task's observations ``[B, D]`` (before any state
    program's extra features); ``state``/``next_state`` name their fields
    (``Task.split_state``). ``done`` marks steps that ended an episode; ``next_obs``
    is then the episode's final observation, not the reset one.
    """

    obs: torch.Tensor
    action: torch.Tensor
    next_obs: torch.Tensor
    env_reward: torch.Tensor
    reward: torch.Tensor
    done: torch.Tensor
    task: Task

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.task.split_state(self.obs)

    @property
    def next_state(self) -> dict[str, torch.Tensor]:
        return self.task.split_state(self.next_obs)


@dataclass
class TrainContext:
    """Everything a training hook may need about the candidate being trained.

    ``config`` is the full resolved run config (an OmegaConf ``DictConfig``);
    :meth:`plugin_config` returns one plugin's section. ``frames`` advances as
    training goes; ``total_frames`` is the budget. ``log_metric`` records a metric on
    the candidate's MLflow run (buffered; written by the tracker).
    """

    task: Task
    candidate: Candidate
    config: Any
    seed: int
    total_frames: int
    frames: int = 0
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    llm_factory: Callable[[], Any] | None = None
    hook: Any = None  # the plugin manager's hook caller, to call other plugins' hooks (label_preferences)
    _llm: Any = None

    def plugin_config(self, name: str) -> Any:
        plugins = self.config.get("plugins") or {}
        return plugins.get(name)

    @property
    def progress(self) -> float:
        """Fraction of the training budget done, in [0, 1]."""
        return min(1.0, self.frames / max(1, self.total_frames))

    @property
    def llm(self) -> Any:
        """The LLM client of this process, created on first use."""
        if self._llm is None and self.llm_factory is not None:
            self._llm = self.llm_factory()
        return self._llm

    def log_metric(self, key: str, value: float) -> None:
        self.metrics.setdefault(key, []).append((self.frames, float(value)))

    def log_text(self, name: str, text: str) -> None:
        """Record a text artifact (``name`` is its file name), e.g. an evaluator's reasons."""
        self.texts[name] = self.texts.get(name, "") + text
