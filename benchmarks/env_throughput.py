"""Environment steps/s per task family: bare vector env vs. our training stack.

For each task and vector size, a random policy steps (1) the task's bare gymnasium
vector env and (2) the same vector env through the stack training actually uses: the
thin TorchRL env :class:`core.train.envs.VecGymEnv` and a ``torchrl.collectors.Collector``
built with the same options as :mod:`core.train.ppo` (``trust_policy``, no trajectory
ids, no policy transforms). Both sides draw their random actions the same cheap way
(one numpy call per vector step), so the ratio measures the stack, not the sampler.
Measurements alternate bare/stack ``--repeats`` times and keep the best of each (the
machine is shared: the best run is the least disturbed one). Prints one JSON object::

    {"frames": ..., "repeats": ..., "load_avg_1min": [before, after],
     "tasks": {"cartpole": {"8": {"bare_sps": ..., "stack_sps": ..., "ratio": ...}, "32": {...},
                            "target_ratio": 0.5, "target_envs": 16, "meets_target": true}, ...}}

Run: ``python benchmarks/env_throughput.py [--envs 8,16,32] [--frames 8000] [--tasks cartpole,minecraft]``.
The targets are checked at ``--target-envs`` (16 envs, a usual PPO vector size). What
remains of the stack's cost is per vector step (the collector's carrier bookkeeping and
its stacking of the batch, ~0.1-0.15 ms here), so the ratio rises with the vector size;
every size's ratio is printed, the 8-env one (the PPO default) included.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from core.envs import make_task

DEFAULT_TASKS = "cartpole,pendulum,lunarlander,halfcheetah,reach,minecraft"
TARGETS = {"minecraft": 0.75, "cartpole": 0.5}  # stack / bare ratio the stack must reach


def action_sampler(space: gym.Space, num_envs: int, seed: int = 0) -> Callable[[], np.ndarray]:
    """A batch of random actions per call, one numpy draw (Discrete or Box spaces)."""
    rng = np.random.default_rng(seed)
    if isinstance(space, gym.spaces.Discrete):
        n, start = int(space.n), int(space.start)
        return lambda: rng.integers(start, start + n, size=num_envs)
    if isinstance(space, gym.spaces.Box):
        low = np.broadcast_to(space.low, (num_envs, *space.shape)).astype(np.float32)
        high = np.broadcast_to(space.high, (num_envs, *space.shape)).astype(np.float32)
        return lambda: rng.uniform(low, high).astype(np.float32)
    raise TypeError(f"no sampler for {space!r}")


def bare_sps(name: str, num_envs: int, frames: int) -> float:
    """Random-action steps/s of the task's vector env alone."""
    env = make_task({"name": name}).make_env(num_envs, seed=0)
    env.reset(seed=0)
    sample = action_sampler(env.single_action_space, num_envs)
    steps = max(1, frames // num_envs)
    start = time.perf_counter()
    for _ in range(steps):
        env.step(sample())
    elapsed = time.perf_counter() - start
    env.close()
    return steps * num_envs / elapsed


class RandomPolicy:
    """The collector's policy: writes a random action batch into the carrier tensordict."""

    def __init__(self, sample: Callable[[], np.ndarray]) -> None:
        self.sample = sample

    def __call__(self, td: Any) -> Any:
        td.set("action", torch.from_numpy(self.sample()))
        return td


def stack_sps(name: str, num_envs: int, frames: int) -> float:
    """Random-policy frames/s through VecGymEnv + Collector, as ``core.train.ppo`` builds them."""
    from torchrl.collectors import Collector

    from core.train.envs import VecGymEnv

    vec = make_task({"name": name}).make_env(num_envs, seed=0)
    env = VecGymEnv(vec, seed=0)
    per_batch = num_envs * 64
    batches = max(1, frames // per_batch)
    policy = RandomPolicy(action_sampler(vec.single_action_space, num_envs))
    collector = Collector(env, policy, frames_per_batch=per_batch, total_frames=(batches + 1) * per_batch,
                          trust_policy=True, track_traj_ids=False, auto_register_policy_transforms=False)
    it = iter(collector)
    next(it)  # warm-up batch (first reset, spec checks)
    start = time.perf_counter()
    done = sum(batch.numel() for batch in it)
    elapsed = time.perf_counter() - start
    collector.shutdown()
    return done / elapsed


def measure(name: str, num_envs: int, frames: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` bare and stack steps/s, measured alternately."""
    frames = max(frames, num_envs * 128)  # at least two batches of 64 steps per env
    bare, stack = 0.0, 0.0
    for _ in range(repeats):
        bare = max(bare, bare_sps(name, num_envs, frames))
        stack = max(stack, stack_sps(name, num_envs, frames))
    return {"bare_sps": round(bare, 1), "stack_sps": round(stack, 1), "ratio": round(stack / bare, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default="8,16,32", help="comma-separated envs per vector env, e.g. 8,32,128")
    parser.add_argument("--target-envs", type=int, default=16, help="vector size the targets are checked at")
    parser.add_argument("--frames", type=int, default=8000, help="frames timed per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="alternating bare/stack runs; best of each kept")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated task names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    sizes = [int(s) for s in args.envs.split(",")]
    load_before = os.getloadavg()[0]
    results: dict[str, dict[str, Any]] = {}
    for name in args.tasks.split(","):
        row: dict[str, Any] = {str(n): measure(name, n, args.frames, args.repeats) for n in sizes}
        if name in TARGETS and str(args.target_envs) in row:
            row["target_ratio"] = TARGETS[name]
            row["target_envs"] = args.target_envs
            row["meets_target"] = row[str(args.target_envs)]["ratio"] >= TARGETS[name]
        results[name] = row
    print(json.dumps({"frames": args.frames, "repeats": args.repeats,
                      "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "tasks": results}))


if __name__ == "__main__":
    main()
