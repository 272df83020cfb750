"""Candidates trained per minute: serially, with the local process pool, and with Ray.

K CartPole candidates (plain PPO, one seed each) with the same budget are trained three
ways through the project's executors: in this process one after another, with
``PoolExecutor`` (spawned worker processes, started once before the timing, as a run keeps them across iterations), and
as Ray tasks on a local Ray (started before the timing: once per process in a run).
Every job uses one torch thread. Prints one JSON object::

    {"k": 4, "frames": 20000, "workers": 2, "serial_per_min": ..., "pool_per_min": ...,
     "ray_per_min": ..., "pool_speedup": ..., "ray_speedup": ..., "same_fitness": true, ...}

``same_fitness`` says whether the three ways gave the same fitness per seed.

Run: ``python benchmarks/candidate_scaling.py [--k 4] [--frames 20000] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.executor import InProcessExecutor, PoolExecutor, TrainJob
from core.records import Candidate, TrainResult
from core.resources import conf_dir


def make_jobs(k: int, frames: int) -> list[TrainJob]:
    """K baseline CartPole candidates, seeds 0..K-1."""
    overrides = ["env=cartpole", f"trainer.frames={frames}", f"trainer.eval_every={frames}", "trainer.eval_episodes=5", "save_policy=false"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    container: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    return [TrainJob(container, Candidate(id=f"c{i}", iteration=0), seed=i) for i in range(k)]


def timed(executor: Any, jobs: list[TrainJob]) -> tuple[float, list[TrainResult]]:
    start = time.perf_counter()
    try:
        results = executor.run(jobs)
    finally:
        executor.close()
    return time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="candidates")
    parser.add_argument("--frames", type=int, default=20000, help="training frames per candidate")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="pool size and Ray CPUs")
    args = parser.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    jobs = make_jobs(args.k, args.frames)

    serial_s, serial = timed(InProcessExecutor(), jobs)
    # like Ray's start-up below, the pool's worker start is paid once per run, not per batch
    start = time.perf_counter()
    pool_executor = PoolExecutor(args.workers)
    pool_executor.start()
    pool_start_s = time.perf_counter() - start
    pool_s, pool = timed(pool_executor, jobs)

    import ray

    from core.ray_executor import RayExecutor

    start = time.perf_counter()
    executor = RayExecutor({"kind": "ray", "num_cpus": args.workers})
    ray_init_s = time.perf_counter() - start
    ray_s, ray_results = timed(executor, jobs)
    ray.shutdown()

    def fitness(results: list[TrainResult]) -> list[float | None]:
        return [r.fitness.value if r.ok and r.fitness else None for r in results]

    per_min = {name: 60 * args.k / s for name, s in (("serial", serial_s), ("pool", pool_s), ("ray", ray_s))}
    print(json.dumps({
        "k": args.k,
        "frames": args.frames,
        "workers": args.workers,
        "cores": os.cpu_count(),
        "serial_per_min": round(per_min["serial"], 2),
        "pool_per_min": round(per_min["pool"], 2),
        "ray_per_min": round(per_min["ray"], 2),
        "pool_speedup": round(serial_s / pool_s, 2),
        "ray_speedup": round(serial_s / ray_s, 2),
        "serial_s": round(serial_s, 1),
        "pool_s": round(pool_s, 1),
        "ray_s": round(ray_s, 1),
        "ray_init_s": round(ray_init_s, 1),
        "pool_start_s": round(pool_start_s, 1),
        "fitness": {"serial": fitness(serial), "pool": fitness(pool), "ray": fitness(ray_results)},
        "same_fitness": fitness(serial) == fitness(pool) == fitness(ray_results),
        "all_ok": all(r.ok for r in serial + pool + ray_results),
    }))


if __name__ == "__main__":
    main()
