"""PPO on TorchRL: train one candidate and score it on the task's ground truth.

Reads top to bottom: the config, the env (task env + the candidate's transforms), the
networks and the loss, then the loop (collect, GAE, update epochs, evaluate, log).
TorchRL pieces: ``Collector`` for rollouts, ``GAE`` for advantages, ``ClipPPOLoss``
for the objective. Speed notes (CartPole, 8 envs): a thin env wrapper
(:mod:`core.train.envs`), a collection policy without distribution objects, the
collected batch indexed directly (no replay buffer), evaluation outside the timed part.

Failures of LLM-written code (reward/state programs, hook plugins) are data: ``train``
returns ``TrainResult(ok=False, error=..., error_kind=...)`` instead of raising.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import numpy as np
import torch
from torchrl.collectors import Collector
from torchrl.envs import Compose, TransformedEnv
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from core.envs.task import Task
from core.records import Candidate, CurvePoint, EnvConfig, Episode, TrainResult
from core.train.context import TrainContext
from core.train.envs import VecGymEnv
from core.train.evaluate import evaluate
from core.train.networks import build_networks
from core.train.transforms import ProgramReward, build_transforms, has_impls


@dataclass
class PPOConfig:
    """PPO settings; mirrors ``conf/trainer/ppo.yaml`` (defaults: rl-zoo CartPole-v1)."""

    frames: int  # training budget per candidate, env steps over all envs (trainer.frames)
    num_envs: int = 8  # vectorised training envs, split among the candidate's env configs
    rollout_steps: int = 32  # steps per env per collected batch
    epochs: int = 20  # update epochs per batch
    minibatch: int = 256  # minibatch size in frames
    lr: float = 1e-3  # Adam learning rate
    anneal_lr: bool = True  # anneal lr and clip range linearly to 0 over training
    gamma: float = 0.98  # discount
    gae_lambda: float = 0.8  # GAE lambda
    clip: float = 0.2  # PPO ratio clip range
    ent_coef: float = 0.0  # entropy bonus coefficient
    vf_coef: float = 0.5  # value loss coefficient
    max_grad_norm: float = 0.5  # gradient norm clip
    hidden: list[int] = field(default_factory=lambda: [64, 64])  # actor and critic MLP sizes
    eval_every: int = 25_000  # frames between periodic evaluations (0: only at the end)
    eval_episodes: int = 10  # episodes per evaluation (0: none)
    threads: int = 1  # torch intra-op threads
    device: str = "cpu"  # torch device of the networks

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PPOConfig:
        """Build from the Hydra ``trainer`` node; unknown keys raise ``ValueError``."""
        if hasattr(cfg, "items") and not isinstance(cfg, dict):
            try:  # an OmegaConf DictConfig
                from omegaconf import OmegaConf

                cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
            except ImportError:  # pragma: no cover
                cfg = dict(cfg)
        values = {k: v for k, v in dict(cfg).items() if k not in ("name", "_target_")}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown trainer setting(s) {unknown}; PPO knows {sorted(known)}")
        if "frames" not in values:
            raise ValueError("trainer.frames (the training budget) is required")
        config = cls(**values)
        config.hidden = [int(h) for h in config.hidden]
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ``ValueError`` on settings that cannot train."""
        positive = ("frames", "num_envs", "rollout_steps", "epochs", "minibatch", "threads")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.gamma <= 1.0 or not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError("trainer.gamma must be in (0, 1] and trainer.gae_lambda in [0, 1]")
        if self.eval_every < 0 or self.eval_episodes < 0:
            raise ValueError("trainer.eval_every and trainer.eval_episodes must be >= 0")
        if not self.hidden:
            raise ValueError("trainer.hidden needs at least one layer size")

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.rollout_steps


