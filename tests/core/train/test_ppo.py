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
    return (
        result.metrics["losses/policy_loss"],
        result.metrics["losses/value_loss"],
        result.fitness.value,
        [(c.frames, c.fitness) for c in result.curve],
    )


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
    value = result.metrics["reward/env_correlation"]
    assert value != value  # NaN, undefined: CartPole's env reward is 1 on every step
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


# -- the fast update path ---------------------------------------------------------------------


def _fixed_batch(discrete: bool, n: int = 256, obs_dim: int = 5):
    """Networks with perturbed weights and a batch whose ratios are away from 1 (clipping active)."""
    from tensordict import TensorDict
    from torchrl.data import Bounded, Categorical

    from core.train.networks import FlatActorCritic, build_networks

    torch.manual_seed(0)
    spec = (
        Categorical(3, shape=(n,)) if discrete else Bounded(low=-torch.ones(n, 2), high=torch.ones(n, 2), shape=(n, 2))
    )
    nets = build_networks(obs_dim, spec, [32, 16])
    model = FlatActorCritic(nets.actor_net, nets.critic_net)
    model.params.add_(0.3 * torch.randn_like(model.params))  # the modules see it: their parameters are views
    td = TensorDict(observation=torch.randn(n, obs_dim), batch_size=[n])
    with torch.no_grad():
        nets.actor(td)
    td["action_log_prob"] = td["action_log_prob"] + 0.3 * torch.randn(n)
    td["advantage"] = 2 * torch.randn(n, 1) + 0.5
    td["value_target"] = torch.randn(n, 1)
    return nets, model, td


@pytest.mark.parametrize("discrete", [True, False], ids=["categorical", "gaussian"])
@pytest.mark.parametrize("ent_coef", [0.0, 0.01])
def test_fast_update_matches_clip_ppo_loss(discrete, ent_coef):
    """Loss terms and gradients of ``ppo_gradients`` equal autograd on TorchRL's ``ClipPPOLoss``."""
    import math

    from torchrl.objectives import ClipPPOLoss

    from core.train.ppo import Frames, ppo_gradients

    nets, model, td = _fixed_batch(discrete)
    clip, vf_coef = 0.2, 0.5
    loss = ClipPPOLoss(
        nets.actor,
        nets.critic,
        clip_epsilon=clip,
        entropy_bonus=ent_coef > 0,
        entropy_coeff=ent_coef,
        critic_coeff=vf_coef,
        loss_critic_type="l2",
        normalize_advantage=True,
        functional=False,
    )
    out = loss(td)
    assert 0.05 < float(out["clip_fraction"]) < 0.95  # both branches of the clipped objective are exercised
    params = nets.parameters()
    total = sum(out[k] for k in ("loss_objective", "loss_critic", "loss_entropy") if k in out.keys())
    grads = torch.autograd.grad(total, params)

    n = td.shape[0]
    action = td["action"].reshape(n, 1) if discrete else td["action"]
    frames = Frames(td["observation"], action, td["action_log_prob"].reshape(n, 1), td["advantage"], td["value_target"])
    model.grad.fill_(float("nan"))  # every entry must be written
    losses = ppo_gradients(
        model, frames.normalized(), (math.log1p(-clip), math.log1p(clip)), vf_coef, ent_coef, report=True
    )
    assert losses["policy"] == pytest.approx(float(out["loss_objective"].detach()), rel=1e-4, abs=1e-6)
    assert losses["value"] == pytest.approx(float(out["loss_critic"].detach()) / vf_coef, rel=1e-4)
    assert not torch.isnan(model.grad).any()
    for param, expected in zip(params, grads):
        at = param.storage_offset()  # the modules' parameters are views of model.params
        ours = model.grad[at : at + param.numel()].view_as(param)
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)


def test_flat_actor_and_modules_agree():
    from core.train.networks import SamplingPolicy

    nets, model, td = _fixed_batch(discrete=False)
    obs = td["observation"]
    loc, std = model.actor(obs)
    ref_loc, ref_std = nets.actor_net(obs)
    torch.testing.assert_close(loc, ref_loc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std, ref_std)
    head, value = model.forward(obs)
    torch.testing.assert_close(head, ref_loc.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, nets.critic_net(obs).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.critic(obs), nets.critic_net(obs).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.critic(obs[:3]), nets.critic_net(obs[:3]).detach(), rtol=1e-5, atol=1e-6)
    SamplingPolicy(model.actor, False, "lp")(td)
    assert td["action"].shape == (obs.shape[0], 2) and td["lp"].shape == (obs.shape[0],)


def test_gumbel_sampling_follows_the_softmax():
    from tensordict import TensorDict

    from core.train.networks import SamplingPolicy

    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    policy = SamplingPolicy(lambda obs: logits.expand(obs.shape[0], -1), True, "lp")
    td = policy(TensorDict(observation=torch.zeros(40_000, 1), batch_size=[40_000]))
    freq = torch.bincount(td["action"], minlength=4).float() / 40_000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.01, rtol=0)
    torch.testing.assert_close(td["lp"], torch.log_softmax(logits[0], -1)[td["action"]])


