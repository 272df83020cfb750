"""Plugin code inside a training draws from its own fork of torch's random stream (core.train.rng)."""

from __future__ import annotations

import pluggy
import torch

from core import hookspecs
from core.hookspecs import PROJECT
from core.records import Candidate
from core.testing.fakes import make_train
from core.train import ppo
from core.train.rng import SeparateStream

hookimpl = pluggy.HookimplMarker(PROJECT)


class DrawsButAddsNothing:
    """A plugin that draws random numbers where real ones do (a reward model's fit, a judge's
    sampling) and adds a zero reward: the method with its LLM's term removed."""

    @hookimpl
    def on_train_start(self, train):
        torch.nn.Linear(64, 64)  # an initialisation: 4,160 draws
        torch.randperm(1000)

    @hookimpl
    def on_rollout(self, train, batch):
        torch.rand(17)

    @hookimpl
    def compute_reward(self, train, batch):
        return torch.randn(batch.reward.shape[0]) * 0.0


def _train(task, cfg, hook_of):
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(DrawsButAddsNothing())
    ctx = make_train(task)
    ctx.pluginmanager = pm
    return ppo.train(task, Candidate("c", 0), cfg, seed=0, hook=hook_of(pm), ctx=ctx)


def _baseline(task, cfg):
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return ppo.train(task, Candidate("c", 0), cfg, seed=0, hook=pm.hook, ctx=make_train(task))


def _returns(result) -> list[float]:
    """What the training did: its evaluation returns and its last losses."""
    losses = [v for k, v in sorted(result.metrics.items()) if k.startswith("losses/")]
    assert losses
    return [e.ret for e in result.episodes] + losses


def test_a_plugins_draws_leave_the_trainers_stream_as_it_was(task, tiny_cfg):
    base = _baseline(task, tiny_cfg)
    separate = _train(task, tiny_cfg, lambda pm: SeparateStream(pm.hook))
    shared = _train(task, tiny_cfg, lambda pm: pm.hook)
    assert base.ok and separate.ok and shared.ok
    # the same seed, the same training: a zero term and a plugin's own draws change nothing
    assert _returns(separate) == _returns(base) and separate.fitness.value == base.fitness.value
    # on the shared stream the plugin's draws alone make another training
    assert _returns(shared) != _returns(base)


def test_the_stream_after_a_plugin_call_is_the_one_before_it():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    from core.train.rng import plugin_stream

    with plugin_stream():
        torch.rand(1000)
    assert torch.equal(torch.rand(4), expected)