def split_env_params(envs: list[EnvConfig], num_envs: int) -> list[dict[str, Any]] | None:
    """Per-env params: ``num_envs`` shared among the configs by weight (None: defaults)."""
    if not envs:
        return None
    weights = np.array([max(0.0, float(e.weight)) for e in envs])
    if weights.sum() <= 0:
        weights = np.ones(len(envs))
    exact = weights / weights.sum() * num_envs
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: num_envs - counts.sum()]:
        counts[i] += 1  # largest remainders get the leftover envs
    return [dict(e.params) for e, c in zip(envs, counts) for _ in range(c)]


def _error_of(exc: BaseException) -> tuple[str, str]:
    """(feedback text, kind) of an exception; sandbox errors carry their own report."""
    report = getattr(exc, "report", None)
    if report is not None and getattr(report, "kind", None):
        message = getattr(report, "message", "") or str(exc)
        return str(message), str(report.kind)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text, type(exc).__name__


def train(
    task: Task,
    candidate: Candidate,
    cfg: PPOConfig,
    *,
    seed: int,
    hook: Any = None,
    ctx: TrainContext | None = None,
    progress: Any = None,
) -> TrainResult:
    """Train ``candidate`` on ``task`` with PPO and evaluate it; never raises for bad code.

    :param hook: ``pm.hook`` of the plugin manager, or None (no training hooks).
    :param ctx: the training context hooks receive; one is made when hooks need it.
    :param progress: a ``rich.progress.Progress`` to show a bar in, or None.
    """
    start = time.perf_counter()
    if hook is not None and ctx is None:
        ctx = TrainContext(task=task, candidate=candidate, config={}, seed=seed, total_frames=cfg.frames)
    result = TrainResult(candidate_id=candidate.id, ok=False)
    try:
        _Run(task, candidate, cfg, seed, hook, ctx, progress, result).run()
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - failures of candidate code are data
        result.error, result.error_kind = _error_of(exc)
    result.seconds = time.perf_counter() - start
    if hook is not None:
        try:
            hook.on_train_end(train=ctx, result=result)
        except Exception as exc:  # noqa: BLE001
            result.ok = False
            result.error, result.error_kind = _error_of(exc)
    return result