def test_flat_adam_matches_torch_adam():
    from core.train.networks import FlatAdam

    torch.manual_seed(0)
    ours = torch.randn(300)
    theirs = ours.clone()
    optim, reference = FlatAdam(ours, lr=1e-3, eps=1e-5), torch.optim.Adam([theirs], lr=1e-3, eps=1e-5, fused=True)
    for i in range(20):
        ours.grad = torch.randn(300)
        theirs.grad = ours.grad.clone()
        optim.lr = reference.param_groups[0]["lr"] = 1e-3 * (1 - i / 20)
        optim.step()
        reference.step()
    assert torch.equal(ours, theirs)


def test_phase_times_and_saved_policy(task, tiny_cfg):
    """Per-phase seconds are reported; the saved networks are copies (not views of the flat tensor) that load."""
    from pathlib import Path

    from torchrl.data import Categorical

    from core.config import Settings
    from core.context import TrainContext
    from core.train.networks import build_networks

    candidate = Candidate("saved", 0)
    ctx = TrainContext(
        settings=Settings.of({"save_policy": True}),
        task=task,
        candidate=candidate,
        seed=0,
        total_frames=tiny_cfg.frames,
    )
    result = train(task, candidate, tiny_cfg, seed=0, ctx=ctx)
    assert result.ok, result.error
    assert all(result.metrics[f"time/{phase}_s"] >= 0 for phase in ("rollout", "reward", "advantage", "update"))
    assert result.metrics["time/update_s"] > 0 and result.metrics["time/rollout_s"] > 0
    state = torch.load(result.policy_path)
    Path(result.policy_path).unlink()
    weight = state["actor"]["0.weight"]
    assert weight.shape == (16, 4) and weight.untyped_storage().nbytes() == weight.numel() * 4
    nets = build_networks(4, Categorical(2, shape=(1,)), [16])
    nets.actor_net.load_state_dict(state["actor"])
    nets.critic_net.load_state_dict(state["critic"])


def test_gae_equals_torchrl():
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    from core.train.ppo import gae

    torch.manual_seed(0)
    shape = (6, 40, 1)  # envs, steps, 1
    value, next_value, reward = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    done = torch.rand(shape) < 0.1
    terminated = done & (torch.rand(shape) < 0.5)  # the other episode ends are truncations
    expected, _ = generalized_advantage_estimate(0.98, 0.8, value, next_value, reward, done, terminated)
    torch.testing.assert_close(gae(reward, value, next_value, done, terminated, 0.98, 0.8), expected)


def test_fast_steps_track_the_reference_update():
    """20 full steps (loss, clip, Adam) from the same start stay within float noise of ClipPPOLoss + autograd + Adam."""
    import math

    from torchrl.data import Categorical
    from torchrl.objectives import ClipPPOLoss

    from core.train.networks import FlatAdam, build_networks
    from core.train.ppo import Frames, ppo_gradients

    nets, model, td = _fixed_batch(discrete=True)
    ref = build_networks(5, Categorical(3, shape=(1,)), [32, 16])  # the same sizes, the same weights below
    ref.actor_net.load_state_dict({k: v.clone() for k, v in nets.actor_net.state_dict().items()})
    ref.critic_net.load_state_dict({k: v.clone() for k, v in nets.critic_net.state_dict().items()})
    params = ref.parameters()
    optim, ref_optim = FlatAdam(model.params, lr=1e-3, eps=1e-5), torch.optim.Adam(params, lr=1e-3, eps=1e-5)
    loss = ClipPPOLoss(
        ref.actor,
        ref.critic,
        clip_epsilon=0.2,
        entropy_bonus=False,
        critic_coeff=0.5,
        loss_critic_type="l2",
        normalize_advantage=True,
        functional=False,
    )
    n = td.shape[0]
    frames = Frames(
        td["observation"],
        td["action"].reshape(n, 1),
        td["action_log_prob"].reshape(n, 1),
        td["advantage"],
        td["value_target"],
    ).normalized()
    for _ in range(20):
        ppo_gradients(model, frames, (math.log1p(-0.2), math.log1p(0.2)), 0.5, 0.0)
        scale = 0.5 / (float(model.grad.norm()) + 1e-6)
        if scale < 1.0:
            model.grad.mul_(scale)
        optim.step()
        out = loss(td)
        ref_optim.zero_grad()
        (out["loss_objective"] + out["loss_critic"]).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        ref_optim.step()
    for ours, theirs in zip(nets.parameters(), params):
        torch.testing.assert_close(
            ours.detach(), theirs.detach(), rtol=0, atol=1e-4 * float(theirs.detach().abs().max())
        )
