"""PPO on panda-gym PandaReach (dense reward): success rate, frames and seconds.

Trains the project's PPO (``core.train.ppo.train``) on ``env=panda_reach`` with the
env's dense reward (minus the end-effector-to-goal distance) and the settings below,
then evaluates the deterministic policy. Prints one JSON object::

    {"success_rate": ..., "frames": ..., "seconds": ..., "fps": ..., "settings": {...}}

The same run from the command line::

    python -m core env=panda_reach trainer.frames=30000 trainer.rollout_steps=50 \
        trainer.epochs=10 trainer.minibatch=200 trainer.lr=0.001 trainer.gamma=0.95 \
        trainer.gae_lambda=0.95 trainer.eval_episodes=50 trainer.eval_every=0

Run: ``python benchmarks/panda_reach.py [--frames 30000] [--seed 0] [--episodes 50]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time
import warnings

import torch

from core.envs import make_task
from core.records import Candidate
from core.train.ppo import PPOConfig, train

#: trainer overrides for a short dense-reward run (one 50-step episode per env per batch)
SETTINGS = dict(
    num_envs=8,
    rollout_steps=50,
    epochs=10,
    minibatch=200,
    lr=1e-3,
    gamma=0.95,
    gae_lambda=0.95,
    hidden=[64, 64],
    eval_every=0,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30_000, help="training budget in env steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=50, help="evaluation episodes")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    task = make_task({"name": "panda_reach", "reward_type": "dense"})
    cfg = PPOConfig(frames=args.frames, eval_episodes=args.episodes, **SETTINGS)
    start = time.perf_counter()
    result = train(task, Candidate(id="panda_reach", iteration=0), cfg, seed=args.seed)
    seconds = time.perf_counter() - start
    if not result.ok:
        raise SystemExit(result.error)
    print(
        json.dumps(
            {
                "success_rate": result.fitness.value if result.fitness else None,
                "frames": result.frames,
                "seconds": round(seconds, 1),
                "fps": round(result.metrics.get("charts/fps", 0.0), 1),
                "settings": SETTINGS,
            }
        )
    )


if __name__ == "__main__":
    main()
