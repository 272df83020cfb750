"""SAC on TorchRL: off-policy training for continuous actions, same contract as PPO.

Soft Actor-Critic (Haarnoja et al., 2018, "Soft Actor-Critic Algorithms and
Applications"): a TanhNormal actor, twin Q networks with Polyak-averaged targets and an
automatically tuned entropy temperature. TorchRL pieces: ``Collector`` (random actions
for the first ``init_random_frames``), a ``ReplayBuffer`` over ``LazyTensorStorage``
(uniform sampling: prioritised replay needs TorchRL's C++ extension), ``SACLoss`` and
``SoftUpdate``. The env, the candidate's programs and hooks, evaluation and saving are
the shared ones of :mod:`core.train.common`.

Building blocks other trainers reuse (LaRes trains a population with them):

- :func:`make_sac_modules` ``(obs_dim, action_spec, cfg) -> SACModules``: networks,
  loss, target updater and optimisers of one agent;
- :func:`make_replay_buffer` ``(cfg) -> ReplayBuffer``;
- :func:`sac_update` ``(modules, batch) -> dict[str, Tensor]``: one gradient step of
  critic, actor and temperature, then the target update;
- :func:`act_deterministic` ``(modules, obs) -> action``: the greedy action.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import Bounded, LazyTensorStorage, ReplayBuffer, TensorSpec
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

from core.envs.task import Task
from core.records import Candidate, Episode, TrainResult
from core.train.common import CandidateEnv, config_from, corr_sums, pearson, save_policy, train_safely, wants_saved_policy
from core.config import Settings
from core.context import TrainContext
from core.train.action_prior import PRIOR_KEYS, PriorBehaviour, PriorSource, imitation_step
from core.train.evaluate import evaluate_and_record
from core.train.transforms import has_impls

#: what the replay buffer keeps of a collected batch (all SACLoss reads)
BUFFER_KEYS = ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done"),
               ("next", "terminated"))


@dataclass
class SACConfig:
    """SAC settings; mirrors ``conf/trainer/sac.yaml`` (defaults: rl-zoo's Pendulum-v1)."""

    frames: int  # training budget per candidate, env steps over all envs (trainer.frames)
    num_envs: int = 1  # vectorised training envs, split among the candidate's env configs
    rollout_steps: int = 1  # steps per env per collected batch
    updates_per_frame: float = 1.0  # gradient steps per collected frame (update-to-data ratio)
    init_random_frames: int = 1000  # uniformly random actions before learning starts
    buffer_size: int = 100_000  # replay buffer capacity, in frames
    batch_size: int = 256  # frames per gradient step
    lr: float = 1e-3  # Adam learning rate of the actor and the critics
    alpha_lr: float = 1e-3  # Adam learning rate of the entropy temperature
    alpha_init: float = 1.0  # initial entropy temperature
    target_entropy: float | str = "auto"  # "auto": -action_dim
    gamma: float = 0.99  # discount
    tau: float = 0.005  # Polyak rate of the target critics
    hidden: list[int] = field(default_factory=lambda: [256, 256])  # actor and critic MLP sizes
    eval_every: int = 5000  # frames between periodic evaluations (0: only at the end)
    eval_episodes: int = 10  # episodes per evaluation (0: none)
    threads: int = 1  # torch intra-op threads
    device: str = "cpu"  # torch device of the networks

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> SACConfig:
        """Build from the Hydra ``trainer`` node; unknown keys raise ``ValueError``."""
        return config_from(cls, cfg, "SAC")

    def validate(self) -> None:
        """Raise ``ValueError`` on settings that cannot train."""
        for name in ("frames", "num_envs", "rollout_steps", "buffer_size", "batch_size", "threads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        if self.updates_per_frame <= 0 or self.init_random_frames < 0:
            raise ValueError("trainer.updates_per_frame must be > 0 and trainer.init_random_frames >= 0")
        if not 0.0 < self.gamma <= 1.0 or not 0.0 < self.tau <= 1.0:
            raise ValueError("trainer.gamma and trainer.tau must be in (0, 1]")
        if self.eval_every < 0 or self.eval_episodes < 0:
            raise ValueError("trainer.eval_every and trainer.eval_episodes must be >= 0")
        if not self.hidden:
            raise ValueError("trainer.hidden needs at least one layer size")

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.rollout_steps


# -- reusable pieces ---------------------------------------------------------------------


@dataclass
class SACModules:
    """One SAC agent: what :func:`sac_update` needs and what evaluation runs."""

    actor: ProbabilisticActor  # observation -> action (TanhNormal within the action bounds)
    qvalue: ValueOperator  # (observation, action) -> state_action_value
    loss: SACLoss
    target: SoftUpdate
    optimizers: list[torch.optim.Optimizer]  # critic, actor, temperature
    action_spec: TensorSpec


def make_sac_modules(obs_dim: int, action_spec: TensorSpec, cfg: SACConfig) -> SACModules:
    """Actor, twin critics, loss, target updater and optimisers for a Box action space.

    :param action_spec: a ``Bounded`` spec; a leading batch dimension (one row per env)
        is allowed and dropped.
    """
    if not isinstance(action_spec, Bounded):
        raise ValueError(f"SAC needs a bounded continuous action space, got {type(action_spec).__name__}")
    low, high = action_spec.space.low, action_spec.space.high
    while low.dim() > 1:
        low, high = low[0], high[0]
    act_dim = int(low.shape[-1])
    spec = Bounded(low=low, high=high, shape=low.shape, dtype=torch.float32)
    actor_net = nn.Sequential(MLP(in_features=obs_dim, out_features=2 * act_dim, num_cells=list(cfg.hidden),
                                  activation_class=nn.ReLU), NormalParamExtractor())
    actor = ProbabilisticActor(TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=TanhNormal,
                               distribution_kwargs={"low": low, "high": high}, spec=spec)
    q_net = MLP(in_features=obs_dim + act_dim, out_features=1, num_cells=list(cfg.hidden), activation_class=nn.ReLU)
    qvalue = ValueOperator(q_net, in_keys=["observation", "action"])
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2", alpha_init=cfg.alpha_init, deactivate_vmap=True,
                   target_entropy=cfg.target_entropy, action_spec=spec)
    loss.make_value_estimator(gamma=cfg.gamma)
    target = SoftUpdate(loss, tau=cfg.tau)
    critic_params = list(loss.qvalue_network_params.flatten_keys().values())
    actor_params = list(loss.actor_network_params.flatten_keys().values())
    optimizers = [torch.optim.Adam(critic_params, lr=cfg.lr), torch.optim.Adam(actor_params, lr=cfg.lr),
                  torch.optim.Adam([loss.log_alpha], lr=cfg.alpha_lr)]
    return SACModules(actor, qvalue, loss, target, optimizers, spec)


def make_replay_buffer(cfg: SACConfig) -> ReplayBuffer:
    """A uniform replay buffer of ``cfg.buffer_size`` frames sampling ``cfg.batch_size``."""
    return ReplayBuffer(storage=LazyTensorStorage(cfg.buffer_size), batch_size=cfg.batch_size)


def sac_update(modules: SACModules, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """One gradient step of critics, actor and temperature on ``batch``; then targets.

    The actor loss sees detached critic parameters and the critic loss detached targets
    (inside ``SACLoss``), so one backward pass of the summed losses is exact.
    :return: the detached losses and ``alpha``.
    """
    out = modules.loss(batch)
    total = out["loss_qvalue"] + out["loss_actor"] + out["loss_alpha"]
    for opt in modules.optimizers:
        opt.zero_grad(set_to_none=True)
    total.backward()
    for opt in modules.optimizers:
        opt.step()
    modules.target.step()
    return {k: out[k].detach() for k in ("loss_qvalue", "loss_actor", "loss_alpha", "alpha")}


@torch.no_grad()
def act_deterministic(modules: SACModules, obs: torch.Tensor) -> torch.Tensor:
    """The actor's greedy action (the squashed mean) for a batch of observations."""
    td = TensorDict({"observation": obs}, batch_size=obs.shape[:1])
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        return modules.actor(td).get("action")


# -- training ----------------------------------------------------------------------------


def train(
    task: Task,
    candidate: Candidate,
    cfg: SACConfig,
    *,
    seed: int,
    hook: Any = None,
    ctx: TrainContext | None = None,
    progress: Any = None,
) -> TrainResult:
    """Train ``candidate`` on ``task`` with SAC and evaluate it; never raises for bad code.

    Same contract as :func:`core.train.ppo.train`.
    """
    if hook is not None and ctx is None:
        ctx = TrainContext(settings=Settings.of(), task=task, candidate=candidate, seed=seed, total_frames=cfg.frames)

    def body(result: TrainResult) -> None:
        _run(task, candidate, cfg, seed, hook, ctx, progress, result)

    return train_safely(body, candidate, hook, ctx)


def _run(task: Task, candidate: Candidate, cfg: SACConfig, seed: int, hook: Any, ctx: TrainContext | None,
         progress: Any, result: TrainResult) -> None:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(seed)
    cenv = CandidateEnv(task, candidate, cfg.num_envs, seed, hook, ctx)
    modules = make_sac_modules(cenv.obs_dim, cenv.base.action_spec, cfg)
    buffer = make_replay_buffer(cfg)
    batches = max(1, cfg.frames // cfg.frames_per_batch)
    total = batches * cfg.frames_per_batch
    policy, random_frames, keys, prior = modules.actor, cfg.init_random_frames, BUFFER_KEYS, None
    if has_impls(hook, "action_prior") and ctx is not None:  # a behaviour prior acts from the first step
        spec = modules.action_spec.space
        prior = PriorBehaviour(modules.actor, PriorSource(hook, ctx, task, low=spec.low, high=spec.high), random_frames)
        policy, random_frames, keys = prior, 0, BUFFER_KEYS + PRIOR_KEYS
    collector = Collector(cenv.env, policy, frames_per_batch=cfg.frames_per_batch, total_frames=total,
                          init_random_frames=random_frames, trust_policy=True, track_traj_ids=False,
                          auto_register_policy_transforms=False, postproc=cenv.postproc)

    def evaluate_now(frames: int) -> list[Episode]:
        def act(obs: torch.Tensor) -> torch.Tensor:
            return act_deterministic(modules, cenv.augment(obs))

        return evaluate_and_record(task, act, cfg.eval_episodes, seed=seed + 10_000, frames=frames, result=result,
                                   ctx=ctx, hook=hook)

    if hook is not None:
        hook.on_train_start(train=ctx)
    bar = progress.add_task(f"train {candidate.id}", total=total) if progress is not None else None
    frames, train_seconds, next_eval, owed = 0, 0.0, cfg.eval_every or math.inf, 0.0
    log_every = max(1, batches // 100)  # ~100 metric points per run
    corr, returns, stats = np.zeros(6), [], {}
    tick = time.perf_counter()
    try:
        for i, batch in enumerate(collector):
            frames += batch.numel()
            if ctx is not None:
                ctx.frames = frames
            if hook is not None:
                hook.on_rollout(train=ctx, batch=batch)
            if cenv.rewrites_reward:
                corr += corr_sums(batch)
            buffer.extend(batch.reshape(-1).select(*keys))
            if frames >= cfg.init_random_frames and len(buffer) >= cfg.batch_size:
                owed += batch.numel() * cfg.updates_per_frame
                losses = imitated = None  # updates_per_frame < 1: a batch may owe no update yet
                while owed >= 1.0:
                    sample = buffer.sample()
                    losses = sac_update(modules, sample)
                    if prior is not None and prior.source.imitation > 0:
                        imitated = imitation_step(modules.actor, modules.optimizers[1], sample, prior.source.imitation)
                    owed -= 1.0
                if losses is not None:
                    stats = {"losses/qvalue_loss": float(losses["loss_qvalue"]),
                             "losses/actor_loss": float(losses["loss_actor"]),
                             "losses/alpha_loss": float(losses["loss_alpha"]), "losses/alpha": float(losses["alpha"])}
                    if imitated is not None:
                        stats["losses/imitation_loss"] = imitated
            finished = cenv.base.pop_finished()
            returns += [r for r, _ in finished]
            now = time.perf_counter()
            train_seconds += now - tick
            stats["charts/fps"] = frames / train_seconds
            if finished:
                stats["charts/episodic_return"] = float(np.mean([r for r, _ in finished]))
            if ctx is not None and ((i + 1) % log_every == 0 or i + 1 == batches):
                for key, value in stats.items():
                    ctx.log_metric(key, value)
            if cenv.program_reward is not None and ((i + 1) % max(1, batches // 10) == 0 or i + 1 == batches):
                for name, mean in cenv.program_reward.pop_components().items():
                    result.components.setdefault(name, []).append((frames, mean))
                    if ctx is not None:
                        ctx.log_metric(f"reward/{name}", mean)
            if frames >= next_eval and frames < total:
                evaluate_now(frames)
                next_eval += cfg.eval_every
            if bar is not None and (i % 20 == 0 or i + 1 == batches):
                last = f"{returns[-1]:.1f}" if returns else "-"
                progress.update(bar, completed=frames,
                                description=f"train {candidate.id} {stats['charts/fps']:.0f} fps return {last}")
            tick = time.perf_counter()
    finally:
        collector.shutdown()
        cenv.close()

    result.frames = frames
    result.metrics.update(stats)
    result.metrics["charts/fps"] = frames / max(train_seconds, 1e-9)
    result.metrics.update(cenv.program_metrics)
    result.metrics.update(cenv.macro_metrics())
    if prior is not None:
        result.metrics.update(prior.source.metrics())
    if returns:
        result.metrics["charts/episodic_return"] = float(np.mean(returns[-20:]))
    if cenv.rewrites_reward and corr[0] > 1:
        result.metrics["reward/env_correlation"] = pearson(corr)
        if ctx is not None:
            ctx.log_metric("reward/env_correlation", result.metrics["reward/env_correlation"])
    episodes = evaluate_now(frames)
    if episodes:
        result.episodes = episodes
        result.fitness = task.fitness(episodes)
    if wants_saved_policy(ctx):
        result.policy_path = save_policy({"algorithm": "sac", "obs_dim": cenv.obs_dim, "hidden": list(cfg.hidden),
                                          "actor": modules.actor.state_dict(), "qvalue": modules.loss.qvalue_network_params.to_dict()},
                                         candidate.id)
