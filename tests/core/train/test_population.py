"""Population training (:mod:`core.train.population`): the shared replay, the agents' settings, inheriting
weights, and a population trained by a method's body (LaRes's, tested in tests/plugins/test_lares.py)."""

from __future__ import annotations

import pluggy
import pytest
import torch
from torchrl.data import Bounded

from core.envs import make_task
from core.errors import UserError
from core.hookspecs import PROJECT
from core.records import Candidate, MacroAction, Program, RewardProgram
from core.registry import make_plugin_manager
from core.testing import fakes
from core.train.population import Population, SharedReplay, copy_agent, population_settings
from core.train.sac import act_deterministic, make_sac_modules, sac_update

SAC = {
    "name": "sac",
    "frames": 400,
    "init_random_frames": 100,
    "updates_per_frame": 0.25,
    "batch_size": 16,
    "num_envs": 2,
    "eval_episodes": 1,
    "hidden": [8],
}

UPRIGHT = """import torch

def compute_reward(state, action, next_state):
    return next_state["cos_theta"], {"upright": next_state["cos_theta"]}
"""


def make_run(trainer: dict | None = None, env: str = "pendulum"):
    run = fakes.make_run(make_task({"name": env}), config={"trainer": trainer or SAC, "save_policy": False})
    run.pluginmanager = make_plugin_manager(run.settings, {})
    return run


def test_the_agents_settings_are_the_sac_trainers_with_the_populations_budget():
    run = make_run()
    assert population_settings(run).frames == 400
    cfg = population_settings(run, frames=900)
    assert cfg.frames == 900 and cfg.hidden == [8]
    with pytest.raises(UserError, match="trainer=sac"):
        population_settings(make_run({"name": "ppo", "frames": 400}), name="lares")


def test_the_shared_replay_relabels_a_column_with_a_new_function():
    task = make_task({"name": "pendulum"})
    buf = SharedReplay(capacity=8, obs_dim=3, act_dim=1, members=2)
    obs = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -0.5], [-1.0, 0.0, 2.0]])
    buf.add(obs, torch.zeros(3, 1), obs, torch.zeros(3), torch.ones(3), torch.zeros(3, 2), hook=torch.full((3, 2), 0.5))
    assert buf.size == 3 and float(buf.env_reward.sum()) == 3.0

    def fn(state, action, next_state, env_reward):
        return next_state["cos_theta"] * 10 + env_reward

    buf.relabel(1, fn, task, chunk=2)
    assert buf.raw[:3, 1].tolist() == [11.0, 1.0, -9.0]
    assert buf.raw[:3, 0].tolist() == [0.0, 0.0, 0.0]  # other columns untouched
    assert buf.hook[:3].eq(0.5).all()  # the hooks' terms stay as collected
    for _ in range(3):  # ring buffer wraps at capacity
        buf.add(obs, torch.zeros(3, 1), obs, torch.zeros(3), torch.ones(3), torch.zeros(3, 2))
    assert buf.size == 8 and buf.ptr == 4


def test_the_replay_samples_a_sac_batch_rewarded_and_featured_for_one_member():
    buf = SharedReplay(capacity=8, obs_dim=2, act_dim=1, members=2, extra_dims=[0, 1])
    obs = torch.arange(8.0).reshape(4, 2)
    feats = {1: (torch.full((4, 1), -1.0), torch.full((4, 1), -2.0))}
    buf.add(
        obs,
        torch.ones(4, 1),
        obs + 1,
        torch.tensor([0, 0, 0, 1]),
        torch.zeros(4),
        torch.tensor([[1.0, 5.0]] * 4),
        hook=torch.tensor([[0.0, 0.5]] * 4),
        extra=feats,
    )
    batch = buf.sample(16, 1, lambda r: 2.0 * r - 1.0)
    assert batch.batch_size == torch.Size([16])
    assert set(batch.keys(True, True)) >= {
        "observation",
        "action",
        ("next", "observation"),
        ("next", "reward"),
        ("next", "done"),
        ("next", "terminated"),
    }
    assert batch["next", "reward"].shape == (16, 1) and torch.all(
        batch["next", "reward"] == 9.5
    )  # shaped program + hook term
    assert batch["next", "terminated"].dtype == torch.bool
    assert batch["observation"].shape == (16, 3) and torch.all(batch["observation"][:, 2] == -1.0)
    assert torch.equal(batch["next", "observation"][:, :2], batch["observation"][:, :2] + 1)
    plain = buf.sample(4, 0)  # member 0: no features, no shaping
    assert plain["observation"].shape == (4, 2) and torch.all(plain["next", "reward"] == 1.0)


