"""Does ``trainer.normalize_reward`` make PPO indifferent to the reward's scale, and what does it cost?

For CartPole-v1 and MountainCar-v0, with the default PPO settings (``conf/trainer/ppo.yaml``,
what ``python -m core env=<task>`` trains) and the frames of the results study
(``conf/study/results.yaml``: 100k and 200k), trains each seed with ``normalize_reward``
off and on, on two rewards:

- ``human``: the env's own reward (CartPole +1 per step, MountainCar -1 per step);
- ``human_x1e4``: the same reward times 1e4, as a candidate's reward program (the sandboxed
  path an LLM-written reward takes; mode ``replace``), standing for an LLM reward of a large
  magnitude (LunarLander's LLM rewards reached 1e6-1e7 per episode).

Each training ends with the task's fitness on ``--episodes`` greedy episodes (CartPole: the
mean return, max 500; MountainCar: the success rate). Prints one JSON line per training, then
the summary (per task, reward and setting: the fitness per seed, their mean and IQM, the
mean training return in the task's units and the final ``train/reward_scale``), and writes
everything to ``--json``. Before training it checks that the scaled program is the env's
reward times 1e4 on random steps (``program_relative_error``). ``--tasks ... pendulum`` adds
Pendulum-v1 with SAC (``conf/trainer/sac.yaml``, 8k frames; its reward is a function of the
state and action, written out as the program).

Run: ``python benchmarks/reward_normalisation.py --seeds 0 1 2 --json docs/scaling/reward_normalisation.json``
(about 6 minutes on 2 cores; ``--tasks pendulum`` about 20 more).
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.envs import make_task
from core.records import Candidate, RewardProgram
from core.train import get_trainer
from core.train.common import CandidateEnv

#: task -> (env config, frames per training, trainer, the env's own reward as a program expression)
TASKS = {
    "cartpole": ({"name": "cartpole"}, 100_000, "ppo", "next_state['pole_angle'].reshape(-1) * 0.0 + 1.0"),
    "mountaincar": ({"name": "mountaincar"}, 200_000, "ppo", "next_state['car_position'].reshape(-1) * 0.0 - 1.0"),
    # opt-in (--tasks ... pendulum): SAC, 8k frames (tests/core/train/test_sac.py's learning test);
    # Pendulum-v1's cost of the state before the step, from the float32 observation
    "pendulum": (
        {"name": "pendulum"},
        8_000,
        "sac",
        "-(torch.atan2(state['sin_theta'], state['cos_theta']).reshape(-1) ** 2 "
        "+ 0.1 * state['angular_velocity'].reshape(-1) ** 2 + 0.001 * action.reshape(-1).clamp(-2, 2) ** 2)",
    ),
}
DEFAULT_TASKS = ["cartpole", "mountaincar"]
SCALE = 1e4


def scaled_program(expression: str) -> RewardProgram:
    """The env's own reward times :data:`SCALE`, as a reward program."""
    source = (
        f"import torch\n\n\ndef compute_reward(state, action, next_state):\n    return {SCALE!r} * ({expression})\n"
    )
    return RewardProgram(source=source, entry="compute_reward", mode="replace")


def program_error(task_name: str) -> float:
    """Largest ``|program - SCALE * env reward| / (SCALE * max |env reward|)`` over 4 x 100 random steps:
    that the scaled program is the env's reward, times :data:`SCALE`."""
    env, _, _, expression = TASKS[task_name]
    cenv = CandidateEnv(make_task(env), Candidate("check", 0, reward=scaled_program(expression)), 4, 0, None, None)
    try:
        batch = cenv.env.rollout(100, break_when_any_done=False)  # uniformly random actions
        batch = cenv.postproc(batch)  # the program, as the trainers apply it to a collected batch
        ours, theirs = batch.get(("next", "reward")), SCALE * batch.get(("next", "env_reward"))
        return float((ours - theirs).abs().max() / theirs.abs().max())
    finally:
        cenv.close()


def iqm(values: list[float]) -> float:
    """Interquartile mean: the mean of the middle half (all of them below 4 values)."""
    x = np.sort(np.asarray(values, dtype=float))
    cut = len(x) // 4
    return float(x[cut : len(x) - cut].mean())


def run_one(task_name: str, reward: str, normalize: bool, seed: int, frames: int, episodes: int) -> dict:
    env, default_frames, trainer, expression = TASKS[task_name]
    task = make_task(env)
    train, config = get_trainer(trainer)
    cfg = config.from_config(
        {"frames": frames or default_frames, "eval_every": 0, "eval_episodes": episodes, "normalize_reward": normalize}
    )
    program = scaled_program(expression) if reward == "human_x1e4" else None
    name = f"{task_name}-{reward}-{'on' if normalize else 'off'}-s{seed}"
    candidate = Candidate(id=name, iteration=0, reward=program)
    result = train(task, candidate, cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return {
        "task": task_name,
        "trainer": trainer,
        "reward": reward,
        "normalize_reward": normalize,
        "seed": seed,
        "frames": result.frames,
        "fitness": round(result.fitness.value, 3),
        "fitness_name": result.fitness.name,
        "train_return": round(result.metrics.get("charts/episodic_return", float("nan")), 2),
        "reward_scale": result.metrics.get("train/reward_scale"),
        "critic_loss": result.metrics.get("losses/value_loss", result.metrics.get("losses/qvalue_loss")),
        "seconds": round(result.seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS, choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--frames", type=int, default=0, help="frames per training (0: the task's, see TASKS)")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start_load, start = os.getloadavg(), time.perf_counter()
    runs, errors = [], {t: program_error(t) for t in args.tasks}
    print(json.dumps({"program_relative_error": errors}), flush=True)
    for task_name in args.tasks:
        for seed in args.seeds:
            for reward in ("human", "human_x1e4"):
                for normalize in (False, True):
                    runs.append(run_one(task_name, reward, normalize, seed, args.frames, args.episodes))
                    print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, dict] = {}
    for task_name in args.tasks:
        for reward in ("human", "human_x1e4"):
            for normalize in (False, True):
                cell = [
                    r
                    for r in runs
                    if r["task"] == task_name and r["reward"] == reward and r["normalize_reward"] == normalize
                ]
                fitness = [r["fitness"] for r in cell]
                scales = [r["reward_scale"] for r in cell if r["reward_scale"] is not None]
                summary.setdefault(task_name, {}).setdefault(reward, {})["on" if normalize else "off"] = {
                    "fitness_name": cell[0]["fitness_name"],
                    "seeds": [r["seed"] for r in cell],
                    "fitness": fitness,
                    "mean": round(float(np.mean(fitness)), 3),
                    "iqm": round(iqm(fitness), 3),
                    "train_return_mean": round(float(np.mean([r["train_return"] for r in cell])), 2),
                    "reward_scale_mean": float(np.mean(scales)) if scales else None,
                    "critic_loss_mean": float(np.mean([r["critic_loss"] for r in cell])),
                }
    out = {
        "settings": {
            "trainers": {t: f"conf/trainer/{TASKS[t][2]}.yaml defaults" for t in args.tasks},
            "tasks": {t: TASKS[t][0] for t in args.tasks},
            "frames": {t: args.frames or TASKS[t][1] for t in args.tasks},
            "seeds": args.seeds,
            "episodes": args.episodes,
            "scale": SCALE,
            "torch_threads": 1,
        },
        "program_relative_error": errors,
        "load_avg_start": [round(x, 2) for x in start_load],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary,
        "runs": runs,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
