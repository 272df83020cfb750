"""Frames/s of the project's trainers against single-file PyTorch references, same run.

Three pairs, each trained from scratch with the same settings on the same machine:

- ``cartpole`` (the headline ``ratio``): PPO on ``CartPole-v1``, 8 envs x 32 steps per
  batch, 20 epochs of minibatch 256, two hidden layers of 64, one thread, against
  :mod:`reference_ppo` (CleanRL's layout).
- ``mujoco``: PPO on ``HalfCheetah-v5`` (8 envs x 256 steps, 10 epochs of minibatch 64,
  lr 3e-4, gamma 0.99, lambda 0.95: CleanRL's MuJoCo settings) against the same reference.
- ``sac``: SAC on ``Pendulum-v1`` (``conf/trainer/sac.yaml``) against :mod:`reference_sac`.

Runs alternate (reference then ours, then ours then reference, ...) so that load from
elsewhere on the machine hurts both alike; ``ratio`` is the median of the per-repeat
ratios (each ours/reference pair ran back to back), ``best_ratio`` the best of ours over
the best of the reference, ``cpu_ratio`` the median ratio of frames per CPU-second of the
process (robust to other load; setup included). Only training is timed: evaluation is
off in ours. The load average is printed before and after. ``profile`` is where our CartPole PPO's training
time goes (``time/*_s`` metrics of the median run): rollout (env steps, the policy,
per-step transforms), reward (the candidate's reward program on the batch and
``on_rollout`` hooks; ``profile_reward_program`` is a run with an LLM-style reward
program), advantage (values and GAE), update (the epochs of minibatch steps). The
``sac`` pair has its own ``profile`` (median run): rollout (env steps and the collection
policy), replay (adding to and sampling the replay ring), update (the gradient step of
critics, actor and temperature), target (the Polyak update), other (hooks, metrics).
Prints one JSON object::

    {"ratio": ..., "ours_fps": ..., "reference_fps": ..., "profile": {...},
     "mujoco": {"ratio": ...}, "sac": {"ratio": ..., "profile": {...}}, "load_avg": [...], ...}

Run: ``python benchmarks/trainer_throughput.py [--frames 50000] [--repeats 3]
[--only cartpole,mujoco,sac]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any, Callable

import gymnasium as gym
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the reference scripts beside this file

import reference_ppo
import reference_sac
from core.envs.task import StateField, Task
from core.records import Candidate, RewardProgram

PHASES = ("rollout", "reward", "advantage", "update")
SAC_PHASES = ("rollout", "replay", "update", "target", "other")
MUJOCO = dict(num_envs=8, rollout_steps=256, epochs=10, minibatch=64, lr=3e-4, gamma=0.99, gae_lambda=0.95)
REWARD_PROGRAM = '''
import torch

def compute_reward(state, action, next_state):
    """+1 while the pole is up, less a penalty for leaning and for drifting off centre."""
    upright = 1.0 - (next_state["pole_angle"].abs() / 0.2095).clamp(max=1.0)
    centred = 1.0 - (next_state["cart_position"].abs() / 2.4).clamp(max=1.0)
    components = {"upright": upright, "centred": centred}
    return 0.5 + 0.3 * upright + 0.2 * centred, components
'''


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
        return reference_ppo.make_env("CartPole-v1", num_envs, seed)


def cartpole_task() -> Task:
    """The project's cartpole task (the stand-in above where it is missing)."""
    try:
        from core.envs.classic import CartPole
    except ImportError:
        return CartPoleTask()
    return CartPole()


# -- one training each ----------------------------------------------------------------------


