"""lares: evolutionary RL over a population of LLM reward functions (LaRes, NeurIPS 2025).

Method ("LaRes: Evolutionary Reinforcement Learning with LLM-based Adaptive Reward
Search"):

1. A population of reward functions written by the LLM (``population``, default 5), each
   with its own off-policy (SAC) agent. One shared replay buffer stores, for every
   transition, the value of every reward function, so a new function relabels all past
   data and every agent learns from everything any agent collected.
2. Thompson sampling over the agents' recent success decides which agent acts in each
   environment for its next episode.
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

The joint training runs in :func:`train_candidates` (:class:`Evolution`); each member is
a core SAC agent (:mod:`core.train.sac`: ``make_sac_modules`` + ``sac_update``, settings
from ``trainer=sac``) learning from the :class:`SharedBuffer`. Config: ``conf/plugins/lares.yaml``.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core import hookimpl
from core.codegen import extract_function
from core.errors import UserError
from core.prompting import reward_interface, sample_evenly, summarize_series
from core.records import Candidate, Fitness, IterationResult, RewardProgram, TrainResult

NAME = "lares"
ENTRY = "compute_reward"
ARGS = ["state", "action", "next_state"]

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
    return ", ".join(f'"{f.name}"' for f in task.state_fields)


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


def base_messages(run: Any, cases: list[dict[str, Any]]) -> list[dict[str, str]]:
    allowed = list(run.config.sandbox.allowed_imports)
    user = TASK.format(description=run.task.description, interface=reward_interface(run.task, allowed), goal=run.task.goal)
    if cases:
        shown = "\n\n".join(f"Goal: {c['goal']}\n```python\n{c['code'].strip()}\n```" for c in cases)
        user = EXAMPLES.format(examples=shown) + "\n\n" + user
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def evolve_messages(base: list[dict[str, str]], code: str, feedback: str, analysis: str) -> list[dict[str, str]]:
    return base + [{"role": "user", "content": EVOLVE.format(code=code.strip(), feedback=feedback, analysis=analysis.strip())}]


def programs_from(replies: list[Any], prompt: str, generation: int) -> tuple[list[RewardProgram], list[str]]:
    programs, errors = [], []
    for i, reply in enumerate(replies):
        found = extract_function(reply.text, ENTRY, ARGS)
        if found.ok:
            programs.append(RewardProgram(source=found.source, entry=ENTRY, origin=NAME, prompt=prompt, reply=reply.text,
                                          meta={"sample": i, "generation": generation}))
        else:
            errors.append(found.error)
    return programs, errors


# -- state ----------------------------------------------------------------------------------------


@dataclass
class LaResState:
    cases: list[dict[str, Any]] = field(default_factory=list)
    case_path: Path | None = None
    best_source: str = ""
    best_score: float = float("-inf")
    log: list[str] = field(default_factory=list)  # what happened at each LLM update


STATE = LaResState()


def _cases_for(run: Any) -> list[dict[str, Any]]:
    cfg = run.plugin_config(NAME)
    if not cfg.retrieval:
        return []
    return retrieve(STATE.cases, run.task.goal, int(cfg.retrieve_k))


# -- shared buffer -------------------------------------------------------------------------------------


class SharedBuffer:
    """One replay buffer for the population: transitions plus every reward function's value.

    ``raw[:, j]`` is reward function ``j``'s unscaled value of each transition; the
    reward agent ``j`` trains on is ``apply_scale(raw[:, j], scales[j])``. This buffer is
    the method (a new function relabels every stored transition), so it is LaRes's own
    rather than the core SAC's single-reward replay buffer.
    """

    def __init__(self, capacity: int, obs_dim: int, act_dim: int, members: int) -> None:
        self.capacity, self.size, self.ptr = capacity, 0, 0
        self.obs = torch.zeros(capacity, obs_dim)
        self.next_obs = torch.zeros(capacity, obs_dim)
        self.action = torch.zeros(capacity, act_dim)
        self.term = torch.zeros(capacity, dtype=torch.bool)
        self.env_reward = torch.zeros(capacity)
        self.raw = torch.zeros(capacity, members)

    def add(self, obs: torch.Tensor, action: torch.Tensor, next_obs: torch.Tensor, term: torch.Tensor,
            env_reward: torch.Tensor, raw: torch.Tensor) -> None:
        """Append one vector step (``B`` transitions), overwriting the oldest when full."""
        rows = (self.ptr + torch.arange(obs.shape[0])) % self.capacity
        self.obs[rows], self.action[rows], self.next_obs[rows] = obs, action.reshape(len(rows), -1), next_obs
        self.term[rows], self.env_reward[rows], self.raw[rows] = term.bool(), env_reward, raw
        self.ptr = int(rows[-1] + 1) % self.capacity
        self.size = min(self.size + obs.shape[0], self.capacity)

    def relabel(self, j: int, fn: Any, task: Any, chunk: int = 4096) -> None:
        """Recompute column ``j`` over every stored transition with reward function ``fn``."""
        for lo in range(0, self.size, chunk):
            hi = min(self.size, lo + chunk)
            reward, _ = fn(task.split_state(self.obs[lo:hi]), self.action[lo:hi], task.split_state(self.next_obs[lo:hi]))
            self.raw[lo:hi, j] = reward

    def sample(self, batch_size: int, column: int, scale: tuple[float, float, str], generator: torch.Generator | None = None) -> Any:
        """A uniform minibatch in the keys ``SACLoss`` reads, rewarded by member ``column``."""
        from tensordict import TensorDict

        idx = torch.randint(0, self.size, (batch_size,), generator=generator)
        term = self.term[idx].unsqueeze(-1)
        reward = apply_scale(self.raw[idx, column], scale).unsqueeze(-1)
        # a truncated episode stores its real final observation and is not terminal, so
        # the target bootstraps through it; done = terminated is then exact
        nxt = {"observation": self.next_obs[idx], "reward": reward, "done": term, "terminated": term}
        return TensorDict({"observation": self.obs[idx], "action": self.action[idx], "next": nxt}, batch_size=[batch_size])


# -- SAC agents (the core's) ----------------------------------------------------------------------------


def sac_settings(run: Any, frames: int | None = None) -> Any:
    """The agents' :class:`core.train.sac.SACConfig`: the run's ``trainer`` (must be SAC).

    ``frames`` (the population's budget) replaces ``trainer.frames`` when given.
    """
    from dataclasses import replace

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


def explore(modules: Any, obs: torch.Tensor) -> torch.Tensor:
    """A sampled (exploring) action of a core SAC agent for a batch of observations."""
    from tensordict import TensorDict
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        return modules.actor(TensorDict({"observation": obs}, batch_size=obs.shape[:1])).get("action")


def inherit(dst: Any, src: Any) -> None:
    """Copy an agent's actor, critics, targets, temperature and optimiser state into another."""
    dst.loss.load_state_dict(src.loss.state_dict())
    for mine, theirs in zip(dst.optimizers, src.optimizers):
        mine.load_state_dict(theirs.state_dict())


# -- the evolutionary loop -------------------------------------------------------------------------


@dataclass
class Member:
    """One slot of the population: its reward function, scale, SAC agent and record."""

    program: RewardProgram | None
    fn: Any  # sandbox RewardFunction, or None (then the env's reward stands in)
    sac: Any  # core.train.sac.SACModules
    result: TrainResult  # curve, components and episodes, filled as it trains
    scale: tuple[float, float, str] = (1.0, 0.0, "affine")
    error: str = ""
    error_kind: str = ""
    frames: int = 0
    generation: int = 0
    outcomes: deque = field(default_factory=lambda: deque(maxlen=20))
    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    owed: float = 0.0  # gradient steps due (updates_per_frame x frames collected)
    history: list[str] = field(default_factory=list)


class Evolution:
    """Trains a LaRes population jointly and evolves its reward functions with the LLM."""

    def __init__(self, run: Any, candidates: list[Candidate], seed: int, cfg: Any, state: LaResState) -> None:
        self.run, self.task, self.candidates, self.seed, self.cfg, self.state = run, run.task, candidates, seed, cfg, state
        self.sac_cfg = sac_settings(run, cfg.frames)
        self.frames_budget = int(self.sac_cfg.frames)
        self.rng = np.random.default_rng(seed)
        self.generation = 0
        self.diversity: list[tuple[int, float]] = []
        self.frames = 0

    # -- setup --------------------------------------------------------------------------------
    def _prepare(self, program: RewardProgram) -> tuple[Any, str, str]:
        from core.sandbox import SandboxError, prepare_reward, settings_from_config

        limits, imports = settings_from_config(self.run.config.sandbox)
        try:
            return prepare_reward(program, self.task, limits=limits, allowed_imports=imports), "", ""
        except SandboxError as e:
            return None, e.report.message, e.report.kind

    def _repair(self, m: Member) -> None:
        """Send a failing function's error back to the LLM until it passes (``retries`` times)."""
        for attempt in range(int(self.cfg.retries)):
            if m.fn is not None or m.program is None:
                return
            msgs = base_messages(self.run, []) + [
                {"role": "assistant", "content": m.program.reply or f"```python\n{m.program.source}\n```"},
                {"role": "user", "content": FAILURE.format(kind=m.error_kind, error=m.error.strip()[-1500:], fields=_fields(self.task))},
            ]
            replies = self.run.llm.chat(msgs, n=1, temperature=float(self.cfg.temperature), max_tokens=int(self.cfg.max_tokens),
                                        seed=self.run.seed * 1000 + 300 + 10 * int(m.program.meta.get("sample", 0)) + attempt,
                                        tag=f"{NAME}-repair")
            programs, errors = programs_from(replies, "\n\n".join(x["content"] for x in msgs), m.generation)
            if not programs:
                m.error = errors[0] if errors else m.error
                continue
            fn, error, kind = self._prepare(programs[0])
            m.program, m.fn, m.error, m.error_kind = programs[0], fn, error, kind
            m.history.append(f"generation {m.generation}: repair {attempt + 1} {'ok' if fn else f'failed ({kind})'}")

    def _column(self, member: Member, state: dict, action: torch.Tensor, next_state: dict, env_reward: torch.Tensor) -> torch.Tensor:
        if member.fn is None:
            return env_reward
        try:
            reward, components = member.fn(state, action, next_state)
        except Exception as e:  # noqa: BLE001 - a function failing mid-training drops out
            report = getattr(e, "report", None)
            member.fn, member.error, member.error_kind = None, getattr(report, "message", str(e)), getattr(report, "kind", type(e).__name__)
            member.history.append(f"generation {member.generation}: failed during training ({member.error_kind})")
            return env_reward
        for name, value in components.items():
            member.sums[name] = member.sums.get(name, 0.0) + float(value.float().mean())
        member.steps += 1
        return reward

    # -- the loop -----------------------------------------------------------------------------------
    def train_all(self) -> list[TrainResult]:
        import gymnasium as gym
        from torchrl.data import Bounded

        from core.train.sac import make_sac_modules

        cfg, task, sac = self.cfg, self.task, self.sac_cfg
        torch.set_num_threads(int(sac.threads))
        torch.manual_seed(self.seed)
        start = time.perf_counter()
        env = task.make_env(int(sac.num_envs), self.seed)
        if not isinstance(env.single_action_space, gym.spaces.Box):
            env.close()
            raise UserError(f"lares trains SAC, which needs a continuous action space; '{task.name}' has {env.single_action_space}.")
        space = env.single_action_space
        spec = Bounded(low=torch.as_tensor(space.low, dtype=torch.float32), high=torch.as_tensor(space.high, dtype=torch.float32),
                       shape=space.shape, dtype=torch.float32)
        obs_dim = int(np.prod(env.single_observation_space.shape))
        self.members = []
        for c in self.candidates:
            fn, error, kind = self._prepare(c.reward)  # type: ignore[arg-type]
            m = Member(c.reward, fn, make_sac_modules(obs_dim, spec, sac), TrainResult(candidate_id=c.id, ok=False),
                       error=error, error_kind=kind)
            m.history.append(f"generation 0: {'ok' if fn else f'failed ({kind}): {error[:200]}'}")
            if fn is None:
                self._repair(m)
            self.members.append(m)
        self.buffer = SharedBuffer(int(sac.buffer_size), obs_dim, int(np.prod(space.shape)), len(self.members))
        try:
            self._train(env)
        finally:
            env.close()
        for m in self.members:
            self._evaluate(m)
        seconds = time.perf_counter() - start
        return [self._result(c, m, seconds) for c, m in zip(self.candidates, self.members)]

    def _train(self, env: Any) -> None:
        from core.train.evaluate import _env_info  # env i's entries of a vector info (nested dicts, masks)
        from core.train.sac import sac_update

        cfg, task, sac = self.cfg, self.task, self.sac_cfg
        obs_np, _ = env.reset(seed=self.seed)
        obs = torch.as_tensor(np.asarray(obs_np), dtype=torch.float32)
        num_envs = obs.shape[0]
        acting = [thompson_pick([m.outcomes for m in self.members], self.rng) for _ in range(num_envs)]
        returns = np.zeros(num_envs)
        recent: deque = deque(maxlen=50)
        next_llm = int(cfg.llm_freq)
        warmup = int(sac.init_random_frames)
        while self.frames < self.frames_budget:
            if self.frames < warmup:
                action = torch.as_tensor(np.stack([env.single_action_space.sample() for _ in range(num_envs)]), dtype=torch.float32)
            else:
                action = torch.zeros(num_envs, *env.single_action_space.shape)
                for i in set(acting):
                    rows = [e for e in range(num_envs) if acting[e] == i]
                    action[rows] = explore(self.members[i].sac, obs[rows])
            next_np, env_r, term, trunc, info = env.step(action.numpy())
            real_next = np.array(next_np, copy=True)
            done = np.logical_or(term, trunc)
            for e in np.flatnonzero(done):
                real_next[e] = info["final_obs"][e]
            next_obs = torch.as_tensor(real_next, dtype=torch.float32)
            env_reward = torch.as_tensor(env_r, dtype=torch.float32)
            state, next_state = task.split_state(obs), task.split_state(next_obs)
            raw = torch.stack([self._column(m, state, action, next_state, env_reward) for m in self.members], dim=1)
            self.buffer.add(obs, action, next_obs, torch.as_tensor(term), env_reward, raw)
            returns += env_r
            for e in range(num_envs):
                self.members[acting[e]].frames += 1
            for e in np.flatnonzero(done):
                final = _env_info(info.get("final_info") or {}, int(e))
                success, _ = task.episode_info(final)
                recent.append(returns[e])
                outcome = float(success) if success is not None else float(returns[e] >= np.median(recent))
                self.members[acting[e]].outcomes.append(outcome)
                returns[e] = 0.0
                acting[e] = thompson_pick([m.outcomes for m in self.members], self.rng)
            obs = torch.as_tensor(np.asarray(next_np), dtype=torch.float32)
            self.frames += num_envs
            if self.buffer.size >= int(sac.batch_size) and self.frames >= warmup:
                for j, m in enumerate(self.members):  # every agent learns from every transition
                    m.owed += num_envs * float(sac.updates_per_frame)
                    while m.owed >= 1.0:
                        losses = sac_update(m.sac, self.buffer.sample(int(sac.batch_size), j, m.scale))
                        m.owed -= 1.0
                        m.result.metrics.update({f"losses/{k}": float(v) for k, v in losses.items()})
            if self.frames >= next_llm and self.frames < self.frames_budget:
                self.evolve()
                next_llm += int(cfg.llm_freq)

    # -- evaluation -------------------------------------------------------------------------------
    def _evaluate(self, m: Member) -> float:
        from core.train.evaluate import evaluate_and_record
        from core.train.sac import act_deterministic

        for name, total in m.sums.items():  # component means since the last evaluation
            m.result.components.setdefault(name, []).append((self.frames, total / max(1, m.steps)))
        m.sums, m.steps = {}, 0
        episodes = evaluate_and_record(self.task, lambda o: act_deterministic(m.sac, o), max(1, int(self.sac_cfg.eval_episodes)),
                                       seed=self.seed + 10_000, frames=self.frames, result=m.result)
        m.result.episodes = episodes
        return m.result.curve[-1].fitness

    def _rollout(self, m: Member) -> tuple[np.ndarray, np.ndarray, bool | None]:
        from core.train.evaluate import _env_info
        from core.train.sac import act_deterministic

        env = self.task.make_env(1, self.seed + 20_000 + self.generation)
        try:
            obs, _ = env.reset(seed=self.seed + 20_000 + self.generation)
            observations, actions, success = [obs[0]], [], None
            for _ in range(self.task.max_episode_steps):
                a = act_deterministic(m.sac, torch.as_tensor(np.asarray(obs), dtype=torch.float32))
                obs, _, term, trunc, info = env.step(a.numpy())
                actions.append(a.numpy()[0])
                if term[0] or trunc[0]:
                    observations.append(info["final_obs"][0])
                    final = _env_info(info.get("final_info") or {}, 0)
                    success, _ = self.task.episode_info(final)
                    break
                observations.append(obs[0])
            return np.asarray(observations), np.asarray(actions), success
        finally:
            env.close()

    # -- one LLM update ---------------------------------------------------------------------------
    def evolve(self) -> None:
        cfg, run = self.cfg, self.run
        self.generation += 1
        g = self.generation
        fitness = [self._evaluate(m) if m.fn is not None else float("-inf") for m in self.members]
        sizes = [complexity(m.program.source) if m.program else 0 for m in self.members]
        scores = selection_scores(fitness, sizes, float(cfg.complexity_penalty))
        alive = [i for i, m in enumerate(self.members) if m.fn is not None]
        picked = select_elites([scores[i] for i in alive], int(cfg.elites), str(cfg.selection), int(cfg.tournament_size), random.Random(self.seed + g))
        elites = [alive[i] for i in picked]  # a failed function is never an elite
        best = max(alive or range(len(scores)), key=lambda i: scores[i])
        bm = self.members[best]
        behaviour = describe_behaviour(self.task, *self._rollout(bm))
        if alive:
            analysis = run.llm.chat([{"role": "user", "content": ANALYSE.format(goal=self.task.goal, behaviour=behaviour)}],
                                    n=1, temperature=float(cfg.temperature), max_tokens=int(cfg.analysis_tokens),
                                    seed=run.seed * 1000 + 500 + g, tag=f"{NAME}-analysis-g{g}")[0].text
            feedback = member_feedback([p.fitness for p in bm.result.curve], {k: [v for _, v in s] for k, s in bm.result.components.items()},
                                       self.task.fitness_name)
            msgs = evolve_messages(base_messages(run, _cases_for(run)), bm.program.source if bm.program else "", feedback, analysis)
        else:  # nothing runs: the error is the feedback (as in Eureka)
            analysis = "(no working reward function: no behaviour analysis)"
            msgs = base_messages(run, _cases_for(run)) + [
                {"role": "assistant", "content": bm.program.reply if bm.program else ""},
                {"role": "user", "content": FAILURE.format(kind=bm.error_kind, error=bm.error.strip()[-1500:], fields=_fields(self.task))},
            ]
        losers = [i for i in range(len(self.members)) if i not in elites]
        replies = run.llm.chat(msgs, n=max(1, len(losers)), temperature=float(cfg.temperature), max_tokens=int(cfg.max_tokens),
                               seed=run.seed * 1000 + 600 + g, tag=f"{NAME}-evolve-g{g}") if losers else []
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        programs, errors = programs_from(replies, prompt, g)
        target = apply_scale(self.buffer.raw[: self.buffer.size, best], bm.scale) if alive else self.buffer.env_reward[: self.buffer.size]
        replaced = []
        for j in losers:
            while programs:
                program = programs.pop(0)
                fn, error, kind = self._prepare(program)
                if fn is None:
                    errors.append(f"{kind}: {error[:200]}")
                    continue
                m = self.members[j]
                m.program, m.fn, m.generation, m.error, m.error_kind = program, fn, g, "", ""
                self.buffer.relabel(j, fn, self.task)
                mode = str(cfg.rescale)
                m.scale = (1.0, 0.0, "affine") if mode == "none" else rescale(self.buffer.raw[: self.buffer.size, j], float(target.mean()), float(target.std()), mode)
                if alive and j != best:
                    inherit(m.sac, bm.sac)
                    m.outcomes = deque(bm.outcomes, maxlen=20)
                m.history.append(f"generation {g}: replaced (the old one scored {scores[j]:.3g})")
                replaced.append(j)
                break
        scaled = torch.stack([apply_scale(self.buffer.raw[: self.buffer.size, j], m.scale) for j, m in enumerate(self.members)], 1)
        div = diversity(scaled)
        self.diversity.append((self.frames, div))
        run.log_metrics({"lares/diversity": div, "lares/best_fitness": fitness[best], "lares/replaced": len(replaced)}, step=self.frames)
        self.state.log.append(
            f"## generation {g} at {self.frames} frames\nfitness: {[round(f, 3) for f in fitness]}; complexity: {sizes}; "
            f"elites: {elites}; best: {best}; replaced: {replaced}; diversity: {div:.3f}"
            + (f"\nerrors: {errors[:3]}" if errors else "")
            + f"\n\n### behaviour of the best agent\n{behaviour}\n\n### analysis\n{analysis.strip()}\n"
        )

    def _result(self, candidate: Candidate, m: Member, seconds: float) -> TrainResult:
        from core.train.common import save_policy

        result = m.result
        result.ok, result.frames, result.seconds, result.error, result.error_kind = m.fn is not None, m.frames, seconds, m.error, m.error_kind
        if result.curve:
            result.fitness = Fitness(self.task.fitness_name, result.curve[-1].fitness)
        result.metrics.update({"lares/generation": float(m.generation), "lares/frames_acted": float(m.frames),
                               "lares/diversity": self.diversity[-1][1] if self.diversity else 0.0})
        result.series = {"lares/diversity": list(self.diversity)}
        result.texts = {"lares_history.md": "\n".join(m.history)}
        if m.program is not None:
            result.texts["lares_final_reward.py"] = m.program.source
        if self.run.config.get("save_policy", False):
            result.policy_path = save_policy({"algorithm": "sac", "obs_dim": int(self.buffer.obs.shape[1]), "hidden": list(self.sac_cfg.hidden),
                                              "actor": m.sac.actor.state_dict(), "qvalue": m.sac.loss.qvalue_network_params.to_dict()},
                                             candidate.id)
        return result


# -- hooks ----------------------------------------------------------------------------------------


@hookimpl
def on_run_start(run) -> None:
    global STATE
    cfg = run.plugin_config(NAME)
    path = Path(str(cfg.case_base)) if cfg.get("case_base") else Path(str(run.config.get("cache_dir", "."))) / "lares_cases.json"
    STATE = LaResState(cases=load_cases(path), case_path=path)


@hookimpl
def propose_rewards(run, iteration: int) -> list[RewardProgram] | None:
    """The initial population (iteration 0); later generations are born inside training."""
    cfg = run.plugin_config(NAME)
    if iteration >= int(cfg.iterations):
        return None
    msgs = base_messages(run, _cases_for(run))
    prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
    replies = run.llm.chat(msgs, n=int(cfg.population), temperature=float(cfg.init_temperature), max_tokens=int(cfg.max_tokens),
                           seed=run.seed * 1000 + iteration, tag=f"{NAME}-init-it{iteration}")
    programs, errors = programs_from(replies, prompt, 0)
    STATE.log.append(f"initial population: {len(programs)}/{len(replies)} replies held a reward function" +
                     (f"; first error: {errors[0]}" if errors else ""))
    return programs


@hookimpl
def train_candidates(run, candidates: list[Candidate], seed: int) -> list[TrainResult] | None:
    mine = [c for c in candidates if c.reward is not None and c.reward.origin == NAME]
    if not mine or len(mine) != len(candidates):
        return None  # not a LaRes population (or mixed with other roles): the executor trains
    return Evolution(run, candidates, seed, run.plugin_config(NAME), STATE).train_all()


@hookimpl
def reflect(run, result: IterationResult) -> str | None:
    mine = [(c, r) for c, r in zip(result.candidates, result.results) if c.reward is not None and c.reward.origin == NAME]
    if not mine:
        return None
    cfg = run.plugin_config(NAME)
    lines = [f"iteration {result.iteration}: population of {len(mine)}"]
    for c, r in mine:
        lines.append(f"- {c.id}: {r.fitness.value:.4g}" if r.ok and r.fitness else f"- {c.id}: failed ({r.error_kind})")
    ok = [(c, r) for c, r in mine if r.ok]
    if ok:
        best_c, best_r = max(ok, key=lambda cr: cr[1].score)
        source = best_r.texts.get("lares_final_reward.py", best_c.reward.source)  # type: ignore[union-attr]
        if best_r.score > STATE.best_score:
            STATE.best_score, STATE.best_source = best_r.score, source
        if cfg.retrieval and best_r.score >= float(cfg.case_min_fitness) and STATE.case_path is not None:
            STATE.cases = [c for c in STATE.cases if not (c["task"] == run.task.name and c["code"] == source)]
            STATE.cases.append({"task": run.task.name, "goal": run.task.goal, "code": source, "fitness": best_r.score})
            STATE.case_path.parent.mkdir(parents=True, exist_ok=True)
            STATE.case_path.write_text(json.dumps(STATE.cases, indent=1))
            lines.append(f"added the best reward to the case base ({len(STATE.cases)} cases)")
    return "\n".join(lines + ["", *STATE.log])


@hookimpl
def on_run_end(run, best: tuple[Candidate, TrainResult] | None) -> None:
    if STATE.best_source:
        run.log_text(f"{NAME}/best_reward.py", STATE.best_source)
    run.log_text(f"{NAME}/evolution.md", "\n".join(STATE.log))
