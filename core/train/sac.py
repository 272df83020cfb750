"""SAC on TorchRL: off-policy training for continuous actions, same contract as PPO.

Soft Actor-Critic (Haarnoja et al., 2018, "Soft Actor-Critic Algorithms and
Applications"): a TanhNormal actor, twin Q networks with Polyak-averaged targets and an
automatically tuned entropy temperature. The networks are TorchRL's
(``ProbabilisticActor``, ``ValueOperator``) and so is the loss module holding their
parameters (``SACLoss``: evaluation, saving, ``state_dict``); the gradient step is
:class:`core.train.networks.FlatSAC`, the same losses and gradients on flat parameter
tensors with the backward pass written out (``docs/scaling.md``, "SAC"). Collection is a
plain loop (:func:`collect`: uniformly random actions for the first
``init_random_frames``), replay a uniform ring over one tensor (:class:`FlatReplay`).
The env, the candidate's programs and hooks, evaluation and saving are the shared ones
of :mod:`core.train.common`. ``time/<phase>_s`` metrics (:data:`PHASES`) say where the
training time went. With ``trainer.normalize_reward`` (on by default) the gradient step sees the
replayed reward divided by the running scale of :class:`core.train.common.RewardNormalizer`
(``train/reward_scale``); the replay keeps the task's reward.

Building blocks other trainers reuse (LaRes trains a population with them):

- :func:`make_sac_modules` ``(obs_dim, action_spec, cfg) -> SACModules``: networks,
  loss, target updater and optimisers of one agent;
- :func:`make_replay_buffer` ``(cfg) -> ReplayBuffer`` (TorchRL's; the trainer uses :class:`FlatReplay`);
- :func:`sac_update` ``(modules, batch) -> dict[str, Tensor]``: one gradient step of
  critic, actor and temperature, then the target update;
- :func:`act_deterministic` ``(modules, obs) -> action``: the greedy action.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.data import Bounded, LazyTensorStorage, ReplayBuffer, TensorSpec
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

from core.config import Settings
from core.context import TrainContext
from core.envs.task import Task
from core.records import Candidate, Episode, TrainResult
from core.train.action_prior import PRIOR_KEYS, PriorBehaviour, PriorSource, imitation_step
from core.train.common import (
    CandidateEnv,
    config_from,
    corr_sums,
    pearson,
    reward_normalizer,
    save_policy,
    train_safely,
    wants_saved_policy,
)
from core.train.evaluate import evaluate_and_record
from core.train.networks import FlatParamsAdam, FlatSAC, SquashedGaussian
from core.train.transforms import has_impls

#: what the replay buffer keeps of a collected batch (all SACLoss reads)
BUFFER_KEYS = (
    "observation",
    "action",
    ("next", "observation"),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
)


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
    normalize_reward: bool = True  # the learner's reward / running std of a discounted return (common.RewardNormalizer)
    reward_clip: float = 10.0  # the normalised reward's clip range +-reward_clip (0: none); only with normalize_reward
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
        if self.reward_clip < 0:
            raise ValueError(f"trainer.reward_clip must be >= 0 (0: no clip), got {self.reward_clip}")

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.rollout_steps


# -- reusable pieces ---------------------------------------------------------------------


@dataclass
class SACModules:
    """One SAC agent: what :func:`sac_update` needs and what evaluation runs.

    ``actor``, ``qvalue``, ``loss`` and ``target`` are TorchRL's (evaluation, saving,
    ``state_dict``); their parameters are views of :attr:`flat`'s tensors, which the
    fused update steps.
    """

    actor: ProbabilisticActor  # observation -> action (TanhNormal within the action bounds)
    qvalue: ValueOperator  # (observation, action) -> state_action_value
    loss: SACLoss  # holds the parameters: actor, twin critics, target critics, log_alpha
    target: SoftUpdate
    optimizers: list[FlatParamsAdam]  # critic, actor, temperature (torch.optim.Adam's interface)
    action_spec: TensorSpec
    flat: FlatSAC  # the fused update over the same parameters


def _layers(params: TensorDictBase) -> list[torch.Tensor]:
    """An MLP's parameters in layer order (weight, bias, ...) from a ``module.<i>.weight`` TensorDict."""
    items = params.flatten_keys(".").items()
    return [
        v
        for _, v in sorted(
            items, key=lambda kv: ([int(k) for k in kv[0].split(".") if k.isdigit()], kv[0].endswith("bias"))
        )
    ]


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
    extractor = NormalParamExtractor()
    actor_net = nn.Sequential(
        MLP(in_features=obs_dim, out_features=2 * act_dim, num_cells=list(cfg.hidden), activation_class=nn.ReLU),
        extractor,
    )
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": low, "high": high},
        spec=spec,
    )
    q_net = MLP(in_features=obs_dim + act_dim, out_features=1, num_cells=list(cfg.hidden), activation_class=nn.ReLU)
    qvalue = ValueOperator(q_net, in_keys=["observation", "action"])
    loss = SACLoss(
        actor,
        qvalue,
        num_qvalue_nets=2,
        loss_function="l2",
        alpha_init=cfg.alpha_init,
        deactivate_vmap=True,
        target_entropy=cfg.target_entropy,
        action_spec=spec,
    )
    loss.make_value_estimator(gamma=cfg.gamma)
    target = SoftUpdate(loss, tau=cfg.tau)
    head = SquashedGaussian(
        shift=float(extractor.scale_mapping.bias),
        min_scale=float(extractor.scale_mapping.min_val),
        scale_lb=float(extractor.scale_lb),
        mid=(high + low) / 2,
        half=(high - low) / 2,
    )
    actor_params = [p for m in actor_net[0] if isinstance(m, nn.Linear) for p in (m.weight, m.bias)]  # type: ignore[attr-defined]
    flat = FlatSAC(
        actor_params,
        _layers(loss.qvalue_network_params),
        _layers(loss.target_qvalue_network_params),
        loss.log_alpha,
        head,
        gamma=cfg.gamma,
        tau=cfg.tau,
        target_entropy=float(loss.target_entropy),
        lr=cfg.lr,
        alpha_lr=cfg.alpha_lr,
    )
    return SACModules(actor, qvalue, loss, target, [flat.critic_opt, flat.actor_opt, flat.alpha_opt], spec, flat)


