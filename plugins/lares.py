"""lares: evolutionary RL over a population of LLM reward functions (LaRes, NeurIPS 2025).

Method ("LaRes: Evolutionary Reinforcement Learning with LLM-based Adaptive Reward
Search"):

1. A population of reward functions written by the LLM (``population``, default 5), each
   with its own off-policy (SAC) agent. One shared replay buffer stores, for every
   transition, the value of every reward function, so a new function relabels all past
   data and every agent learns from everything any agent collected.
2. Thompson sampling over the agents' recent success decides which agent collects the
   next episode.
3. Every ``llm_freq`` env steps: evaluate every agent, keep the elites (top
   ``elites``, or tournament selection), describe the best agent's behaviour in a short
   bounded text, let the LLM name its defects and propose improvements, then show the
   best code, its component feedback and that analysis to the LLM (temperature ~0.4)
   to rewrite the non-elite functions. New functions relabel the buffer and are
   rescaled to the best elite's reward mean/std (or squashed by a sigmoid); their agent
   starts from the best elite's weights. Selection penalises reward complexity (AST
   size); population diversity (1 - mean |correlation| of the reward columns) is logged.
4. Optional retrieval: a case base of earlier successful reward functions; the most
   similar ones are shown as examples before generating.

The joint training runs in ``train_candidates`` (:class:`Evolution`) through the core's
training machinery: each member is one candidate with its own
:class:`core.train.common.CandidateEnv` (the task's vector env with the candidate's env
configs, its state program, the ``compute_reward`` / ``represent_state`` hooks) and its
own :class:`core.context.TrainContext`, and a core SAC agent (:mod:`core.train.sac`:
``make_sac_modules`` + ``sac_update``, settings from ``trainer=sac``) learning from the
:class:`SharedBuffer`. Config: ``conf/plugins/lares.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
import torch

from core.plugin import (Candidate, Fitness, IterationResult, PluginConfig, RewardProgram, SandboxError, Shapes,
                         StepBatch, TrainContext, TrainResult, UserError, batch_shapes, candidate_line, code_options,
                         fence, hookimpl, interface_of, prepare_reward, program_from_reply, repair_messages,
                         reply_counts, reward_interface, sample_evenly, summarize_series)

NAME = "lares"
ENTRY = "compute_reward"
ARGS = ["state", "action", "next_state"]
SELECTIONS = ("top", "tournament")
RESCALES = ("affine", "sigmoid", "none")


@dataclass
class Config(PluginConfig):
    """``plugins.lares``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`.

    The agents' settings are ``trainer=sac``'s (``conf/trainer/sac.yaml``).
    """

    iterations: int = 1  # outer rounds; LaRes evolves inside one long training (keep 1)
    population: int = 5  # reward functions, each with its own SAC agent (paper: 5)
    elites: int = 3  # members kept at each LLM update; the others are regenerated (paper: 3)
    selection: str = "top"  # top | tournament: how the elites are chosen
    tournament_size: int = 2  # entrants per tournament when selection=tournament
    llm_freq: int = 5000  # env steps (all members together) between LLM updates
    frames: int | None = None  # env steps for the whole population (all agents together); null = trainer.frames
    init_temperature: float | None = None  # sampling temperature of the initial population; None: by its size (core.prompting.sampling_temperature)
    temperature: float = 0.4  # temperature of the analysis and regeneration calls (paper: 0.3-0.5)
    max_tokens: int = 768  # cap on each reward-function reply
    retries: int = 2  # re-asks with the error when an initial or repaired function fails the sandbox
    analysis_tokens: int = 256  # cap on the behaviour-analysis reply
    rescale: str = "affine"  # affine (to the best elite's reward mean/std) | sigmoid (squash) | none
    complexity_penalty: float = 0.0005  # selection penalty per AST node of a reward function
    retrieval: bool = False  # show the most similar reward functions of the case base as examples
    retrieve_k: int = 2  # how many to show
    case_base: str | None = None  # JSON file of earlier successful reward functions; null = <cache_dir>/lares_cases.json
    case_min_fitness: float = 0.5  # a run's best reward joins the case base when its fitness reaches this
    final_seeds: int = 0  # retrain the best reward on this many more seeds after the loop (a population of one)

    def check(self) -> None:
        super().check()
        for name in ("population", "tournament_size", "llm_freq", "max_tokens", "analysis_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("elites", "retries", "retrieve_k", "init_temperature", "temperature", "complexity_penalty"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.frames is not None and self.frames < 1:
            raise ValueError(f"frames must be >= 1 or null, got {self.frames}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.rescale not in RESCALES:
            raise ValueError(f"rescale must be one of {', '.join(RESCALES)}, got {self.rescale!r}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You are a rigorous robot coach and reward engineer. You write reward functions
for reinforcement learning agents in Python. Keep reward expressions simple: a few
smooth, bounded terms. Reply with one ```python code block."""

TASK = """The environment:

{description}

{interface}

Task goal: {goal}"""

EXAMPLES = """Reward functions that worked on similar tasks before:

{examples}"""

ANALYSE = """An RL agent is learning this task: {goal}

Its current behaviour, from a recent evaluation episode:

{behaviour}

In at most five short bullet points, name the defects of this behaviour (for example
abrupt stops, jitter, oscillation, wasted effort, never reaching the goal) and propose
how the reward function should change to fix each one."""

EVOLVE = """This is the best reward function of the population so far:

```python
{code}
```

Its agent's results, sampled over training (max/mean/min):

{feedback}

Analysis of the agent's behaviour:

{analysis}

