"""Candidates trained per minute: serially, with the local process pool, and with Ray,
on the machine as it is and with one core kept busy.

K CartPole candidates (plain PPO, one seed each) with the same budget are trained three
ways through the project's executors: in this process one after another (the serial
baseline), with ``PoolExecutor`` and as Ray tasks on a local Ray, both sized as a run
sizes them (``executor.workers``, default ``auto``: one job for the driver's core plus
one per idle core, in this process when that is one). Start-up is outside the timing,
as a run pays it once and keeps the workers: the pool's spawned workers import the
training stack and build the run's task and plugins when it starts, Ray starts and warms
one worker per CPU the same way, and the serial arm's runtime is built before its
timing too. Every job uses one torch thread.

Two conditions, each measured the same way:

- ``idle``: the machine as it is (on a shared machine, not truly idle: the reading of
  free cores and the load average are printed beside every figure);
- ``busy``: while a spinning subprocess pinned to the last usable core keeps it busy (it
  stops itself after ``--busy-limit`` seconds and is stopped when the condition ends).

The executors read the free cores once at the start of each condition (the reading is
printed) and size every batch of that condition to it. With ``--rounds`` > 1 the three
arms alternate and each speedup is total serial time / total arm time. Prints one JSON
object::

    {"k": 4, "frames": 20000, "workers": "auto", "cores": 2,
     "pool_speedup": ..., "ray_speedup": ..., "pool_speedup_busy": ..., "ray_speedup_busy": ...,
     "idle": {"reading": {"free_cores": ..., "load_avg_1min": ...}, "pool_workers": 2, "ray_workers": 2,
              "serial_s": ..., "pool_s": ..., "ray_s": ..., "load_avg_1min": [start, end], ...},
     "busy": {...}, "same_fitness": true, "all_ok": true, ...}

``same_fitness`` says whether the three ways gave the same fitness per seed.

Run: ``python benchmarks/candidate_scaling.py [--k 4] [--frames 20000] [--workers auto|N]
[--conditions idle,busy] [--rounds 1]``; ``--workers 2`` forces two workers whatever
the load (what the pool does when it is not sized).
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
import subprocess
import time
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.executor import (
    CpuReading,
    InProcessExecutor,
    PoolExecutor,
    TrainJob,
    build_runtime,
    read_cpu,
    usable_cores,
    workers_setting,
)
from core.records import Candidate, TrainResult
from core.resources import conf_dir


def make_jobs(k: int, frames: int, run_key: str) -> list[TrainJob]:
    """K baseline CartPole candidates, seeds 0..K-1, of one run (workers build its runtime once)."""
    overrides = [
        "env=cartpole",
        f"trainer.frames={frames}",
        f"trainer.eval_every={frames}",
        "trainer.eval_episodes=5",
        "save_policy=false",
    ]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    container: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    container.pop("hydra", None)
    return [TrainJob(container, Candidate(id=f"c{i}", iteration=0), seed=i, run_key=run_key) for i in range(k)]


class BusyCore:
    """A subprocess spinning on one core (the last this process may use), bounded in time."""

    def __init__(self, limit_s: float) -> None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.cpu = cpus[-1] if cpus else None
        pin = f"os.sched_setaffinity(0, {{{self.cpu}}})" if self.cpu is not None else "pass"
        code = f"import os, time\n{pin}\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end:\n    pass\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(1.0)  # let it reach the core before anything is read

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def timed(executor: Any, jobs: list[TrainJob]) -> tuple[float, list[TrainResult]]:
    start = time.perf_counter()
    results = executor.run(jobs)
    return time.perf_counter() - start, results


def fitness(results: list[TrainResult]) -> list[float | None]:
    return [r.fitness.value if r.ok and r.fitness else None for r in results]


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def condition(
    name: str, jobs: list[TrainJob], rounds: int, pool: PoolExecutor, ray_cfg: dict[str, Any]
) -> dict[str, Any]:
    """Serial, pool and Ray on ``jobs``, ``rounds`` times alternately, sized to one reading."""
    from core.ray_executor import RayExecutor

    reading = read_cpu()
    fixed = lambda: reading  # noqa: E731 - every batch of this condition sees this reading
    load = [load_avg()]
    runtime = build_runtime(jobs[0].config, run_key=jobs[0].run_key)  # the driver's, as a run builds it first
    pool.read = fixed
    ray = RayExecutor(ray_cfg, runtime, read=fixed)
    pool_workers, ray_workers = pool.plan(len(jobs)), ray.plan(len(jobs))
    start = time.perf_counter()
    pool.start(pool_workers, prime=jobs[0])  # untimed, as in a run (no-op when it is already this size, or sized to 1)
    pool_start_s = time.perf_counter() - start
    start = time.perf_counter()
    if ray_workers > 1:
        ray.start(prime=jobs[0])  # untimed: Ray starts once per process in a run
    ray_start_s = time.perf_counter() - start
    totals = {"serial": 0.0, "pool": 0.0, "ray": 0.0}
    results: dict[str, list[TrainResult]] = {}
    arm_loads: dict[str, list[float]] = {arm: [] for arm in totals}
    for _ in range(rounds):
        for arm, executor in (("serial", InProcessExecutor(runtime)), ("pool", pool), ("ray", ray)):
            seconds, results[arm] = timed(executor, jobs)
            totals[arm] += seconds
            arm_loads[arm].append(load_avg())
    load.append(load_avg())
    per_min = {arm: round(60 * rounds * len(jobs) / s, 2) for arm, s in totals.items()}
    return {
        "condition": name,
        "reading": {
            "cores": reading.cores,
            "free_cores": round(reading.free, 2),
            "load_avg_1min": reading.load_avg and round(reading.load_avg, 2),
            "source": reading.source,
        },
        "pool_workers": pool_workers,
        "ray_workers": ray_workers,
        "pool_speedup": round(totals["serial"] / totals["pool"], 2),
        "ray_speedup": round(totals["serial"] / totals["ray"], 2),
        **{f"{arm}_s": round(s, 1) for arm, s in totals.items()},
        **{f"{arm}_per_min": v for arm, v in per_min.items()},
        "load_avg_1min": load,
        "load_avg_after_arm": arm_loads,
        "pool_start_s": round(pool_start_s, 1),
        "ray_start_s": round(ray_start_s, 1),
        "fitness": {arm: fitness(r) for arm, r in results.items()},
        "same_fitness": fitness(results["serial"]) == fitness(results["pool"]) == fitness(results["ray"]),
        "all_ok": all(r.ok for rs in results.values() for r in rs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="candidates")
    parser.add_argument("--frames", type=int, default=20000, help="training frames per candidate")
    parser.add_argument("--workers", default="auto", help="executor.workers for the pool and Ray: auto or a number")
    parser.add_argument(
        "--conditions",
        default="idle,busy",
        help="comma-separated: idle (the machine as it is), busy (one core spinning)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating serial/pool/Ray rounds per condition")
    parser.add_argument(
        "--busy-limit", type=float, default=1800.0, help="seconds after which the busy process stops itself"
    )
    args = parser.parse_args()
    workers = workers_setting(args.workers if args.workers == "auto" else int(args.workers))
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    jobs = make_jobs(args.k, args.frames, run_key="candidate-scaling")
    pool = PoolExecutor(workers, read=lambda: CpuReading(usable_cores(), 0.0))
    ray_cfg = {"kind": "ray", "workers": workers}
    out: dict[str, Any] = {
        "k": args.k,
        "frames": args.frames,
        "workers": workers,
        "cores": usable_cores(),
        "rounds": args.rounds,
    }
    try:
        for name in args.conditions.split(","):
            busy = BusyCore(args.busy_limit) if name == "busy" else None
            try:
                out[name] = condition(name, jobs, args.rounds, pool, ray_cfg)
                if busy is not None:
                    out[name]["busy_cpu"] = busy.cpu
            finally:
                if busy is not None:
                    busy.stop()
    finally:
        pool.close()
        if "ray" in sys.modules:
            import ray

            ray.shutdown()
    for name, suffix in (("idle", ""), ("busy", "_busy")):
        if name in out:
            out[f"pool_speedup{suffix}"] = out[name]["pool_speedup"]
            out[f"ray_speedup{suffix}"] = out[name]["ray_speedup"]
    conditions = [out[n] for n in ("idle", "busy") if n in out]
    out["same_fitness"] = (
        all(c["same_fitness"] for c in conditions)
        and len({json.dumps(c["fitness"]["serial"]) for c in conditions}) <= 1
    )
    out["all_ok"] = all(c["all_ok"] for c in conditions)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