def make_replay_buffer(cfg: SACConfig) -> ReplayBuffer:
    """A uniform TorchRL replay buffer of ``cfg.buffer_size`` frames sampling ``cfg.batch_size``.

    The trainer itself uses the leaner :class:`FlatReplay`; this one is for code that wants TorchRL's.
    """
    return ReplayBuffer(storage=LazyTensorStorage(cfg.buffer_size), batch_size=cfg.batch_size)


class FlatReplay:
    """Uniform replay over one preallocated ``[capacity, width]`` tensor (a ring).

    Each key of the stored batches is a column range (booleans as 0/1), so that adding a
    batch is one copy and sampling is one ``index_select``; :meth:`sample` gives the
    columns back as a dict of views (booleans restored).
    """

    def __init__(self, capacity: int, keys: tuple) -> None:
        self.capacity, self.keys = int(capacity), keys
        self.storage: torch.Tensor | None = None
        self.columns: dict[Any, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        self.size = self.cursor = 0

    def __len__(self) -> int:
        return self.size

    def extend(self, batch: TensorDictBase) -> None:
        """Add the rows of a batch (any batch shape: its elements are the rows) holding :attr:`keys`."""
        values = [batch.get(k) for k in self.keys]
        n, dims = batch.numel(), batch.batch_dims
        if self.storage is None:
            at = 0
            for k, v in zip(self.keys, values):
                width = math.prod(v.shape[dims:])
                self.columns[k] = (at, at + width, v.dtype, tuple(v.shape[dims:]))
                at += width
            self.storage = torch.zeros(self.capacity, at)
        rows = torch.cat([v.reshape(n, -1).to(torch.float32) for v in values], 1)
        end = self.cursor + n
        if end <= self.capacity:
            self.storage[self.cursor : end] = rows
        else:
            self.storage[torch.arange(self.cursor, end) % self.capacity] = rows
        self.cursor, self.size = end % self.capacity, min(self.capacity, self.size + n)

    def sample(self, n: int) -> dict[Any, torch.Tensor]:
        """``n`` rows drawn uniformly with replacement: key -> ``[n, ...]``."""
        rows = self.storage.index_select(0, torch.randint(self.size, (n,)))  # type: ignore[union-attr]
        out = {}
        for k, (a, b, dtype, shape) in self.columns.items():
            col = rows[:, a:b].view(n, *shape)
            out[k] = col.to(dtype) if dtype != torch.float32 else col
        return out


def sac_update(modules: SACModules, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """One gradient step of critics, actor and temperature on ``batch``; then the targets.

    ``batch`` holds ``SACLoss``'s keys (``observation``, ``action``, ``("next", "reward")``,
    ``("next", "observation")``, ``("next", "terminated")``).
    :return: the detached losses and ``alpha``.
    """
    losses = modules.flat.update(
        batch.get("observation"),
        batch.get("action"),
        batch.get(("next", "reward")),
        batch.get(("next", "observation")),
        batch.get(("next", "terminated")),
    )
    modules.flat.update_targets()
    return losses


class SamplingActor(nn.Module):
    """The collection policy: writes a sampled ``action`` (the fused actor, no TensorDict plumbing)."""

    def __init__(self, flat: FlatSAC) -> None:
        super().__init__()
        self.flat = flat

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        td.set("action", self.flat.act(td.get("observation")))
        return td


@torch.no_grad()
def act_deterministic(modules: SACModules, obs: torch.Tensor) -> torch.Tensor:
    """The actor's greedy action (the squashed mean) for a batch of observations."""
    td = TensorDict({"observation": obs}, batch_size=obs.shape[:1])
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        return modules.actor(td).get("action")


# -- training ----------------------------------------------------------------------------

#: the loop's phases (``time/<phase>_s`` metrics): collection (env steps, the policy,
#: per-step transforms and the reward program), replay (adding and sampling), the
#: gradient step, the target update, and the rest (hooks, metrics, progress)
PHASES = ("rollout", "replay", "update", "target", "other")


def _lap(phases: dict[str, float], phase: str, since: float) -> float:
    now = time.perf_counter()
    phases[phase] += now - since
    return now


def collect(
    env: EnvBase,
    policy: Callable[[TensorDictBase], TensorDictBase],
    batches: int,
    steps: int,
    random_frames: int,
    postproc: Callable[[TensorDictBase], TensorDictBase] | None,
) -> Generator[TensorDictBase, None, None]:
    """``batches`` batches ``[envs, steps]`` from ``env``, as TorchRL's ``Collector`` gives them.

    Uniformly random actions while fewer than ``random_frames`` frames were collected
    (checked per batch), else ``policy``'s; ``postproc`` rewrites each batch. A plain
    loop over ``step_and_maybe_reset``: the ``Collector``'s bookkeeping cost about a
    millisecond a frame, as much as the env and the policy together at one env.
    """
    space = env.action_spec.space
    low, width = space.low, space.high - space.low  # uniform actions as the spec's rand() draws them, cheaper
    td, frames = env.reset(), 0
    for _ in range(batches):
        rows, explore = [], frames >= random_frames
        with torch.no_grad():  # not across the yield: the consumer's gradient step needs autograd
            for _ in range(steps):
                if explore:
                    td = policy(td)
                else:
                    td.set("action", low + width * torch.rand(width.shape))
                step, td = env.step_and_maybe_reset(td)
                rows.append(step)
            batch = rows[0].unsqueeze(1) if steps == 1 else torch.stack(rows, dim=1)
            if postproc is not None:
                batch = postproc(batch)
        frames += batch.numel()
        yield batch


def _as_batch(sample: dict[Any, torch.Tensor]) -> TensorDict:
    """A replay sample as the TensorDict :func:`imitation_step` reads."""
    n = sample["observation"].shape[0]
    return TensorDict({k: v for k, v in sample.items() if isinstance(k, str)}, batch_size=[n])


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


def _run(
    task: Task,
    candidate: Candidate,
    cfg: SACConfig,
    seed: int,
    hook: Any,
    ctx: TrainContext | None,
    progress: Any,
    result: TrainResult,
) -> None:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(seed)
    cenv = CandidateEnv(task, candidate, cfg.num_envs, seed, hook, ctx)
    modules = make_sac_modules(cenv.obs_dim, cenv.base.action_spec, cfg)
    buffer = FlatReplay(cfg.buffer_size, BUFFER_KEYS)
    batches = max(1, cfg.frames // cfg.frames_per_batch)
    total = batches * cfg.frames_per_batch
    policy: SamplingActor | PriorBehaviour = SamplingActor(modules.flat)
    random_frames, prior = cfg.init_random_frames, None
    if has_impls(hook, "action_prior") and ctx is not None:  # a behaviour prior acts from the first step
        spec = modules.action_spec.space
        prior = PriorBehaviour(policy, PriorSource(ctx, task, low=spec.low, high=spec.high), random_frames)
        policy, random_frames, buffer = prior, 0, FlatReplay(cfg.buffer_size, BUFFER_KEYS + PRIOR_KEYS)
    collector = collect(cenv.env, policy, batches, cfg.rollout_steps, random_frames, cenv.postproc)
    # trainer.normalize_reward: the replay keeps the task's reward; the gradient step sees it
    # divided by the running scale at sampling time (SB3's replay buffer under VecNormalize)
    reward_norm = reward_normalizer(cfg)

    def evaluate_now(frames: int) -> list[Episode]:
        def act(obs: torch.Tensor) -> torch.Tensor:
            return act_deterministic(modules, cenv.augment(obs))

        return evaluate_and_record(
            task, act, cfg.eval_episodes, seed=seed + 10_000, frames=frames, result=result, ctx=ctx, hook=hook
        )

    if hook is not None:
        hook.on_train_start(train=ctx)
    bar = progress.add_task(f"train {candidate.id}", total=total) if progress is not None else None
    frames, train_seconds, next_eval, owed = 0, 0.0, cfg.eval_every or math.inf, 0.0
    log_every = max(1, batches // 100)  # ~100 metric points per run
    corr, returns, stats = np.zeros(6), [], {}
    phases = dict.fromkeys(PHASES, 0.0)
    flat = modules.flat
    tick = time.perf_counter()
    try:
        for i, batch in enumerate(collector):
            lap = time.perf_counter()
            phases["rollout"] += lap - tick
            frames += batch.numel()
            if ctx is not None:
                ctx.frames = frames
            if hook is not None:
                hook.on_rollout(train=ctx, batch=batch)
            if cenv.rewrites_reward:
                corr += corr_sums(batch)
            lap = _lap(phases, "other", lap)
            buffer.extend(batch)
            if reward_norm is not None:
                reward_norm.update(batch.get(("next", "reward")), batch.get(("next", "done")))
            lap = _lap(phases, "replay", lap)
            if frames >= cfg.init_random_frames and len(buffer) >= cfg.batch_size:
                owed += batch.numel() * cfg.updates_per_frame
                losses = imitated = None  # updates_per_frame < 1: a batch may owe no update yet
                while owed >= 1.0:
                    sample = buffer.sample(cfg.batch_size)
                    lap = _lap(phases, "replay", lap)
                    reward = sample["next", "reward"]
                    if reward_norm is not None:
                        reward = reward_norm.normalize(reward)
                    losses = flat.update(
                        sample["observation"],
                        sample["action"],
                        reward,
                        sample["next", "observation"],
                        sample["next", "terminated"],
                    )
                    lap = _lap(phases, "update", lap)
                    flat.update_targets()
                    lap = _lap(phases, "target", lap)
                    if prior is not None and prior.source.imitation > 0:
                        imitated = imitation_step(
                            modules.actor,
                            modules.optimizers[1],  # type: ignore[arg-type]  # a FlatParamsAdam steps like an Optimizer
                            _as_batch(sample),
                            prior.source.imitation,
                        )
                        lap = _lap(phases, "update", lap)
                    owed -= 1.0
                if losses is not None:
                    stats = {
                        "losses/qvalue_loss": float(losses["loss_qvalue"]),
                        "losses/actor_loss": float(losses["loss_actor"]),
                        "losses/alpha_loss": float(losses["loss_alpha"]),
                        "losses/alpha": float(losses["alpha"]),
                    }
                    if imitated is not None:
                        stats["losses/imitation_loss"] = imitated
                    if reward_norm is not None:
                        stats["train/reward_scale"] = reward_norm.scale
            finished = cenv.base.pop_finished()
            returns += [r for r, _ in finished]
            now = time.perf_counter()
            phases["other"] += now - lap
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
                progress.update(
                    bar,
                    completed=frames,
                    description=f"train {candidate.id} {stats['charts/fps']:.0f} fps return {last}",
                )
            tick = time.perf_counter()
    finally:
        collector.close()
        cenv.close()

    result.frames = frames
    result.metrics.update(stats)
    result.metrics.update({f"time/{phase}_s": seconds for phase, seconds in phases.items()})
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
        result.policy_path = save_policy(
            {
                "algorithm": "sac",
                "obs_dim": cenv.obs_dim,
                "hidden": list(cfg.hidden),
                "actor": modules.actor.state_dict(),
                "qvalue": modules.loss.qvalue_network_params.to_dict(),
            },
            candidate.id,
        )
