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

Continuing a policy (EnvGen's one agent across cycles): a candidate with ``start``
begins from that policy's actor, critic and Adam state (loaded into the flat parameter
tensor's views, :meth:`_Run.restore`), anneals lr and clip along the schedule the
policy was on, and with ``keep_policy`` hands its own final state back in the result
(bytes, so it crosses process boundaries; no file is written). ``original_after``
trains the last share of the batches on the original env (a second env, the same
networks and optimizer).

Reward normalisation (``trainer.normalize_reward``, on by default): the advantages and
value targets see the reward divided by the running std of a discounted return
(:class:`core.train.common.RewardNormalizer`, clipped to ``+-reward_clip``), so a reward of
any scale reaches the critic at unit scale; the batch hooks see, episode returns, metrics
and the fitness keep the task's units. Its statistics continue with a continued policy.
``train/reward_scale`` logs the divisor.

Failures of LLM-written code (reward/state programs, hook plugins) are data: ``train``
returns ``TrainResult(ok=False, error=..., error_kind=...)`` instead of raising.
"""

from __future__ import annotations

import hashlib
import io
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import torch
from torchrl.collectors import Collector

from core.config import Settings
from core.context import TrainContext
from core.envs.task import Task
from core.records import Candidate, Episode, TrainResult
from core.train.action_prior import PriorSamplingPolicy, PriorSource
from core.train.common import (
    CandidateEnv,
    config_from,
    corr_sums,
    pearson,
    reward_normalizer,
    save_policy,
    split_env_params as split_env_params,  # re-exported: tests import it from here
    train_safely,
    wants_saved_policy,
)
from core.train.evaluate import evaluate_and_record
from core.train.networks import FlatActorCritic, FlatAdam, SamplingPolicy, build_networks
from core.train.transforms import has_impls

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
    normalize_reward: bool = True  # the learner's reward / running std of a discounted return (common.RewardNormalizer)
    reward_clip: float = 10.0  # the normalised reward's clip range +-reward_clip (0: none); only with normalize_reward
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
        if self.reward_clip < 0:
            raise ValueError(f"trainer.reward_clip must be >= 0 (0: no clip), got {self.reward_clip}")

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
    prior: torch.Tensor | None = None  # [N, n] the action priors' term added to the logits (action_prior hooks)

    def take(self, index: torch.Tensor) -> Frames:
        prior = self.prior.index_select(0, index) if self.prior is not None else None
        return Frames(  # type: ignore[call-arg]
            *(t.index_select(0, index) for t in (self.obs, self.action, self.log_prob, self.advantage, self.target)),
            prior,
        )

    def normalized(self) -> Frames:
        """The same frames with standardised advantages (``ClipPPOLoss``'s ``normalize_advantage``)."""
        adv = self.advantage
        if adv.numel() > 1:
            adv = (adv - adv.mean()) / adv.std().clamp_min(1e-6)
        return Frames(self.obs, self.action, self.log_prob, adv, self.target, self.prior)


def ppo_gradients(
    model: FlatActorCritic,
    mb: Frames,
    log_bounds: tuple[float, float],
    vf_coef: float,
    ent_coef: float,
    report: bool = False,
) -> dict[str, float]:
    """Write the gradient of the clipped PPO loss on ``mb`` into ``model.grad``.

    The loss is ``ClipPPOLoss``'s (advantages already normalised in ``mb``)::

        w = log pi(a|s) - log pi_old(a|s)
        L = -mean(min(e^w A, e^clamp(w, *log_bounds) A)) + vf_coef mean((V(s) - target)^2)
            - ent_coef mean(H(pi(.|s)))

    ``d L / d w = -e^w A / N`` where the unclipped term is the minimum, 0 elsewhere; the
    log-probability's own gradient is ``onehot(a) - softmax`` (categorical) or
    ``z / std`` and ``z^2 - 1`` for the mean and ``log std`` (Gaussian, ``z = (a - mean) / std``).
    ``tests/core/train/test_ppo.py`` checks the result against autograd on ``ClipPPOLoss``.
    With action priors (``mb.prior``), ``pi`` is ``softmax(logits + prior)``, the
    distribution that acted; the prior is constant in the parameters.

    :param report: also return the loss terms (``policy``, ``value``; floats) for logging.
    """
    head, value = model.forward(mb.obs)
    n = head.shape[0]
    if model.gaussian:
        log_std = model.log_std
        z = (mb.action - head) / log_std.exp()
        log_prob = (-0.5 * z * z - log_std - _HALF_LOG_2PI).sum(-1, keepdim=True)
    else:
        logp_all = torch.log_softmax(head if mb.prior is None else head + mb.prior, -1)
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
    return {"policy": float(-torch.minimum(gain, clipped).mean()), "value": float((value - mb.target).pow(2).mean())}


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    done: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    lmbda: float,
) -> torch.Tensor:
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

    The candidate's training fields: ``frames`` replaces ``cfg.frames`` as the budget;
    ``start`` continues that policy (actor, critic and Adam's moments; see
    :meth:`_Run.restore`); ``original_after`` trains that share of the batches last on the
    original env; ``keep_policy`` returns the trained state in ``result.final_policy``.

    :param hook: ``pm.hook`` of the plugin manager, or None (no training hooks).
    :param ctx: the training context hooks receive; one is made when hooks need it.
        Its ``config`` gives the sandbox limits (``sandbox:``) and ``save_policy``.
    :param progress: a ``rich.progress.Progress`` to show a bar in, or None.
    """
    budget = cfg.frames  # the learning-rate schedule's horizon, counted from the policy's first frame
    if candidate.frames > 0:
        cfg = replace(cfg, frames=int(candidate.frames))
    if hook is not None and ctx is None:
        ctx = TrainContext(settings=Settings.of(), task=task, candidate=candidate, seed=seed, total_frames=cfg.frames)
    elif ctx is not None:
        ctx.total_frames = cfg.frames

    def body(result: TrainResult) -> None:
        _Run(task, candidate, cfg, seed, hook, ctx, progress, result, budget).run()

    return train_safely(body, candidate, hook, ctx)


class _Run:
    """One training run; its state lives here so that ``run`` reads as the loop."""

    def __init__(
        self,
        task: Task,
        candidate: Candidate,
        cfg: PPOConfig,
        seed: int,
        hook: Any,
        ctx: TrainContext | None,
        progress: Any,
        result: TrainResult,
        budget: int | None = None,
    ) -> None:
        self.task, self.candidate, self.cfg, self.seed = task, candidate, cfg, seed
        self.hook, self.ctx, self.progress, self.result = hook, ctx, progress, result
        self.budget = cfg.frames if budget is None else budget

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        cfg, result, ctx, hook = self.cfg, self.result, self.ctx, self.hook
        start = self.start_state()
        self.before = int(start["frames"]) if start is not None else 0  # frames the policy trained before
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(self.seed + self.before)  # a continued policy meets new worlds and noise
        stages = self.stages()
        self.cenv = cenv = CandidateEnv(self.task, stages[0][0], cfg.num_envs, self.seed + self.before, hook, ctx)
        self.env, self.base = cenv.env, cenv.base
        nets = build_networks(cenv.obs_dim, self.base.action_spec, cfg.hidden)
        self.nets, self.model = nets, FlatActorCritic(nets.actor_net, nets.critic_net)
        self.optim = FlatAdam(self.model.params, lr=cfg.lr, eps=1e-5)  # one fused kernel per step
        self.reward_norm = reward_normalizer(cfg)  # the learner's reward scale (trainer.normalize_reward), or None
        if start is not None:
            try:
                self.restore(start)
            except Exception:
                cenv.close()
                raise
        self.policy: SamplingPolicy | PriorSamplingPolicy = SamplingPolicy(
            self.model.actor, nets.discrete, "action_log_prob"
        )
        self.prior = None  # the action_prior hooks, combined with the policy in collection, loss and evaluation
        if has_impls(hook, "action_prior") and ctx is not None:
            n = int(self.base.action_spec.n) if nets.discrete else None
            self.prior = PriorSamplingPolicy(self.model.actor, PriorSource(ctx, self.task, n_actions=n), self.policy)
            self.policy = self.prior
        batches = sum(n for _, n in stages)
        # lr and clip anneal over the trainer's budget from the policy's first batch: a chain of
        # continued trainings follows one schedule (a lone training: over its own batches)
        fpb = cfg.frames_per_batch
        self.schedule = (self.before // fpb, max(self.budget // fpb, self.before // fpb + batches))
        self.clock = _PhaseClock()
        if hook is not None:
            hook.on_train_start(train=ctx)
        self.bar = (
            self.progress.add_task(f"train {self.candidate.id}", total=batches * fpb)
            if self.progress is not None
            else None
        )

        self.frames, self.batch, self.train_seconds, self.next_eval = 0, 0, 0.0, cfg.eval_every or math.inf
        self.sample_every = max(1, batches // 10)  # reward components ~10 times per run
        self.corr = np.zeros(6)  # n, sum x, sum y, sum xx, sum yy, sum xy (program vs env reward)
        self.returns: list[float] = []
        self.stats: dict[str, float] = {}
        self.total = batches * fpb
        macro_metrics: dict[str, float] = {}
        for k, (stage, n) in enumerate(stages):
            if k:  # the next stage's env (the original one), the same networks
                seed = self.seed + self.before + self.frames
                self.cenv = CandidateEnv(self.task, stage, cfg.num_envs, seed, hook, ctx)
                self.env, self.base = self.cenv.env, self.cenv.base
                if self.reward_norm is not None:
                    self.reward_norm.reset_returns()
            try:
                self.train_stage(n)
            finally:
                self.cenv.close()
            for key, value in self.cenv.macro_metrics().items():
                macro_metrics[key] = macro_metrics.get(key, 0.0) + value
        cenv = self.cenv  # the last stage's: evaluation uses its state transforms and macros

        frames, stats, corr = self.frames, self.stats, self.corr
        result.frames = frames
        result.metrics.update(stats)
        result.metrics["charts/fps"] = frames / max(self.train_seconds, 1e-9)
        result.metrics.update({f"time/{phase}_s": seconds for phase, seconds in self.clock.seconds.items()})
        result.metrics.update(cenv.program_metrics)
        if self.returns:
            result.metrics["charts/episodic_return"] = float(np.mean(self.returns[-20:]))
        result.metrics.update(macro_metrics)
        if self.prior is not None:
            result.metrics.update(self.prior.source.metrics())
        if cenv.rewrites_reward and corr[0] > 1:
            result.metrics["reward/env_correlation"] = pearson(corr)
            if ctx is not None:
                ctx.log_metric("reward/env_correlation", result.metrics["reward/env_correlation"])
        if self.before:
            result.metrics["train/start_frames"] = float(self.before)
        episodes = self._evaluate(frames)
        if episodes:
            result.episodes = episodes
            result.fitness = self.task.fitness(episodes)
        if wants_saved_policy(ctx):
            result.policy_path = save_policy(self._policy_state(), self.candidate.id)
        if self.candidate.keep_policy:
            result.final_policy = self.final_state()

    def stages(self) -> list[tuple[Candidate, int]]:
        """``(candidate, batches)`` per stage: the candidate's envs, then the original env for
        ``original_after`` of the batches; a stage of no batches is left out."""
        total = max(1, self.cfg.frames // self.cfg.frames_per_batch)
        last = int(round(min(1.0, max(0.0, float(self.candidate.original_after))) * total))
        stages = [(self.candidate, total - last), (replace(self.candidate, envs=[]), last)]
        return [(candidate, n) for candidate, n in stages if n > 0]

    def train_stage(self, batches: int) -> None:
        """Collect and update ``batches`` batches on the current stage's env."""
        cfg, ctx, hook, cenv, clock = self.cfg, self.ctx, self.hook, self.cenv, self.clock
        collector = Collector(
            self.env,
            self.policy,
            frames_per_batch=cfg.frames_per_batch,
            total_frames=batches * cfg.frames_per_batch,
            trust_policy=True,
            track_traj_ids=False,
            auto_register_policy_transforms=False,
            postproc=clock.timed("reward", cenv.postproc),
        )
        done, horizon = self.schedule
        tick = time.perf_counter()
        try:
            for batch in collector:
                clock.lap("rollout", since=tick)  # env steps, policy, per-step transforms (less the reward program)
                self.frames += batch.numel()
                if ctx is not None:
                    ctx.frames = self.frames
                if hook is not None:
                    hook.on_rollout(train=ctx, batch=batch)
                    clock.lap("reward")
                frac = 1.0 - (done + self.batch) / horizon if cfg.anneal_lr else 1.0
                self.optim.lr = cfg.lr * frac
                data = self._advantages(batch)
                clock.lap("advantage")
                stats = self.stats = self._update(data, self.optim, cfg.clip * frac)
                if self.reward_norm is not None:
                    stats["train/reward_scale"] = self.reward_norm.scale
                clock.lap("update")
                self.batch += 1
                if cenv.rewrites_reward:
                    self.corr += corr_sums(batch)
                finished = self.base.pop_finished()
                self.returns += [r for r, _ in finished]
                now = time.perf_counter()
                self.train_seconds += now - tick
                stats["charts/fps"] = self.frames / self.train_seconds
                if finished:
                    stats["charts/episodic_return"] = float(np.mean([r for r, _ in finished]))
                if ctx is not None:
                    for key, value in stats.items():
                        ctx.log_metric(key, value)
                sample = self.batch % self.sample_every == 0 or self.frames >= self.total
                if cenv.program_reward is not None and sample:
                    self._sample_components(self.frames)
                if self.frames >= self.next_eval and self.frames < self.total:
                    self._evaluate(self.frames)
                    self.next_eval += cfg.eval_every
                if self.bar is not None:
                    last = f"{self.returns[-1]:.1f}" if self.returns else "-"
                    self.progress.update(
                        self.bar,
                        completed=self.frames,
                        description=(f"train {self.candidate.id} {stats['charts/fps']:.0f} fps return {last}"),
                    )
                tick = time.perf_counter()
        finally:
            collector.shutdown()

    # -- continuing a policy ------------------------------------------------------------
    def start_state(self) -> dict[str, Any] | None:
        """The state the candidate's ``start`` holds (what :meth:`final_state` wrote), or None."""
        start = self.candidate.start
        if start is None:
            return None
        if hashlib.sha256(start.state).hexdigest() != start.sha256:
            raise ValueError(f"the start policy from {start.source} does not match its sha256")
        return torch.load(io.BytesIO(start.state), map_location=self.cfg.device, weights_only=True)

    def restore(self, state: dict[str, Any]) -> None:
        """Load a continued policy's actor, critic and Adam state into this run's networks.

        ``load_state_dict`` copies into the modules' parameters in place: they stay views of
        the flat parameter tensor that the update steps. Adam's moments and step count are
        the flat tensors of the same layout. With ``normalize_reward`` the reward statistics
        continue too (the critic learned values in their scale); a state without them (one
        trained without normalisation) starts them afresh.
        """
        mine = {"obs_dim": self.cenv.obs_dim, "hidden": list(self.cfg.hidden), "discrete": self.nets.discrete}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            source = self.candidate.start.source if self.candidate.start is not None else "?"
            raise ValueError(
                f"the start policy from {source} does not fit this training: "
                f"it has {theirs}, this candidate's networks need {mine}"
            )
        self.nets.actor_net.load_state_dict(state["actor"])
        self.nets.critic_net.load_state_dict(state["critic"])
        optim = state.get("optimizer")
        if optim is not None:
            if self.optim._fallback is not None:
                self.optim._fallback.load_state_dict(optim["fallback"])
            else:
                for name in ("exp_avg", "exp_avg_sq", "steps"):
                    getattr(self.optim, name).copy_(optim[name])
        if self.reward_norm is not None and state.get("reward_norm") is not None:
            self.reward_norm.load_state_dict(state["reward_norm"])

    def final_state(self) -> bytes:
        """The trained state as bytes: both networks, Adam's state, the reward statistics (with
        ``normalize_reward``) and the frames trained so far."""
        optim = self.optim
        state = self._policy_state()
        state["optimizer"] = (
            {"fallback": optim._fallback.state_dict()}
            if optim._fallback is not None
            else {name: getattr(optim, name).clone() for name in ("exp_avg", "exp_avg_sq", "steps")}
        )
        if self.reward_norm is not None:
            state["reward_norm"] = self.reward_norm.state_dict()
        state["frames"] = self.before + self.frames
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _policy_state(self) -> dict[str, Any]:
        """What the saved policy file holds: both networks and how to rebuild them."""
        nets = self.nets

        def own(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # copies, not views of the flat tensor
            return {k: v.clone() for k, v in state.items()}

        return {
            "algorithm": "ppo",
            "obs_dim": self.cenv.obs_dim,
            "hidden": list(self.cfg.hidden),
            "discrete": nets.discrete,
            "actor": own(nets.actor_net.state_dict()),
            "critic": own(nets.critic_net.state_dict()),
        }

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
                mb = whole if order is None else frames.take(order[k * size : (k + 1) * size]).normalized()
                report = epoch == cfg.epochs - 1 and k == last
                losses = ppo_gradients(model, mb, bounds, cfg.vf_coef, cfg.ent_coef, report=report)  # type: ignore[arg-type]
                scale = cfg.max_grad_norm / (float(model.grad.norm()) + 1e-6)  # clip_grad_norm_ on the flat gradient
                if scale < 1.0:
                    model.grad.mul_(scale)
                optim.step()
        stats = {"losses/policy_loss": losses["policy"], "losses/value_loss": losses["value"]}
        stats["losses/entropy"] = float(self.nets.entropy(frames.obs).mean())  # once per batch, on the whole batch
        return stats

    def _advantages(self, batch: Any) -> Frames:
        """The batch's frames as plain tensors, with GAE advantages and value targets.

        With ``normalize_reward`` the advantages see the normalised reward; the batch keeps the
        task's (hooks, metrics and the reward correlation read it)."""
        cfg = self.cfg
        obs, next_obs = batch.get("observation"), batch.get(("next", "observation"))
        values = self.model.critic(torch.cat([obs, next_obs]).reshape(-1, obs.shape[-1]))
        value, next_value = values.reshape(2, *obs.shape[:-1], 1).unbind(0)
        reward, done = batch.get(("next", "reward")), batch.get(("next", "done"))
        if self.reward_norm is not None:
            self.reward_norm.update(reward, done)
            reward = self.reward_norm.normalize(reward)
        adv = gae(reward, value, next_value, done, batch.get(("next", "terminated")), cfg.gamma, cfg.gae_lambda)
        action = batch.get("action")
        action = action.reshape(-1, 1) if self.nets.discrete else action.reshape(-1, action.shape[-1])
        prior = batch.get("action_prior", None)
        return Frames(
            obs.reshape(-1, obs.shape[-1]),
            action,
            batch.get("action_log_prob").reshape(-1, 1),
            adv.reshape(-1, 1),
            (adv + value).reshape(-1, 1),
            prior.reshape(-1, prior.shape[-1]) if prior is not None else None,
        )

    def _sample_components(self, frames: int) -> None:
        assert self.cenv.program_reward is not None
        for name, mean in self.cenv.program_reward.pop_components().items():
            self.result.components.setdefault(name, []).append((frames, mean))
            if self.ctx is not None:
                self.ctx.log_metric(f"reward/{name}", mean)

    def _evaluate(self, frames: int) -> list[Episode]:
        """Deterministic episodes on the original env (with the candidate's macros)."""

        def act(obs: torch.Tensor) -> torch.Tensor:
            if self.prior is not None and self.nets.discrete:  # the combined distribution is the policy PPO trained
                return self.prior.act(obs, self.cenv.augment(obs), self.cfg.eval_deterministic)
            if self.cfg.eval_deterministic:
                return self.nets.act_deterministic(self.cenv.augment(obs))
            return self.nets.act_sampled(self.cenv.augment(obs))

        macros = self.cenv.macros
        return evaluate_and_record(
            self.task,
            act,
            self.cfg.eval_episodes,
            seed=self.seed + 10_000,
            frames=frames,
            result=self.result,
            ctx=self.ctx,
            hook=self.hook,
            wrap_env=macros.wrap if macros is not None else None,
        )