Write a new, improved reward function that fixes these defects. Reply with the complete
function in a ```python block."""

FAILURE = """Running the reward function above failed ({kind}):

{error}

The only keys of `state` and `next_state` are: {fields}.
Fix the problem and reply with the complete corrected reward function in a ```python block."""

WORD = re.compile(r"[a-z0-9_]+")
BEHAVIOUR_CHARS = 2000  # ~512 tokens: the paper bounds the trajectory description


# -- pure pieces: selection, sampling, rescaling, complexity, diversity, text --------------


def complexity(source: str) -> int:
    """Size of a reward program: its number of AST nodes (0 if it does not parse)."""
    try:
        return sum(1 for _ in ast.walk(ast.parse(source)))
    except SyntaxError:
        return 0


def selection_scores(fitness: list[float], sizes: list[int], penalty: float) -> list[float]:
    """Fitness minus ``penalty`` per AST node of the reward expression."""
    return [f - penalty * n for f, n in zip(fitness, sizes)]


def select_elites(scores: list[float], k: int, method: str = "top", tournament: int = 2, rng: random.Random | None = None) -> list[int]:
    """Indices of the ``k`` elites: the best scores (``top``) or by repeated tournaments."""
    k = max(0, min(k, len(scores)))
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if method == "top":
        return sorted(order[:k])
    if method != "tournament":
        raise UserError(f"plugins.lares.selection must be 'top' or 'tournament', not {method!r}")
    rng = rng or random.Random(0)
    left, chosen = list(range(len(scores))), []
    for _ in range(k):
        entrants = rng.sample(left, min(tournament, len(left)))
        winner = max(entrants, key=lambda i: scores[i])
        chosen.append(winner)
        left.remove(winner)
    return sorted(chosen)


def thompson_pick(outcomes: list[deque[float]], rng: np.random.Generator) -> int:
    """The agent to act: argmax of a Beta(1 + successes, 1 + failures) draw per agent."""
    draws = [rng.beta(1.0 + sum(o), 1.0 + len(o) - sum(o)) for o in outcomes]
    return int(np.argmax(draws))


def rescale(values: torch.Tensor, target_mean: float, target_std: float, mode: str = "affine") -> tuple[float, float, str]:
    """``(a, b, mode)`` so that ``a * r + b`` has the target mean/std (``sigmoid``: squashed).

    With ``sigmoid``, the reward is ``sigmoid(a * r + b)`` where ``a * r + b`` is the
    standardised reward.
    """
    mean, std = float(values.mean()), float(values.std()) if values.numel() > 1 else 0.0
    std = std if std > 1e-8 else 1.0
    if mode == "sigmoid":
        return 1.0 / std, -mean / std, "sigmoid"
    if mode != "affine":
        raise UserError(f"plugins.lares.rescale must be 'affine', 'sigmoid' or 'none', not {mode!r}")
    a = (target_std if target_std > 1e-8 else 1.0) / std
    return a, target_mean - a * mean, "affine"


def apply_scale(values: torch.Tensor, scale: tuple[float, float, str]) -> torch.Tensor:
    a, b, mode = scale
    out = a * values + b
    return torch.sigmoid(out) if mode == "sigmoid" else out


def diversity(columns: torch.Tensor) -> float:
    """1 - mean |Pearson correlation| between the reward columns ``[T, N]`` (1 = unrelated)."""
    if columns.shape[1] < 2 or columns.shape[0] < 2:
        return 0.0
    x = columns.double() - columns.double().mean(0)
    std = x.std(0)
    keep = std > 1e-12
    n = int(columns.shape[1])
    corr = torch.zeros(n, n, dtype=torch.float64)
    if int(keep.sum()) >= 2:
        z = x[:, keep] / std[keep]
        sub = (z.T @ z) / (columns.shape[0] - 1)
        idx = torch.nonzero(keep).flatten()
        corr[idx.unsqueeze(1), idx.unsqueeze(0)] = sub
    mask = ~torch.eye(n, dtype=torch.bool)
    return float(min(1.0, max(0.0, 1.0 - float(corr.abs()[mask].mean()))))


def describe_behaviour(task: Any, observations: np.ndarray, actions: np.ndarray, success: bool | None, points: int = 6) -> str:
    """A bounded natural-language account of one episode: states over time and motion stats."""
    steps = len(actions)
    lines = [f"Episode of {steps} steps; {'reached the goal' if success else 'did not reach the goal' if success is not None else 'no success signal'}."]
    for t in sample_evenly(list(range(len(observations))), points):
        state = task.render_state(observations[t]).replace("\n", ", ")
        lines.append(f"t={t}: {state}")
    if steps > 1:
        a = actions.reshape(steps, -1)
        jitter = float(np.abs(np.diff(a, axis=0)).mean())
        lines.append(f"actions: mean {float(a.mean()):.2f}, std {float(a.std()):.2f}, mean |change| per step {jitter:.2f} (high = jitter)")
        delta = np.abs(np.diff(observations.reshape(len(observations), -1), axis=0)).sum(-1)
        if len(delta) > 1:
            stops = int(((delta[1:] < 0.2 * delta[:-1]) & (delta[:-1] > np.median(delta) + 1e-6)).sum())
            lines.append(f"sudden slow-downs (state change dropping by 80% in one step): {stops}")
    return "\n".join(lines)[:BEHAVIOUR_CHARS]


def member_feedback(fitness_curve: list[float], components: dict[str, list[float]], fitness_name: str) -> str:
    lines = [f"fitness ({fitness_name}): {summarize_series(sample_evenly(fitness_curve, 10))}"]
    lines += [f"{name}: {summarize_series(sample_evenly(vals, 10))}" for name, vals in sorted(components.items())]
    return "\n".join(lines)


def _fields(task: Any) -> str:
    return ", ".join(f'"{name}"' for name in task.field_names())


# -- case base -----------------------------------------------------------------------------


def _bag(text: str) -> Counter[str]:
    return Counter(WORD.findall(text.lower()))


def similarity(a: str, b: str) -> float:
    x, y = _bag(a), _bag(b)
    dot = sum(x[w] * y[w] for w in x)
    norm = math.sqrt(sum(v * v for v in x.values()) * sum(v * v for v in y.values()))
    return dot / norm if norm else 0.0


def retrieve(cases: list[dict[str, Any]], query: str, k: int) -> list[dict[str, Any]]:
    """The ``k`` cases (``{"task", "goal", "code", "fitness"}``) most similar to ``query``."""
    ranked = sorted(cases, key=lambda c: (similarity(c["goal"] + " " + c["code"], query), c["fitness"]), reverse=True)
    return ranked[: max(0, k)]


def load_cases(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text())) if path.exists() else []
    except ValueError:
        return []


# -- prompts -----------------------------------------------------------------------------------


def base_messages(run: Any, cases: list[dict[str, Any]], shapes: Shapes | None = None) -> list[dict[str, str]]:
    """System + (similar cases) + the task; ``shapes``: the task's :func:`core.prompting.batch_shapes` (made when None)."""
    interface = reward_interface(run.task, list(run.sandbox.imports), shapes, interface=interface_of(run))
    user = TASK.format(description=run.task.description, interface=interface, goal=run.task.goal)
    if cases:
        shown = "\n\n".join(f"Goal: {c['goal']}\n```python\n{c['code'].strip()}\n```" for c in cases)
        user = EXAMPLES.format(examples=shown) + "\n\n" + user
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def evolve_messages(base: list[dict[str, str]], code: str, feedback: str, analysis: str) -> list[dict[str, str]]:
    return base + [{"role": "user", "content": EVOLVE.format(code=code.strip(), feedback=feedback, analysis=analysis.strip())}]


