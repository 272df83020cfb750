"""PPO on TorchRL: train one candidate and score it on the task's ground truth.

Reads top to bottom: the config, the minibatch data and the loss's gradient, the
advantages, then the loop (collect, GAE, update epochs, evaluate, log). TorchRL pieces:
``Collector`` for rollouts (over the candidate's ``TransformedEnv``), the collected
``TensorDict`` batch that hooks see. The update itself runs on plain tensors: the
actor and critic live in one flat parameter tensor (:class:`FlatActorCritic`), the
clipped loss's gradient is written out (:func:`ppo_gradients`, the same loss as
TorchRL's ``ClipPPOLoss``, which a test checks against autograd), the gradient is
clipped with one norm and Adam's fused kernel steps the flat tensor (:class:`FlatAdam`);
GAE is one triangular solve (:func:`gae`). At the default settings (20 epochs over
256-frame batches, two hidden layers of 64) a minibatch step costs ~0.45 ms of CPU
against ~1.8 ms through autograd and ``ClipPPOLoss`` (``docs/scaling.md``).

Other speed notes (CartPole, 8 envs): a thin env wrapper (:mod:`core.train.envs`), a
collection policy without distribution objects, the collected batch indexed directly
(no replay buffer), evaluation outside the timed part. ``time/<phase>_s`` metrics say
where the training time went (rollout, reward, advantage, update).

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

from core.envs.task import Task
from core.records import Candidate, Episode, TrainResult
from core.train.common import (CandidateEnv, config_from, corr_sums, pearson, save_policy, split_env_params,  # noqa: F401
                               train_safely, wants_saved_policy)
from core.config import Settings
from core.context import TrainContext
from core.train.evaluate import evaluate_and_record
from core.train.networks import FlatActorCritic, FlatAdam, SamplingPolicy, build_networks

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


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


@dataclass
class Frames:
    """A batch (or minibatch) of frames as plain tensors, one row per frame."""

    obs: torch.Tensor  # [N, D] policy input
    action: torch.Tensor  # [N, 1] int64 (categorical) or [N, A] (Gaussian)
    log_prob: torch.Tensor  # [N, 1] log-probability of the action under the collecting policy
    advantage: torch.Tensor  # [N, 1] GAE advantage
    target: torch.Tensor  # [N, 1] value target (advantage + value)

    def take(self, index: torch.Tensor) -> Frames:
        return Frames(*(t.index_select(0, index) for t in (self.obs, self.action, self.log_prob, self.advantage,
                                                           self.target)))

    def normalized(self) -> Frames:
        """The same frames with standardised advantages (``ClipPPOLoss``'s ``normalize_advantage``)."""
        adv = self.advantage
        if adv.numel() > 1:
            adv = (adv - adv.mean()) / adv.std().clamp_min(1e-6)
        return Frames(self.obs, self.action, self.log_prob, adv, self.target)


def ppo_gradients(model: FlatActorCritic, mb: Frames, log_bounds: tuple[float, float], vf_coef: float,
                  ent_coef: float, report: bool = False) -> dict[str, float]:
    """Write the gradient of the clipped PPO loss on ``mb`` into ``model.grad``.

    The loss is ``ClipPPOLoss``'s (advantages already normalised in ``mb``)::

        w = log pi(a|s) - log pi_old(a|s)
        L = -mean(min(e^w A, e^clamp(w, *log_bounds) A)) + vf_coef mean((V(s) - target)^2)
            - ent_coef mean(H(pi(.|s)))

    ``d L / d w = -e^w A / N`` where the unclipped term is the minimum, 0 elsewhere; the
    log-probability's own gradient is ``onehot(a) - softmax`` (categorical) or
    ``z / std`` and ``z^2 - 1`` for the mean and ``log std`` (Gaussian, ``z = (a - mean) / std``).
    ``tests/core/train/test_ppo.py`` checks the result against autograd on ``ClipPPOLoss``.

    :param report: also return the loss terms (``policy``, ``value``; floats) for logging.
    """
    head, value = model.forward(mb.obs)
    n = head.shape[0]
    if model.gaussian:
        log_std = model.log_std
        z = (mb.action - head) / log_std.exp()
        log_prob = (-0.5 * z * z - log_std - _HALF_LOG_2PI).sum(-1, keepdim=True)
    else:
        logp_all = torch.log_softmax(head, -1)
        log_prob = logp_all.gather(-1, mb.action)
    log_weight = log_prob - mb.log_prob
    gain = log_weight.exp().mul_(mb.advantage)
    clipped = log_weight.clamp(*log_bounds).exp_().mul_(mb.advantage)
    d_logp = torch.where(gain <= clipped, gain, 0.0).mul_(-1.0 / n)  # dL/dw = dL/dlogp
    if model.gaussian:
        d_head = d_logp * z / log_std.exp()
        model.grad_log_std.copy_((d_logp * (z * z - 1)).sum(0)).sub_(ent_coef)
    else:
        prob = logp_all.exp()
        d_head = (prob * d_logp).neg_().scatter_add_(-1, mb.action, d_logp)
        if ent_coef:
            entropy = (prob * logp_all).sum(-1, keepdim=True).neg_()
            d_head.addcmul_(prob, logp_all + entropy, value=ent_coef / n)
    d_value = (value - mb.target).mul_(2.0 * vf_coef / n)
    model.backward(d_head, d_value)
    if not report:
        return {}
    return {"policy": float(-torch.minimum(gain, clipped).mean()),
            "value": float((value - mb.target).pow(2).mean())}


def gae(reward: torch.Tensor, value: torch.Tensor, next_value: torch.Tensor, done: torch.Tensor,
        terminated: torch.Tensor, gamma: float, lmbda: float) -> torch.Tensor:
    """Generalised advantage estimates (Schulman et al. 2016) of ``[*B, T, 1]`` trajectories.

    ``A_t = delta_t + gamma lmbda (1 - done_t) A_{t+1}`` with
    ``delta_t = r_t + gamma (1 - terminated_t) V(s_{t+1}) - V(s_t)`` (a truncated episode
    bootstraps from its final observation's value) is a bidiagonal linear system in
    ``A``, solved as one triangular solve per trajectory instead of a Python loop over
    ``T``: the values of TorchRL's ``generalized_advantage_estimate``.
    """
    delta = reward + gamma * next_value * (~terminated) - value
    decay = (gamma * lmbda) * (~done[..., :-1, 0]).to(value.dtype)
    system = torch.diag_embed(-decay, offset=1)  # A_t - decay_t A_{t+1}; the unit diagonal is implied
    return torch.linalg.solve_triangular(system, delta, upper=True, unitriangular=True)


class _PhaseClock:
    """Seconds spent per phase of the loop (``time/<phase>_s`` metrics): laps and timed calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"rollout": 0.0, "reward": 0.0, "advantage": 0.0, "update": 0.0}
        self._last = time.perf_counter()
        self._inside = 0.0  # timed-call seconds inside the current lap

    def lap(self, phase: str, since: float | None = None) -> None:
        """Add the time since the last lap (or since ``since``) to ``phase``, less timed calls in between."""
        now = time.perf_counter()
        self.seconds[phase] += now - (self._last if since is None else since) - self._inside
        self._last, self._inside = now, 0.0

    def timed(self, phase: str, fn: Any) -> Any:
        """``fn`` wrapped so that its time counts to ``phase`` (None stays None)."""
        if fn is None:
            return None

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.seconds[phase] += spent
                self._inside += spent
        return call


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
        self.nets, self.model = nets, FlatActorCritic(nets.actor_net, nets.critic_net)
        optim = FlatAdam(self.model.params, lr=cfg.lr, eps=1e-5)  # one fused kernel per step
        policy = SamplingPolicy(self.model.actor, nets.discrete, "action_log_prob")
        batches = max(1, cfg.frames // cfg.frames_per_batch)
        clock = _PhaseClock()
        collector = Collector(self.env, policy, frames_per_batch=cfg.frames_per_batch,
                              total_frames=batches * cfg.frames_per_batch, trust_policy=True,
                              track_traj_ids=False, auto_register_policy_transforms=False,
                              postproc=clock.timed("reward", cenv.postproc))
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
                clock.lap("rollout", since=tick)  # env steps, policy, per-step transforms (less the reward program)
                frames += batch.numel()
                if ctx is not None:
                    ctx.frames = frames
                if hook is not None:
                    hook.on_rollout(train=ctx, batch=batch)
                    clock.lap("reward")
                frac = 1.0 - i / batches if cfg.anneal_lr else 1.0
                optim.lr = cfg.lr * frac
                data = self._advantages(batch)
                clock.lap("advantage")
                stats = self._update(data, optim, cfg.clip * frac)
                clock.lap("update")
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
        result.metrics.update({f"time/{phase}_s": seconds for phase, seconds in clock.seconds.items()})
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

        def own(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # copies, not views of the flat tensor
            return {k: v.clone() for k, v in state.items()}

        return {"algorithm": "ppo", "obs_dim": self.cenv.obs_dim, "hidden": list(self.cfg.hidden),
                "discrete": nets.discrete, "actor": own(nets.actor_net.state_dict()),
                "critic": own(nets.critic_net.state_dict())}

    def _update(self, frames: Frames, optim: FlatAdam, clip: float) -> dict[str, float]:
        """``epochs`` passes of minibatch updates; the last minibatch's losses and the batch's entropy."""
        cfg, model = self.cfg, self.model
        n = frames.obs.shape[0]
        size = min(cfg.minibatch, n)
        whole = frames.normalized() if size == n else None  # the same minibatch every epoch: normalise once
        bounds = (math.log1p(-clip), math.log1p(clip))
        last = (n // size) - 1
        losses: dict[str, float] = {}
        for epoch in range(cfg.epochs):
            order = torch.randperm(n) if whole is None else None
            for k in range(n // size):
                mb = whole if order is None else frames.take(order[k * size:(k + 1) * size]).normalized()
                report = epoch == cfg.epochs - 1 and k == last
                losses = ppo_gradients(model, mb, bounds, cfg.vf_coef, cfg.ent_coef, report=report)
                scale = cfg.max_grad_norm / (float(model.grad.norm()) + 1e-6)  # clip_grad_norm_ on the flat gradient
                if scale < 1.0:
                    model.grad.mul_(scale)
                optim.step()
        stats = {"losses/policy_loss": losses["policy"], "losses/value_loss": losses["value"]}
        stats["losses/entropy"] = float(self.nets.entropy(frames.obs).mean())  # once per batch, on the whole batch
        return stats

    def _advantages(self, batch: Any) -> Frames:
        """The batch's frames as plain tensors, with GAE advantages and value targets."""
        cfg = self.cfg
        obs, next_obs = batch.get("observation"), batch.get(("next", "observation"))
        values = self.model.critic(torch.cat([obs, next_obs]).reshape(-1, obs.shape[-1]))
        value, next_value = values.reshape(2, *obs.shape[:-1], 1).unbind(0)
        adv = gae(batch.get(("next", "reward")), value, next_value, batch.get(("next", "done")),
                  batch.get(("next", "terminated")), cfg.gamma, cfg.gae_lambda)
        action = batch.get("action")
        action = action.reshape(-1, 1) if self.nets.discrete else action.reshape(-1, action.shape[-1])
        return Frames(obs.reshape(-1, obs.shape[-1]), action, batch.get("action_log_prob").reshape(-1, 1),
                      adv.reshape(-1, 1), (adv + value).reshape(-1, 1))

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
