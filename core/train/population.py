"""Population training: off-policy agents, one per candidate, learning from one shared replay.

The seam for population methods (LaRes): a plugin's ``train_candidates`` hands its
candidates to a :class:`Population` and keeps only its method, which member acts and
when a member's reward is rewritten; the core trains each member as it trains any
candidate. Each member has

- its own env, :class:`core.train.common.CandidateEnv`: the task's vector env with the
  candidate's env configs, its state program, the ``compute_reward`` /
  ``represent_state`` hooks, and the member's *current* reward function (the method
  swaps it during training: :meth:`Population.adopt`);
- its own :class:`core.context.TrainContext`, which receives ``on_train_start``,
  ``on_rollout``, ``on_evaluation`` and ``on_train_end``;
- a core SAC agent (:mod:`core.train.sac`: ``make_sac_modules``, ``sac_update``; the
  settings are ``trainer=sac``'s) that learns from every transition any member collected.

The replay is shared (:class:`SharedReplay`): each transition holds every member's
reward, so a new function relabels all past data. One method's loop, as LaRes's::

    def evolve(pop):                                # the body, run after the members are built
        for m in pop.live:
            m.use(program, prepare_reward(program, ...))
        while pop.frames < pop.budget:
            ended = pop.step(pop.live[pick()])          # one batch by one member; every agent learns
            if it_is_time:
                fitness = [pop.evaluate(m) for m in pop.live]
                pop.adopt(loser, new_program, new_fn)   # relabels the replay
                pop.inherit(loser, elite)               # the elite's weights

    results = Population(run, candidates, seed, name="lares").train(evolve)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from core.context import StepBatch, TrainContext
from core.envs.task import task_steps
from core.errors import UserError
from core.records import Candidate, Fitness, RewardProgram, TrainResult
from core.train.common import CandidateEnv, error_of, save_policy, wants_saved_policy
from core.train.evaluate import _env_info, evaluate_and_record
from core.train.rng import SeparateStream
from core.train.sac import SACConfig, act_deterministic, make_sac_modules, sac_update
from core.train.transforms import has_impls

#: what a member's reward passes through before its agent learns from it (identity when None)
Shaping = Callable[[torch.Tensor], torch.Tensor]


def population_settings(run: Any, frames: int | None = None, name: str = "population") -> SACConfig:
    """The agents' settings: the run's ``trainer``, which must be SAC.

    :param frames: the population's budget (all members together), in place of ``trainer.frames``.
    :param name: the method, for the message.
    :raises UserError: when the trainer is not SAC.
    """
    settings = run.settings
    if settings.trainer_name != "sac" or settings.trainer is None:
        raise UserError(
            f"{name} trains one SAC agent per reward function: run it with trainer=sac "
            f"(the trainer is {settings.trainer_name!r}); trainer.* sets the agents' hyperparameters."
        )
    cfg: SACConfig = settings.trainer
    return replace(cfg, frames=int(frames)) if frames else cfg


def program_value(
    fn: Any,
    program: RewardProgram | None,
    state: dict,
    action: torch.Tensor,
    next_state: dict,
    env_reward: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(reward [B], components)`` of a reward function under its candidate's ``mode``/``weight``."""
    out = fn(state, action, next_state)
    reward, components = out if isinstance(out, tuple) else (out, {})
    reward = torch.as_tensor(reward, dtype=torch.float32).reshape(-1)
    if program is not None and program.mode == "add":
        reward = env_reward.reshape(-1) + float(program.weight) * reward
    return reward, components or {}


# -- the shared replay --------------------------------------------------------------------------------