def every_program(replies: list[Any], prompt: str, generation: int, call: str = "",
                  fields: list[str] | None = None) -> list[RewardProgram]:
    """A program per reply: usable, or rejected with the reason (:func:`core.codegen.program_from_reply`);
    with ``fields`` (the task's field names) the names each reads are checked and mended first."""
    extra = {"call": call} if call else {}
    return [program_from_reply(RewardProgram, reply.text, ENTRY, ARGS, state_fields=fields, origin=NAME, prompt=prompt,
                               meta={"sample": i, "generation": generation, **extra}) for i, reply in enumerate(replies)]


def programs_from(replies: list[Any], prompt: str, generation: int,
                  fields: list[str] | None = None) -> tuple[list[RewardProgram], list[str]]:
    """The usable programs of ``replies`` and the rejected replies' reasons."""
    programs = every_program(replies, prompt, generation, fields=fields)
    return [p for p in programs if not p.rejected], [p.rejected for p in programs if p.rejected]


# -- what a population can hold ------------------------------------------------------------------


def is_mine(candidate: Candidate) -> bool:
    """Whether LaRes proposed the candidate's reward (only those join its population)."""
    return candidate.reward is not None and candidate.reward.origin == NAME


def action_space(task: Any, seed: int) -> gym.Space:
    env = task.make_env(1, seed)
    try:
        return env.single_action_space
    finally:
        env.close()


def unsupported(candidate: Candidate, task: Any, space: gym.Space) -> str:
    """Why a LaRes candidate cannot join the population ("" when it can).

    Reward and state programs and env configs are honoured; macro-actions and discrete
    action spaces are not (one SAC action space is shared through the replay buffer).
    """
    if not isinstance(space, gym.spaces.Box):
        return (f"action space: lares trains SAC agents, which need a continuous (Box) action space; "
                f"'{task.name}' has {space}.")
    if candidate.macros:
        names = ", ".join(m.name for m in candidate.macros)
        return (f"macro-actions ({names}): lares's SAC agents share one replay buffer over the task's continuous "
                "action space; macro-actions extend a discrete action space, which that buffer and SAC cannot hold. "
                "Train them without lares (or without the action role).")
    return ""