class _Run:
    """One training run; its state lives here so that ``run`` reads as the loop."""

    def __init__(self, task: Task, candidate: Candidate, cfg: PPOConfig, seed: int, hook: Any,
                 ctx: TrainContext | None, progress: Any, result: TrainResult) -> None:
        self.task, self.candidate, self.cfg, self.seed = task, candidate, cfg, seed
        self.hook, self.ctx, self.progress, self.result = hook, ctx, progress, result

    # -- setup ------------------------------------------------------------------------
    def _reward_and_state_fns(self) -> tuple[Any, Any, int]:
        reward_fn = state_fn = None
        state_dim = 0
        if self.candidate.reward is not None:
            from core.sandbox import prepare_reward  # lazy: the sandbox is heavy

            reward_fn = prepare_reward(self.candidate.reward, self.task)
        if self.candidate.state is not None:
            from core.sandbox import prepare_state

            state_fn = prepare_state(self.candidate.state, self.task)
            state_dim = int(getattr(state_fn, "extra_dim", self.candidate.state.extra_dim))
        return reward_fn, state_fn, state_dim

    def _build_env(self) -> None:
        cfg, task = self.cfg, self.task
        reward_fn, state_fn, state_dim = self._reward_and_state_fns()
        params = split_env_params(self.candidate.envs, cfg.num_envs)
        wants_hooks = self.hook is not None and self.ctx is not None
        base = VecGymEnv(task.make_env(cfg.num_envs, self.seed, params), self.seed,
                         keep_env_reward=wants_hooks and has_impls(self.hook, "compute_reward"))
        probe = None
        if wants_hooks:
            probe = torch.as_tensor(np.asarray(base.env.observation_space.sample()), dtype=torch.float32)
        program = self.candidate.reward
        rewards, states = build_transforms(
            task, reward_fn=reward_fn, reward_mode=program.mode if program else "replace",
            reward_weight=program.weight if program else 1.0, state_fn=state_fn, state_dim=state_dim,
            hook=self.hook, ctx=self.ctx, probe_obs=probe)
        self.base = base
        self.program_reward = next((t for t in rewards if isinstance(t, ProgramReward)), None)
        self.rewrites_reward = bool(rewards)
        self.state_transforms = states
        self.postproc = None
        if rewards == [self.program_reward]:
            # no per-step hook needs the program's reward during collection: rewrite the
            # whole batch in one program call instead of one call per step
            self.postproc = rewards.pop()
        self.env = TransformedEnv(base, Compose(*rewards, *states)) if rewards or states else base

    def _augment(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy's input for a task observation (the state transforms applied)."""
        for t in self.state_transforms:
            obs = t.augment(obs)
        return obs

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        cfg, result, ctx, hook = self.cfg, self.result, self.ctx, self.hook
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(self.seed)
        self._build_env()
        obs_dim = int(self.env.observation_spec["observation"].shape[-1])
        nets = build_networks(obs_dim, self.base.action_spec, cfg.hidden)
        self.nets = nets
        loss = ClipPPOLoss(nets.actor, nets.critic, clip_epsilon=cfg.clip, entropy_bonus=cfg.ent_coef > 0,
                           entropy_coeff=cfg.ent_coef, critic_coeff=cfg.vf_coef, loss_critic_type="l2",
                           normalize_advantage=True, functional=False)
        gae = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=nets.critic, average_gae=False)
        params = nets.parameters()
        # fused Adam: one kernel for all parameters instead of a Python loop over them
        optim = torch.optim.Adam(params, lr=cfg.lr, eps=1e-5, fused=cfg.device == "cpu" or None)
        policy = nets.sampling_policy(loss.tensor_keys.sample_log_prob)
        batches = max(1, cfg.frames // cfg.frames_per_batch)
        collector = Collector(self.env, policy, frames_per_batch=cfg.frames_per_batch,
                              total_frames=batches * cfg.frames_per_batch, trust_policy=True,
                              track_traj_ids=False, auto_register_policy_transforms=False,
                              postproc=self.postproc)
        if hook is not None:
            hook.on_train_start(train=ctx)
        bar = self.progress.add_task(f"train {self.candidate.id}", total=batches * cfg.frames_per_batch) \
            if self.progress is not None else None

        frames, train_seconds, next_eval = 0, 0.0, cfg.eval_every or math.inf
        sample_every = max(1, batches // 10)  # reward components ~10 times per run
        corr = np.zeros(6)  # n, sum x, sum y, sum xx, sum yy, sum xy (program vs env reward)
        returns: list[float] = []
        stats: dict[str, float] = {}
        tick = time.perf_counter()
        try:
            for i, batch in enumerate(collector):
                frames += batch.numel()
                if ctx is not None:
                    ctx.frames = frames
                if hook is not None:
                    hook.on_rollout(train=ctx, batch=batch)
                frac = 1.0 - i / batches if cfg.anneal_lr else 1.0
                optim.param_groups[0]["lr"] = cfg.lr * frac
                loss.clip_epsilon.fill_(cfg.clip * frac)
                stats = self._update(batch, gae, loss, optim, params)
                if self.rewrites_reward:
                    corr += self._corr_sums(batch)
                finished = self.base.pop_finished()
                returns += [r for r, _ in finished]
                now = time.perf_counter()
                train_seconds += now - tick
                stats["charts/fps"] = frames / train_seconds
                if finished:
                    stats["charts/episodic_return"] = float(np.mean([r for r, _ in finished]))
                if ctx is not None:
                    for key, value in stats.items():
                        ctx.log_metric(key, value)
                if self.program_reward is not None and ((i + 1) % sample_every == 0 or i + 1 == batches):
                    self._sample_components(frames)
                if frames >= next_eval and frames < batches * cfg.frames_per_batch:
                    self._evaluate(frames)
                    next_eval += cfg.eval_every
                if bar is not None:
                    last = f"{returns[-1]:.1f}" if returns else "-"
                    self.progress.update(bar, completed=frames, description=(
                        f"train {self.candidate.id} {stats['charts/fps']:.0f} fps return {last}"))
                tick = time.perf_counter()
        finally:
            collector.shutdown()
            self.env.close(raise_if_closed=False)

        result.frames = frames
        result.metrics.update(stats)
        result.metrics["charts/fps"] = frames / max(train_seconds, 1e-9)
        if returns:
            result.metrics["charts/episodic_return"] = float(np.mean(returns[-20:]))
        if self.rewrites_reward and corr[0] > 1:
            result.metrics["reward/env_correlation"] = _pearson(corr)
            if ctx is not None:
                ctx.log_metric("reward/env_correlation", result.metrics["reward/env_correlation"])
        episodes = self._evaluate(frames)
        if episodes:
            result.episodes = episodes
            result.fitness = self.task.fitness(episodes)

    def _update(self, batch: Any, gae: GAE, loss: ClipPPOLoss, optim: torch.optim.Optimizer,
                params: list[torch.nn.Parameter]) -> dict[str, float]:
        """GAE on the batch, then ``epochs`` passes of minibatch updates."""
        cfg = self.cfg
        with torch.no_grad():
            gae(batch)
        flat = batch.reshape(-1)
        n = flat.numel()
        size = min(cfg.minibatch, n)
        keys = [k for k in ("loss_objective", "loss_critic", "loss_entropy")]
        for _ in range(cfg.epochs):
            order = torch.randperm(n) if size < n else None
            for lo in range(0, n - size + 1, size):
                mb = flat if order is None else flat[order[lo:lo + size]]
                out = loss(mb)
                total = sum(out.get(k) for k in keys if k in out.keys())
                optim.zero_grad(set_to_none=True)
                total.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optim.step()
        stats = {
            "losses/policy_loss": float(out.get("loss_objective").detach()),
            "losses/value_loss": float(out.get("loss_critic").detach()) / max(cfg.vf_coef, 1e-12),
        }
        with torch.no_grad():  # entropy once per batch, on the whole batch
            stats["losses/entropy"] = float(self.nets.actor.get_dist(flat).entropy().mean())
        return stats

    @staticmethod
    def _corr_sums(batch: Any) -> np.ndarray:
        x = batch.get(("next", "reward")).reshape(-1).double()
        y = batch.get(("next", "env_reward")).reshape(-1).double()
        return np.array([x.numel(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()], dtype=float)

    def _sample_components(self, frames: int) -> None:
        assert self.program_reward is not None
        for name, mean in self.program_reward.pop_components().items():
            self.result.components.setdefault(name, []).append((frames, mean))
            if self.ctx is not None:
                self.ctx.log_metric(f"reward/{name}", mean)

    def _evaluate(self, frames: int) -> list[Episode]:
        """Deterministic episodes on the original env; records a curve point."""
        cfg = self.cfg
        if cfg.eval_episodes <= 0:
            return []

        def act(obs: torch.Tensor) -> torch.Tensor:
            return self.nets.act_deterministic(self._augment(obs))

        episodes = evaluate(self.task, act, cfg.eval_episodes, seed=self.seed + 10_000)
        fitness = self.task.fitness(episodes)
        components = {k: v[-1][1] for k, v in self.result.components.items() if v}
        self.result.curve.append(CurvePoint(frames, fitness.value, float(np.mean([e.ret for e in episodes])),
                                            components))
        if self.ctx is not None:
            self.ctx.log_metric("eval/fitness", fitness.value)
        if self.hook is not None:
            self.hook.on_evaluation(train=self.ctx, frames=frames, fitness=fitness.value, episodes=episodes)
        return episodes


def _pearson(s: np.ndarray) -> float:
    """Pearson correlation from (n, sx, sy, sxx, syy, sxy); 0 when one side is constant."""
    n, sx, sy, sxx, syy, sxy = s
    cov = sxy / n - sx * sy / n**2
    vx, vy = sxx / n - (sx / n) ** 2, syy / n - (sy / n) ** 2
    if vx <= 1e-12 or vy <= 1e-12:
        return 0.0
    return float(cov / math.sqrt(vx * vy))