class SharedReplay:
    """One replay buffer for a population: transitions plus every member's reward and features.

    ``raw[:, j]`` is member ``j``'s reward program's value of each transition and
    ``hook[:, j]`` the ``compute_reward`` hooks' terms computed with member ``j``'s
    context when the transition was collected; member ``j`` learns from
    ``shaping(raw[:, j]) + hook[:, j]``. A member whose state program or
    ``represent_state`` hooks append features keeps them in ``extra[j]`` (for the
    observation and the next one), computed by its own transforms at collection time.
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

    def add(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        next_obs: torch.Tensor,
        term: torch.Tensor,
        env_reward: torch.Tensor,
        raw: torch.Tensor,
        hook: torch.Tensor | None = None,
        extra: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
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

    def sample(
        self, batch_size: int, column: int, shaping: Shaping | None = None, generator: torch.Generator | None = None
    ) -> Any:
        """A uniform minibatch in the keys ``SACLoss`` reads, rewarded and featured for member ``column``."""
        from tensordict import TensorDict

        idx = torch.randint(0, self.size, (batch_size,), generator=generator)
        obs, next_obs = self.obs[idx], self.next_obs[idx]
        if column in self.extra:
            feat, next_feat = self.extra[column]
            obs, next_obs = torch.cat([obs, feat[idx]], -1), torch.cat([next_obs, next_feat[idx]], -1)
        term = self.term[idx].unsqueeze(-1)
        raw = self.raw[idx, column]
        reward = ((shaping(raw) if shaping is not None else raw) + self.hook[idx, column]).unsqueeze(-1)
        # a truncated episode stores its real final observation and is not terminal, so
        # the target bootstraps through it; done = terminated is then exact
        nxt = {"observation": next_obs, "reward": reward, "done": term, "terminated": term}
        return TensorDict({"observation": obs, "action": self.action[idx], "next": nxt}, batch_size=[batch_size])


# -- one member -------------------------------------------------------------------------------------------


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
    """One slot of a population: its candidate, context, env, current reward function and agent.

    The method reads ``program``, ``fn``, ``error`` / ``error_kind``, ``frames``,
    ``generation``, ``history`` and ``result``, and sets ``shaping`` and ``generation``;
    the rest is the population's.
    """

    candidate: Candidate
    ctx: TrainContext
    result: TrainResult  # curve, components and episodes, filled as it trains
    program: RewardProgram | None = None  # the slot's current reward program
    fn: Any = None  # its sandboxed function, or None (no working function: rewarded 0, no updates)
    error: str = ""
    error_kind: str = ""
    shaping: Shaping | None = None  # applied to its program's reward before its agent learns from it
    generation: int = 0  # the method's count of rewrites that made the current function
    history: list[str] = field(default_factory=list)  # one line per event (the method's and the population's)
    frames: int = 0  # env steps it collected
    env: CandidateEnv | None = None
    agent: Any = None  # core.train.sac.SACModules
    episodes: EpisodeLog | None = None
    carry: Any = None  # the env's next root TensorDict
    returns: list[float] = field(default_factory=list)
    sums: dict[str, float] = field(default_factory=dict)  # component sums since the last evaluation
    steps: int = 0
    owed: float = 0.0  # gradient steps due (updates_per_frame x frames collected)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def extra_dim(self) -> int:
        """Features its state program and ``represent_state`` hooks append to the observation."""
        return self.env.obs_dim - self.ctx.task.obs_dim if self.env is not None else 0

    def use(self, program: RewardProgram | None, fn: Any, error: str = "", error_kind: str = "") -> None:
        """Its reward: ``program`` and its prepared function, or None with the reason it has none."""
        self.program, self.fn, self.error, self.error_kind = program, fn, error, error_kind

    def drop(self, exc: BaseException, when: str) -> None:
        """The function failed: no working function until the method gives it a new one."""
        report = getattr(exc, "report", None)
        self.fn, self.error = None, str(getattr(report, "message", "") or exc)
        self.error_kind = str(getattr(report, "kind", "") or type(exc).__name__)
        self.history.append(f"generation {self.generation}: failed {when} ({self.error_kind})")

    def value(self, state: dict, action: torch.Tensor, next_state: dict, env_reward: torch.Tensor) -> torch.Tensor:
        """Its program's reward ``[B]`` (0 without a working function); component means are summed."""
        if self.fn is not None:
            try:
                reward, components = program_value(
                    self.fn, self.candidate.reward, state, action, next_state, env_reward
                )
            except Exception as e:  # a function failing mid-training drops out
                self.drop(e, "during training")
            else:
                for name, v in components.items():
                    self.sums[name] = self.sums.get(name, 0.0) + float(torch.as_tensor(v, dtype=torch.float32).mean())
                self.steps += 1
                return reward
        return torch.zeros(action.shape[0])


