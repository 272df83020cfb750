"""Shared trainer pieces: sandbox settings from the run config, saved policies."""

from __future__ import annotations

from pathlib import Path

import torch

import core.sandbox
from core.config import Settings
from core.context import TrainContext
from core.records import Candidate, RewardProgram, StateProgram
from core.train.common import sandbox_settings, save_policy, wants_saved_policy
from core.train.ppo import train

SANDBOX = {"allowed_imports": ["math", "torch"], "cpu_s": 3, "wall_s": 7, "memory_mb": 1024, "call_timeout_s": 0.25}


def _ctx(task, candidate, tiny_cfg, **config) -> TrainContext:
    return TrainContext(
        settings=Settings.of(config), task=task, candidate=candidate, seed=0, total_frames=tiny_cfg.frames
    )


def test_sandbox_settings_read_the_config_node(task, tiny_cfg):
    limits, imports = sandbox_settings(_ctx(task, Candidate("a", 0), tiny_cfg, sandbox=SANDBOX))
    assert imports == ("math", "torch")
    assert (limits.cpu_s, limits.wall_s, limits.memory_mb, limits.call_timeout_s) == (3, 7, 1024, 0.25)


def test_sandbox_settings_default_without_a_context():
    limits, imports = sandbox_settings(None)
    assert imports == tuple(core.sandbox.DEFAULT_IMPORTS)
    assert limits == core.sandbox.Limits()


def test_training_passes_the_sandbox_config_to_the_programs(task, tiny_cfg, monkeypatch):
    seen = {}

    def fake_reward(program, task, *, limits, allowed_imports, **_):
        seen["reward"] = (limits.call_timeout_s, allowed_imports)
        return lambda s, a, n: torch.ones(a.shape[0])

    def fake_state(program, task, *, limits, allowed_imports, **_):
        seen["state"] = (limits.memory_mb, allowed_imports)
        fn = lambda s: s["pole_angle"]  # noqa: E731
        fn.extra_dim = 1
        return fn

    monkeypatch.setattr(core.sandbox, "prepare_reward", fake_reward)
    monkeypatch.setattr(core.sandbox, "prepare_state", fake_state)
    candidate = Candidate(
        "p",
        0,
        reward=RewardProgram(source="", entry="compute_reward"),
        state=StateProgram(source="", entry="revise_state"),
    )
    ctx = _ctx(task, candidate, tiny_cfg, sandbox=SANDBOX, save_policy=False)
    result = train(task, candidate, tiny_cfg, seed=0, ctx=ctx)
    assert result.ok, result.error
    assert seen == {"reward": (0.25, ("math", "torch")), "state": (1024, ("math", "torch"))}
    assert result.policy_path == ""


def test_policy_is_saved_when_the_run_asks(task, tiny_cfg):
    candidate = Candidate("saved/1", 0)
    result = train(task, candidate, tiny_cfg, seed=0, ctx=_ctx(task, candidate, tiny_cfg, save_policy=True))
    assert result.ok, result.error
    state = torch.load(result.policy_path)
    Path(result.policy_path).unlink()  # in a run the tracker uploads it and deletes it
    assert state["algorithm"] == "ppo" and state["obs_dim"] == 4
    assert state["actor"]["0.weight"].shape == (16, 4)


def test_policy_saving_defaults(task, tiny_cfg):
    assert not wants_saved_policy(None)
    assert not wants_saved_policy(_ctx(task, Candidate("a", 0), tiny_cfg))  # outside a run nobody would upload it
    assert wants_saved_policy(_ctx(task, Candidate("a", 0), tiny_cfg, save_policy=True))
    path = save_policy({"x": torch.ones(2)}, "a b/c")
    saved = torch.load(path)
    Path(path).unlink()
    assert "a_b_c" in Path(path).name and saved["x"].sum() == 2


def test_a_per_state_reward_trains_and_is_reported(task, tiny_cfg):
    source = (
        "def compute_reward(state, action, next_state):\n"
        "    return 1.0 if abs(float(next_state['pole_angle'])) < 0.1 else 0.0\n"
    )
    candidate = Candidate("per-row", 0, reward=RewardProgram(source=source))
    result = train(task, candidate, tiny_cfg, seed=0, ctx=_ctx(task, candidate, tiny_cfg, save_policy=False))
    assert result.ok, result.error
    assert result.metrics["sandbox/reward_per_row"] == 1.0
    assert "sandbox/state_per_row" not in result.metrics
