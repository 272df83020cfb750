"""A single-file PyTorch PPO: the yardstick of ``trainer_throughput.py``.

CleanRL's layout (``ppo.py`` and ``ppo_continuous_action.py``, Huang et al. 2022): an
``Args`` dataclass, ``make_env``, an ``Agent`` of two MLPs, then the loop (rollout into
preallocated buffers, GAE as a Python loop, minibatch epochs with
``torch.distributions`` objects, ``clip_grad_norm_`` and ``torch.optim.Adam``). The
discrete path is the reference the project's PPO was first measured against; the
continuous one adds CleanRL's Gaussian head (state-independent log standard deviation,
actions clipped to the bounds in the env). Same loss as the project's: clipped
surrogate with per-minibatch normalised advantages, learning rate and clip range
annealed to 0. Two differences in detail, kept from the original reference: the value
loss is ``0.5 * vf_coef * MSE`` (the project's is ``vf_coef * MSE``) and a truncated
episode is not bootstrapped.

Only the training loop is timed; ``on_batch(frames, act)`` (evaluation, say) runs
outside the clock.

Run: ``python benchmarks/reference_ppo.py [--env CartPole-v1] [--frames 50000]``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Callable

import gymnasium as gym
import numpy as np
import torch
from torch import nn


@dataclass
class Args:
    """PPO settings (defaults: the project's ``conf/trainer/ppo.yaml``, rl-zoo's CartPole)."""

    env_id: str = "CartPole-v1"
    num_envs: int = 8  # vectorised envs
    num_steps: int = 32  # steps per env per rollout
    update_epochs: int = 20  # passes over each rollout
    minibatch_size: int = 256  # frames per gradient step
    learning_rate: float = 1e-3  # Adam, annealed linearly to 0
    gamma: float = 0.98
    gae_lambda: float = 0.8
    clip_coef: float = 0.2  # annealed with the learning rate
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64  # two hidden layers of this size, actor and critic apart


def make_env(env_id: str, num_envs: int, seed: int) -> gym.vector.VectorEnv:
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make(env_id) for _ in range(num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    env.reset(seed=seed)
    return env


def _layer(n_in: int, n_out: int, std: float = 2**0.5) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(n_in: int, hidden: int, n_out: int, out_std: float) -> nn.Sequential:
    return nn.Sequential(
        _layer(n_in, hidden), nn.Tanh(), _layer(hidden, hidden), nn.Tanh(), _layer(hidden, n_out, out_std)
    )


class Agent(nn.Module):
    """Separate actor and critic MLPs; Categorical or diagonal-Gaussian policy."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, continuous: bool) -> None:
        super().__init__()
        self.continuous = continuous
        self.critic = _mlp(obs_dim, hidden, 1, 1.0)
        self.actor = _mlp(obs_dim, hidden, n_actions, 0.01)
        if continuous:
            self.actor_logstd = nn.Parameter(torch.zeros(1, n_actions))

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def dist(self, x: torch.Tensor) -> torch.distributions.Distribution:
        if self.continuous:
            mean = self.actor(x)
            return torch.distributions.Normal(mean, self.actor_logstd.expand_as(mean).exp())
        return torch.distributions.Categorical(logits=self.actor(x))

    def action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        dist = self.dist(x)
        if action is None:
            action = dist.sample()
        if self.continuous:
            return action, dist.log_prob(action).sum(1), dist.entropy().sum(1), self.critic(x)
        return action, dist.log_prob(action), dist.entropy(), self.critic(x)

    @torch.no_grad()
    def act(self, x: torch.Tensor) -> torch.Tensor:
        """The greedy action (for evaluation)."""
        return self.actor(x) if self.continuous else self.actor(x).argmax(-1)


