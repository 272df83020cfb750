"""Does the fast PPO learn what the reference formulation learns? Curves over seeds.

Trains CartPole-v1 with the default PPO settings (``conf/trainer/ppo.yaml``, 100k
frames) for each seed with:

- ``ours``: the project's PPO (:mod:`core.train.ppo`, hand-written update);
- ``before`` (with ``--before COMMIT``): the project's PPO as it was at ``COMMIT``
  (``ClipPPOLoss`` and autograd), its ``core/train/ppo.py`` read with ``git show``;
- ``reference``: the single-file PPO of :mod:`reference_ppo`.

Every ``--eval-every`` frames each is evaluated the same way: ``--episodes`` greedy
episodes of the task's env (``core.train.evaluate.evaluate``, seed + 10000). Writes the
curves and final returns to ``--json`` and a figure to ``--figure`` (mean and per-seed
curves), and prints a summary.

Run: ``python benchmarks/ppo_learning.py --seeds 0 1 2 3 4 --before e5fc525
--json docs/scaling/ppo_learning.json --figure docs/scaling/ppo_learning.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import importlib.util
import json
import os
import subprocess
import time
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference_ppo
from core.envs.classic import CartPole
from core.records import Candidate
from core.train.evaluate import evaluate

REPO = Path(__file__).resolve().parent.parent


def trainer_at(commit: str) -> ModuleType:
    """``core/train/ppo.py`` as it was at ``commit``, imported as ``ppo_at_<commit>``."""
    source = subprocess.check_output(["git", "show", f"{commit}:core/train/ppo.py"], cwd=REPO, text=True)
    name = f"ppo_at_{commit}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)  # our own history
    return module


def project_curve(module: ModuleType, seed: int, frames: int, every: int, episodes: int) -> tuple[list, float]:
    cfg = module.PPOConfig.from_config({"frames": frames, "eval_every": every, "eval_episodes": episodes})
    result = module.train(CartPole(), Candidate(id=f"seed{seed}", iteration=0), cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return [(p.frames, p.episode_return) for p in result.curve], result.metrics["charts/fps"]


def reference_curve(seed: int, frames: int, every: int, episodes: int) -> tuple[list, float]:
    task, points, next_eval = CartPole(), [], every

    def on_batch(done: int, act: Any) -> None:
        nonlocal next_eval
        if done >= next_eval or done + 256 > frames:
            found = evaluate(task, act, episodes, seed=seed + 10_000)
            points.append((done, float(np.mean([e.ret for e in found]))))
            next_eval += every

    fps = reference_ppo.train(reference_ppo.Args(), frames, seed, on_batch=on_batch)
    return points, fps


def figure(curves: dict[str, dict[int, list]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"ours": "tab:blue", "before": "tab:orange", "reference": "tab:green"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, per_seed in curves.items():
        frames = np.array([f for f, _ in next(iter(per_seed.values()))])
        returns = np.array([[r for _, r in points] for points in per_seed.values()])
        for row in returns:
            ax.plot(frames, row, color=colours.get(name), alpha=0.25, linewidth=0.8)
        ax.plot(
            frames,
            returns.mean(0),
            color=colours.get(name),
            linewidth=2.2,
            label=f"{name} (mean of {len(returns)} seeds)",
        )
    ax.set_xlabel("frames")
    ax.set_ylabel("greedy evaluation return (10 episodes)")
    ax.set_title("PPO on CartPole-v1, default settings")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--eval-every", type=int, default=10_000)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--before", default="", help="a commit whose PPO to add to the comparison")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--figure", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import core.train.ppo as ours

    trainers: dict[str, Any] = {"ours": ours}
    if args.before:
        trainers["before"] = trainer_at(args.before)
    curves: dict[str, dict[int, list]] = {name: {} for name in [*trainers, "reference"]}
    fps: dict[str, dict[int, float]] = {name: {} for name in curves}
    start_load = os.getloadavg()
    for seed in args.seeds:
        for name, module in trainers.items():
            curves[name][seed], fps[name][seed] = project_curve(
                module, seed, args.frames, args.eval_every, args.episodes
            )
        curves["reference"][seed], fps["reference"][seed] = reference_curve(
            seed, args.frames, args.eval_every, args.episodes
        )
        print(
            json.dumps(
                {
                    "seed": seed,
                    **{n: round(c[seed][-1][1], 1) for n, c in curves.items()},
                    "fps": {n: round(f[seed]) for n, f in fps.items()},
                }
            ),
            flush=True,
        )
    summary = {}
    for name, per_seed in curves.items():
        finals = [points[-1][1] for points in per_seed.values()]
        areas = [float(np.mean([r for _, r in points])) for points in per_seed.values()]
        summary[name] = {
            "final_mean": round(float(np.mean(finals)), 1),
            "final_std": round(float(np.std(finals)), 1),
            "finals": [round(x, 1) for x in finals],
            "curve_mean": round(float(np.mean(areas)), 1),
            "fps_median": round(float(np.median(list(fps[name].values()))), 1),
        }
    out = {
        "settings": {
            "env": "CartPole-v1",
            "frames": args.frames,
            "seeds": args.seeds,
            "eval_every": args.eval_every,
            "episodes": args.episodes,
            "before": args.before or None,
        },
        "load_avg_start": [round(x, 2) for x in start_load],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "summary": summary,
        "curves": {n: {str(s): c for s, c in per.items()} for n, per in curves.items()},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.figure:
        figure(curves, args.figure)


if __name__ == "__main__":
    main()
