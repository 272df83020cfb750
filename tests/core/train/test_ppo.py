"""PPO: config handling, env splitting, determinism, failures as data, CartPole end to end."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import yaml

import core.sandbox
from core.records import Candidate, EnvConfig, RewardProgram
from core.resources import conf_dir
from core.sandbox import SandboxError
from core.train.evaluate import evaluate
from core.train.ppo import PPOConfig, split_env_params, train


def _yaml() -> dict:
    return yaml.safe_load((conf_dir() / "trainer" / "ppo.yaml").read_text())


# -- config -------------------------------------------------------------------------------


def test_yaml_and_dataclass_have_the_same_fields():
    keys = set(_yaml()) - {"name"}
    assert keys == {f.name for f in fields(PPOConfig)}


def test_from_config_reads_the_yaml_defaults():
    cfg = PPOConfig.from_config(_yaml())
    assert cfg.frames == 100_000 and cfg.hidden == [64, 64] and cfg.epochs == 20
    assert cfg.frames_per_batch == 256


def test_from_config_accepts_omegaconf():
    from omegaconf import OmegaConf

    cfg = PPOConfig.from_config(OmegaConf.create({"frames": 1000, "hidden": [8]}))
    assert cfg.frames == 1000 and cfg.hidden == [8]


def test_unknown_key_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown trainer setting.*'lrate'"):
        PPOConfig.from_config({"frames": 1000, "lrate": 0.1})


@pytest.mark.parametrize("bad", [{"frames": 0}, {"frames": 10, "gamma": 1.5}, {"frames": 10, "hidden": []}])
def test_invalid_values_raise(bad):
    with pytest.raises(ValueError):
        PPOConfig.from_config(bad)


def test_missing_frames_raises():
    with pytest.raises(ValueError, match="frames"):
        PPOConfig.from_config({"num_envs": 4})


# -- env params ----------------------------------------------------------------------------


def test_split_env_params_by_weight():
    envs = [EnvConfig("a", {"x": 1}, weight=3.0), EnvConfig("b", {"x": 2}, weight=1.0)]
    params = split_env_params(envs, 8)
    assert params is not None and len(params) == 8
    assert [p["x"] for p in params] == [1] * 6 + [2] * 2
    assert split_env_params([], 8) is None
    assert len(split_env_params([EnvConfig("a", {}), EnvConfig("b", {}), EnvConfig("c", {})], 8)) == 8


# -- evaluation ----------------------------------------------------------------------------


def test_evaluate_runs_one_episode_per_env(task):
    episodes = evaluate(task, lambda obs: torch.zeros(obs.shape[0], dtype=torch.long), 3, seed=0)
    assert len(episodes) == 3
    # always pushing left fails within a few dozen steps, one reward per step
    assert all(5 <= e.length < 60 and e.ret == e.length for e in episodes)


# -- training ------------------------------------------------------------------------------


def _numbers(result):
    return (result.metrics["losses/policy_loss"], result.metrics["losses/value_loss"],
            result.fitness.value, [(c.frames, c.fitness) for c in result.curve])


def test_same_seed_same_numbers(task, tiny_cfg):
    a = train(task, Candidate("a", 0), tiny_cfg, seed=3)
    b = train(task, Candidate("a", 0), tiny_cfg, seed=3)
    c = train(task, Candidate("a", 0), tiny_cfg, seed=4)
    assert a.ok and b.ok, a.error
    assert _numbers(a) == _numbers(b)
    assert _numbers(a) != _numbers(c)
    assert a.frames == 512 and len(a.curve) == 2 and len(a.episodes) == 2
    for key in ("charts/fps", "losses/policy_loss", "losses/value_loss", "losses/entropy"):
        assert key in a.metrics


def _with_reward_fn(monkeypatch, fn):
    monkeypatch.setattr(core.sandbox, "prepare_reward", lambda program, task, **kw: fn)
    return Candidate("r", 0, reward=RewardProgram(source="", entry="compute_reward"))


def test_reward_program_metrics(task, tiny_cfg, monkeypatch):
    def reward(state, action, next_state):
        r = 1.0 - next_state["pole_angle"].abs() * 10
        return r, {"angle": next_state["pole_angle"].abs()}

    result = train(task, _with_reward_fn(monkeypatch, reward), tiny_cfg, seed=0)
    assert result.ok, result.error
    assert -1.0 <= result.metrics["reward/env_correlation"] <= 1.0
    assert "angle" in result.components and len(result.components["angle"]) >= 1


def test_failing_reward_program_is_a_failed_result(task, tiny_cfg, monkeypatch):
    calls = []

    def reward(state, action, next_state):
        calls.append(1)
        if len(calls) > 1:  # the first batch works, the second fails
            raise ZeroDivisionError("division by zero in compute_reward")
        return torch.ones(action.shape[0]), {}

    result = train(task, _with_reward_fn(monkeypatch, reward), tiny_cfg, seed=0)
    assert not result.ok
    assert result.error_kind == "ZeroDivisionError"
    assert "division by zero in compute_reward" in result.error


def test_sandbox_error_keeps_its_report(task, tiny_cfg, monkeypatch):
    from core.sandbox import SandboxReport

    def reward(state, action, next_state):
        raise SandboxError(SandboxReport(ok=False, kind="timeout", message="compute_reward took too long"))

    result = train(task, _with_reward_fn(monkeypatch, reward), tiny_cfg, seed=0)
    assert not result.ok
    assert result.error_kind == "timeout" and "took too long" in result.error


@pytest.mark.slow
def test_cartpole_with_defaults_reaches_450(task):
    cfg = PPOConfig.from_config(_yaml())
    result = train(task, Candidate("cartpole", 0), cfg, seed=0)
    assert result.ok, result.error
    assert result.fitness is not None and result.fitness.value >= 450
    assert result.seconds < 120
