"""Reward vetting: run a reward program on reference trajectories before paying for RL.

A reward program that passes the sandbox's probe can still be useless or harmful: it may
rank failed episodes above successful ones, or pay for every step of a task whose success
ends the episode, so that the agent learns never to finish (a small model's usual
mistake: ``reward = 1 + ...`` on MountainCar or Acrobot). Following CARD's trajectory
preference evaluation (Sun et al., "CARD: A Large Language Model-Driven Reward Design
Framework via Dynamic Feedback for Reinforcement Learning", 2024), the
program's return is computed on the task's reference trajectories
(:meth:`core.envs.task.Task.reference_trajectories`: random rollouts and, where the
task has a known controller, successful ones) and compared with the ground truth:

- **preference**: over every (success, failure) pair, the share the program's return
  orders correctly (``vetting/pair_accuracy``, CARD's trajectory preference accuracy);
  the program is rejected when the mean return of the successes does not exceed the
  failures'.
- **prolonging**: on a task whose success ends the episode (``Task.ends_on_success``),
  a reward whose mean per continuing step of the random rollouts is materially positive
  (``vetting/step_reward``) is rejected when stalling pays at least as much as finishing:
  that per-step reward (or the successful episodes' own, short of their last step, if
  higher) over the whole time limit (``vetting/stall_return``) against the successful
  episodes' mean return. A small positive term beside a goal bonus that outweighs it passes.

:func:`vet` returns a :class:`Verdict` with the reason in words for the LLM and the
figures for MLflow. Trajectories are cached per task and seed (:func:`reference_set`).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.envs.task import Task, Trajectory

#: a mean per-step reward below this share of the mean absolute per-step reward counts as
#: no drift (a potential difference, for example, averages near 0 without being exactly 0)
DRIFT_TOLERANCE = 0.1
#: rows per call of the program (one call per chunk keeps each call within its time limit)
CHUNK = 2048


@dataclass
class Verdict:
    """The outcome of vetting one reward program.

    ``ok``: whether it may train; ``reason``: feedback for the LLM ("" when ok), naming
    the problem and the figures that show it; ``figures``: ``vetting/*`` metrics.
    """

    ok: bool
    reason: str = ""
    figures: dict[str, float] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)  # one line per check, for the log

    def text(self) -> str:
        """The verdict as Markdown (logged as an MLflow text per candidate)."""
        lines = [f"# Reward vetting: {'passed' if self.ok else 'rejected'}", ""]
        lines += [f"- {line}" for line in self.checks]
        if self.figures:
            lines += ["", "| figure | value |", "| --- | --- |"]
            lines += [f"| {k} | {v:.4g} |" for k, v in sorted(self.figures.items())]
        if self.reason:
            lines += ["", "## Feedback sent to the LLM", "", self.reason]
        return "\n".join(lines) + "\n"


# -- reference trajectories ----------------------------------------------------------------------------


def task_key(task: Task) -> str:
    """A name for the task's reference set: its name and a hash of its plain settings."""
    plain = {k: v for k, v in sorted(vars(task).items()) if isinstance(v, (str, int, float, bool, type(None)))}
    plain["class"] = f"{type(task).__module__}.{type(task).__qualname__}"
    digest = hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{task.name}-{digest}"


def reference_set(
    task: Task, episodes: int, seed: int, *, max_steps: int = 1000, cache_dir: str | Path | None = None
) -> list[Trajectory]:
    """The task's reference trajectories (:meth:`Task.reference_trajectories`), cached on disk.

    The cache file is ``<cache_dir>/reference/<task key>-s<seed>-e<episodes>-m<max_steps>.pkl``
    (no cache without ``cache_dir``); a damaged file is rebuilt.
    """
    path = None
    if cache_dir:
        path = Path(cache_dir) / "reference" / f"{task_key(task)}-s{seed}-e{episodes}-m{max_steps}.pkl"
        if path.exists():
            try:
                with path.open("rb") as f:
                    found = pickle.load(f)
                if isinstance(found, list) and all(isinstance(t, Trajectory) for t in found):
                    return found
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
                pass
    trajectories = task.reference_trajectories(episodes, seed, max_steps=max_steps)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            pickle.dump(trajectories, f)
        tmp.replace(path)
    return trajectories


# -- the program on the trajectories ----------------------------------------------------------------------


def step_rewards(reward_fn: Any, program: Any, trajectories: list[Trajectory]) -> list[np.ndarray]:
    """The reward the agent would get at each step of each trajectory, as training computes it.

    ``reward_fn`` is a prepared :class:`core.sandbox.RewardFunction` (or any callable with
    ``from_obs``); a program in ``mode="add"`` adds ``weight`` times its value to the
    env's own reward, as :class:`core.train.transforms.ProgramReward` does.

    :raises core.sandbox.SandboxError: when a call fails (the report names the problem).
    """
    obs = np.concatenate([t.obs for t in trajectories]).astype(np.float32)
    nxt = np.concatenate([t.next_obs for t in trajectories]).astype(np.float32)
    act = np.concatenate(
        [
            np.asarray(t.action).reshape(t.length, -1) if np.asarray(t.action).ndim > 1 else np.asarray(t.action)
            for t in trajectories
        ]
    )
    paid = np.concatenate([t.env_reward for t in trajectories]).astype(np.float32)
    parts = []
    for start in range(0, len(obs), CHUNK):
        end = start + CHUNK
        out = reward_fn.from_obs(
            torch.as_tensor(obs[start:end]), torch.as_tensor(act[start:end]), torch.as_tensor(nxt[start:end])
        )
        reward = out[0] if isinstance(out, tuple) else out
        parts.append(torch.as_tensor(reward, dtype=torch.float32).reshape(-1).numpy())
    values = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if getattr(program, "mode", "replace") == "add":
        values = paid + float(getattr(program, "weight", 1.0)) * values
    bounds = np.cumsum([0] + [t.length for t in trajectories])
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def vet(reward_fn: Any, program: Any, task: Task, trajectories: list[Trajectory]) -> Verdict:
    """Judge a prepared reward program on the task's reference trajectories (see the module doc).

    A failing call of the program is a rejection whose reason is the sandbox's report.
    """
    from core.sandbox import SandboxError

    try:
        rewards = step_rewards(reward_fn, program, trajectories)
    except SandboxError as e:
        reason = f"Running the reward function on reference episodes failed ({e.report.kind}): {e.report.message}"
        return Verdict(
            False, reason, {"vetting/passed": 0.0}, [f"the program failed on the reference episodes ({e.report.kind})"]
        )
    returns = np.array([float(r.sum()) for r in rewards])
    success = np.array([t.success for t in trajectories], bool)
    figures: dict[str, float] = {
        "vetting/trajectories": float(len(trajectories)),
        "vetting/successes": float(success.sum()),
    }
    checks: list[str] = []
    problems: list[str] = []
    names: list[str] = []  # the problems in a few words, for the reason's first line

    # CARD's trajectory preference: successes must earn more than failures
    if success.any() and (~success).any():
        good, bad = returns[success], returns[~success]
        wins = (good[:, None] > bad[None, :]).mean() + 0.5 * (good[:, None] == bad[None, :]).mean()
        good_len = np.mean([t.length for t, s in zip(trajectories, success) if s])
        bad_len = np.mean([t.length for t, s in zip(trajectories, success) if not s])
        figures.update(
            {
                "vetting/pair_accuracy": float(wins),
                "vetting/success_return": float(good.mean()),
                "vetting/failure_return": float(bad.mean()),
            }
        )
        checks.append(
            f"preference: successes {good.mean():.4g} (mean return over {len(good)} episodes, "
            f"{good_len:.0f} steps each on average) vs failures {bad.mean():.4g} ({len(bad)} episodes, "
            f"{bad_len:.0f} steps); pair accuracy {wins:.2f}"
        )
        if good.mean() <= bad.mean():
            names.append("it ranks failure above success")
            problems.append(
                f"It ranks failure above success: on reference episodes, the {len(good)} that achieved the task "
                f"(mean length {good_len:.0f} steps) earn a mean return of {good.mean():.4g} under your reward, "
                f"while the {len(bad)} that failed (mean length {bad_len:.0f} steps) earn {bad.mean():.4g}; only "
                f"{wins:.0%} of (success, failure) pairs are ordered correctly. An agent trained on it would learn "
                "to fail. Make achieving the task clearly the best-paid outcome."
            )
    else:
        checks.append("preference: skipped (the reference episodes are all successes or all failures)")

    # paying for prolonging an episode whose success ends it
    if task.ends_on_success:
        steps = [r[:-1] if t.terminated else r for t, r in zip(trajectories, rewards) if t.source == "random"]
        flat = np.concatenate(steps) if steps else np.zeros(0)
        if flat.size:
            mean, scale = float(flat.mean()), float(np.abs(flat).mean())
            figures["vetting/step_reward"] = mean
            checks.append(
                f"prolonging: mean reward per continuing step of random episodes {mean:.4g} "
                f"(mean magnitude {scale:.4g})"
            )
            drifts = mean > DRIFT_TOLERANCE * scale and mean > 0
            # what stalling pays: the per-step reward of random episodes, or of successful ones short of
            # their last step (near the goal), kept for the whole time limit without finishing
            near = [r[:-1] for t, r in zip(trajectories, rewards) if t.success and t.terminated and len(r) > 1]
            hover = max(mean, float(np.concatenate(near).mean())) if near else mean
            stall = hover * task.max_episode_steps
            finish = float(returns[success].mean()) if success.any() else float("-inf")
            if drifts:
                figures["vetting/stall_return"] = stall
                checks.append(
                    f"prolonging: stalling for the {task.max_episode_steps}-step limit would earn {stall:.4g}, "
                    f"finishing {finish:.4g}"
                    if success.any()
                    else "prolonging: no successful episode to compare"
                )
            if drifts and stall >= finish:
                names.append("it pays for prolonging the episode")
                than = (
                    f", more than the {finish:.4g} that the successful episodes earn by reaching it"
                    if success.any()
                    else ""
                )
                problems.append(
                    f"It pays for prolonging the episode: reaching the goal ends the episode in this task, yet on "
                    f"episodes that have not reached it your reward is positive on average ({mean:.4g} per step on "
                    f"random episodes). An agent that stays short of the goal until the {task.max_episode_steps}-step "
                    f"time limit would collect about {stall:.4g}{than}, so it learns to avoid finishing. Make the "
                    "reward per step negative or zero until the goal is reached (for example a small step penalty "
                    "plus progress terms that are not positive on average), or pay a bonus on reaching the goal "
                    "that outweighs everything staying could earn."
                )
    else:
        checks.append("prolonging: not checked (success does not end this task's episodes)")

    figures["vetting/passed"] = 0.0 if problems else 1.0
    reason = ""
    if problems:
        reason = f"The reward function was rejected before training: {'; '.join(names)}.\n\n" + "\n\n".join(
            f"- {p}" for p in problems
        )
    return Verdict(not problems, reason, figures, checks)
