"""trainer.normalize_reward: the learner's reward divided by the running std of a discounted
return (core.train.common.RewardNormalizer), in PPO and SAC; off changes nothing."""

from __future__ import annotations

import io
import math

import pytest
import torch

import core.sandbox
from core.envs.classic import Pendulum
from core.records import Candidate, RewardProgram, StartPolicy
from core.train import ppo, sac
from core.train.common import RewardNormalizer
from core.train.ppo import PPOConfig
from core.train.sac import SACConfig


def _episodes(envs: int, steps: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards ``[envs, steps, 1]`` around 1 (a survival-like reward with noise) and done flags
    ending an episode every ``length`` steps, staggered over the envs."""
    g = torch.Generator().manual_seed(seed)
    reward = 1.0 + 0.5 * torch.randn(envs, steps, 1, generator=g)
    t = torch.arange(steps).expand(envs, steps) + torch.arange(envs).unsqueeze(1) * 7
    done = ((t + 1) % length == 0).unsqueeze(-1)
    return reward, done


def _discounted(reward: torch.Tensor, done: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-step discounted returns (reset after done), the quantity the normaliser standardises."""
    ret, out = torch.zeros(reward.shape[0], dtype=torch.float64), torch.empty(reward.shape[:2], dtype=torch.float64)
    for t in range(reward.shape[1]):
        ret = ret * gamma + reward[:, t, 0].double()
        out[:, t] = ret
        ret = ret.masked_fill(done[:, t, 0], 0.0)
    return out


# -- the running statistics -----------------------------------------------------------------


def test_a_reward_times_1e6_is_brought_to_unit_scale():
    reward, done = _episodes(8, 256, 50)
    norm = RewardNormalizer(8, gamma=0.98, clip=0.0)
    out = []
    for k in range(0, 256, 32):  # collected in batches of 32 steps per env
        norm.update(1e6 * reward[:, k : k + 32], done[:, k : k + 32])
        out.append(norm.normalize(1e6 * reward[:, k : k + 32]))
    scaled = torch.cat(out, 1)
    late = _discounted(scaled, done, 0.98)[:, 128:]  # once the statistics have settled
    assert 0.5 < float(late.std()) < 2.0  # the return the critic fits has unit scale
    assert 1e-3 < float(scaled.abs().mean()) < 1.0  # and so has the reward (not 1e6)
    assert norm.scale == pytest.approx(float(_discounted(1e6 * reward, done, 0.98).std()), rel=0.05)


def test_the_normalised_reward_does_not_depend_on_the_reward_scale():
    reward, done = _episodes(4, 64, 20)
    small, large = RewardNormalizer(4, 0.99), RewardNormalizer(4, 0.99)
    small.update(reward, done)
    large.update(1e6 * reward, done)
    assert large.scale / small.scale == pytest.approx(1e6, rel=1e-4)
    assert torch.allclose(small.normalize(reward), large.normalize(1e6 * reward), rtol=1e-4)


def test_returns_restart_after_an_episode_end_and_with_new_envs():
    norm = RewardNormalizer(2, gamma=0.5, clip=0.0)
    norm.update(torch.tensor([[1.0, 1.0], [1.0, 1.0]]), torch.tensor([[False, False], [False, True]]))
    assert norm.returns.tolist() == [1.5, 0.0]  # env 0 mid-episode (1 * 0.5 + 1), env 1 ended
    norm.reset_returns()
    assert norm.returns.tolist() == [0.0, 0.0]
    assert norm.count == pytest.approx(4 + 1e-4)  # the statistics stay


def test_clip_bounds_the_normalised_reward():
    norm = RewardNormalizer(1, gamma=0.9, clip=10.0)
    norm.update(torch.ones(1, 100), torch.zeros(1, 100, dtype=torch.bool))
    assert float(norm.normalize(torch.tensor([1e9]))) == 10.0
    assert float(norm.normalize(torch.tensor([-1e9]))) == -10.0
    assert float(RewardNormalizer(1, 0.9, clip=0.0).normalize(torch.tensor([1e9]))) > 1e8  # 0: no clip


def test_state_round_trips():
    reward, done = _episodes(3, 40, 9)
    a = RewardNormalizer(3, 0.95)
    a.update(reward, done)
    b = RewardNormalizer(3, 0.95)
    b.load_state_dict(a.state_dict())
    assert b.scale == a.scale and b.count == a.count and b.mean == a.mean


# -- PPO ------------------------------------------------------------------------------------


def _scaled_reward(monkeypatch: pytest.MonkeyPatch, scale: float) -> Candidate:
    """A candidate whose reward program is ``scale`` times a CartPole reward of varying size."""

    def reward(state, action, next_state):
        return scale * (1.0 - 5.0 * next_state["pole_angle"].abs())

    monkeypatch.setattr(core.sandbox, "prepare_reward", lambda program, task, **kw: reward)
    return Candidate(f"x{scale:g}", 0, reward=RewardProgram(source="", entry="compute_reward"))


def _ppo(task, cfg: PPOConfig, monkeypatch, scale: float):
    result = ppo.train(task, _scaled_reward(monkeypatch, scale), cfg, seed=0)
    assert result.ok, result.error
    return result


def test_ppo_on_a_reward_times_1e6_trains_as_on_the_reward_itself(task, tiny_cfg, monkeypatch):
    on = PPOConfig(**{**tiny_cfg.__dict__, "normalize_reward": True})
    one, big = _ppo(task, on, monkeypatch, 1.0), _ppo(task, on, monkeypatch, 1e6)
    assert big.metrics["train/reward_scale"] / one.metrics["train/reward_scale"] == pytest.approx(1e6, rel=1e-3)
    for key in ("losses/policy_loss", "losses/value_loss"):
        assert big.metrics[key] == pytest.approx(one.metrics[key], rel=1e-2, abs=1e-4), key
    assert big.metrics["losses/value_loss"] < 10.0
    # what is logged stays in the task's units: CartPole's return counts steps
    assert big.metrics["charts/episodic_return"] == pytest.approx(one.metrics["charts/episodic_return"], rel=0.05)
    assert big.metrics["charts/episodic_return"] < 500


def test_ppo_without_normalisation_sees_the_raw_scale(task, tiny_cfg, monkeypatch):
    off = PPOConfig(**{**tiny_cfg.__dict__, "normalize_reward": False})
    one, big = _ppo(task, off, monkeypatch, 1.0), _ppo(task, off, monkeypatch, 1e6)
    assert "train/reward_scale" not in one.metrics and "train/reward_scale" not in big.metrics
    assert big.metrics["losses/value_loss"] > 1e9 * one.metrics["losses/value_loss"]
    assert big.metrics["charts/episodic_return"] < 500


@pytest.mark.parametrize("normalize", [True, False], ids=["on", "off"])
def test_ppo_advantages_see_the_normalised_reward_only_when_on(task, tiny_cfg, monkeypatch, normalize):
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the batch's reward, the reward GAE got)
    batches: list[torch.Tensor] = []
    advantages, gae = ppo._Run._advantages, ppo.gae

    def spy_advantages(self, batch):
        batches.append(batch.get(("next", "reward")).clone())
        return advantages(self, batch)

    def spy_gae(reward, *args):
        seen.append((batches[-1], reward.clone()))
        return gae(reward, *args)

    monkeypatch.setattr(ppo._Run, "_advantages", spy_advantages)
    monkeypatch.setattr(ppo, "gae", spy_gae)
    cfg = PPOConfig(**{**tiny_cfg.__dict__, "normalize_reward": normalize})
    result = ppo.train(task, Candidate("a", 0, keep_policy=True), cfg, seed=0)
    assert result.ok, result.error
    assert len(seen) == cfg.frames // cfg.frames_per_batch
    state = torch.load(io.BytesIO(result.final_policy), weights_only=True)
    if not normalize:
        assert all(torch.equal(raw, used) for raw, used in seen)  # the env's reward, untouched
        assert "reward_norm" not in state
        return
    scale = result.metrics["train/reward_scale"]
    raw, used = seen[-1]
    assert torch.allclose(used, raw / scale)  # CartPole's +1 per step, divided by the last batch's scale
    assert 1.0 < scale < 50.0  # the std of a discounted count of steps (gamma 0.98: returns up to 50)
    assert state["reward_norm"]["count"] == pytest.approx(cfg.frames + 1e-4)


def test_a_continued_policy_continues_the_reward_statistics(task, tiny_cfg):
    first = ppo.train(task, Candidate("a", 0, keep_policy=True), tiny_cfg, seed=0)
    assert first.ok and tiny_cfg.normalize_reward, first.error
    start = StartPolicy.of(Candidate("a", 0), first)
    second = ppo.train(task, Candidate("b", 1, start=start, keep_policy=True), tiny_cfg, seed=0)
    assert second.ok, second.error
    a = torch.load(io.BytesIO(first.final_policy), weights_only=True)["reward_norm"]
    b = torch.load(io.BytesIO(second.final_policy), weights_only=True)["reward_norm"]
    assert b["count"] == pytest.approx(a["count"] + second.frames)  # one running estimate over the chain


# -- SAC ------------------------------------------------------------------------------------


def _sac(monkeypatch, scale: float, normalize: bool):
    def reward(state, action, next_state):
        return scale * -(next_state["angular_velocity"].abs() + 1.0)

    monkeypatch.setattr(core.sandbox, "prepare_reward", lambda program, task, **kw: reward)
    candidate = Candidate("r", 0, reward=RewardProgram(source="", entry="compute_reward"))
    cfg = SACConfig(
        frames=400,
        init_random_frames=100,
        batch_size=32,
        hidden=[16],
        eval_every=0,
        eval_episodes=1,
        normalize_reward=normalize,
    )
    result = sac.train(Pendulum(), candidate, cfg, seed=0)
    assert result.ok, result.error
    return result


def test_sac_on_a_reward_times_1e6_trains_as_on_the_reward_itself(monkeypatch):
    one, big = _sac(monkeypatch, 1.0, True), _sac(monkeypatch, 1e6, True)
    assert big.metrics["train/reward_scale"] / one.metrics["train/reward_scale"] == pytest.approx(1e6, rel=1e-3)
    for key in ("losses/qvalue_loss", "losses/actor_loss"):
        assert big.metrics[key] == pytest.approx(one.metrics[key], rel=2e-2, abs=1e-3), key
    assert math.isfinite(big.metrics["losses/qvalue_loss"]) and big.metrics["losses/qvalue_loss"] < 100.0


def test_sac_without_normalisation_sees_the_raw_scale(monkeypatch):
    one, big = _sac(monkeypatch, 1.0, False), _sac(monkeypatch, 1e6, False)
    assert "train/reward_scale" not in one.metrics
    assert big.metrics["losses/qvalue_loss"] > 1e9 * one.metrics["losses/qvalue_loss"]
    assert big.metrics["charts/episodic_return"] < 0  # Pendulum's own reward, not the program's


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="reward_clip"):
        PPOConfig.from_config({"frames": 1000, "reward_clip": -1.0})
    with pytest.raises(ValueError, match="reward_clip"):
        SACConfig.from_config({"frames": 1000, "reward_clip": -1.0})
