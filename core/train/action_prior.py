"""The per-step action role in the trainers: ``action_prior`` hooks combined with the policy.

:class:`PriorSource` calls the hooks on a batch of observations, checks each plugin's
:class:`core.context.ActionPrior` against the action space and combines them:

- discrete (PPO, :class:`PriorSamplingPolicy`): ``logits + sum_i w_i log p_i`` on the rows
  each prior covers. The collection policy writes the summed term into the collected
  batch (``action_prior``), and the PPO loss adds it to the actor's logits again, so the
  ratio and the gradient are those of the combined distribution that acted. The term is
  a constant of the actor's parameters, so the written-out gradient keeps its form
  (``onehot(a) - softmax(logits + prior)``). Evaluation acts with the combined
  distribution too, since it is the policy PPO trains. Metrics: ``action_prior/rows``
  (share of steps a prior covered), ``action_prior/changed`` (share of steps whose most
  likely action a prior changed).
- continuous (SAC, :class:`PriorBehaviour`): per row, with the prior's ``prob``, the action
  is ``clip(mean + std * noise)`` instead of the actor's (RLingua's behaviour policy,
  annealed by the plugin); of several priors, the first in hook call order whose draw
  succeeds acts. The replay buffer keeps which rows the prior acted and its action, and
  :func:`imitation_step` pulls the actor towards those actions
  (``imitation * |actor(s) - a|^2``) when a prior asks for it. Evaluation acts with the
  actor alone: the prior is a behaviour policy, meant to be annealed away. Metric:
  ``action_prior/share`` (share of steps a prior acted).

A prior of the wrong kind or shape (``log_probs`` not ``[B, n]`` or not finite, ``mean``
not ``[B, A]``, a continuous prior under PPO) raises :class:`ActionPriorError` naming the
plugin and the shapes: the trainer's failure handling turns it into a failed candidate
whose error text is the plugin's feedback.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.envs.utils import ExplorationType, set_exploration_type

from core.context import ActionPrior, TrainContext
from core.envs.task import Task

#: keys the SAC replay buffer keeps when a prior may act
PRIOR_KEYS = ("prior_action", "prior_taken")


class ActionPriorError(ValueError):
    """An ``action_prior`` result that does not fit the task's action space."""


class PriorSource:
    """The ``action_prior`` hooks of one training, called and checked per batch.

    :param ctx: the training's context; its ``pluginmanager`` calls each plugin's hook.
    :param n_actions: the discrete action count (macros included), or None.
    :param low: / :param high: the continuous action bounds ``[A]``, or None.
    """

    def __init__(
        self,
        ctx: TrainContext,
        task: Task,
        *,
        n_actions: int | None = None,
        low: torch.Tensor | None = None,
        high: torch.Tensor | None = None,
    ) -> None:
        if ctx.pluginmanager is None:  # priors are credited per plugin: pm.hook alone cannot do that
            raise ValueError("action priors need the training context's pluginmanager (TrainContext(pluginmanager=pm))")
        self.plugins, self.ctx, self.task = ctx.pluginmanager, ctx, task
        self.n_actions, self.low, self.high = n_actions, low, high
        self.steps = self.covered = self.changed = self.taken = 0.0
        self.imitation = 0.0  # the largest imitation weight a prior asked for lately

    def priors(self, obs: torch.Tensor) -> list[tuple[str, ActionPrior]]:
        """``(plugin name, checked prior)`` of every plugin that gave one for ``obs [B, D]``, in hook call order."""
        from core.registry import call_each
        from core.train.rng import plugin_stream

        obs = obs[..., : self.task.obs_dim]
        out = []
        with plugin_stream():  # a prior's draws leave the policy's sampling noise as it was
            given = list(call_each(self.plugins, "action_prior", train=self.ctx, obs=obs))
        for name, prior in given:
            if prior is None:
                continue
            self._check(name, prior, int(obs.shape[0]))
            out.append((name, prior))
        return out

    def _check(self, name: str, prior: Any, rows: int) -> None:
        def fail(what: str) -> None:
            raise ActionPriorError(f"action_prior of plugin {name!r}: {what}")

        if not isinstance(prior, ActionPrior):
            fail(f"expected a core.context.ActionPrior or None, got {type(prior).__name__}")
        if prior.mask is not None and tuple(prior.mask.shape) != (rows,):
            fail(f"mask has shape {list(prior.mask.shape)}, expected [{rows}]")
        if self.n_actions is None and self.low is None:
            fail("PPO (on-policy) takes discrete action priors only; a continuous prior needs trainer=sac")
        if self.n_actions is not None:
            if prior.log_probs is None:
                fail(
                    f"this task has {self.n_actions} discrete actions: fill log_probs [B, n], not mean "
                    "(a continuous prior needs an off-policy trainer: trainer=sac)"
                )
            lp = prior.log_probs
            if tuple(lp.shape) != (rows, self.n_actions):
                fail(
                    f"log_probs has shape {list(lp.shape)}, expected [{rows}, {self.n_actions}] "
                    f"(one row per observation, one column per action)"
                )
            if not bool(torch.isfinite(lp).all()):
                fail("log_probs must be finite (rule an action out with a large negative number, not -inf or nan)")
        else:
            if prior.mean is None:
                fail("this task's actions are continuous: fill mean [B, A] (and std, prob), not log_probs")
            dim = int(self.low.shape[-1]) if self.low is not None else -1
            if tuple(prior.mean.shape) != (rows, dim):
                fail(f"mean has shape {list(prior.mean.shape)}, expected [{rows}, {dim}]")
            if not bool(torch.isfinite(prior.mean).all()):
                fail("mean must be finite")
            if not 0.0 <= float(prior.prob) <= 1.0:
                fail(f"prob must be in [0, 1], got {prior.prob}")

    # -- discrete -------------------------------------------------------------------------
    def log_prior(self, obs: torch.Tensor) -> torch.Tensor:
        """The summed ``weight * log_probs`` term ``[B, n]`` (zeros where no prior covers a row)."""
        total = obs.new_zeros(obs.shape[0], int(self.n_actions or 0))
        for _, prior in self.priors(obs):
            term = float(prior.weight) * prior.log_probs.to(total.dtype)  # type: ignore[union-attr]
            if prior.mask is not None:
                term = term * prior.mask.reshape(-1, 1).to(total.dtype)
            total = total + term
        return total

    def count(self, logits: torch.Tensor, term: torch.Tensor) -> None:
        """Count covered rows and rows whose most likely action the prior changed."""
        covered = term.abs().sum(-1) > 0
        self.steps += term.shape[0]
        self.covered += float(covered.sum())
        self.changed += float((logits.argmax(-1) != (logits + term).argmax(-1)).sum())

    # -- continuous -----------------------------------------------------------------------
    def behaviour(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action, taken)``: the actor's ``action [B, A]`` with the rows a prior took replaced."""
        taken = torch.zeros(action.shape[0], dtype=torch.bool, device=action.device)
        action = action.clone()
        imitation = 0.0
        for _, prior in self.priors(obs):
            imitation = max(imitation, float(prior.imitation))
            draw = torch.rand(action.shape[0], device=action.device) < float(prior.prob)
            if prior.mask is not None:
                draw &= prior.mask.to(torch.bool)
            draw &= ~taken
            if not bool(draw.any()):
                continue
            mean = prior.mean.to(action.dtype)  # type: ignore[union-attr]
            std = torch.as_tensor(prior.std, dtype=action.dtype)
            proposal = torch.maximum(torch.minimum(mean + std * torch.randn_like(mean), self.high), self.low)  # type: ignore[arg-type]
            action[draw] = proposal[draw]
            taken |= draw
        self.imitation = imitation
        self.steps += action.shape[0]
        self.taken += float(taken.sum())
        return action, taken

    def metrics(self) -> dict[str, float]:
        steps = max(self.steps, 1.0)
        if self.n_actions is not None:
            return {"action_prior/rows": self.covered / steps, "action_prior/changed": self.changed / steps}
        return {"action_prior/share": self.taken / steps}


