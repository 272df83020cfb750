"""A single-file PyTorch SAC: the yardstick for the project's SAC in ``trainer_throughput.py``.

CleanRL's ``sac_continuous_action.py`` layout (Haarnoja et al. 2018, "Soft Actor-Critic
Algorithms and Applications"): twin soft Q networks with Polyak-averaged targets, a
tanh-squashed Gaussian actor, an automatically tuned temperature, a replay buffer of
preallocated NumPy arrays. Settings are the project's ``conf/trainer/sac.yaml``: one
env, 1000 random frames, one gradient step per frame (actor and temperature too, not
CleanRL's delayed policy updates), batch 256, two hidden layers of 256 (ReLU), Adam at
1e-3, tau 0.005, gamma 0.99. A truncated episode bootstraps from its final observation.

Run: ``python benchmarks/reference_sac.py [--env Pendulum-v1] [--frames 5000]``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@dataclass
class Args:
    """SAC settings (defaults: the project's ``conf/trainer/sac.yaml``, rl-zoo's Pendulum)."""

    env_id: str = "Pendulum-v1"
    buffer_size: int = 100_000
    batch_size: int = 256
    learning_starts: int = 1000  # uniformly random actions before learning starts
    lr: float = 1e-3  # critics, actor and temperature
    gamma: float = 0.99
    tau: float = 0.005
    hidden: int = 256


def make_env(env_id: str, seed: int) -> gym.vector.VectorEnv:
    env = gym.vector.SyncVectorEnv([lambda: gym.make(env_id)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + act_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, a], 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Actor(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low: np.ndarray, high: np.ndarray) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc_mean = nn.Linear(hidden, act_dim)
        self.fc_logstd = nn.Linear(hidden, act_dim)
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        log_std = torch.tanh(self.fc_logstd(x))
        return self.fc_mean(x), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)

    def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t) - torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        return action, log_prob.sum(1, keepdim=True), torch.tanh(mean) * self.action_scale + self.action_bias


def train(args: Args, frames: int, seed: int = 0) -> float:
    """Train for ``frames`` env steps; return frames/s."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    envs = make_env(args.env_id, seed)
    space = envs.single_action_space
    obs_dim, act_dim = int(np.prod(envs.single_observation_space.shape)), int(np.prod(space.shape))
    actor = Actor(obs_dim, act_dim, args.hidden, space.low, space.high)
    qf1, qf2 = SoftQNetwork(obs_dim, act_dim, args.hidden), SoftQNetwork(obs_dim, act_dim, args.hidden)
    qf1_target, qf2_target = SoftQNetwork(obs_dim, act_dim, args.hidden), SoftQNetwork(obs_dim, act_dim, args.hidden)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.lr)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.lr)
    target_entropy = -float(act_dim)
    log_alpha = torch.zeros(1, requires_grad=True)
    alpha = log_alpha.exp().item()
    a_optimizer = torch.optim.Adam([log_alpha], lr=args.lr)

    size = min(args.buffer_size, frames)
    b_obs, b_next = np.zeros((size, obs_dim), np.float32), np.zeros((size, obs_dim), np.float32)
    b_act, b_rew = np.zeros((size, act_dim), np.float32), np.zeros((size, 1), np.float32)
    b_term = np.zeros((size, 1), np.float32)
    obs, _ = envs.reset(seed=seed)
    start = time.perf_counter()
    for step in range(frames):
        if step < args.learning_starts:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions = actor.get_action(torch.as_tensor(obs, dtype=torch.float32))[0].numpy()
        next_obs, rewards, terms, truncs, infos = envs.step(actions)
        real_next = next_obs.copy()
        for i in np.flatnonzero(np.logical_or(terms, truncs)):
            real_next[i] = infos["final_obs"][i]
        at = step % size
        b_obs[at], b_next[at], b_act[at] = obs[0], real_next[0], actions[0]
        b_rew[at, 0], b_term[at, 0] = rewards[0], terms[0]
        obs = next_obs

        if step >= args.learning_starts:
            idx = np.random.randint(0, min(step + 1, size), args.batch_size)
            o, a, r = torch.from_numpy(b_obs[idx]), torch.from_numpy(b_act[idx]), torch.from_numpy(b_rew[idx])
            o2, d = torch.from_numpy(b_next[idx]), torch.from_numpy(b_term[idx])
            with torch.no_grad():
                next_a, next_logp, _ = actor.get_action(o2)
                min_next = torch.min(qf1_target(o2, next_a), qf2_target(o2, next_a)) - alpha * next_logp
                target = r + (1 - d) * args.gamma * min_next
            qf_loss = F.mse_loss(qf1(o, a), target) + F.mse_loss(qf2(o, a), target)
            q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()

            pi, logp, _ = actor.get_action(o)
            actor_loss = (alpha * logp - torch.min(qf1(o, pi), qf2(o, pi))).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()

            with torch.no_grad():
                _, logp, _ = actor.get_action(o)
            alpha_loss = (-log_alpha.exp() * (logp + target_entropy)).mean()
            a_optimizer.zero_grad()
            alpha_loss.backward()
            a_optimizer.step()
            alpha = log_alpha.exp().item()

            for net, target_net in ((qf1, qf1_target), (qf2, qf2_target)):
                for p, tp in zip(net.parameters(), target_net.parameters()):
                    tp.data.copy_(args.tau * p.data + (1 - args.tau) * tp.data)
    elapsed = time.perf_counter() - start
    envs.close()
    return frames / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--frames", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"env": cli.env, "fps": round(train(Args(env_id=cli.env), cli.frames, cli.seed), 1)}))


if __name__ == "__main__":
    main()
