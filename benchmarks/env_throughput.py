"""Environment steps/s per task family: bare vector env vs. our training stack.

For each task, a random policy steps (1) the task's bare gymnasium vector env and
(2) the same vector env through the stack training actually uses: the thin TorchRL env
:class:`core.train.envs.VecGymEnv` and a ``torchrl.collectors.Collector`` built with the
same options as :mod:`core.train.ppo` (``trust_policy``, no trajectory ids, no policy
transforms), with a random policy in place of the actor. Prints one JSON object::

    {"tasks": {"cartpole": {"bare_sps": ..., "stack_sps": ..., "ratio": ...}, ...},
     "targets": {"minecraft": "stack >= 0.75 x bare", "cartpole": "stack >= 0.5 x bare"}}

Run: ``python benchmarks/env_throughput.py [--envs 8] [--frames 8000] [--tasks cartpole,minecraft]``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from core.envs import make_task

DEFAULT_TASKS = "cartpole,pendulum,lunarlander,halfcheetah,reach,minecraft"
TARGETS = {"minecraft": 0.75, "cartpole": 0.5}  # stack / bare ratio the stack must reach


def bare_sps(name: str, num_envs: int, frames: int) -> float:
    """Random-action steps/s of the task's vector env alone."""
    env = make_task({"name": name}).make_env(num_envs, seed=0)
    env.reset(seed=0)
    space = env.action_space
    steps = max(1, frames // num_envs)
    start = time.perf_counter()
    for _ in range(steps):
        env.step(space.sample())  # a fresh random action, as the collector's random policy draws
    elapsed = time.perf_counter() - start
    env.close()
    return steps * num_envs / elapsed


def stack_sps(name: str, num_envs: int, frames: int) -> float:
    """Random-policy frames/s through VecGymEnv + Collector, as ``core.train.ppo`` builds them."""
    from torchrl.collectors import Collector

    from core.train.envs import VecGymEnv

    env = VecGymEnv(make_task({"name": name}).make_env(num_envs, seed=0), seed=0)
    per_batch = num_envs * 64
    collector = Collector(env, policy=None, frames_per_batch=per_batch, total_frames=frames + per_batch,
                          trust_policy=True, track_traj_ids=False, auto_register_policy_transforms=False)
    batches = iter(collector)
    next(batches)  # warm-up batch (first reset, spec checks)
    start = time.perf_counter()
    done = 0
    for batch in batches:
        done += batch.numel()
    elapsed = time.perf_counter() - start
    collector.shutdown()
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8, help="envs per vector env")
    parser.add_argument("--frames", type=int, default=8000, help="frames timed per measurement")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated task names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    results = {}
    for name in args.tasks.split(","):
        # best of two alternating runs: the machine is shared, take the least disturbed
        bare = max(bare_sps(name, args.envs, args.frames) for _ in range(2))
        stack = max(stack_sps(name, args.envs, args.frames) for _ in range(2))
        results[name] = {"bare_sps": round(bare, 1), "stack_sps": round(stack, 1), "ratio": round(stack / bare, 3)}
        if name in TARGETS:
            results[name]["target_ratio"] = TARGETS[name]
            results[name]["meets_target"] = stack / bare >= TARGETS[name]
    print(json.dumps({"envs": args.envs, "frames": args.frames, "tasks": results}))


if __name__ == "__main__":
    main()