def train(
    args: Args,
    frames: int,
    seed: int = 0,
    on_batch: Callable[[int, Callable[[torch.Tensor], torch.Tensor]], None] | None = None,
) -> float:
    """Train for ``frames`` frames; return frames/s of the training loop (``on_batch`` not counted)."""
    torch.manual_seed(seed)
    envs = make_env(args.env_id, args.num_envs, seed)
    continuous = isinstance(envs.single_action_space, gym.spaces.Box)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    n_actions = int(envs.single_action_space.shape[0]) if continuous else int(envs.single_action_space.n)
    low, high = (envs.single_action_space.low, envs.single_action_space.high) if continuous else (None, None)
    agent = Agent(obs_dim, n_actions, args.hidden, continuous)
    opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    steps, n_envs = args.num_steps, args.num_envs
    obs_buf = torch.zeros(steps, n_envs, obs_dim)
    act_buf = torch.zeros(steps, n_envs, n_actions) if continuous else torch.zeros(steps, n_envs, dtype=torch.long)
    logp_buf = torch.zeros(steps, n_envs)
    rew_buf = torch.zeros(steps, n_envs)
    done_buf = torch.zeros(steps, n_envs)
    val_buf = torch.zeros(steps, n_envs)
    next_obs = torch.tensor(envs.reset(seed=seed)[0], dtype=torch.float32)
    updates = frames // (n_envs * steps)
    elapsed, start = 0.0, time.perf_counter()
    for update in range(updates):
        frac = 1.0 - update / updates
        opt.param_groups[0]["lr"] = frac * args.learning_rate
        clip = args.clip_coef * frac
        for step in range(steps):
            obs_buf[step] = next_obs
            with torch.no_grad():
                action, logp, _, value = agent.action_and_value(next_obs)
            val_buf[step] = value.flatten()
            act_buf[step], logp_buf[step] = action, logp
            env_action = np.clip(action.numpy(), low, high) if continuous else action.numpy()
            obs, reward, term, trunc, _ = envs.step(env_action)
            rew_buf[step] = torch.as_tensor(reward, dtype=torch.float32)
            done_buf[step] = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32)
            next_obs = torch.as_tensor(obs, dtype=torch.float32)
        with torch.no_grad():
            next_value = agent.value(next_obs).flatten()
            adv = torch.zeros_like(rew_buf)
            last = torch.zeros(n_envs)
            for t in reversed(range(steps)):
                nv = next_value if t == steps - 1 else val_buf[t + 1]
                nonterminal = 1.0 - done_buf[t]
                delta = rew_buf[t] + args.gamma * nv * nonterminal - val_buf[t]
                last = delta + args.gamma * args.gae_lambda * nonterminal * last
                adv[t] = last
            returns = adv + val_buf
        b_obs, b_logp = obs_buf.reshape(-1, obs_dim), logp_buf.reshape(-1)
        b_act = act_buf.reshape(-1, n_actions) if continuous else act_buf.reshape(-1)
        b_adv, b_ret = adv.reshape(-1), returns.reshape(-1)
        n = b_obs.shape[0]
        for _ in range(args.update_epochs):
            perm = torch.randperm(n)
            for i in range(0, n, args.minibatch_size):
                mb = perm[i : i + args.minibatch_size]
                _, logp, _, value = agent.action_and_value(b_obs[mb], b_act[mb])
                ratio = (logp - b_logp[mb]).exp()
                a = b_adv[mb]
                a = (a - a.mean()) / (a.std() + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)).mean()
                v_loss = 0.5 * ((value.flatten() - b_ret[mb]) ** 2).mean()
                loss = pg + args.vf_coef * v_loss
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                opt.step()
        if on_batch is not None:
            elapsed += time.perf_counter() - start
            on_batch((update + 1) * n_envs * steps, agent.act)
            start = time.perf_counter()
    elapsed += time.perf_counter() - start
    envs.close()
    return updates * n_envs * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"env": cli.env, "fps": round(train(Args(env_id=cli.env), cli.frames, cli.seed), 1)}))


if __name__ == "__main__":
    main()
