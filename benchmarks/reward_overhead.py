"""Cost of a reward program: PPO frames/s on CartPole with the env's reward and with code.

The program is written the way an LLM writes one (Eureka's signature, a components
dict) and gives CartPole's own +1 per step, so both runs learn the same thing. It goes
through ``core.sandbox.prepare_reward`` (checks, probe run) and the ``ProgramReward``
transform, as in a real run. Runs alternate (best of ``--repeats``) so that other load
on the machine hurts both alike. Prints one JSON object::

    {"env_reward_fps": ..., "program_reward_fps": ..., "ratio": ...}

Run: ``python benchmarks/reward_overhead.py [--frames 30000] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json

import torch

from core.records import Candidate, RewardProgram
from core.train.ppo import PPOConfig, train
from trainer_throughput import cartpole_task

PROGRAM = '''
import torch

def compute_reward(state, action, next_state):
    """+1 for every step the pole is still up (CartPole's own reward)."""
    alive_bonus = torch.ones_like(next_state["pole_angle"])
    components = {"alive_bonus": alive_bonus}
    return alive_bonus, components
'''


def fps(candidate: Candidate, frames: int, seed: int) -> tuple[float, dict]:
    cfg = PPOConfig(frames=frames, eval_every=0, eval_episodes=0)
    result = train(cartpole_task(), candidate, cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return result.metrics["charts/fps"], result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain = Candidate(id="env-reward", iteration=0)
    coded = Candidate(id="program-reward", iteration=0,
                      reward=RewardProgram(source=PROGRAM, entry="compute_reward", origin="benchmark"))
    env_fps, program_fps, metrics = 0.0, 0.0, {}
    for _ in range(args.repeats):
        env_fps = max(env_fps, fps(plain, args.frames, args.seed)[0])
        value, metrics = fps(coded, args.frames, args.seed)
        program_fps = max(program_fps, value)
    print(json.dumps({"env_reward_fps": round(env_fps, 1), "program_reward_fps": round(program_fps, 1),
                      "ratio": round(program_fps / env_fps, 3), "frames": args.frames,
                      "reward/env_correlation": metrics.get("reward/env_correlation")}))


if __name__ == "__main__":
    main()