def ours_ppo(task: Task, frames: int, seed: int = 0, candidate: Candidate | None = None, **settings: Any) -> dict:
    """Train the project's PPO without evaluation; its metrics (``charts/fps``, ``time/*_s``)."""
    from core.train.ppo import PPOConfig, train

    cfg = PPOConfig(frames=frames, eval_every=0, eval_episodes=0, **settings)
    result = train(task, candidate or Candidate(id="bench", iteration=0), cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return result.metrics


def ours_sac(frames: int, seed: int = 0) -> dict:
    from core.envs.classic import Pendulum
    from core.train.sac import SACConfig, train

    cfg = SACConfig(frames=frames, eval_every=0, eval_episodes=0)
    result = train(Pendulum(), Candidate(id="bench", iteration=0), cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return result.metrics


def interleaved(ours: Callable[[], dict], reference: Callable[[], float], repeats: int, frames: int) -> dict:
    """Alternate the two ``repeats`` times; frames/s of each, per-repeat ratios and their median.

    Besides wall-clock frames/s (what each trainer reports), each call's process CPU time
    is measured around it (setup included, so slightly against both): ``cpu_ratio``
    compares frames per CPU-second, which other load on the machine changes little.
    """

    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        start = time.process_time()
        value = fn()
        return value, time.process_time() - start

    runs = []
    for r in range(repeats):
        if r % 2 == 0:
            ref, ref_cpu = timed(reference)
            metrics, ours_cpu = timed(ours)
        else:
            metrics, ours_cpu = timed(ours)
            ref, ref_cpu = timed(reference)
        runs.append(
            {
                "ours_fps": round(metrics["charts/fps"], 1),
                "reference_fps": round(ref, 1),
                "ratio": round(metrics["charts/fps"] / ref, 3),
                "ours_cpu_fps": round(frames / ours_cpu, 1),
                "reference_cpu_fps": round(frames / ref_cpu, 1),
                "cpu_ratio": round(ref_cpu / ours_cpu, 3),
                "metrics": metrics,
            }
        )
    ratios = [run["ratio"] for run in runs]
    median_run = sorted(runs, key=lambda run: run["ratio"])[len(runs) // 2]
    return {
        "ratio": round(statistics.median(ratios), 3),
        "best_ratio": round(max(run["ours_fps"] for run in runs) / max(run["reference_fps"] for run in runs), 3),
        "cpu_ratio": round(statistics.median(run["cpu_ratio"] for run in runs), 3),
        "ours_fps": round(statistics.median(run["ours_fps"] for run in runs), 1),
        "reference_fps": round(statistics.median(run["reference_fps"] for run in runs), 1),
        "ratios": ratios,
        "runs": [{k: v for k, v in run.items() if k != "metrics"} for run in runs],
        "median_metrics": median_run["metrics"],
    }


def profile(metrics: dict, frames_per_batch: int, phases: tuple[str, ...] = PHASES) -> dict:
    """Seconds, share of the training time and milliseconds per batch of each phase."""
    seconds = {p: metrics.get(f"time/{p}_s", 0.0) for p in phases}
    total = sum(seconds.values())
    batches = max(1.0, metrics["charts/fps"] * total / frames_per_batch)
    return {
        p: {
            "s": round(s, 3),
            "share": round(s / total, 3) if total else 0.0,
            "ms_per_batch": round(1000 * s / batches, 2),
        }
        for p, s in seconds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50_000, help="CartPole PPO frames per run")
    parser.add_argument("--mujoco-frames", type=int, default=3 * 2048)
    parser.add_argument("--sac-frames", type=int, default=3000, help="SAC frames per run (the first 1000 random)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="cartpole,mujoco,sac", help="comma-separated subset of the pairs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    only = set(args.only.split(","))
    import core.train.ppo  # imports before any clock starts
    import core.train.sac

    if "mujoco" in only:
        import mujoco  # noqa: F401

        import core.envs.mujoco  # noqa: F401
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # after torchrl's import: stdout carries the JSON only
    out: dict[str, Any] = {"load_avg_start": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}

    if "cartpole" in only:
        task = cartpole_task()
        pair = interleaved(
            lambda: ours_ppo(task, args.frames, args.seed),
            lambda: reference_ppo.train(reference_ppo.Args(), args.frames, args.seed),
            args.repeats,
            args.frames,
        )
        metrics = pair.pop("median_metrics")
        out.update(pair, frames=args.frames, profile=profile(metrics, 256))
        try:  # a candidate with an LLM-style reward program (through the sandbox)
            coded = Candidate(
                id="program",
                iteration=0,
                reward=RewardProgram(source=REWARD_PROGRAM, entry="compute_reward", origin="benchmark"),
            )
            coded_metrics = ours_ppo(task, args.frames, args.seed, candidate=coded)
            out["profile_reward_program"] = {
                "fps": round(coded_metrics["charts/fps"], 1),
                **profile(coded_metrics, 256),
            }
        except Exception as exc:  # the sandbox may be unavailable; the rest still counts
            out["profile_reward_program"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    if "mujoco" in only:
        from core.envs.mujoco import HalfCheetah

        ref_args = reference_ppo.Args(
            env_id="HalfCheetah-v5",
            num_envs=8,
            num_steps=256,
            update_epochs=10,
            minibatch_size=64,
            learning_rate=3e-4,
            gamma=0.99,
            gae_lambda=0.95,
        )
        pair = interleaved(
            lambda: ours_ppo(HalfCheetah(), args.mujoco_frames, args.seed, **MUJOCO),
            lambda: reference_ppo.train(ref_args, args.mujoco_frames, args.seed),
            max(2, args.repeats - 1),
            args.mujoco_frames,
        )
        metrics = pair.pop("median_metrics")
        out["mujoco"] = {
            "env": "HalfCheetah-v5",
            "frames": args.mujoco_frames,
            **pair,
            "profile": profile(metrics, MUJOCO["num_envs"] * MUJOCO["rollout_steps"]),
        }

    if "sac" in only:
        pair = interleaved(
            lambda: ours_sac(args.sac_frames, args.seed),
            lambda: reference_sac.train(reference_sac.Args(), args.sac_frames, args.seed),
            max(2, args.repeats - 1),
            args.sac_frames,
        )
        metrics = pair.pop("median_metrics")
        out["sac"] = {
            "env": "Pendulum-v1",
            "frames": args.sac_frames,
            **pair,
            "profile": profile(metrics, 1, SAC_PHASES),
        }

    out["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