class MemberReward:
    """The reward program a member's env runs: the member's current function.

    The method rewrites a member's function during training while its env (and the
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
            except Exception as e:
                m.drop(e, "during training")
        return torch.zeros(action.shape[0]), {}


# -- the population ----------------------------------------------------------------------------------------


class Population:
    """Candidates trained jointly: one SAC agent each over one shared replay (see the module docstring).

    :param run: the run context.
    :param candidates: the candidates to train, each a member; their ``reward`` is each
        member's first program (the method gives it a function with :meth:`Member.use`).
    :param seed: the seed they train under.
    :param frames: env steps for the whole population; None: ``trainer.frames``.
    :param name: the method, for messages and for its records on each result
        (``<name>/generation``, ``<name>/frames_acted``, ``<name>_history.md``,
        ``<name>_final_reward.py``).
    """

    def __init__(
        self, run: Any, candidates: list[Candidate], seed: int, frames: int | None = None, name: str = "population"
    ) -> None:
        self.run, self.task, self.seed, self.name = run, run.task, seed, name
        # hook calls run on a fork of torch's random stream, as a single training's do (core.train.rng)
        self.hook: Any = SeparateStream(run.hook) if run.hook is not None else None
        self.cfg = population_settings(run, frames, name)
        self.budget = int(self.cfg.frames)  # env steps for all members together
        self.frames = 0  # env steps collected so far
        self.members = [
            Member(c, self._context(c), TrainResult(candidate_id=c.id, ok=False), program=c.reward) for c in candidates
        ]
        self.live: list[Member] = []  # the members whose env and agent exist, in order
        self.replay: SharedReplay | None = None
        self._log_step = max(1, self.budget // 100)  # ~100 metric points per member
        self._next_log = self._log_step

    def _context(self, candidate: Candidate) -> TrainContext:
        run = self.run
        return TrainContext(
            settings=run.settings,
            task=run.task,
            seed=self.seed,
            candidate=candidate,
            total_frames=self.budget,
            llm_factory=lambda: run.llm,
            hook=self.hook,
            pluginmanager=run.pluginmanager,
        )

    # -- what a population can hold -------------------------------------------------------------------
    def refusal(self, candidate: Candidate, space: gym.Space) -> str:
        """Why a candidate cannot join the population ("" when it can).

        Reward and state programs and env configs are honoured; macro-actions and
        discrete action spaces are not (one SAC action space is shared through the replay).
        """
        if not isinstance(space, gym.spaces.Box):
            return (
                f"action space: {self.name} trains SAC agents, which need a continuous (Box) action space; "
                f"'{self.task.name}' has {space}."
            )
        if candidate.macros:
            names = ", ".join(m.name for m in candidate.macros)
            return (
                f"macro-actions ({names}): {self.name}'s SAC agents share one replay buffer over the task's continuous "
                "action space; macro-actions extend a discrete action space, which that buffer and SAC cannot hold. "
                f"Train them without {self.name} (or without the action role)."
            )
        return ""

    def _action_space(self) -> gym.Space:
        env = self.task.make_env(1, self.seed)
        try:
            return env.single_action_space
        finally:
            env.close()

    # -- training -----------------------------------------------------------------------------------------
    def train(self, body: Callable[[Population], None]) -> list[TrainResult]:
        """Build every member's env and agent, run the method's ``body(self)``, evaluate, finish.

        A candidate the population cannot hold gets a failed ``unsupported`` result naming
        the part, and nothing trains when none can. A member whose env cannot be built
        fails alone; an exception of ``body`` (a hook, an env) fails every member. Failures
        are results, never exceptions.

        :return: one result per candidate, in order.
        """
        space = self._action_space()
        refused = {id(m): self.refusal(m.candidate, space) for m in self.members}
        results = {
            id(m): TrainResult(candidate_id=m.candidate.id, ok=False, error=refused[id(m)], error_kind="unsupported")
            for m in self.members
            if refused[id(m)]
        }
        held = [m for m in self.members if not refused[id(m)]]
        if held:
            torch.set_num_threads(int(self.cfg.threads))
            torch.manual_seed(self.seed)
            start = time.perf_counter()
            failure: tuple[str, str] | None = None
            try:
                self._start(held)
                if self.live:
                    body(self)
                    for m in self.live:
                        self.evaluate(m)
            except Exception as exc:  # the population's training failed (a hook, an env): every member did
                failure = error_of(exc)
            finally:
                for m in self.live:
                    m.env.close()  # type: ignore[union-attr]
            seconds = time.perf_counter() - start
            # a member whose own setup failed keeps its error; the others share the population's
            for m in held:
                results[id(m)] = self._finish(m, seconds, failure if m in self.live or not m.error_kind else None)
        return [results[id(m)] for m in self.members]

    def _start(self, members: list[Member]) -> None:
        """Each member's env and agent, ``on_train_start``, and the shared replay."""
        cfg = self.cfg
        for k, m in enumerate(members):

            def log_episodes(vec: Any, m: Member = m) -> Any:
                m.episodes = EpisodeLog(vec, self.task)
                return m.episodes

            try:  # the candidate's env configs, state program and the per-step hooks, as the trainers build them
                m.env = CandidateEnv(
                    self.task,
                    m.candidate,
                    cfg.num_envs,
                    self.seed + k,
                    self.hook,
                    m.ctx,
                    reward_fn=MemberReward(m),
                    wrap_env=log_episodes,
                )
                m.agent = make_sac_modules(m.env.obs_dim, m.env.base.action_spec, cfg)
            except Exception as e:  # e.g. its state program fails its probe: this member fails
                if m.env is not None:
                    m.env.close()
                    m.env = None
                m.fn = None
                m.error, m.error_kind = error_of(e)
                m.history.append(f"generation 0: its env could not be built ({m.error_kind})")
                continue
            self.live.append(m)
            if self.hook is not None:
                self.hook.on_train_start(train=m.ctx)
            m.carry = m.env.env.reset()
        if self.live:
            space = self.live[0].env.base.action_spec  # type: ignore[union-attr]
            self.replay = SharedReplay(
                int(cfg.buffer_size),
                self.task.obs_dim,
                int(space.shape[-1]),
                len(self.live),
                [m.extra_dim for m in self.live],
            )

    def step(self, m: Member) -> list[tuple[float, bool | None]]:
        """One batch ``[envs, rollout_steps]`` collected by ``m`` (at random before
        ``init_random_frames``), labelled with every member's reward and stored; then every
        agent with a working function learns (``updates_per_frame``).

        :return: the episodes that ended in the batch: ``(env return, success or None)``.
        """
        cfg, replay = self.cfg, self.replay
        assert replay is not None
        warmup = int(cfg.init_random_frames)
        batch = self._collect(m, explore=self.frames >= warmup)
        n = batch.numel()
        self.frames += n
        m.frames += n
        for other in self.live:
            other.ctx.frames = self.frames
        if self.hook is not None:
            self.hook.on_rollout(train=m.ctx, batch=batch)
        task_obs, task_next, raw, hook, extra = self._label(batch, self.live.index(m))
        flat = batch.reshape(-1)
        env_reward = flat.get(("next", "env_reward"), flat["next", "reward"])
        replay.add(task_obs, flat["action"], task_next, flat["next", "terminated"], env_reward, raw, hook, extra)
        m.returns += [r for r, _ in m.env.base.pop_finished()]  # type: ignore[union-attr]
        ended = m.episodes.pop() if m.episodes is not None else []
        if replay.size >= int(cfg.batch_size) and self.frames >= warmup:
            for j, member in enumerate(self.live):  # every agent learns from every transition
                if member.fn is None:
                    continue
                member.owed += n * float(cfg.updates_per_frame)
                while member.owed >= 1.0:
                    losses = sac_update(member.agent, replay.sample(int(cfg.batch_size), j, member.shaping))
                    member.owed -= 1.0
                    member.stats.update(
                        {
                            "losses/qvalue_loss": float(losses["loss_qvalue"]),
                            "losses/actor_loss": float(losses["loss_actor"]),
                            "losses/alpha_loss": float(losses["loss_alpha"]),
                            "losses/alpha": float(losses["alpha"]),
                        }
                    )
        if self.frames >= self._next_log:
            for member in self.live:
                if member.returns:
                    member.stats["charts/episodic_return"] = float(np.mean(member.returns[-20:]))
                for key, value in member.stats.items():
                    member.ctx.log_metric(key, value)
            self._next_log += self._log_step
        return ended

    def _collect(self, m: Member, explore: bool) -> Any:
        """One batch ``[envs, rollout_steps]`` from the member's env, acted by its agent (or at random)."""
        from torchrl.envs.utils import ExplorationType, set_exploration_type

        env, steps, td = m.env.env, [], m.carry  # type: ignore[union-attr]
        with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
            for _ in range(int(self.cfg.rollout_steps)):
                if explore:
                    td = m.agent.actor(td)
                else:
                    td.set("action", env.action_spec.rand())
                td, m.carry = env.step_and_maybe_reset(td)
                steps.append(td)
        batch = torch.stack(steps, dim=1)
        if m.env.postproc is not None:  # type: ignore[union-attr]  # the reward program over the whole batch, as the trainers' collector does
            batch = m.env.postproc(batch)  # type: ignore[union-attr]
        return batch

    def _label(
        self, batch: Any, acting: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[int, Any]]:
        """``(task obs, task next obs, program rewards [N, M], hook terms [N, M], features)`` of a flat batch.

        The acting member's hook terms and features come from its env; every other
        member's are computed with its own context and transforms, since it learns from
        these transitions too.
        """
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
        n = len(self.live)
        raw, hook, extra = torch.zeros(len(flat), n), torch.zeros(len(flat), n), {}
        for j, m in enumerate(self.live):
            raw[:, j] = m.value(state, action, next_state, env_reward)
            if hooked and j == acting:
                hook[:, j] = total - raw[:, j]
            elif hooked and m.fn is not None:
                step = StepBatch(
                    obs=task_obs,
                    action=action,
                    next_obs=task_next,
                    env_reward=env_reward,
                    reward=raw[:, j],
                    done=done,
                    task=task,
                )
                for term in self.hook.compute_reward(train=m.ctx, batch=step):
                    if term is not None:
                        hook[:, j] += torch.as_tensor(term, dtype=torch.float32).reshape(-1)
            if m.extra_dim:
                if j == acting:
                    extra[j] = (obs[:, dim:], next_obs[:, dim:])
                else:
                    extra[j] = (m.env.augment(task_obs)[:, dim:], m.env.augment(task_next)[:, dim:])  # type: ignore[union-attr]
        return task_obs, task_next, raw, hook, extra

    # -- what the method reads and changes ------------------------------------------------------------------
    def rewards(self, m: Member) -> torch.Tensor:
        """``m``'s reward of every stored transition, as its agent learns from it (``shaping``
        applied, no hook terms)."""
        assert self.replay is not None
        raw = self.replay.raw[: self.replay.size, self.live.index(m)]
        return m.shaping(raw) if m.shaping is not None else raw

    def env_rewards(self) -> torch.Tensor:
        """The env's own reward of every stored transition."""
        assert self.replay is not None
        return self.replay.env_reward[: self.replay.size]

    def adopt(self, m: Member, program: RewardProgram, fn: Any) -> None:
        """Give ``m`` a new reward function: it relabels every stored transition first.

        ``m``'s shaping is reset; hooks see the new program as its candidate's reward.
        :raises Exception: whatever ``fn`` raises on the stored data (``m`` is then unchanged).
        """
        assert self.replay is not None
        reward = m.candidate.reward

        def column(state: dict, action: torch.Tensor, next_state: dict, env_reward: torch.Tensor) -> torch.Tensor:
            return program_value(fn, reward, state, action, next_state, env_reward)[0]

        self.replay.relabel(self.live.index(m), column, self.task)
        m.use(program, fn)
        m.shaping = None
        m.ctx.candidate = replace(m.candidate, reward=program)  # hooks see the slot's current reward

    def inherit(self, dst: Member, src: Member) -> bool:
        """Copy ``src``'s actor, critics, targets, temperature and optimiser state into ``dst``.

        :return: False (nothing copied) when their observations differ (state features).
        """
        if dst.extra_dim != src.extra_dim:
            return False
        copy_agent(dst.agent, src.agent)
        return True

    def act(self, m: Member) -> Callable[[torch.Tensor], torch.Tensor]:
        """``m``'s greedy policy on task observations (its state transforms applied)."""
        return lambda obs: act_deterministic(m.agent, m.env.augment(obs))  # type: ignore[union-attr]

    def evaluate(self, m: Member) -> float:
        """Evaluate ``m``'s agent on the task's own env (``on_evaluation``): its fitness; its component
        means since the last evaluation join its result."""
        for name, total in m.sums.items():
            m.result.components.setdefault(name, []).append((self.frames, total / max(1, m.steps)))
        m.sums, m.steps = {}, 0
        episodes = evaluate_and_record(
            self.task,
            self.act(m),
            max(1, int(self.cfg.eval_episodes)),
            seed=self.seed + 10_000,
            frames=self.frames,
            result=m.result,
            ctx=m.ctx,
            hook=self.hook,
        )
        m.result.episodes = episodes
        return m.result.curve[-1].fitness

    def rollout(self, m: Member, seed: int) -> tuple[np.ndarray, np.ndarray, bool | None]:
        """One deterministic episode of ``m``'s agent on the task's own env:
        ``(observations [T + 1], actions [T], success or None)``, the final observation the true one."""
        act = self.act(m)
        observations: list[np.ndarray] = []
        actions: list[np.ndarray] = []
        success: bool | None = None
        for step in task_steps(
            self.task, 1, self.task.max_episode_steps, seed, policy=lambda obs: act(torch.as_tensor(obs)).numpy()
        ):
            observations += [step.obs[0]] if not observations else []
            observations.append(step.next_obs[0])
            actions.append(step.action[0])
            if step.done[0]:
                success, _ = self.task.episode_info(_env_info(step.info.get("final_info") or {}, 0))
                break
        return np.asarray(observations), np.asarray(actions), success

    # -- results ----------------------------------------------------------------------------------------------
    def _finish(self, m: Member, seconds: float, failure: tuple[str, str] | None) -> TrainResult:
        """The member's result, ``on_train_end``, and what hooks logged through its context."""
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
        result.metrics.update(
            {f"{self.name}/generation": float(m.generation), f"{self.name}/frames_acted": float(m.frames)}
        )
        result.texts[f"{self.name}_history.md"] = "\n".join(m.history)
        if m.program is not None:
            result.texts[f"{self.name}_final_reward.py"] = m.program.source
        if result.ok and m.agent is not None and wants_saved_policy(m.ctx):
            result.policy_path = save_policy(
                {
                    "algorithm": "sac",
                    "obs_dim": m.env.obs_dim,  # type: ignore[union-attr]
                    "hidden": list(self.cfg.hidden),
                    "actor": m.agent.actor.state_dict(),
                    "qvalue": m.agent.loss.qvalue_network_params.to_dict(),
                },
                m.candidate.id,
            )
        if self.hook is not None:
            try:
                self.hook.on_train_end(train=m.ctx, result=result)
            except Exception as exc:
                result.ok = False
                result.error, result.error_kind = error_of(exc)
        for key, points in m.ctx.metrics.items():  # what plugins recorded through the context travels with the result
            result.series.setdefault(key, []).extend(points)
        result.texts.update(m.ctx.texts)
        return result


def copy_agent(dst: Any, src: Any) -> None:
    """Copy a SAC agent's actor, critics, targets, temperature and optimiser state into another."""
    dst.loss.load_state_dict(src.loss.state_dict())
    for mine, theirs in zip(dst.optimizers, src.optimizers):
        mine.load_state_dict(theirs.state_dict())
