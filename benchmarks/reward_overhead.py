"""Cost of a sandboxed reward program: PPO frames/s on CartPole with the env's reward and with code.

The program is written the way an LLM writes one (Eureka's signature, a components
dict) and gives CartPole's own +1 per step, so both runs learn the same thing. It goes
through ``core.sandbox.prepare_reward`` (static check, a worker process of its own with
namespaces, limits and an unprivileged user, a probe) and the ``ProgramReward``
transform, as in a real run: every call crosses to the worker and back.

Two paths:

- ``ratio``: the default batched path (the program rewrites each collected batch of
  256 frames in one call), against the env's own reward;
- ``per_step_ratio``: the per-step path that online judges use (a ``compute_reward``
  hook is registered, so the program runs on every step of the 8 envs), against the
  env's own reward with the same (no-op) hook.

``call_overhead_us`` is the round trip of one call of a trivial program on a batch of 8
states through the worker, back to back, less the same function called directly;
``per_step_call_us`` is the mean round trip of the calls in the last per-step training
run, where the worker sleeps between calls and must be scheduled again each time (on a
busy machine this, not the crossing itself, is most of the cost). Runs alternate
in pairs, back to back and in alternating order, so that other load on the machine hurts
both alike: ``ratio`` and ``per_step_ratio`` are the medians of the pairs' ratios (as in
``trainer_throughput.py``), ``best_ratio`` the best program run over the best env run.
``cpu_ratio`` and ``per_step_cpu_ratio`` compare CPU time instead of wall time (the
trainer's process plus the worker's), the cost of the sandbox without the waits for a
CPU that a busy machine adds; ``batched_extra_cpu_s`` and ``per_step_extra_cpu_s`` are the
CPU seconds the program adds to one run (medians of the pairs), ``per_step_worker_cpu_us``
the worker's part per call (with the polling for the next step where the worker spins on
a spare CPU; ``per_step_spun_share`` says for what share of the calls it did). The load
average is printed before and after; ``LLM4RL_SANDBOX_SPIN=0`` or ``=1`` in the
environment switches the spinning off or on whatever the load.
Prints one JSON object::

    {"ratio": ..., "per_step_ratio": ..., "call_overhead_us": ..., "env_reward_fps": ..., ...}

Run: ``python benchmarks/reward_overhead.py [--frames 30000] [--repeats 3]``.
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
from dataclasses import replace
from typing import Any

import pluggy
import torch

import core.hookspecs
from core.hookspecs import PROJECT
from core.records import Candidate, RewardProgram
from core.sandbox import Limits, prepare_reward
from core.train.ppo import PPOConfig, train
from trainer_throughput import cartpole_task

PROGRAM = '''
import torch

def compute_reward(state, action, next_state):
    """+1 for every step the pole is still up (CartPole's own reward)."""
    alive_bonus = torch.ones_like(next_state["pole_angle"])
    components = {"alive_bonus": alive_bonus}
    return alive_bonus, components
'''
TRIVIAL = "def compute_reward(state, action, next_state):\n    return next_state['pole_angle'] * 0.0 + 1.0\n"

hookimpl = pluggy.HookimplMarker(PROJECT)


class NoOpJudge:
    """A ``compute_reward`` hook that abstains: it puts the program on the per-step path."""

    @hookimpl
    def compute_reward(self, train: Any, batch: Any) -> None:
        return None


def _hook() -> Any:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(core.hookspecs)
    pm.register(NoOpJudge())
    return pm.hook


def fps(candidate: Candidate, frames: int, seed: int, hook: Any = None) -> tuple[float, dict[str, Any]]:
    """Training frames/s (wall clock); the metrics also hold ``cpu_s``: the trainer's CPU time plus the worker's."""
    cfg = PPOConfig(frames=frames, eval_every=0, eval_episodes=0)
    cpu = time.process_time()
    result = train(cartpole_task(), candidate, cfg, seed=seed, hook=hook)
    if not result.ok:
        raise RuntimeError(f"{result.error_kind}: {result.error}")
    result.metrics["cpu_s"] = time.process_time() - cpu + result.metrics.get("sandbox/worker_cpu_seconds", 0.0)
    return result.metrics["charts/fps"], result.metrics


def call_overhead_us(calls: int = 3000) -> dict[str, Any]:
    """Median round trip of a trivial program through the worker, less a direct call."""
    task = cartpole_task()
    fn = prepare_reward(RewardProgram(TRIVIAL), task, limits=Limits(max_time_share=1.0))
    obs, action = torch.randn(8, task.obs_dim), torch.zeros(8, dtype=torch.long)

    def direct(state: dict, action: torch.Tensor, next_state: dict) -> torch.Tensor:
        return next_state["pole_angle"] * 0.0 + 1.0

    def timed(call: Any) -> float:
        for _ in range(200):
            call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls * 1e6

    sandboxed, plain = [], []
    for _ in range(3):
        sandboxed.append(timed(lambda: fn.from_obs(obs, action, obs)))
        plain.append(timed(lambda: direct(task.split_state(obs), action, task.split_state(obs))))
    isolation = fn.worker.isolation
    fn.close()
    return {
        "call_overhead_us": round(statistics.median(sandboxed) - statistics.median(plain), 1),
        "sandboxed_call_us": round(statistics.median(sandboxed), 1),
        "direct_call_us": round(statistics.median(plain), 1),
        "isolation": {k: isolation.get(k) for k in ("network", "pid", "mount", "ipc", "root_dropped")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    plain = Candidate(id="env-reward", iteration=0)
    coded = Candidate(
        id="program-reward",
        iteration=0,
        reward=RewardProgram(source=PROGRAM, entry="compute_reward", origin="benchmark"),
    )
    best: dict[str, float] = {"env": 0.0, "program": 0.0, "env_step": 0.0, "program_step": 0.0}
    pairs: dict[str, list[float]] = {
        "batched": [],
        "per_step": [],
        "batched_cpu": [],
        "per_step_cpu": [],
        "batched_extra_cpu": [],
        "per_step_extra_cpu": [],
    }
    metrics: dict[str, Any] = {}
    step_metrics: dict[str, Any] = {}
    fps(coded, 2048, args.seed)  # start the sandbox's zygote (once per process) outside the timing

    def coded_run(hook: Any) -> tuple[float, dict[str, Any]]:
        return fps(replace(coded, reward=replace(coded.reward)), args.frames, args.seed, hook)

    for i in range(args.repeats):
        # each pair back to back, in alternating order, so that load from elsewhere hurts both alike
        if i % 2 == 0:
            (env, env_metrics), (program, metrics) = fps(plain, args.frames, args.seed), coded_run(None)
            (env_step, env_step_metrics), (program_step, step_metrics) = (
                fps(plain, args.frames, args.seed, _hook()),
                coded_run(_hook()),
            )
        else:
            (program, metrics), (env, env_metrics) = coded_run(None), fps(plain, args.frames, args.seed)
            (program_step, step_metrics), (env_step, env_step_metrics) = (
                coded_run(_hook()),
                fps(plain, args.frames, args.seed, _hook()),
            )
        pairs["batched_cpu"].append(env_metrics["cpu_s"] / metrics["cpu_s"])
        pairs["per_step_cpu"].append(env_step_metrics["cpu_s"] / step_metrics["cpu_s"])
        pairs["batched_extra_cpu"].append(metrics["cpu_s"] - env_metrics["cpu_s"])
        pairs["per_step_extra_cpu"].append(step_metrics["cpu_s"] - env_step_metrics["cpu_s"])
        for key, value in (("env", env), ("program", program), ("env_step", env_step), ("program_step", program_step)):
            best[key] = max(best[key], value)
        pairs["batched"].append(program / env)
        pairs["per_step"].append(program_step / env_step)
    overhead = call_overhead_us()
    print(
        json.dumps(
            {
                "ratio": round(statistics.median(pairs["batched"]), 3),
                "per_step_ratio": round(statistics.median(pairs["per_step"]), 3),
                "call_overhead_us": overhead["call_overhead_us"],
                "best_ratio": round(best["program"] / best["env"], 3),
                "per_step_best_ratio": round(best["program_step"] / best["env_step"], 3),
                "cpu_ratio": round(statistics.median(pairs["batched_cpu"]), 3),
                "per_step_cpu_ratio": round(statistics.median(pairs["per_step_cpu"]), 3),
                "pair_ratios": [round(r, 3) for r in pairs["batched"]],
                "per_step_pair_ratios": [round(r, 3) for r in pairs["per_step"]],
                "env_reward_fps": round(best["env"], 1),
                "program_reward_fps": round(best["program"], 1),
                "per_step_env_reward_fps": round(best["env_step"], 1),
                "per_step_program_reward_fps": round(best["program_step"], 1),
                "sandboxed_call_us": overhead["sandboxed_call_us"],
                "direct_call_us": overhead["direct_call_us"],
                "per_step_call_us": round(
                    1e6 * step_metrics["sandbox/call_seconds"] / max(1.0, step_metrics["sandbox/program_calls"]), 1
                ),
                "per_step_call_share": step_metrics.get("sandbox/call_share"),
                "per_step_program_share": step_metrics.get("sandbox/program_share"),
                "per_step_calls": step_metrics.get("sandbox/program_calls"),
                # the share of the last per-step run's calls made with the worker spinning on a spare CPU
                # (core.sandbox.host._Spin)
                "per_step_spun_share": step_metrics.get("sandbox/spun_share"),
                # CPU seconds the program costs a run (trainer and worker), and the worker's share per call
                "batched_extra_cpu_s": round(statistics.median(pairs["batched_extra_cpu"]), 3),
                "per_step_extra_cpu_s": round(statistics.median(pairs["per_step_extra_cpu"]), 3),
                "per_step_worker_cpu_us": round(
                    1e6
                    * step_metrics.get("sandbox/worker_cpu_seconds", 0.0)
                    / max(1.0, step_metrics["sandbox/program_calls"]),
                    1,
                ),
                "isolation": overhead["isolation"],
                "frames": args.frames,
                "repeats": args.repeats,
                "reward/env_correlation": metrics.get("reward/env_correlation"),
                "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                "cores": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
