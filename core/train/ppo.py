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
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from torchrl.collectors import Collector
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from core.envs.task import Task
from core.records import Candidate, Episode, TrainResult
from core.train.common import (CandidateEnv, config_from, corr_sums, pearson, save_policy, split_env_params,  # noqa: F401
                               train_safely, wants_saved_policy)
from core.config import Settings
from core.context import TrainContext
from core.train.evaluate import evaluate_and_record
from core.train.networks import build_networks


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
    eval_deterministic: bool = True  # greedy actions in evaluation; false samples the policy (Crafter's protocol)
    threads: int = 1  # torch intra-op threads
    device: str = "cpu"  # torch device of the networks

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PPOConfig:
        """Build from the Hydra ``trainer`` node; unknown keys raise ``ValueError``."""
        return config_from(cls, cfg, "PPO")

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
        Its ``config`` gives the sandbox limits (``sandbox:``) and ``save_policy``.
    :param progress: a ``rich.progress.Progress`` to show a bar in, or None.
    """
    if hook is not None and ctx is None:
        ctx = TrainContext(settings=Settings.of(), task=task, candidate=candidate, seed=seed, total_frames=cfg.frames)

    def body(result: TrainResult) -> None:
        _Run(task, candidate, cfg, seed, hook, ctx, progress, result).run()

    return train_safely(body, candidate, hook, ctx)


class _Run:
    """One training run; its state lives here so that ``run`` reads as the loop."""

    def __init__(self, task: Task, candidate: Candidate, cfg: PPOConfig, seed: int, hook: Any,
                 ctx: TrainContext | None, progress: Any, result: TrainResult) -> None:
        self.task, self.candidate, self.cfg, self.seed = task, candidate, cfg, seed
        self.hook, self.ctx, self.progress, self.result = hook, ctx, progress, result

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        cfg, result, ctx, hook = self.cfg, self.result, self.ctx, self.hook
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(self.seed)
        self.cenv = cenv = CandidateEnv(self.task, self.candidate, cfg.num_envs, self.seed, hook, ctx)
        self.env, self.base = cenv.env, cenv.base
        nets = build_networks(cenv.obs_dim, self.base.action_spec, cfg.hidden)
        self.nets = nets
        loss = ClipPPOLoss(nets.actor, nets.critic, clip_epsilon=cfg.clip, entropy_bonus=cfg.ent_coef > 0,
                           entropy_coeff=cfg.ent_coef, critic_coeff=cfg.vf_coef, loss_critic_type="l2",
                           normalize_advantage=True, functional=False, log_explained_variance=False)
        gae = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=nets.critic, average_gae=False)
        params = nets.parameters()
        # fused Adam: one kernel for all parameters instead of a Python loop over them
        optim = torch.optim.Adam(params, lr=cfg.lr, eps=1e-5, fused=cfg.device == "cpu" or None)
        policy = nets.sampling_policy(loss.tensor_keys.sample_log_prob)
        batches = max(1, cfg.frames // cfg.frames_per_batch)
        collector = Collector(self.env, policy, frames_per_batch=cfg.frames_per_batch,
                              total_frames=batches * cfg.frames_per_batch, trust_policy=True,
                              track_traj_ids=False, auto_register_policy_transforms=False,
                              postproc=cenv.postproc)
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
                if cenv.rewrites_reward:
                    corr += corr_sums(batch)
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
                if cenv.program_reward is not None and ((i + 1) % sample_every == 0 or i + 1 == batches):
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
            cenv.close()

        result.frames = frames
        result.metrics.update(stats)
        result.metrics["charts/fps"] = frames / max(train_seconds, 1e-9)
        result.metrics.update(cenv.program_metrics)
        if returns:
            result.metrics["charts/episodic_return"] = float(np.mean(returns[-20:]))
        result.metrics.update(cenv.macro_metrics())
        if cenv.rewrites_reward and corr[0] > 1:
            result.metrics["reward/env_correlation"] = pearson(corr)
            if ctx is not None:
                ctx.log_metric("reward/env_correlation", result.metrics["reward/env_correlation"])
        episodes = self._evaluate(frames)
        if episodes:
            result.episodes = episodes
            result.fitness = self.task.fitness(episodes)
        if wants_saved_policy(ctx):
            result.policy_path = save_policy(self._policy_state(), self.candidate.id)

    def _policy_state(self) -> dict[str, Any]:
        """What the saved policy file holds: both networks and how to rebuild them."""
        nets = self.nets
        return {"algorithm": "ppo", "obs_dim": self.cenv.obs_dim, "hidden": list(self.cfg.hidden),
                "discrete": nets.discrete, "actor": nets.actor_net.state_dict(), "critic": nets.critic_net.state_dict()}

    def _update(self, batch: Any, gae: GAE, loss: ClipPPOLoss, optim: torch.optim.Optimizer,
                params: list[torch.nn.Parameter]) -> dict[str, float]:
        """GAE on the batch, then ``epochs`` passes of minibatch updates."""
        cfg = self.cfg
        with torch.no_grad():
            gae(batch)
        keys_ = loss.tensor_keys
        # only what the loss reads: every TensorDict op per minibatch scales with the keys
        flat = batch.reshape(-1).select("observation", keys_.action, keys_.sample_log_prob, keys_.advantage,
                                        keys_.value_target)
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

    def _sample_components(self, frames: int) -> None:
        assert self.cenv.program_reward is not None
        for name, mean in self.cenv.program_reward.pop_components().items():
            self.result.components.setdefault(name, []).append((frames, mean))
            if self.ctx is not None:
                self.ctx.log_metric(f"reward/{name}", mean)

    def _evaluate(self, frames: int) -> list[Episode]:
        """Deterministic episodes on the original env (with the candidate's macros)."""

        def act(obs: torch.Tensor) -> torch.Tensor:
            if self.cfg.eval_deterministic:
                return self.nets.act_deterministic(self.cenv.augment(obs))
            return self.nets.act_sampled(self.cenv.augment(obs))

        macros = self.cenv.macros
        return evaluate_and_record(self.task, act, self.cfg.eval_episodes, seed=self.seed + 10_000, frames=frames,
                                   result=self.result, ctx=self.ctx, hook=self.hook,
                                   wrap_env=macros.wrap if macros is not None else None)
