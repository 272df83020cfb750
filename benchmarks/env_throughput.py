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
                            "target_ratio": 0.5, "target_envs": 16, "meets_target": true}, ...},
     "crafter": {"envs": 16, "game_sps": ..., "upstream_sps": ..., "vector_sps": ..., "stack_sps": ...,
                 "crafter_ratio": ..., "upstream_ratio": ..., "load_avg_1min": [...]},
     "crafter_ratio": ...}

For Crafter (``minecraft`` in ``--tasks``) the stack is also set against *bare
vectorised Crafter* at ``--target-envs`` games: ``game_sps`` steps ``crafter.Env`` games
with Crafter's own ``Env.step`` in a plain loop (on the worlds the task generates, with
the image and semantic map switched off, so it measures the rules alone), and
``crafter_ratio`` = ``stack_sps / game_sps`` (target >= 0.75). ``upstream_sps`` is
``crafter.Env`` as shipped (its own world generation, a 64x64 image and the semantic map
every step), ``vector_sps`` the task's vector env alone; all four alternate, best of
``--repeats``.

Run: ``python benchmarks/env_throughput.py [--envs 8,16,32] [--frames 8000] [--tasks cartpole,minecraft]``
(``--tasks minecraft --envs 16`` for the Crafter figures alone).
The targets are checked at ``--target-envs`` (16 envs, a usual PPO vector size). What
remains of the stack's cost is per vector step (the collector's carrier bookkeeping and
its stacking of the batch, ~0.1-0.15 ms here), so the ratio rises with the vector size;
every size's ratio is printed, the 8-env one (the PPO default) included.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
CRAFTER_TARGET = 0.75  # stack / bare vectorised Crafter (Crafter's own Env.step)


class Clock:
    """Wall and CPU seconds of a timed block (CPU time is what the shared machine leaves us)."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def rates(self, frames: int) -> tuple[float, float]:
        """(frames per wall second, frames per CPU second)."""
        return frames / self.wall, frames / max(self.cpu, 1e-9)


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


def bare_sps(name: str, num_envs: int, frames: int) -> tuple[float, float]:
    """Random-action steps per wall and per CPU second of the task's vector env alone."""
    env = make_task({"name": name}).make_env(num_envs, seed=0)
    env.reset(seed=0)
    sample = action_sampler(env.single_action_space, num_envs)
    steps = max(1, frames // num_envs)
    with Clock() as clock:
        for _ in range(steps):
            env.step(sample())
    env.close()
    return clock.rates(steps * num_envs)


class RandomPolicy:
    """The collector's policy: writes a random action batch into the carrier tensordict."""

    def __init__(self, sample: Callable[[], np.ndarray]) -> None:
        self.sample = sample

    def __call__(self, td: Any) -> Any:
        td.set("action", torch.from_numpy(self.sample()))
        return td


def stack_sps(name: str, num_envs: int, frames: int) -> tuple[float, float]:
    """Random-policy frames per wall and CPU second through VecGymEnv + Collector, as ``core.train.ppo`` builds them."""
    from torchrl.collectors import Collector

    from core.train.envs import VecGymEnv

    vec = make_task({"name": name}).make_env(num_envs, seed=0)
    env = VecGymEnv(vec, seed=0)
    per_batch = num_envs * 64
    batches = max(1, frames // per_batch)
    policy = RandomPolicy(action_sampler(vec.single_action_space, num_envs))
    collector = Collector(
        env,
        policy,
        frames_per_batch=per_batch,
        total_frames=(batches + 1) * per_batch,
        trust_policy=True,
        track_traj_ids=False,
        auto_register_policy_transforms=False,
    )
    it = iter(collector)
    next(it)  # warm-up batch (first reset, spec checks)
    with Clock() as clock:
        done = sum(batch.numel() for batch in it)
    collector.shutdown()
    return clock.rates(done)


def crafter_game_sps(num_envs: int, frames: int) -> tuple[float, float]:
    """Bare vectorised Crafter: the task's worlds stepped by ``crafter.Env.step`` in a loop."""
    vec = make_task({"name": "minecraft"}).make_env(num_envs, seed=0)
    envs = list(vec.envs)  # CrafterEnv: its game has the image and semantic map switched off
    games = [env._game for env in envs]
    sample = action_sampler(vec.single_action_space, num_envs)
    steps = max(1, frames // num_envs)
    with Clock() as clock:
        for _ in range(steps):
            for env, game, action in zip(envs, games, sample().tolist()):
                _, _, done, _ = game.step(action)
                if done:
                    env._new_world()
    return clock.rates(steps * num_envs)


def crafter_upstream_sps(num_envs: int, frames: int) -> tuple[float, float]:
    """``crafter.Env`` as shipped (own world generation, image and semantic map per step)."""
    from core.quiet import import_gym_quietly

    import_gym_quietly()
    import crafter

    games = [crafter.Env(seed=i) for i in range(num_envs)]
    for game in games:
        game.reset()
    sample = action_sampler(gym.spaces.Discrete(len(crafter.constants.actions)), num_envs)
    steps = max(1, frames // num_envs)
    with Clock() as clock:
        for _ in range(steps):
            for game, action in zip(games, sample().tolist()):
                _, _, done, _ = game.step(action)
                if done:
                    game.reset()
    return clock.rates(steps * num_envs)


def measure_crafter(num_envs: int, frames: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` steps/s of bare Crafter, upstream Crafter, our vector env and our stack."""
    frames = max(frames, num_envs * 128)
    arms: dict[str, Callable[[int, int], tuple[float, float]]] = {
        "game": crafter_game_sps,
        "upstream": crafter_upstream_sps,
        "vector": lambda n, f: bare_sps("minecraft", n, f),
        "stack": lambda n, f: stack_sps("minecraft", n, f),
    }
    wall, cpu = dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0.0)
    load = [round(os.getloadavg()[0], 2)]
    for _ in range(repeats):
        for key, run in arms.items():
            w, c = run(num_envs, frames)
            wall[key], cpu[key] = max(wall[key], w), max(cpu[key], c)
    load.append(round(os.getloadavg()[0], 2))
    out: dict[str, Any] = {"envs": num_envs, **{f"{k}_sps": round(v, 1) for k, v in wall.items()}}
    out["crafter_ratio"] = round(wall["stack"] / wall["game"], 3)
    out["upstream_ratio"] = round(wall["stack"] / wall["upstream"], 3)
    out["cpu_sps"] = {k: round(v, 1) for k, v in cpu.items()}  # steps per CPU second: less sensitive to load
    out["crafter_cpu_ratio"] = round(cpu["stack"] / cpu["game"], 3)
    out["target_ratio"] = CRAFTER_TARGET
    out["meets_target"] = out["crafter_ratio"] >= CRAFTER_TARGET
    out["load_avg_1min"] = load
    return out


def measure(name: str, num_envs: int, frames: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` bare and stack steps/s, measured alternately."""
    frames = max(frames, num_envs * 128)  # at least two batches of 64 steps per env
    bare, stack = 0.0, 0.0
    for _ in range(repeats):
        bare = max(bare, bare_sps(name, num_envs, frames)[0])
        stack = max(stack, stack_sps(name, num_envs, frames)[0])
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
    out: dict[str, Any] = {
        "frames": args.frames,
        "repeats": args.repeats,
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "tasks": results,
    }
    if "minecraft" in args.tasks.split(","):
        out["crafter"] = measure_crafter(args.target_envs, args.frames, args.repeats)
        out["crafter_ratio"] = out["crafter"]["crafter_ratio"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