class PriorSamplingPolicy(nn.Module):
    """PPO's collection policy with the discrete priors: samples ``softmax(logits + prior)``.

    Writes ``action``, its log-probability under the combined distribution and the prior
    term ``action_prior [B, n]`` (for the loss) into the tensordict. On a continuous task
    it acts as ``fallback`` (the plain policy) and any prior fails the candidate.
    """

    def __init__(
        self, actor: Any, source: PriorSource, fallback: nn.Module, log_prob_key: str = "action_log_prob"
    ) -> None:
        super().__init__()
        self.actor, self.source, self.fallback, self.log_prob_key = actor, source, fallback, log_prob_key

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        obs = td.get("observation")
        if self.source.n_actions is None:
            self.source.priors(obs)  # raises for any prior
            return self.fallback(td)
        logits = self.actor(obs)
        term = self.source.log_prior(obs)
        self.source.count(logits, term)
        logp = torch.log_softmax(logits + term, dim=-1)
        action = (logp.exp() / torch.empty_like(logp).exponential_()).argmax(-1, keepdim=True)
        td.set("action", action.squeeze(-1))
        td.set(self.log_prob_key, logp.gather(-1, action).squeeze(-1))
        td.set("action_prior", term)
        return td

    @torch.no_grad()
    def act(self, obs: torch.Tensor, policy_obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """An evaluation action from the combined distribution (``obs``: the task's, for the hooks)."""
        logits = self.actor(policy_obs) + self.source.log_prior(obs)
        if deterministic:
            return logits.argmax(-1)
        return torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(-1)


class PriorBehaviour(nn.Module):
    """SAC's collection policy with the continuous priors: the actor, or a prior's action.

    Also takes over the collector's random warm-up (``init_random_frames``: uniform
    actions from the bounds for the rows no prior took), so that a prior acts from the
    first step. Writes ``prior_action`` and ``prior_taken`` for :func:`imitation_step`.
    """

    def __init__(self, actor: nn.Module, source: PriorSource, random_frames: int) -> None:
        super().__init__()
        self.actor, self.source, self.random_frames = actor, source, int(random_frames)
        self.frames = 0

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        obs = td.get("observation")
        if self.frames < self.random_frames:
            low, high = self.source.low, self.source.high
            td.set("action", low + (high - low) * torch.rand(obs.shape[0], low.shape[-1]))  # type: ignore[operator, union-attr]
        else:
            td = self.actor(td)
        self.frames += int(obs.shape[0])
        action, taken = self.source.behaviour(obs, td.get("action"))
        td.set("action", action)
        td.set("prior_action", action.clone())
        td.set("prior_taken", taken)
        return td


def imitation_step(
    actor: nn.Module, optimizer: torch.optim.Optimizer, batch: TensorDictBase, weight: float
) -> float | None:
    """One behaviour-cloning step: ``weight * mean |actor(s) - a_prior|^2`` over the prior's rows.

    :return: the loss, or None when the batch holds none of the prior's transitions.
    """
    taken = batch.get("prior_taken").reshape(-1).to(torch.bool)
    if weight <= 0 or not bool(taken.any()):
        return None
    obs = batch.get("observation")[taken]
    target = batch.get("prior_action")[taken]
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        action = actor(TensorDict({"observation": obs}, batch_size=obs.shape[:1])).get("action")
    loss = weight * (action - target).pow(2).sum(-1).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