def program_value(fn: Any, program: RewardProgram | None, state: dict, action: torch.Tensor, next_state: dict,
                  env_reward: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(reward [B], components)`` of a reward function under its candidate's ``mode``/``weight``."""
    out = fn(state, action, next_state)
    reward, components = out if isinstance(out, tuple) else (out, {})
    reward = torch.as_tensor(reward, dtype=torch.float32).reshape(-1)
    if program is not None and program.mode == "add":
        reward = env_reward.reshape(-1) + float(program.weight) * reward
    return reward, components or {}


# -- shared buffer -------------------------------------------------------------------------------------


class SharedBuffer:
    """One replay buffer for the population: transitions plus every member's reward and features.

    ``raw[:, j]`` is member ``j``'s reward program's value of each transition and
    ``hook[:, j]`` the ``compute_reward`` hooks' terms computed with member ``j``'s
    context when the transition was collected; member ``j`` trains on
    ``apply_scale(raw[:, j], scales[j]) + hook[:, j]``. A member whose state program or
    ``represent_state`` hooks append features keeps them in ``extra[j]`` (for the
    observation and the next one), computed by its own transforms at collection time.
    This buffer is the method (a new function relabels every stored transition), so it is
    LaRes's own rather than the core SAC's single-reward replay buffer.
    """

    def __init__(self, capacity: int, obs_dim: int, act_dim: int, members: int, extra_dims: Sequence[int] = ()) -> None:
        self.capacity, self.size, self.ptr = capacity, 0, 0
        self.obs = torch.zeros(capacity, obs_dim)
        self.next_obs = torch.zeros(capacity, obs_dim)
        self.action = torch.zeros(capacity, act_dim)
        self.term = torch.zeros(capacity, dtype=torch.bool)
        self.env_reward = torch.zeros(capacity)
        self.raw = torch.zeros(capacity, members)
        self.hook = torch.zeros(capacity, members)
        self.extra = {j: (torch.zeros(capacity, k), torch.zeros(capacity, k)) for j, k in enumerate(extra_dims) if k}

    def add(self, obs: torch.Tensor, action: torch.Tensor, next_obs: torch.Tensor, term: torch.Tensor, env_reward: torch.Tensor,
            raw: torch.Tensor, hook: torch.Tensor | None = None, extra: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Append ``B`` transitions, overwriting the oldest when full."""
        rows = (self.ptr + torch.arange(obs.shape[0])) % self.capacity
        self.obs[rows], self.action[rows], self.next_obs[rows] = obs, action.reshape(len(rows), -1), next_obs
        self.term[rows], self.env_reward[rows], self.raw[rows] = term.reshape(-1).bool(), env_reward.reshape(-1), raw
        self.hook[rows] = hook if hook is not None else 0.0
        for j, (feat, next_feat) in self.extra.items():
            feat[rows], next_feat[rows] = (extra or {})[j]
        self.ptr = int(rows[-1] + 1) % self.capacity
        self.size = min(self.size + obs.shape[0], self.capacity)

    def relabel(self, j: int, fn: Any, task: Any, chunk: int = 4096) -> None:
        """Recompute column ``j`` over every stored transition: ``fn(state, action, next_state, env_reward) -> [n]``.

        The hooks' terms (``hook[:, j]``) stay as they were computed at collection time.
        """
        for lo in range(0, self.size, chunk):
            hi = min(self.size, lo + chunk)
            state, next_state = task.split_state(self.obs[lo:hi]), task.split_state(self.next_obs[lo:hi])
            self.raw[lo:hi, j] = fn(state, self.action[lo:hi], next_state, self.env_reward[lo:hi])

    def sample(self, batch_size: int, column: int, scale: tuple[float, float, str], generator: torch.Generator | None = None) -> Any:
        """A uniform minibatch in the keys ``SACLoss`` reads, rewarded and featured for member ``column``."""
        from tensordict import TensorDict

        idx = torch.randint(0, self.size, (batch_size,), generator=generator)
        obs, next_obs = self.obs[idx], self.next_obs[idx]
        if column in self.extra:
            feat, next_feat = self.extra[column]
            obs, next_obs = torch.cat([obs, feat[idx]], -1), torch.cat([next_obs, next_feat[idx]], -1)
        term = self.term[idx].unsqueeze(-1)
        reward = (apply_scale(self.raw[idx, column], scale) + self.hook[idx, column]).unsqueeze(-1)
        # a truncated episode stores its real final observation and is not terminal, so
        # the target bootstraps through it; done = terminated is then exact
        nxt = {"observation": next_obs, "reward": reward, "done": term, "terminated": term}
        return TensorDict({"observation": obs, "action": self.action[idx], "next": nxt}, batch_size=[batch_size])


# -- SAC agents (the core's) ----------------------------------------------------------------------------


def sac_settings(run: Any, frames: int | None = None) -> Any:
    """The agents' :class:`core.train.sac.SACConfig`: the run's ``trainer`` (must be SAC).

    ``frames`` (the population's budget) replaces ``trainer.frames`` when given.
    """
    from core.train.sac import SACConfig

    trainer = run.config.trainer
    if str(trainer.get("name", "")) != "sac":
        raise UserError("lares trains one SAC agent per reward function: run it with trainer=sac "
                        f"(the trainer is {trainer.get('name')!r}); trainer.* sets the agents' hyperparameters.")
    try:
        cfg = SACConfig.from_config(trainer)
    except ValueError as e:
        raise UserError(str(e)) from e
    return replace(cfg, frames=int(frames)) if frames else cfg


def inherit(dst: Any, src: Any) -> None:
    """Copy an agent's actor, critics, targets, temperature and optimiser state into another."""
    dst.loss.load_state_dict(src.loss.state_dict())
    for mine, theirs in zip(dst.optimizers, src.optimizers):
        mine.load_state_dict(theirs.state_dict())


# -- one member: a candidate, its env, its context, its agent --------------------------------------------


class EpisodeLog(gym.vector.VectorWrapper):
    """Records how each episode of a vector env ends: ``(env return, task success or None)``."""

    def __init__(self, env: gym.vector.VectorEnv, task: Any) -> None:
        super().__init__(env)
        self.task = task
        self.copy = getattr(env, "copy", True)  # VecGymEnv copies observations of envs that reuse buffers
        self.returns = np.zeros(env.num_envs)
        self.ended: list[tuple[float, bool | None]] = []

    def reset(self, **kwargs: Any) -> Any:
        self.returns[:] = 0.0
        return self.env.reset(**kwargs)

    def step(self, actions: Any) -> Any:
        from core.train.evaluate import _env_info  # env i's entries of a vector info (nested dicts, masks)

        obs, reward, term, trunc, info = self.env.step(actions)
        self.returns += np.asarray(reward, dtype=np.float64)
        for e in np.flatnonzero(np.logical_or(term, trunc)):
            success, _ = self.task.episode_info(_env_info(info.get("final_info") or {}, int(e)))
            self.ended.append((float(self.returns[e]), success))
            self.returns[e] = 0.0
        return obs, reward, term, trunc, info

    def pop(self) -> list[tuple[float, bool | None]]:
        ended, self.ended = self.ended, []
        return ended


@dataclass(eq=False)
class Member:
    """One slot of the population: its candidate, context, env, reward function and agent."""

    candidate: Candidate
    ctx: TrainContext
    result: TrainResult  # curve, components and episodes, filled as it trains
    program: RewardProgram | None = None  # the slot's current reward program
    fn: Any = None  # its sandboxed function, or None (no working function: rewarded 0, no updates)
    error: str = ""
    error_kind: str = ""
    env: Any = None  # core.train.common.CandidateEnv, once built
    episodes: EpisodeLog | None = None
    sac: Any = None  # core.train.sac.SACModules
    carry: Any = None  # the env's next root TensorDict
    scale: tuple[float, float, str] = (1.0, 0.0, "affine")
    frames: int = 0  # env steps it collected
    generation: int = 0
    outcomes: deque = field(default_factory=lambda: deque(maxlen=20))
    returns: list[float] = field(default_factory=list)
    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    owed: float = 0.0  # gradient steps due (updates_per_frame x frames collected)
    stats: dict[str, float] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)

    @property
    def extra_dim(self) -> int:
        """Features its state program and ``represent_state`` hooks append to the observation."""
        return self.env.obs_dim - self.ctx.task.obs_dim if self.env is not None else 0

    def drop(self, exc: BaseException, when: str) -> None:
        """The function failed: no working function until the LLM writes a new one."""
        report = getattr(exc, "report", None)
        self.fn, self.error = None, str(getattr(report, "message", "") or exc)
        self.error_kind = str(getattr(report, "kind", "") or type(exc).__name__)
        self.history.append(f"generation {self.generation}: failed {when} ({self.error_kind})")

    def value(self, state: dict, action: torch.Tensor, next_state: dict, env_reward: torch.Tensor) -> torch.Tensor:
        """Its program's reward ``[B]`` (0 without a working function); component means are summed."""
        if self.fn is not None:
            try:
                reward, components = program_value(self.fn, self.candidate.reward, state, action, next_state, env_reward)
            except Exception as e:  # noqa: BLE001 - a function failing mid-training drops out
                self.drop(e, "during training")
            else:
                for name, v in components.items():
                    self.sums[name] = self.sums.get(name, 0.0) + float(torch.as_tensor(v, dtype=torch.float32).mean())
                self.steps += 1
                return reward
        return torch.zeros(action.shape[0])


class MemberReward:
    """The reward program a member's env runs: the member's current function.

    The LLM rewrites a member's function during training while its env (and the
    ``ProgramReward`` transform in it) stays; this relay always calls the current one.
    Without a working function the member is rewarded 0.
    """

    def __init__(self, member: Member) -> None:
        self.member = member

    def __call__(self, state: dict, action: torch.Tensor, next_state: dict) -> tuple[torch.Tensor, dict]:
        m = self.member
        if m.fn is not None:
            try:
                return m.fn(state, action, next_state)
            except Exception as e:  # noqa: BLE001
                m.drop(e, "during training")
        return torch.zeros(action.shape[0]), {}


# -- the evolutionary loop -------------------------------------------------------------------------


class Evolution:
    """Trains a LaRes population jointly and evolves its reward functions with the LLM."""

    def __init__(self, run: Any, candidates: list[Candidate], seed: int, cfg: Config, plugin: Plugin) -> None:
        self.run, self.task, self.seed, self.cfg, self.plugin = run, run.task, seed, cfg, plugin
        self.hook = run.hook
        self.sac_cfg = sac_settings(run, cfg.frames)
        self.frames_budget = int(self.sac_cfg.frames)
        self.rng = np.random.default_rng(seed)
        self.generation = 0
        self.diversity: list[tuple[int, float]] = []
        self.frames = 0
        self.members = [Member(c, self._context(c), TrainResult(candidate_id=c.id, ok=False), program=c.reward)
                        for c in candidates]
        self.pop: list[Member] = []  # the members whose env and agent exist
        self.buffer: SharedBuffer | None = None

    def _context(self, candidate: Candidate) -> TrainContext:
        run = self.run
        return TrainContext(settings=run.settings, task=run.task, seed=self.seed, candidate=candidate,
                            total_frames=self.frames_budget, llm_factory=lambda: run.llm, hook=run.hook,
                            pluginmanager=run.pluginmanager)

    # -- setup --------------------------------------------------------------------------------
    def _prepare(self, program: RewardProgram) -> tuple[Any, str, str]:
        sandbox = self.run.sandbox
        try:
            return prepare_reward(program, self.task, limits=sandbox.limits(), allowed_imports=sandbox.imports), "", ""
        except SandboxError as e:
            return None, e.report.message, e.report.kind

    def _repair(self, m: Member) -> None:
        """Send a failing function's error back to the LLM until it passes (``retries`` times)."""
        run, cfg = self.run, self.cfg
        for attempt in range(cfg.retries):
            if m.fn is not None or m.program is None:
                return
            seed = run.seed * 1000 + 300 + 10 * int(m.program.meta.get("sample", 0)) + attempt
            if interface_of(run) == "fields":  # the core's short repair request: fields, function, error, rule
                code = run.settings.run.code
                msgs = repair_messages(self.task, m.program.source or m.program.reply, m.error, m.error_kind, entry=ENTRY,
                                       shapes=self.plugin.shapes)
                replies = run.llm.chat(msgs, n=1, temperature=code.repair_temperature, max_tokens=code.repair_max_tokens,
                                       seed=seed, tag=f"{NAME}-repair", stop=code_options(run, 1, None)["stop"])
            else:
                msgs = base_messages(run, [], self.plugin.shapes) + [
                    {"role": "assistant", "content": m.program.reply or f"```python\n{m.program.source}\n```"},
                    {"role": "user", "content": FAILURE.format(kind=m.error_kind, error=m.error.strip()[-1500:],
                                                               fields=_fields(self.task))},
                ]
                replies = run.llm.chat(msgs, n=1, temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=seed,
                                       tag=f"{NAME}-repair")
            programs, errors = programs_from(replies, "\n\n".join(x["content"] for x in msgs), m.generation,
                                             self.task.field_names())
            if not programs:
                m.error = errors[0] if errors else m.error
                continue
            fn, error, kind = self._prepare(programs[0])
            m.program, m.fn, m.error, m.error_kind = programs[0], fn, error, kind
            m.history.append(f"generation {m.generation}: repair {attempt + 1} {'ok' if fn else f'failed ({kind})'}")

    def _setup(self) -> None:
        """Each member's function (repaired if it fails), env, agent and ``on_train_start``."""
        from core.train.common import CandidateEnv, error_of
        from core.train.sac import make_sac_modules

        sac = self.sac_cfg
        for k, m in enumerate(self.members):
            if m.program is not None:
                m.fn, m.error, m.error_kind = self._prepare(m.program)
            m.history.append(f"generation 0: {'ok' if m.fn else f'failed ({m.error_kind}): {m.error[:200]}'}")
            if m.fn is None:
                self._repair(m)

            def log_episodes(vec: Any, m: Member = m) -> Any:
                m.episodes = EpisodeLog(vec, self.task)
                return m.episodes

            try:  # the candidate's env configs, state program and the per-step hooks, as the trainers build them
                m.env = CandidateEnv(self.task, m.candidate, sac.num_envs, self.seed + k, self.hook, m.ctx,
                                     reward_fn=MemberReward(m), wrap_env=log_episodes)
                m.sac = make_sac_modules(m.env.obs_dim, m.env.base.action_spec, sac)
            except Exception as e:  # noqa: BLE001 - e.g. its state program fails its probe: this member fails
                if m.env is not None:
                    m.env.close()
                    m.env = None
                m.fn = None
                m.error, m.error_kind = error_of(e)
                m.history.append(f"generation 0: its env could not be built ({m.error_kind})")
                continue
            self.pop.append(m)
            if self.hook is not None:
                self.hook.on_train_start(train=m.ctx)
            m.carry = m.env.env.reset()

    # -- the loop -----------------------------------------------------------------------------------
    def train_all(self) -> list[TrainResult]:
        """One result per candidate, in order; failures are results, never exceptions."""
        from core.train.common import error_of

        torch.set_num_threads(int(self.sac_cfg.threads))
        torch.manual_seed(self.seed)
        start = time.perf_counter()
        failure: tuple[str, str] | None = None
        try:
            self._setup()
            if self.pop:
                space = self.pop[0].env.base.action_spec
                self.buffer = SharedBuffer(int(self.sac_cfg.buffer_size), self.task.obs_dim, int(space.shape[-1]),
                                           len(self.pop), [m.extra_dim for m in self.pop])
                self._train()
                for m in self.pop:
                    self._evaluate(m)
        except Exception as exc:  # noqa: BLE001 - the population's training failed (a hook, an env): every member did
            failure = error_of(exc)
        finally:
            for m in self.pop:
                m.env.close()
        seconds = time.perf_counter() - start
        # a member whose own setup failed keeps its error; the others share the population's
        return [self._finish(m, seconds, failure if m in self.pop or not m.error_kind else None) for m in self.members]

    def _pick(self) -> int:
        """Thompson sampling over the members with a working function (all of them if none has one)."""
        alive = [j for j, m in enumerate(self.pop) if m.fn is not None] or list(range(len(self.pop)))
        return alive[thompson_pick([self.pop[j].outcomes for j in alive], self.rng)]

    def _collect(self, m: Member, explore: bool) -> Any:
        """One batch ``[envs, rollout_steps]`` from the member's env, acted by its agent (or at random)."""
        from torchrl.envs.utils import ExplorationType, set_exploration_type

        env, steps, td = m.env.env, [], m.carry
        with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
            for _ in range(int(self.sac_cfg.rollout_steps)):
                if explore:
                    td = m.sac.actor(td)
                else:
                    td.set("action", env.action_spec.rand())
                td, m.carry = env.step_and_maybe_reset(td)
                steps.append(td)
        batch = torch.stack(steps, dim=1)
        if m.env.postproc is not None:  # the reward program over the whole batch, as the trainers' collector does
            batch = m.env.postproc(batch)
        return batch

    def _label(self, batch: Any, acting: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[int, Any]]:
        """``(task obs, task next obs, program rewards [N, M], hook terms [N, M], features)`` of a flat batch.

        The acting member's hook terms and features come from its env; every other
        member's are computed with its own context and transforms, since it learns from
        these transitions too.
        """
        from core.train.transforms import has_impls

        task, dim = self.task, self.task.obs_dim
        flat = batch.reshape(-1)
        obs, next_obs = flat["observation"], flat["next", "observation"]
        task_obs, task_next = obs[:, :dim], next_obs[:, :dim]
        action = flat["action"]
        total = flat["next", "reward"].reshape(-1)
        env_reward = flat.get(("next", "env_reward"), flat["next", "reward"]).reshape(-1)
        done = flat["next", "done"].reshape(-1)
        state, next_state = task.split_state(task_obs), task.split_state(task_next)
        hooked = has_impls(self.hook, "compute_reward")
        n = len(self.pop)
        raw, hook, extra = torch.zeros(len(flat), n), torch.zeros(len(flat), n), {}
        for j, m in enumerate(self.pop):
            raw[:, j] = m.value(state, action, next_state, env_reward)
            if hooked and j == acting:
                hook[:, j] = total - raw[:, j]
            elif hooked and m.fn is not None:
                step = StepBatch(obs=task_obs, action=action, next_obs=task_next, env_reward=env_reward, reward=raw[:, j],
                                 done=done, task=task)
                for term in self.hook.compute_reward(train=m.ctx, batch=step):
                    if term is not None:
                        hook[:, j] += torch.as_tensor(term, dtype=torch.float32).reshape(-1)
            if m.extra_dim:
                if j == acting:
                    extra[j] = (obs[:, dim:], next_obs[:, dim:])
                else:
                    extra[j] = (m.env.augment(task_obs)[:, dim:], m.env.augment(task_next)[:, dim:])
        return task_obs, task_next, raw, hook, extra

    def _train(self) -> None:
        from core.train.sac import sac_update

        cfg, sac, buffer = self.cfg, self.sac_cfg, self.buffer
        assert buffer is not None
        recent: deque = deque(maxlen=50)
        next_llm, warmup = cfg.llm_freq, int(sac.init_random_frames)
        log_step = max(1, self.frames_budget // 100)  # ~100 metric points per member
        next_log = log_step
        acting: int | None = None
        while self.frames < self.frames_budget:
            if acting is None:  # Thompson sampling picks the member that collects the next episode
                acting = self._pick()
            m = self.pop[acting]
            batch = self._collect(m, explore=self.frames >= warmup)
            n = batch.numel()
            self.frames += n
            m.frames += n
            for other in self.pop:
                other.ctx.frames = self.frames
            if self.hook is not None:
                self.hook.on_rollout(train=m.ctx, batch=batch)
            task_obs, task_next, raw, hook, extra = self._label(batch, acting)
            flat = batch.reshape(-1)
            env_reward = flat.get(("next", "env_reward"), flat["next", "reward"])
            buffer.add(task_obs, flat["action"], task_next, flat["next", "terminated"], env_reward, raw, hook, extra)
            m.returns += [r for r, _ in m.env.base.pop_finished()]
            ended = m.episodes.pop() if m.episodes is not None else []
            for ret, success in ended:
                recent.append(ret)
                m.outcomes.append(float(success) if success is not None else float(ret >= np.median(recent)))
            if ended:
                acting = None
            if buffer.size >= int(sac.batch_size) and self.frames >= warmup:
                for j, member in enumerate(self.pop):  # every agent learns from every transition
                    if member.fn is None:
                        continue
                    member.owed += n * float(sac.updates_per_frame)
                    while member.owed >= 1.0:
                        losses = sac_update(member.sac, buffer.sample(int(sac.batch_size), j, member.scale))
                        member.owed -= 1.0
                        member.stats.update({"losses/qvalue_loss": float(losses["loss_qvalue"]), "losses/actor_loss": float(losses["loss_actor"]),
                                             "losses/alpha_loss": float(losses["loss_alpha"]), "losses/alpha": float(losses["alpha"])})
            if self.frames >= next_log:
                for member in self.pop:
                    if member.returns:
                        member.stats["charts/episodic_return"] = float(np.mean(member.returns[-20:]))
                    for key, value in member.stats.items():
                        member.ctx.log_metric(key, value)
                next_log += log_step
            if self.frames >= next_llm and self.frames < self.frames_budget:
                self.evolve()
                next_llm += cfg.llm_freq
                acting = None

    # -- evaluation -------------------------------------------------------------------------------
    def _act(self, m: Member) -> Any:
        from core.train.sac import act_deterministic

        return lambda obs: act_deterministic(m.sac, m.env.augment(obs))

    def _evaluate(self, m: Member) -> float:
        from core.train.evaluate import evaluate_and_record

        for name, total in m.sums.items():  # component means since the last evaluation
            m.result.components.setdefault(name, []).append((self.frames, total / max(1, m.steps)))
        m.sums, m.steps = {}, 0
        episodes = evaluate_and_record(self.task, self._act(m), max(1, int(self.sac_cfg.eval_episodes)), seed=self.seed + 10_000,
                                       frames=self.frames, result=m.result, ctx=m.ctx, hook=self.hook)
        m.result.episodes = episodes
        return m.result.curve[-1].fitness

    def _rollout(self, m: Member) -> tuple[np.ndarray, np.ndarray, bool | None]:
        """One deterministic episode of the member's agent on the task's own env."""
        from core.train.evaluate import _env_info

        act = self._act(m)
        env = self.task.make_env(1, self.seed + 20_000 + self.generation)
        try:
            obs, _ = env.reset(seed=self.seed + 20_000 + self.generation)
            observations, actions, success = [obs[0]], [], None
            for _ in range(self.task.max_episode_steps):
                a = act(torch.as_tensor(np.asarray(obs), dtype=torch.float32))
                obs, _, term, trunc, info = env.step(a.numpy())
                actions.append(a.numpy()[0])
                if term[0] or trunc[0]:
                    observations.append(info["final_obs"][0])
                    success, _ = self.task.episode_info(_env_info(info.get("final_info") or {}, 0))
                    break
                observations.append(obs[0])
            return np.asarray(observations), np.asarray(actions), success
        finally:
            env.close()

    # -- one LLM update ---------------------------------------------------------------------------
    def evolve(self) -> None:
        cfg, run, buffer = self.cfg, self.run, self.buffer
        assert buffer is not None
        self.generation += 1
        g = self.generation
        pop = self.pop
        fitness = [self._evaluate(m) if m.fn is not None else float("-inf") for m in pop]
        sizes = [complexity(m.program.source) if m.program else 0 for m in pop]
        scores = selection_scores(fitness, sizes, cfg.complexity_penalty)
        alive = [i for i, m in enumerate(pop) if m.fn is not None]
        picked = select_elites([scores[i] for i in alive], cfg.elites, cfg.selection, cfg.tournament_size, random.Random(self.seed + g))
        elites = [alive[i] for i in picked]  # a failed function is never an elite
        best = max(alive or range(len(scores)), key=lambda i: scores[i])
        bm = pop[best]
        losers = [i for i in range(len(pop)) if i not in elites]
        behaviour = analysis = ""
        msgs: list[dict[str, str]] = []
        if losers and alive:
            behaviour = describe_behaviour(self.task, *self._rollout(bm))
            analysis = run.llm.chat([{"role": "user", "content": ANALYSE.format(goal=self.task.goal, behaviour=behaviour)}],
                                    n=1, temperature=cfg.temperature, max_tokens=cfg.analysis_tokens,
                                    seed=run.seed * 1000 + 500 + g, tag=f"{NAME}-analysis-g{g}")[0].text
            feedback = member_feedback([p.fitness for p in bm.result.curve], {k: [v for _, v in s] for k, s in bm.result.components.items()},
                                       self.task.fitness_name)
            msgs = evolve_messages(base_messages(run, self.plugin.cases_for(run), self.plugin.shapes), bm.program.source if bm.program else "", feedback, analysis)
        elif losers:  # nothing runs: the error is the feedback (as in Eureka)
            analysis = "(no working reward function: no behaviour analysis)"
            msgs = base_messages(run, self.plugin.cases_for(run), self.plugin.shapes) + [
                {"role": "assistant", "content": bm.program.reply if bm.program else ""},
                {"role": "user", "content": FAILURE.format(kind=bm.error_kind, error=bm.error.strip()[-1500:], fields=_fields(self.task))},
            ]
        replies = run.llm.chat(msgs, n=len(losers), max_tokens=cfg.max_tokens, seed=run.seed * 1000 + 600 + g,
                               tag=f"{NAME}-evolve-g{g}", **code_options(run, len(losers), cfg.temperature)) if losers else []
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs) if losers else ""
        programs, errors = programs_from(replies, prompt, g, self.task.field_names())
        target = apply_scale(buffer.raw[: buffer.size, best], bm.scale) if alive else buffer.env_reward[: buffer.size]
        replaced = [j for j in losers if self._replace(pop[j], programs, errors, g, target, scores[j], bm if alive else None)]
        columns = [apply_scale(buffer.raw[: buffer.size, j], m.scale) for j, m in enumerate(pop) if m.fn is not None]
        div = diversity(torch.stack(columns, 1)) if columns else 0.0
        self.diversity.append((self.frames, div))
        run.log_metrics({"lares/diversity": div, "lares/best_fitness": fitness[best], "lares/replaced": len(replaced)}, step=self.frames)
        self.plugin.log.append(
            f"## generation {g} at {self.frames} frames\n\n- fitness: {[round(f, 3) for f in fitness]}; complexity: {sizes}; "
            f"elites: {elites}; best: {best}; replaced: {replaced}; diversity: {div:.3f}"
            + (f"\n- errors: {errors[:3]}" if errors else "")
            + (f"\n\n### behaviour of the best agent\n{behaviour}\n\n### analysis\n{analysis.strip()}\n" if losers else "\n")
        )

    def _replace(self, m: Member, programs: list[RewardProgram], errors: list[str], g: int, target: torch.Tensor,
                 old_score: float, elite: Member | None) -> bool:
        """Give ``m`` the first of ``programs`` that passes the sandbox and relabels the buffer."""
        assert self.buffer is not None
        j = self.pop.index(m)
        while programs:
            program = programs.pop(0)
            fn, error, kind = self._prepare(program)
            if fn is None:
                errors.append(f"{kind}: {error[:200]}")
                continue
            reward = m.candidate.reward

            def column(state: dict, action: torch.Tensor, next_state: dict, env_reward: torch.Tensor) -> torch.Tensor:
                return program_value(fn, reward, state, action, next_state, env_reward)[0]

            try:
                self.buffer.relabel(j, column, self.task)
            except Exception as e:  # noqa: BLE001 - fails on the stored data: try the next one
                errors.append(f"relabel: {str(getattr(getattr(e, 'report', None), 'message', e))[:200]}")
                continue
            m.program, m.fn, m.generation, m.error, m.error_kind = program, fn, g, "", ""
            m.ctx.candidate = replace(m.candidate, reward=program)  # hooks see the slot's current reward
            raw = self.buffer.raw[: self.buffer.size, j]
            m.scale = (1.0, 0.0, "affine") if self.cfg.rescale == "none" else rescale(raw, float(target.mean()), float(target.std()), self.cfg.rescale)
            note = ""
            if elite is not None and elite is not m:
                if elite.extra_dim == m.extra_dim:
                    inherit(m.sac, elite.sac)
                    m.outcomes = deque(elite.outcomes, maxlen=20)
                else:
                    note = "; keeps its own weights (its observation differs from the elite's)"
            m.history.append(f"generation {g}: replaced (the old one scored {old_score:.3g}){note}")
            return True
        return False

    # -- results ----------------------------------------------------------------------------------
    def _finish(self, m: Member, seconds: float, failure: tuple[str, str] | None) -> TrainResult:
        """The member's result, ``on_train_end``, and what hooks logged through its context."""
        from core.train.common import error_of, save_policy, wants_saved_policy

        result = m.result
        result.ok = m.fn is not None and failure is None
        result.frames, result.seconds = m.frames, seconds
        result.error, result.error_kind = failure or ((m.error, m.error_kind) if not result.ok else ("", ""))
        if result.curve:
            result.fitness = Fitness(self.task.fitness_name, result.curve[-1].fitness)
        result.metrics.update(m.stats)
        if m.env is not None:
            result.metrics.update(m.env.program_metrics)
        if m.returns:
            result.metrics["charts/episodic_return"] = float(np.mean(m.returns[-20:]))
        result.metrics.update({"lares/generation": float(m.generation), "lares/frames_acted": float(m.frames),
                               "lares/diversity": self.diversity[-1][1] if self.diversity else 0.0})
        result.series["lares/diversity"] = list(self.diversity)
        result.texts["lares_history.md"] = "\n".join(m.history)
        if m.program is not None:
            result.texts["lares_final_reward.py"] = m.program.source
        if result.ok and m.sac is not None and wants_saved_policy(m.ctx):
            result.policy_path = save_policy({"algorithm": "sac", "obs_dim": m.env.obs_dim, "hidden": list(self.sac_cfg.hidden),
                                              "actor": m.sac.actor.state_dict(), "qvalue": m.sac.loss.qvalue_network_params.to_dict()},
                                             m.candidate.id)
        if self.hook is not None:
            try:
                self.hook.on_train_end(train=m.ctx, result=result)
            except Exception as exc:  # noqa: BLE001
                result.ok = False
                result.error, result.error_kind = error_of(exc)
        for key, points in m.ctx.metrics.items():  # what plugins recorded through the context travels with the result
            result.series.setdefault(key, []).extend(points)
        result.texts.update(m.ctx.texts)
        return result


# -- hooks ----------------------------------------------------------------------------------------


class Plugin:
    """One LaRes run: the case base, the log of every LLM update, the best reward found."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.cases: list[dict[str, Any]] = []
        self.case_path: Path | None = None
        self.best_source = ""
        self.best_score = float("-inf")
        self.log: list[str] = []  # what happened at each LLM update
        self.shapes: Shapes | None = None  # what the reward code receives, read off a real batch once per run

    def cases_for(self, run: Any) -> list[dict[str, Any]]:
        return retrieve(self.cases, run.task.goal, self.cfg.retrieve_k) if self.cfg.retrieval else []

    @hookimpl
    def on_run_start(self, run) -> None:
        sac_settings(run, self.cfg.frames)  # trainer=sac, checked before any work
        cache = Path(run.settings.run.cache_dir or ".")
        self.case_path = Path(self.cfg.case_base) if self.cfg.case_base else cache / "lares_cases.json"
        self.cases = load_cases(self.case_path)

    @hookimpl
    def propose_rewards(self, run, iteration: int) -> list[RewardProgram] | None:
        """The initial population (iteration 0); later generations are born inside training."""
        cfg = self.cfg
        self.shapes = self.shapes or batch_shapes(run.task, run.seed)
        msgs = base_messages(run, self.cases_for(run), self.shapes)
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        tag = f"{NAME}-init-it{iteration}"
        replies = run.llm.chat(msgs, n=cfg.population, max_tokens=cfg.max_tokens, seed=run.seed * 1000 + iteration, tag=tag,
                               **code_options(run, cfg.population, cfg.init_temperature))
        # every reply is proposed: a rejected one is recorded by the loop, never joins the population
        programs = every_program(replies, prompt, 0, tag, run.task.field_names())
        errors = [p.rejected for p in programs if p.rejected]
        self.log.append(f"initial population: {len(programs) - len(errors)}/{len(replies)} replies held a reward function"
                        + (f"; first error: {' '.join(errors[0].split())}" if errors else ""))
        return programs

    @hookimpl
    def train_candidates(self, run, candidates: list[Candidate], seed: int) -> list[TrainResult | None] | None:
        """Train the candidates whose reward LaRes proposed as one population.

        Others get None (the executor trains them); a LaRes candidate with a part the
        population cannot honour gets a failed ``unsupported`` result naming it.
        """
        mine = [i for i, c in enumerate(candidates) if is_mine(c)]
        if not mine:
            return None
        results: list[TrainResult | None] = [None] * len(candidates)
        space = action_space(run.task, seed)
        population = []
        for i in mine:
            reason = unsupported(candidates[i], run.task, space)
            if reason:
                results[i] = TrainResult(candidate_id=candidates[i].id, ok=False, error=reason, error_kind="unsupported")
            else:
                population.append(i)
        if population:
            trained = Evolution(run, [candidates[i] for i in population], seed, self.cfg, self).train_all()
            for i, result in zip(population, trained):
                results[i] = result
        return results

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        mine = [(c, r) for c, r in zip(result.candidates, result.results) if is_mine(c)]
        if not mine:
            return None
        cfg = self.cfg
        population = sum(not c.rejected for c, _ in mine)
        lines = [f"### Iteration {result.iteration}: population of {population} ({reply_counts(mine)})", ""]
        lines += [candidate_line(c, r, c.reward) for c, r in mine]
        ok = [(c, r) for c, r in mine if r.ok]
        if ok:
            best_c, best_r = max(ok, key=lambda cr: cr[1].score)
            source = best_r.texts.get("lares_final_reward.py", best_c.reward.source)  # type: ignore[union-attr]
            if best_r.score > self.best_score:
                self.best_score, self.best_source = best_r.score, source
            if cfg.retrieval and best_r.score >= cfg.case_min_fitness and self.case_path is not None:
                self.cases = [c for c in self.cases if not (c["task"] == run.task.name and c["code"] == source)]
                self.cases.append({"task": run.task.name, "goal": run.task.goal, "code": source, "fitness": best_r.score})
                self.case_path.parent.mkdir(parents=True, exist_ok=True)
                self.case_path.write_text(json.dumps(self.cases, indent=1))
                lines.append(f"- added the best reward to the case base ({len(self.cases)} cases)")
            lines += ["", f"### `{best_c.id}`, the best of this iteration", "",
                      "Its reward function at the end of training (after the population's evolution):", "",
                      fence(source, "python")]
        return "\n".join(lines + ["", *self.log])

    @hookimpl
    def on_run_end(self, run, best: tuple[Candidate, TrainResult] | None) -> None:
        if self.best_source:
            run.log_text(f"{NAME}/best_reward.py", self.best_source)
        run.log_text(f"{NAME}/evolution.md", "\n".join(self.log))
