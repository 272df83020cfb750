"""The action_prior hooks in the trainers: the prior changes the actions taken, PPO stays
on-policy with respect to the combined distribution, and bad priors are clear failures."""

from __future__ import annotations

import math

import pluggy
import pytest
import torch

from core import hookspecs
from core.context import ActionPrior
from core.envs.classic import MountainCarContinuous
from core.hookspecs import PROJECT
from core.records import Candidate
from core.testing.fakes import make_train
from core.train import ppo, sac
from core.train.action_prior import PriorSource
from core.train.sac import SACConfig

hookimpl = pluggy.HookimplMarker(PROJECT)


class Push:
    """A prior that wants one action (discrete) or one behaviour action (continuous)."""

    def __init__(
        self,
        action: int = 1,
        weight: float = 10.0,
        shape: tuple[int, ...] | None = None,
        mean: float | None = None,
        prob: float = 1.0,
        imitation: float = 0.0,
    ) -> None:
        self.action, self.weight, self.shape, self.mean, self.prob, self.imitation = (
            action,
            weight,
            shape,
            mean,
            prob,
            imitation,
        )
        self.calls = 0
        self.taken: list[torch.Tensor] = []

    @hookimpl
    def action_prior(self, train, obs):
        self.calls += 1
        if self.mean is not None:
            return ActionPrior(mean=torch.full((obs.shape[0], 1), self.mean), prob=self.prob, imitation=self.imitation)
        rows = obs.shape[0]
        lp = torch.full(self.shape or (rows, 2), math.log(0.01))
        lp[..., self.action] = math.log(0.99)
        return ActionPrior(log_probs=lp, weight=self.weight)

    @hookimpl
    def on_rollout(self, train, batch):
        self.taken.append(batch.get("action").reshape(-1).float())


def manager(*plugins: object) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for p in plugins:
        pm.register(p)
    return pm


def context(task, pm: pluggy.PluginManager):
    """A training context whose plugin manager calls each plugin's prior (as the executor's does)."""
    ctx = make_train(task)
    ctx.pluginmanager = pm
    return ctx


def train_ppo(task, cfg, plugin):
    pm = manager(plugin)
    return ppo.train(task, Candidate("c", 0), cfg, seed=0, hook=pm.hook, ctx=context(task, pm))


def test_discrete_prior_changes_the_actions_taken(task, tiny_cfg):
    push = Push(action=1, weight=10.0)
    result = train_ppo(task, tiny_cfg, push)
    assert result.ok, result.error
    share = float(torch.cat(push.taken).mean())  # CartPole: 1 pushes right
    assert share > 0.95, f"with the prior the policy pushed right only {share:.2f} of the time"
    assert result.metrics["action_prior/rows"] == 1.0
    assert result.metrics["action_prior/changed"] > 0.2
    left = train_ppo(task, tiny_cfg, Push(action=0, weight=10.0))
    assert left.ok and left.metrics["action_prior/changed"] > 0.2


def test_ppo_loss_sees_the_combined_distribution():
    """The collected log-probabilities are those of softmax(logits + prior): the first update's ratio is 1."""
    from torchrl.data import Categorical

    from core.train.networks import FlatActorCritic, build_networks

    nets = build_networks(4, Categorical(2), [8])
    model = FlatActorCritic(nets.actor_net, nets.critic_net)
    obs = torch.randn(6, 4)
    logits = model.actor(obs).detach()
    term = torch.randn(6, 2)
    action = torch.log_softmax(logits + term, -1).argmax(-1, keepdim=True)
    old = torch.log_softmax(logits + term, -1).gather(-1, action)
    frames = ppo.Frames(obs, action, old, torch.ones(6, 1), torch.zeros(6, 1), term)
    stats = ppo.ppo_gradients(model, frames, (math.log(0.8), math.log(1.2)), 0.5, 0.0, report=True)
    assert stats["policy"] == pytest.approx(-1.0, abs=1e-5)  # ratio 1 everywhere: on-policy
    without = ppo.Frames(obs, action, old, torch.ones(6, 1), torch.zeros(6, 1))
    assert ppo.ppo_gradients(model, without, (math.log(0.8), math.log(1.2)), 0.5, 0.0, report=True)[
        "policy"
    ] != pytest.approx(-1.0, abs=1e-5)


@pytest.mark.parametrize("shape, words", [((3, 2), "expected ["), ((4, 5), "one column per action")])
def test_wrong_shaped_prior_fails_the_candidate_with_a_clear_error(task, tiny_cfg, shape, words):
    result = train_ppo(task, tiny_cfg, Push(shape=shape))
    assert not result.ok
    assert result.error_kind == "ActionPriorError"
    assert "action_prior of plugin" in result.error and words in result.error


def test_continuous_prior_under_ppo_is_refused(tiny_cfg):
    task = MountainCarContinuous()
    result = train_ppo(task, tiny_cfg, Push(mean=0.5))
    assert not result.ok and "trainer=sac" in result.error


def test_source_masks_rows(task):
    class Half:
        @hookimpl
        def action_prior(self, obs):
            return ActionPrior(log_probs=torch.zeros(obs.shape[0], 2) - 1.0, mask=torch.tensor([True, False]))

    pm = manager(Half())
    src = PriorSource(context(task, pm), task, n_actions=2)
    term = src.log_prior(torch.zeros(2, 4))
    assert term[0].tolist() == [-1.0, -1.0] and term[1].tolist() == [0.0, 0.0]


def test_sac_takes_the_behaviour_prior_and_imitates_it():
    task = MountainCarContinuous()
    push = Push(mean=0.9, prob=1.0, imitation=1.0)
    cfg = SACConfig(frames=300, init_random_frames=100, batch_size=32, hidden=[16], eval_every=0, eval_episodes=1)
    pm = manager(push)
    result = sac.train(task, Candidate("c", 0), cfg, seed=0, hook=pm.hook, ctx=context(task, pm))
    assert result.ok, result.error
    assert result.metrics["action_prior/share"] == 1.0
    actions = torch.cat(push.taken)
    assert torch.allclose(actions, torch.full_like(actions, 0.9))  # the prior acted from the first step
    assert "losses/imitation_loss" in result.metrics
