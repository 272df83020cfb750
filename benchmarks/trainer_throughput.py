"""Frames/s of the project's PPO against a single-file PyTorch PPO on CartPole.

Both train PPO on ``CartPole-v1`` with the same settings (8 envs, 32 steps per env per
batch, 20 epochs, minibatch 256, two hidden layers of 64) and the same vectorised env
(``gymnasium.vector.SyncVectorEnv``, autoreset SAME_STEP). Only training is timed:
evaluation is switched off in ours. Prints one JSON object::

    {"ours_fps": ..., "reference_fps": ..., "ratio": ...}

Run: ``python benchmarks/trainer_throughput.py [--frames 50000] [--repeats 2]`` (best of
the repeats, alternating the two).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from core.envs.task import StateField, Task

ENVS, STEPS, EPOCHS, MINIBATCH, HIDDEN = 8, 32, 20, 256, 64


class CartPoleTask(Task):
    """CartPole-v1 as a task (a stand-in where ``core.envs.classic`` is not installed)."""

    def __init__(self) -> None:
        super().__init__(
            name="cartpole",
            goal="Balance the pole on the cart for as long as possible.",
            state_fields=[
                StateField("cart_position", 0, 1, "cart position", "m"),
                StateField("cart_velocity", 1, 2, "cart velocity", "m/s"),
                StateField("pole_angle", 2, 3, "pole angle from upright", "rad"),
                StateField("pole_angular_velocity", 3, 4, "pole angular velocity", "rad/s"),
            ],
            description="CartPole-v1: push the cart left (0) or right (1).",
            max_episode_steps=500,
        )

    def make_env(self, num_envs: int, seed: int, params: Any = None) -> gym.vector.VectorEnv:
        env = gym.vector.SyncVectorEnv(
            [lambda: gym.make("CartPole-v1") for _ in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        env.reset(seed=seed)
        return env


def cartpole_task() -> Task:
    """The project's cartpole task (the stand-in above where it is missing)."""
    try:
        from core.envs.classic import CartPole
    except ImportError:
        return CartPoleTask()
    return CartPole()


# ---------------------------------------------------------------------------------------
# Reference: a plain single-file PPO (CleanRL layout: two MLPs, Python GAE loop)
# ---------------------------------------------------------------------------------------


def _layer(n_in: int, n_out: int, std: float = 2**0.5) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class _Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            _layer(obs_dim, HIDDEN), nn.Tanh(), _layer(HIDDEN, HIDDEN), nn.Tanh(), _layer(HIDDEN, 1, 1.0)
        )
        self.actor = nn.Sequential(
            _layer(obs_dim, HIDDEN), nn.Tanh(), _layer(HIDDEN, HIDDEN), nn.Tanh(), _layer(HIDDEN, n_actions, 0.01)
        )

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        dist = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x)


def reference_ppo(frames: int, seed: int = 0) -> float:
    """Train the reference PPO for ``frames`` frames; return frames/s."""
    torch.manual_seed(seed)
    gamma, lam, clip, lr, vf_coef, max_grad_norm = 0.98, 0.8, 0.2, 1e-3, 0.5, 0.5
    envs = CartPoleTask().make_env(ENVS, seed)
    agent = _Agent(4, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    obs_buf = torch.zeros(STEPS, ENVS, 4)
    act_buf = torch.zeros(STEPS, ENVS, dtype=torch.long)
    logp_buf = torch.zeros(STEPS, ENVS)
    rew_buf = torch.zeros(STEPS, ENVS)
    done_buf = torch.zeros(STEPS, ENVS)
    val_buf = torch.zeros(STEPS, ENVS)
    next_obs = torch.tensor(envs.reset(seed=seed)[0], dtype=torch.float32)
    updates = frames // (ENVS * STEPS)
    start = time.perf_counter()
    for update in range(updates):
        frac = 1.0 - update / updates
        opt.param_groups[0]["lr"] = frac * lr
        for step in range(STEPS):
            obs_buf[step] = next_obs
            with torch.no_grad():
                action, logp, _, value = agent.action_and_value(next_obs)
            val_buf[step] = value.flatten()
            act_buf[step], logp_buf[step] = action, logp
            obs, reward, term, trunc, _ = envs.step(action.numpy())
            rew_buf[step] = torch.as_tensor(reward, dtype=torch.float32)
            done_buf[step] = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32)
            next_obs = torch.as_tensor(obs, dtype=torch.float32)
        with torch.no_grad():
            next_value = agent.value(next_obs).flatten()
            adv = torch.zeros_like(rew_buf)
            last = torch.zeros(ENVS)
            for t in reversed(range(STEPS)):
                nv = next_value if t == STEPS - 1 else val_buf[t + 1]
                nonterminal = 1.0 - done_buf[t]
                delta = rew_buf[t] + gamma * nv * nonterminal - val_buf[t]
                last = delta + gamma * lam * nonterminal * last
                adv[t] = last
            returns = adv + val_buf
        b_obs, b_act, b_logp = obs_buf.reshape(-1, 4), act_buf.reshape(-1), logp_buf.reshape(-1)
        b_adv, b_ret = adv.reshape(-1), returns.reshape(-1)
        n = b_obs.shape[0]
        for _ in range(EPOCHS):
            perm = torch.randperm(n)
            for i in range(0, n, MINIBATCH):
                mb = perm[i : i + MINIBATCH]
                _, logp, ent, value = agent.action_and_value(b_obs[mb], b_act[mb])
                ratio = (logp - b_logp[mb]).exp()
                a = b_adv[mb]
                a = (a - a.mean()) / (a.std() + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(1 - clip * frac, 1 + clip * frac)).mean()
                v_loss = 0.5 * ((value.flatten() - b_ret[mb]) ** 2).mean()
                loss = pg + vf_coef * v_loss
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
                opt.step()
    elapsed = time.perf_counter() - start
    envs.close()
    return updates * ENVS * STEPS / elapsed


def ours_ppo(frames: int, seed: int = 0) -> float:
    """Train the project's PPO for ``frames`` frames without evaluation; return frames/s."""
    from core.records import Candidate
    from core.train.ppo import PPOConfig, train

    cfg = PPOConfig(frames=frames, num_envs=ENVS, rollout_steps=STEPS, epochs=EPOCHS, minibatch=MINIBATCH,
                    hidden=[HIDDEN, HIDDEN], eval_every=0, eval_episodes=0)
    result = train(cartpole_task(), Candidate(id="bench", iteration=0), cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return result.metrics["charts/fps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # alternate, best of N: a busy neighbour on the machine then hurts both sides alike
    reference = ours = 0.0
    for _ in range(args.repeats):
        reference = max(reference, reference_ppo(args.frames, args.seed))
        ours = max(ours, ours_ppo(args.frames, args.seed))
    print(json.dumps({"ours_fps": round(ours, 1), "reference_fps": round(reference, 1),
                      "ratio": round(ours / reference, 3), "frames": args.frames}))


if __name__ == "__main__":
    main()
