"""Goals a task can check, plans checked against them, and a plan followed during training.

A task's checkable goals are its state fields named ``achievement_<goal>`` (1 once the
goal is achieved in the episode, else 0): Crafter's 22 achievements. Because the flags
are part of the observation, everything here is a pure function of the observation:
the same code serves the collecting envs, evaluation envs of another size, and episode
resets, with nothing kept per env.

- :func:`goal_names` / :func:`achieved` / :func:`newly_achieved`: the goals and which
  ones a batch of observations (or transitions) shows achieved.
- :func:`match_goal`: a goal named in free text (``"Collect Wood"``, ``"collect-wood"``)
  to the task's goal name, or None.
- :func:`check_plan`: the errors of a plan (unknown skills, goals the task cannot check),
  as text to send back to the LLM.
- :class:`PlanFollower`: the active step of each env (the first checked step whose goal
  is not achieved yet), a reward for completing it, and the active step as a one-hot for
  a goal-conditioned policy.
"""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING, Iterable

import torch

from core.records import Plan

if TYPE_CHECKING:  # pragma: no cover
    from core.envs.task import Task

PREFIX = "achievement_"


def goal_names(task: Task) -> list[str]:
    """The goals ``task`` can check (its ``achievement_<goal>`` fields), in field order."""
    return [f.name[len(PREFIX) :] for f in task.state_fields if f.name.startswith(PREFIX)]


def _slice(task: Task) -> tuple[int, list[int]]:
    fields = [f for f in task.state_fields if f.name.startswith(PREFIX)]
    return len(fields), [f.start for f in fields]


def achieved(task: Task, obs: torch.Tensor) -> torch.Tensor:
    """``[B, G]`` bool: which of :func:`goal_names` each observation shows achieved."""
    _, starts = _slice(task)
    obs = torch.as_tensor(obs)
    return obs[..., starts] > 0.5


def newly_achieved(task: Task, obs: torch.Tensor, next_obs: torch.Tensor) -> torch.Tensor:
    """``[B, G]`` bool: the goals each transition achieved (not achieved before, achieved after).

    An episode's first achievement of a goal counts; the flags reset with the episode.
    """
    return achieved(task, next_obs) & ~achieved(task, obs)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(text).strip().lower()).strip("_")


def match_goal(text: str, goals: Iterable[str]) -> str | None:
    """The goal of ``goals`` that ``text`` names (case, spaces and hyphens aside), or None."""
    key = _norm(text)
    for goal in goals:
        if key == goal or key == _norm(goal):
            return goal
    return None


def check_plan(plan: Plan, task: Task, skills: Iterable[str] = ()) -> list[str]:
    """Why ``plan`` cannot be followed on ``task``, one line each (``[]`` when it can).

    A step's ``done`` must be a goal the task checks; a ``"skill"`` step must name a
    known skill (``skills``, when given) or a checkable goal.
    """
    goals = goal_names(task)
    known = set(skills)
    errors = []
    if not goals and any(s.done for s in plan.steps):
        errors.append(f"the task {task.name!r} has no goals it can check (no achievement fields)")
        return errors
    for i, step in enumerate(plan.steps, 1):
        if step.done and step.done not in goals:
            close = difflib.get_close_matches(step.done, goals, n=3, cutoff=0.5)
            errors.append(
                f"step {i} ({step.name}): the task cannot check the goal {step.done!r}"
                + (f"; did you mean {', '.join(close[:3])}?" if close else "")
            )
        if step.kind == "skill" and known and step.name not in known and step.name not in goals:
            errors.append(f"step {i} ({step.name}): unknown skill; known skills: {', '.join(sorted(known))}")
    return errors


class PlanFollower:
    """Follows a plan on batches of observations, with no per-env state.

    The active step of an env is the first step whose ``done`` goal its observation does
    not show achieved (unchecked steps are skipped); ``len(checked)`` when every checked
    step is achieved. ``kinds`` limits the steps followed (RL-GPT follows its ``"rl"``
    steps; coded skills run as macro-actions).
    """

    def __init__(self, plan: Plan, task: Task, kinds: Iterable[str] | None = None) -> None:
        goals = goal_names(task)
        wanted = set(kinds) if kinds is not None else None
        self.steps = [s for s in plan.steps if s.done in goals and (wanted is None or s.kind in wanted)]
        self.task = task
        self.index = torch.tensor([goals.index(s.done) for s in self.steps], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.steps)

    def done_mask(self, obs: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` bool: which followed steps each observation shows done."""
        return achieved(self.task, obs)[..., self.index]

    def active(self, obs: torch.Tensor) -> torch.Tensor:
        """``[B]`` long: the active step of each observation (``len(self)`` when all are done)."""
        done = self.done_mask(obs)
        pending = torch.cat([~done, torch.ones_like(done[..., :1])], dim=-1)
        return pending.float().argmax(dim=-1)

    def one_hot(self, obs: torch.Tensor) -> torch.Tensor:
        """``[B, S + 1]`` float: the active step as a one-hot (the last column: plan finished)."""
        return torch.nn.functional.one_hot(self.active(obs), len(self) + 1).float()

    def completed(self, obs: torch.Tensor, next_obs: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the transition achieved the goal of the step active before it."""
        if not len(self):
            return torch.zeros(torch.as_tensor(obs).shape[0], dtype=torch.bool)
        active = self.active(obs)
        new = newly_achieved(self.task, obs, next_obs)[..., self.index]
        padded = torch.cat([new, torch.zeros_like(new[..., :1])], dim=-1)
        return padded.gather(-1, active.unsqueeze(-1)).squeeze(-1)
