"""Does the fast SAC learn what the TorchRL ``SACLoss`` formulation learns? Curves over seeds.

Trains Pendulum-v1 with the default SAC settings (``conf/trainer/sac.yaml``) for
``--frames`` frames per seed with:

- ``ours``: the project's SAC (:mod:`core.train.sac`, the fused update);
- ``before`` (with ``--before COMMIT``): the project's SAC as it was at ``COMMIT``
  (``SACLoss``, autograd, three ``torch.optim.Adam``), its ``core/train/sac.py`` read
  with ``git show``.

Both are evaluated the same way every ``--eval-every`` frames: ``--episodes`` greedy
episodes (``core.train.evaluate``, seed + 10000). Writes the curves, the final returns per
seed and their means to ``--json`` (merging with what the file already holds, so the two
sides can run at different times) and prints a summary. Learning is stochastic: the two
differ per seed even when the algorithm is the same (their random streams differ); the
check is that the per-seed finals and the mean sit within each other's seed spread.

Run: ``python benchmarks/sac_learning.py --seeds 0 1 2 3 --frames 8000 --before 4323735
--json docs/scaling/sac_learning.json``.
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
import statistics
import subprocess
import time
from types import ModuleType
from typing import Any

import torch

from core.envs.classic import Pendulum
from core.records import Candidate

REPO = Path(__file__).resolve().parent.parent


def trainer_at(commit: str) -> ModuleType:
    """``core/train/sac.py`` as it was at ``commit``, imported as ``sac_at_<commit>``."""
    source = subprocess.check_output(["git", "show", f"{commit}:core/train/sac.py"], cwd=REPO, text=True)
    name = f"sac_at_{commit}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)  # our own history
    return module


def run(module: ModuleType, seed: int, frames: int, every: int, episodes: int) -> dict[str, Any]:
    cfg = module.SACConfig.from_config({"frames": frames, "eval_every": every, "eval_episodes": episodes})
    start = time.perf_counter()
    result = module.train(Pendulum(), Candidate(id=f"seed{seed}", iteration=0), cfg, seed=seed)
    if not result.ok:
        raise RuntimeError(result.error)
    return {
        "seed": seed,
        "final_return": round(result.curve[-1].episode_return, 1),
        "curve": [[p.frames, round(p.episode_return, 1)] for p in result.curve],
        "fps": round(result.metrics["charts/fps"], 1),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--frames", type=int, default=8000)
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--before", default="", help="a commit whose core/train/sac.py is the 'before' side")
    parser.add_argument("--only", default="ours,before", help="comma-separated: ours, before")
    parser.add_argument("--json", default="", help="write (merge) the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sides: dict[str, ModuleType] = {}
    if "ours" in args.only.split(","):
        from core.train import sac

        sides["ours"] = sac
    if args.before and "before" in args.only.split(","):
        sides["before"] = trainer_at(args.before)
    out: dict[str, Any] = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    out.update({"env": "Pendulum-v1", "frames": args.frames, "eval_every": args.eval_every, "episodes": args.episodes})
    for name, module in sides.items():
        load = [round(x, 2) for x in os.getloadavg()]
        runs = [run(module, seed, args.frames, args.eval_every, args.episodes) for seed in args.seeds]
        finals = [r["final_return"] for r in runs]
        out[name] = {
            "commit": args.before if name == "before" else "working tree",
            "load_avg_start": load,
            "final_mean": round(statistics.mean(finals), 1),
            "final_std": round(statistics.stdev(finals), 1) if len(finals) > 1 else 0.0,
            "runs": runs,
        }
    if "ours" in out and "before" in out:
        out["final_mean_difference"] = round(out["ours"]["final_mean"] - out["before"]["final_mean"], 1)
    text = json.dumps(out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
