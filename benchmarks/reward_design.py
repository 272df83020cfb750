"""Reward design on a sparse task: the best Eureka reward vs PPO on the env's own reward.

Arms, at the same frame budget per training:

- ``sparse``: PPO on the env's own reward (MountainCar: -1 per step, the only signal is
  reaching the flag early);
- ``eureka``: PPO on the best reward the eureka plugin found with the configured LLM
  (``--iterations`` x ``--samples`` candidates, searched with seed 0), retrained on
  fresh seeds.

Fitness is the task's ground truth (MountainCar: success rate of reaching the flag).
Prints one JSON object with each arm's fitness per seed and ``eureka_beats_sparse``
(Eureka's mean fitness above the sparse arm's).

    python benchmarks/reward_design.py                  # MountainCar, 2 x 4 candidates, 3 seeds
    python benchmarks/reward_design.py --frames 30000 --seeds 5
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
import statistics
import time
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def compose(overrides: list[str]) -> Any:
    """The run config for ``overrides`` (the same composition as ``python -m core``)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from core.resources import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def search(args: argparse.Namespace, common: list[str]) -> tuple[Any, dict[str, Any]]:
    """Run the eureka loop (no tracking); return the best candidate and a summary."""
    from core.loop import Loop

    config = compose(common + [
        "+plugins=[eureka]", f"plugins.eureka.iterations={args.iterations}", f"plugins.eureka.samples={args.samples}",
        f"plugins.eureka.max_tokens={args.max_tokens}", "seed=0",
    ])  # fmt: skip
    loop = Loop(config)
    summary = loop.execute()
    best = loop.run.best
    results = [r for it in loop.run.history for r in it.results]
    info = {
        "iterations": args.iterations,
        "samples": args.samples,
        "candidates": len(results),
        "failed": sum(not r.ok for r in results),
        "fitness_per_candidate": [r.score if r.ok else None for r in results],
        "best_search_fitness": summary.fitness,
        "reused_trainings": summary.reused,
        "llm": summary.llm,
        "best_reward": best[0].reward.source if best and best[0].reward else None,
    }
    return (best[0] if best else None), info


def retrain(args: argparse.Namespace, common: list[str], best: Any) -> dict[str, list[float]]:
    """Train both arms on seeds 1..N through the configured executor."""
    from omegaconf import OmegaConf

    from core.executor import TrainJob, build_runtime, make_executor
    from core.records import Candidate

    config = compose(common)
    container = OmegaConf.to_container(config, resolve=True)
    container.pop("hydra", None)
    runtime = build_runtime(container)
    seeds = list(range(1, args.seeds + 1))
    jobs, arms = [], []
    for seed in seeds:
        jobs.append(TrainJob(container, Candidate(id=f"sparse-s{seed}", iteration=0), seed))
        arms.append("sparse")
        if best is not None:
            jobs.append(TrainJob(container, Candidate(id=f"eureka-s{seed}", iteration=0, reward=best.reward), seed))
            arms.append("eureka")
    executor = make_executor(config.executor, runtime, len(jobs))
    try:
        results = executor.run(jobs)
    finally:
        executor.close()
    out: dict[str, list[float]] = {"sparse": [], "eureka": []}
    for arm, result in zip(arms, results):
        out[arm].append(result.score if result.ok else 0.0)
    if best is None:  # nothing usable was found: the arm scores zero on every seed
        out["eureka"] = [0.0] * len(seeds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="mountaincar", help="task config name (conf/env/)")
    parser.add_argument("--iterations", type=int, default=2, help="eureka iterations")
    parser.add_argument("--samples", type=int, default=4, help="eureka reward functions per iteration")
    parser.add_argument("--frames", type=int, default=50_000, help="PPO frames per training (every arm)")
    parser.add_argument("--seeds", type=int, default=3, help="fresh seeds per arm for the comparison")
    parser.add_argument("--max-tokens", type=int, default=700, help="cap on each LLM reply")
    parser.add_argument("--cache-dir", default=None, help="LLM and result cache (default: the config's)")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    args = parser.parse_args()

    from core.quiet import quiet_third_party

    quiet_third_party()
    common = [f"env={args.env}", f"trainer.frames={args.frames}", "progress=false", "save_policy=false", *args.override]
    if args.cache_dir:
        common.append(f"cache_dir={Path(args.cache_dir).resolve()}")
    start = time.perf_counter()
    best, found = search(args, common)
    searched = time.perf_counter() - start
    fitness = retrain(args, common, best)
    means = {arm: statistics.fmean(values) for arm, values in fitness.items()}
    print(json.dumps({
        "benchmark": "reward_design",
        "env": args.env,
        "frames": args.frames,
        "seeds": list(range(1, args.seeds + 1)),
        "fitness": fitness,
        "mean_fitness": means,
        "eureka_beats_sparse": means["eureka"] > means["sparse"],
        "search": found,
        "seconds": {"search": round(searched, 1), "total": round(time.perf_counter() - start, 1)},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