def test_agents_are_core_sac_modules_and_a_newcomer_inherits_the_elites_weights():
    cfg = population_settings(make_run(), frames=500)
    spec = Bounded(low=-2.0, high=2.0, shape=(1,), dtype=torch.float32)
    elite, newcomer = make_sac_modules(3, spec, cfg), make_sac_modules(3, spec, cfg)
    buf = SharedReplay(capacity=8, obs_dim=3, act_dim=1, members=1)
    buf.add(torch.randn(8, 3), torch.rand(8, 1), torch.randn(8, 3), torch.zeros(8), torch.zeros(8), torch.randn(8, 1))
    sac_update(elite, buf.sample(4, 0))
    obs = torch.randn(5, 3)
    assert not torch.allclose(act_deterministic(elite, obs), act_deterministic(newcomer, obs))
    copy_agent(newcomer, elite)
    assert torch.allclose(act_deterministic(elite, obs), act_deterministic(newcomer, obs))


def test_a_population_trains_a_methods_body_and_refuses_what_it_cannot_hold():
    """The body picks who acts and swaps a reward; the core builds, trains, evaluates and records."""
    from core.sandbox import prepare_reward

    run = make_run()
    plain = Candidate("c0", 0, reward=RewardProgram(source=UPRIGHT))
    other = Candidate("c1", 0, reward=RewardProgram(source=UPRIGHT))
    macro = Candidate(
        "c2",
        0,
        reward=RewardProgram(source=UPRIGHT),
        macros=[MacroAction("spin", Program(source="def act(state):\n    return 0", entry="act"))],
    )
    seen: list[int] = []

    def body(pop: Population) -> None:
        assert [m.candidate.id for m in pop.live] == ["c0", "c1"]
        for m in pop.live:
            m.use(
                m.program,
                prepare_reward(m.program, run.task, limits=run.sandbox.limits(), allowed_imports=run.sandbox.imports),
            )
        turn = 0
        while pop.frames < pop.budget:
            pop.step(pop.live[turn % 2])
            turn += 1
            if pop.frames == 200:  # member 1 gets member 0's reward and weights
                a, b = pop.live
                pop.adopt(b, a.program, a.fn)
                b.shaping = lambda r: r + 1.0
                assert torch.allclose(pop.rewards(b), pop.rewards(a) + 1.0)
                assert pop.inherit(b, a)
        seen.append(pop.frames)

    results = Population(run, [plain, macro, other], seed=0, name="test").train(body)
    assert seen == [400]
    assert [r.candidate_id for r in results] == ["c0", "c2", "c1"]
    assert not results[1].ok and results[1].error_kind == "unsupported" and "macro-actions (spin)" in results[1].error
    for r in (results[0], results[2]):
        assert r.ok, r.error
        assert r.fitness is not None and r.curve and r.components["upright"]
        assert "test/frames_acted" in r.metrics and "test_history.md" in r.texts and "test_final_reward.py" in r.texts
    assert results[0].frames + results[2].frames == 400


def test_a_discrete_task_gets_unsupported_results_and_nothing_trains():
    run = make_run(env="cartpole")
    calls: list[int] = []
    (result,) = Population(run, [Candidate("c", 0, reward=RewardProgram(source=UPRIGHT))], 0, name="x").train(
        lambda pop: calls.append(1)
    )
    assert not result.ok and result.error_kind == "unsupported" and result.error.startswith("action space")
    assert calls == []


hookimpl = pluggy.HookimplMarker(PROJECT)


class _DrawsButAddsNothing:
    """A plugin that draws from torch's stream inside the training and adds a zero reward."""

    @hookimpl
    def on_train_start(self, train):
        torch.nn.Linear(64, 64)

    @hookimpl
    def compute_reward(self, train, batch):
        return torch.randn(batch.reward.shape[0]) * 0.0


def _population_training(plugin: object | None) -> list[float]:
    from core.sandbox import prepare_reward

    run = make_run()
    if plugin is not None:
        run.pluginmanager.register(plugin)

    def body(pop: Population) -> None:
        (m,) = pop.live
        m.use(
            m.program,
            prepare_reward(m.program, run.task, limits=run.sandbox.limits(), allowed_imports=run.sandbox.imports),
        )
        while pop.frames < pop.budget:
            pop.step(m)

    (result,) = Population(run, [Candidate("c0", 0, reward=RewardProgram(source=UPRIGHT))], seed=0, name="t").train(
        body
    )
    assert result.ok, result.error
    return [e.ret for e in result.episodes] + [v for k, v in sorted(result.metrics.items()) if k.startswith("losses/")]


def test_a_plugins_draws_in_a_population_leave_the_agents_stream_as_it_was():
    # the hooks run on a fork of the stream (core.train.rng), as in a single training
    assert _population_training(_DrawsButAddsNothing()) == _population_training(None)
