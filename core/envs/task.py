"""The task abstraction: what every LLM-for-RL method needs from an environment.

A :class:`Task` bundles a vectorised env factory, a natural-language goal, a state
schema over the flat observation vector, text renderings of a state and of a piece of an
episode (for LLM judges),
the environment description the LLM sees (Eureka shows the env's observation code),
and the ground-truth fitness of a set of evaluation episodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
import torch

from core.errors import UserError
from core.records import Episode, Fitness

#: the training rewards a task can offer (``env.reward``); the fitness never depends on the choice
REWARDS = ("human", "sparse")


def ground_truth_return(episode: Episode) -> float:
    """The episode's return under the env designers' own reward, whichever reward the env paid.

    A task trained on another reward (``env.reward=sparse``) records the designers' return in
    the episode's info (``human_return``); return-based fitness is computed from it.
    """
    return float(episode.info.get("human_return", episode.ret))


@dataclass
class Trajectory:
    """One reference episode of a task, in the reward program's state format (:mod:`core.vetting`).

    ``obs[t]`` / ``next_obs[t]`` are the flat observations before and after step ``t``
    (``next_obs`` of the last step is the episode's true final observation), so
    ``task.split_state`` turns them into the ``state`` / ``next_state`` a reward program
    reads. ``success`` is the task's ground truth (:meth:`Task.judge_success`).
    """

    obs: np.ndarray  # [T, obs_dim] float32
    action: np.ndarray  # [T, ...] as the env took it
    next_obs: np.ndarray  # [T, obs_dim] float32
    env_reward: np.ndarray  # [T] the reward the env paid (its designers' unless env.reward=sparse)
    terminated: bool  # the env ended the episode (False: time limit or the rollout's step cap)
    success: bool  # the episode achieved the task, by its ground truth
    ground_truth: float  # the episode's return under the designers' reward
    source: str  # "random" (uniform random actions) or "controller" (the task's reference policy)

    @property
    def length(self) -> int:
        return int(len(self.obs))


@dataclass(frozen=True)
class StateField:
    """A named slice of the flat observation vector.

    ``start:stop`` indexes the last axis of the observation. ``shape`` is the field's
    own shape (``()`` for a scalar, ``(3,)`` for a position); its size is ``stop-start``.
    """

    name: str
    start: int
    stop: int
    description: str
    unit: str = ""
    shape: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class DerivedField:
    """A quantity computed from a task's fields, offered to LLM code as a field of its own.

    Small models reach for the quantities a task's goal talks about (Acrobot's joint
    angles and tip height, Pendulum's angle, LunarLander's distance to the pad) rather
    than the raw observation they hide in. ``compute`` maps the named base fields
    (``{name: [B, ...]}``, as :meth:`Task.split_state` gives them before derived fields
    are added) to a float tensor ``[B, *shape]``; it is the task's own (trusted) code and
    runs in the host, before the state crosses to a program's worker.
    """

    name: str
    description: str
    compute: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    unit: str = ""
    shape: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class ParamSpec:
    """A controllable world parameter (EnvGen): name, allowed values or range, default."""

    name: str
    description: str
    default: Any
    choices: tuple[Any, ...] | None = None  # allowed values, when discrete
    low: float | None = None  # numeric range, when continuous
    high: float | None = None


@dataclass
class Task:
    """Base class of every task. Subclasses fill the fields and implement ``make_env``.

    Fields users and plugins read:

    - ``name``: the config name (``cartpole``); ``goal``: the instruction in words.
    - ``state_fields``: schema over the flat float32 observation; per-step LLM code
      receives ``split_state(obs)``, a dict of these names to batched tensors.
    - ``derived_fields``: quantities computed from those fields that LLM code may read
      like fields (:class:`DerivedField`); :attr:`program_fields` lists both.
    - ``description``: environment context for prompts (observation code or a prose
      description listing the fields by name).
    - ``fitness_name``: name of the ground-truth metric (``return``, ``success_rate``,
      ``crafter_score``); ``fitness()`` computes it from evaluation episodes.
    - ``params``: controllable world parameters (empty when the task has none).
    - ``max_episode_steps``: the time limit used for training and evaluation.
    - ``reward``: the reward the env pays (:data:`REWARDS`): ``human``, the env designers'
      own (the default), or ``sparse``, paid only when the task's success condition is met
      (:attr:`sparse_text` says what it is; tasks that define none refuse it). The fitness
      is the same under either.
    """

    #: the task's sparse reward in words; empty when the task has none (``reward=sparse`` refused)
    sparse_text: ClassVar[str] = ""
    #: the task's success ends the episode (MountainCar, Acrobot, LunarLander): a reward that
    #: pays for every step then pays the agent to never finish (:mod:`core.vetting` checks it)
    ends_on_success: ClassVar[bool] = False
    #: the task's failure ends the episode (CartPole's fallen pole, a Hopper that falls, a lander
    #: that crashes, death in Crafter): a reward that is negative on every step then pays the
    #: agent to fail early (:func:`core.prompting.sign_rule` says which sign the task needs)
    ends_on_failure: ClassVar[bool] = False
    #: for tasks without a success flag: the ground-truth return at or above which an episode
    #: counts as a success (None: such tasks have no successes to compare)
    success_return: ClassVar[float | None] = None

    name: str
    goal: str
    state_fields: list[StateField]
    description: str
    fitness_name: str = "return"
    params: list[ParamSpec] = field(default_factory=list)
    max_episode_steps: int = 500
    action_description: str = ""
    reward: str = "human"
    derived_fields: list[DerivedField] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reward not in REWARDS:
            raise UserError(f"env.reward must be one of {', '.join(REWARDS)}, got {self.reward!r}.")
        if self.reward == "sparse":
            if not self.sparse_text:
                raise UserError(
                    f"The task '{self.name}' has no sparse reward (env.reward=sparse); use env.reward=human. "
                    "Tasks with one: cartpole, mountaincar, acrobot, pendulum, lunarlander, the MuJoCo and "
                    "MetaWorld tasks, minecraft."
                )
            self.description += (
                "\n\nTraining reward in this run (env.reward=sparse), in place of the env designers' own: "
                f"{self.sparse_text}"
            )

    # -- construction ---------------------------------------------------------------
    def make_env(
        self, num_envs: int, seed: int, params: dict[str, Any] | list[dict[str, Any]] | None = None
    ) -> gym.vector.VectorEnv:
        """A gymnasium vector env of ``num_envs`` copies with a flat float32 Box observation.

        Autoreset mode must be ``gym.vector.AutoresetMode.SAME_STEP`` so that a step that
        ends an episode already returns the first observation of the next one (the final
        observation and info are in ``info["final_obs"]``/``info["final_info"]``).
        ``params`` are values for :attr:`params`: None for the defaults, one dict for
        every env, or a list of ``num_envs`` dicts (one per env, for EnvGen's training
        mix). Episode-level task
        info (success flags, achievements) must be in the step ``info`` dict under keys
        that :meth:`episode_info` reads.
        """
        raise NotImplementedError

    def check_available(self) -> None:
        """Raise ``core.errors.UserError`` saying what to install if the env cannot run."""

    # -- state ------------------------------------------------------------------------
    @property
    def obs_dim(self) -> int:
        return max(f.stop for f in self.state_fields)

    @property
    def program_fields(self) -> list[StateField]:
        """Every field LLM code may read: the state fields, then the derived ones.

        A derived field is a slice past :attr:`obs_dim` of :meth:`program_obs`'s columns.
        """
        out, start = list(self.state_fields), self.obs_dim
        for d in self.derived_fields:
            out.append(StateField(d.name, start, start + d.size, d.description, d.unit, d.shape))
            start += d.size
        return out

    def field_names(self) -> list[str]:
        """The names of :attr:`program_fields`, in order."""
        return [f.name for f in self.program_fields]

    def program_obs(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs[..., :obs_dim]`` with the derived fields' columns appended (float32).

        What a sandboxed program's worker receives; its fields are :attr:`program_fields`.
        """
        base = obs[..., : self.obs_dim]
        if not self.derived_fields:
            return base
        named = self._base_fields(base)
        extra = [d.compute(named).to(base.dtype).reshape(*base.shape[:-1], d.size) for d in self.derived_fields]
        return torch.cat([base, *extra], dim=-1)

    def _base_fields(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in self.state_fields:
            part = obs[..., f.start : f.stop]
            if f.shape:
                part = part.reshape(*obs.shape[:-1], *f.shape)
            elif f.size == 1:
                part = part[..., 0]
            out[f.name] = part
        return out

    def split_state(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name the fields of a batched observation ``[B, obs_dim]`` (derived fields included).

        Scalars come out as ``[B]``, vectors as ``[B, *shape]``.
        """
        out = self._base_fields(obs[..., : self.obs_dim])
        for d in self.derived_fields:
            out[d.name] = d.compute(out).to(obs.dtype)
        return out

    def render_state(self, obs: np.ndarray, info: dict[str, Any] | None = None) -> str:
        """A short text description of one (unbatched) state for LLM evaluators."""
        lines = []
        for f in self.state_fields:
            value = obs[f.start : f.stop]
            shown = f"{float(value[0]):.3f}" if f.size == 1 else np.array2string(np.asarray(value), precision=3)
            unit = f" {f.unit}" if f.unit else ""
            lines.append(f"{f.name}: {shown}{unit}")
        return "\n".join(lines)

    def caption(self, obs: np.ndarray) -> str:
        """A coarse text of one (unbatched) state, for LLM calls cached per state text.

        Coarse on purpose, so that the same caption comes back many times in a training
        and one LLM answer serves every step that has it: only what bears on what to do
        next, at low resolution. The default is :meth:`render_state` with each value
        rounded to one decimal; tasks with a richer state (Crafter) override it.
        """
        lines = []
        for f in self.state_fields:
            value = np.round(np.asarray(obs[f.start : f.stop], dtype=np.float64), 1) + 0.0  # + 0.0: no "-0.0"
            shown = f"{float(value[0]):.1f}" if f.size == 1 else np.array2string(value, precision=1)
            lines.append(f"{f.name}: {shown}")
        return "\n".join(lines)

    def caption_transition(self, obs: np.ndarray, next_obs: np.ndarray) -> str:
        """What one (unbatched) step did, as short verb phrases joined by ``", "`` ("" when
        nothing worth saying happened), for methods that match goals against what the agent
        did (ELLM's transition captioner).

        Phrases name events in the game's own terms ("collect wood", "place table", "eat
        cow"), never the state the step ended in. ``next_obs`` of a step that ended an
        episode is that episode's final observation. The default says nothing; tasks with
        discrete events (Crafter) override it.
        """
        return ""

    def describe_segment(self, obs: np.ndarray, ended: bool) -> str:
        """A plain-language account of a piece of one episode, for LLM judges ("" if none).

        ``obs`` ``[L, obs_dim]`` holds the states reached by the piece's ``L`` steps;
        ``ended``: the episode terminated at the last of them. Say what happened and how it
        ended in words (what a termination means here, how the state stands relative to
        the goal) rather than raw numbers: small models compare such sentences far better
        than tables of floats. Tasks that return "" get the judge's generic rendering
        (step count, end, last state, field changes).
        """
        return ""

    def schema_text(self) -> str:
        """The state schema as prompt text: one line per field (derived fields included)."""
        lines = []
        for f in self.program_fields:
            shape = "scalar" if f.size == 1 and not f.shape else f"shape {f.shape or (f.size,)}"
            unit = f", unit {f.unit}" if f.unit else ""
            lines.append(f"- {f.name} ({shape}{unit}): {f.description}")
        return "\n".join(lines)

    # -- fitness ----------------------------------------------------------------------
    def episode_info(self, final_info: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
        """From the info of an episode's last step: (success flag or None, task info).

        The task info keeps the designers' return (``human_return``) when the env paid
        another reward; subclasses that add their own info extend this one's.
        """
        success = final_info.get("success", final_info.get("is_success"))
        extra = {"human_return": float(final_info["human_return"])} if "human_return" in final_info else {}
        return (None if success is None else bool(success)), extra

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        """The sparse reward of one step (``reward`` is the designers' reward of that step).

        ``episode`` is a dict the rule may keep per-episode memory in (emptied at reset).
        Tasks that offer ``reward=sparse`` override this and set :attr:`sparse_text`.
        """
        raise NotImplementedError(f"The task '{self.name}' has no sparse reward")

    def fitness(self, episodes: list[Episode]) -> Fitness:
        """The ground-truth score of evaluation episodes (default: mean return under the designers' reward)."""
        value = float(np.mean([ground_truth_return(e) for e in episodes])) if episodes else float("nan")
        return Fitness(self.fitness_name, value)

    def failure_modes(self, episodes: list[Episode]) -> str:
        """A short text classifying how evaluation episodes failed, for LLM feedback ("" if none).

        Tasks that record per-episode facts in :meth:`episode_info` override this
        (e.g. the Kuka grasp task: never reached the block, grasp slipped, dropped).
        """
        return ""

    # -- reference trajectories (reward vetting) ------------------------------------------
    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """A known controller that often succeeds: batched observations ``[B, obs_dim]`` to actions.

        Used to produce successful reference trajectories for :mod:`core.vetting`; None
        (the default) when the task has none, so only random rollouts are available.
        """
        return None

    def judge_success(self, success: bool | None, ground_truth: float) -> bool:
        """Whether an episode achieved the task: its success flag, else ``success_return``."""
        if success is not None:
            return bool(success)
        return self.success_return is not None and ground_truth >= self.success_return

    def reference_trajectories(self, episodes: int, seed: int, max_steps: int = 1000) -> list[Trajectory]:
        """``episodes`` random rollouts, then ``episodes`` of :meth:`reference_policy` if there is one.

        Each rollout is one episode per env of a vector env of the task, cut at
        ``max_steps`` (and the task's time limit). Deterministic in ``seed``.
        """
        out = rollouts(self, None, episodes, seed, max_steps)
        policy = self.reference_policy()
        if policy is not None:
            out += rollouts(self, policy, episodes, seed + 1, max_steps)
        return out


def _final_info(info: dict[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s entries of the vector info's ``final_info`` (``_key`` arrays are masks)."""
    final = info.get("final_info", {}) if isinstance(info, dict) else {}
    out: dict[str, Any] = {}
    for key, value in final.items():
        mask = final.get("_" + key)
        if key.startswith("_") or (mask is not None and not bool(np.asarray(mask)[i])):
            continue
        try:
            out[key] = value[i]
        except (TypeError, IndexError, KeyError):
            out[key] = value
    return out


@dataclass
class VectorStep:
    """One step of every env of a task's vector env (:func:`task_steps`)."""

    obs: np.ndarray  # [B, ...] the observations acted on
    action: np.ndarray  # [B, ...]
    next_obs: np.ndarray  # [B, ...] the true next observations: the final one where an episode ended, not the reset's
    reward: np.ndarray  # [B]
    terminated: np.ndarray  # [B] bool
    truncated: np.ndarray  # [B] bool
    info: dict[str, Any]  # the vector info (``final_info`` for the envs whose episode ended)

    @property
    def done(self) -> np.ndarray:
        return np.logical_or(self.terminated, self.truncated)

    def final_info(self, i: int) -> dict[str, Any]:
        """Env ``i``'s info at the end of its episode (empty when it did not end here)."""
        return _final_info(self.info, i)


def task_steps(
    task: Task, envs: int, steps: int, seed: int, policy: Callable[[np.ndarray], np.ndarray] | None = None
) -> Iterator[VectorStep]:
    """``steps`` steps of ``envs`` envs of the task from a reset with ``seed``: random actions
    (the action space seeded with ``seed``) or ``policy``'s (``[B, obs_dim]`` float32 to actions).

    Episodes restart as the vector env resets them; each step's ``next_obs`` is the true
    one (an ended episode's final observation). The env is closed when the steps end or
    the caller stops early.
    """
    env = task.make_env(envs, seed)
    try:
        obs, _ = env.reset(seed=seed)
        env.action_space.seed(seed)
        for _ in range(steps):
            action = np.asarray(
                policy(np.asarray(obs, np.float32)) if policy is not None else env.action_space.sample()
            )
            nxt, reward, term, trunc, info = env.step(action)
            true_next, final = np.array(nxt, copy=True), info.get("final_obs")
            if final is not None:  # same-step autoreset: the ended episodes' last observations are here
                for i in np.flatnonzero(np.logical_or(term, trunc)):
                    true_next[i] = final[i]
            yield VectorStep(
                np.asarray(obs),
                action,
                true_next,
                np.asarray(reward),
                np.asarray(term, bool),
                np.asarray(trunc, bool),
                info,
            )
            obs = nxt
    finally:
        env.close()


def rollouts(
    task: Task, policy: Callable[[np.ndarray], np.ndarray] | None, episodes: int, seed: int, max_steps: int = 1000
) -> list[Trajectory]:
    """One episode in each of ``episodes`` envs of ``task``: random actions, or ``policy``'s."""
    if episodes <= 0:
        return []
    steps = max(1, min(int(max_steps), int(task.max_episode_steps)))
    record: list[list[tuple[np.ndarray, Any, np.ndarray, float]]] = [[] for _ in range(episodes)]
    ends: dict[int, tuple[bool, bool, float]] = {}
    for step in task_steps(task, episodes, steps, seed, policy):
        for i in range(episodes):
            if i in ends:
                continue
            record[i].append(
                (
                    np.asarray(step.obs[i], np.float32),
                    step.action[i],
                    np.asarray(step.next_obs[i], np.float32),
                    float(step.reward[i]),
                )
            )
            if step.done[i]:
                flag, extra = task.episode_info(step.final_info(i))
                ret = float(extra.get("human_return", sum(r for *_, r in record[i])))
                ends[i] = (bool(step.terminated[i]), task.judge_success(flag, ret), ret)
        if len(ends) == episodes:
            break
    source = "random" if policy is None else "controller"
    out = []
    for i, steps_i in enumerate(record):
        paid = np.array([r for *_, r in steps_i], np.float32)
        terminated, success, ret = ends.get(i, (False, False, float(paid.sum())))  # cut at the step cap
        out.append(
            Trajectory(
                obs=np.stack([o for o, *_ in steps_i]),
                action=np.stack([np.asarray(a) for _, a, *_ in steps_i]),
                next_obs=np.stack([n for _, _, n, _ in steps_i]),
                env_reward=paid,
                terminated=terminated,
                success=success,
                ground_truth=ret,
                source=source,
            )
        )
    return out
